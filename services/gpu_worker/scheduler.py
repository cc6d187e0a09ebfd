"""The first part of a step: which requests run, and how many rows each writes.

Admission is first in, first out by footprint: the head of the queue is admitted when its
whole footprint (less the pages it shares from the prefix cache) fits, and nothing behind
it jumps ahead, so a large request is never starved. An admitted request always finds its
pages, so nothing is ever preempted or recomputed.

A plan puts every decoding request first (its last token, plus speculative drafts where
it speculates), then prefill chunks in arrival order under the step's token budget.
Drafts never run past what the request may still emit (its loop cap, max_tokens,
max_seq_len), so the rows a step writes, rejected drafts included, stay inside the rows
its layout already declares: speculation changes no footprint.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.gpu_worker.kv_manager import KVManager
from services.gpu_worker.request import Request


@dataclass
class PlanEntry:
    """One request's part of a step: `rows` rows written (the last of them sampled when
    the request's prompt ends there), of which the trailing `drafts` are speculative."""

    request: Request
    rows: int
    decode: bool
    drafts: list[int] = field(default_factory=list)
    #: per label the step writes, the request's live pages once the runner reserved its rows
    pages: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class StepPlan:
    entries: list[PlanEntry] = field(default_factory=list)


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int
    max_batch_tokens: int
    max_seq_len: int
    #: most requests admitted in one step (an encoder pass each holds up the running ones)
    max_admissions: int | None = None


class Scheduler:
    def __init__(self, kv: KVManager, limits: Limits, step_loops: tuple[str, ...], speculative_k: int = 0) -> None:
        self.kv = kv
        self.limits = limits
        #: the loops a decode step iterates: drafts never run any of them past its cap
        self.loops = step_loops
        self.speculative_k = speculative_k
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.ids: dict[str, Request] = {}

    # -- the request table -------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Queue a request the engine has ingested (it refuses duplicate ids before that)."""
        self.ids[req.request_id] = req
        self.waiting.append(req)

    def remove(self, request_id: str, ran_to_caps: bool = False) -> tuple[Request, int] | None:
        """Take a request out wherever it is; (the request, pages released) if it was here."""
        req = self.ids.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        return req, self.kv.remove(request_id, ran_to_caps)

    @property
    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting and self._admissible())

    def _admissible(self) -> bool:
        return len(self.running) < self.limits.max_num_seqs and self.kv.can_admit(self.waiting[0].kv)

    # -- a step ------------------------------------------------------------------------

    def admit(self) -> list[Request]:
        """Requests that join the running batch now, oldest first, never skipping the head."""
        admitted: list[Request] = []
        cap = self.limits.max_admissions
        while self.waiting and (cap is None or len(admitted) < cap) and self._admissible():
            req = self.waiting.popleft()
            req.num_computed = self.kv.admit(req.kv)  # rows shared from the prefix cache
            self.running.append(req)
            admitted.append(req)
        return admitted

    def schedule(self) -> StepPlan:
        ready = [r for r in self.running if r.ready]
        decodes = [r for r in ready if r.decoding]
        budget = self.limits.max_batch_tokens - len(decodes)
        plan = StepPlan()
        for r in decodes:
            drafts = self._drafts(r, budget) if r.proposer is not None and budget > 0 else []
            budget -= len(drafts)
            plan.entries.append(PlanEntry(r, 1 + len(drafts), True, drafts))
        for r in ready:
            if r.decoding:
                continue
            if budget <= 0:
                break
            n = min(len(r.prompt) - r.num_computed, budget)
            plan.entries.append(PlanEntry(r, n, False))
            budget -= n
        return plan

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Prompt-lookup drafts for this step, never more than the request may still emit
        after the token this step samples anyway: its loop cap, max_tokens, max_seq_len."""
        left = min(req.caps.get(loop, 0) - req.iters[loop] for loop in self.loops)
        k = min(self.speculative_k, budget, left - 1,
                req.max_tokens - len(req.output) - 1, self.limits.max_seq_len - req.tokens_len - 1)
        return req.proposer.propose(req.prompt + req.output, k) if k > 0 else []
