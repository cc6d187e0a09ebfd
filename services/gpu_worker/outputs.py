"""The third part of a step: what the sampled tokens mean for each request.

For each plan entry: keep what a speculative verify accepted, commit the rows to every
label the step wrote (under `MSTAR_KV_DEBUG_ASSERTS=1` the KV manager checks each commit
against the layout; a violation fails that request alone), count the loop's iterations,
then emit the tokens with the first stop condition met: EOS (unless ignore_eos) or one of
the request's `stop_token_ids` (neither before `min_tokens` tokens),
max_tokens, max_seq_len, or the loop's cap, which is never run past.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

from services.gpu_worker.kv_manager import KVManager, LayoutViolation
from services.gpu_worker.request import Request
from services.gpu_worker.runner import LAYOUT_VIOLATED
from services.gpu_worker.scheduler import PlanEntry, StepPlan
from services.gpu_worker.speculative import accept_greedy
from shared.errors import ErrorKind, new_error_id
from shared.frames import Output, RequestError
from shared.layout import KVLabel

log = logging.getLogger("mstar.outputs")


class Finished(NamedTuple):
    request_id: str
    pages: int  # pages its end released
    status: str  # "ok" | "error" | "abort"


@dataclass
class StepResult:
    """What one step tells the world, by destination: token outputs and errors for the
    api (each request's `reply_to`), finished requests for the conductor."""

    outputs: list[tuple[str, Output]] = field(default_factory=list)
    errors: list[tuple[str, RequestError]] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)


def error_frame(request_id: str, kind: ErrorKind, message: str, error_id: str | None = None) -> RequestError:
    """The frame for a request that failed in this worker."""
    return RequestError(request_id=request_id, kind=kind, message=message, error_id=error_id)


class OutputProcessor:
    def __init__(self, kv: KVManager, labels: tuple[KVLabel, ...], step_loops: tuple[str, ...], eos_ids: list[int],
                 max_seq_len: int) -> None:
        self.kv = kv
        self.labels = labels
        #: the loops a decode step iterates (each committed token is one iteration of each)
        self.loops = step_loops
        self.eos = set(eos_ids)
        self.max_seq_len = max_seq_len
        #: speculative drafts verified, and accepted, over the worker's life
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def update(self, plan: StepPlan, sampled: list[list[int]], end, res: StepResult) -> None:
        """Commit and emit every entry; `end(request, ran_to_caps, status)` ends a request."""
        for entry, toks in zip(plan.entries, sampled):
            rows, toks = self._kept(entry, toks)
            try:
                self._commit(entry, rows)
            except LayoutViolation as exc:
                self.fail(entry.request, LAYOUT_VIOLATED, end, res, exc)
                continue
            if toks:
                self._emit(entry.request, toks, end, res)

    def fail(self, req: Request, message: str, end, res: StepResult, exc: BaseException | None = None) -> None:
        error_id = new_error_id()
        log.error("request %s failed (error_id=%s): %s", req.request_id, error_id, exc or message)
        res.errors.append((req.reply_to, error_frame(req.request_id, ErrorKind.INTERNAL, message, error_id)))
        end(req, False, "error")

    def _kept(self, entry: PlanEntry, toks: list[int]) -> tuple[int, list[int]]:
        """A verify step keeps the accepted drafts and then the model's own token after
        them (a correction, or one past the last draft when all were accepted); the rows
        kept are the last token's and the accepted drafts'."""
        if not entry.drafts:
            return entry.rows, toks
        accepted = accept_greedy(entry.drafts, toks)
        self.draft_tokens += len(entry.drafts)
        self.accepted_tokens += accepted
        return accepted + 1, toks[: accepted + 1]

    def _commit(self, entry: PlanEntry, rows: int) -> None:
        """Commit the step's rows on every label it wrote; in the decode loop each row is
        one iteration (a verify step commits the last token and its accepted drafts)."""
        req = entry.request
        for lab in self.labels:
            if entry.decode:
                for _ in range(rows):
                    self.kv.commit(req.request_id, lab.name, 1, lab.grows_on)
            else:
                self.kv.commit(req.request_id, lab.name, rows, None)
        req.num_computed += rows
        if entry.decode:
            for loop in self.loops:
                req.iters[loop] += rows

    def _emit(self, req: Request, toks: list[int], end, res: StepResult) -> None:
        """Append the step's tokens (several after a verify step) and send them in one
        Output; the first stop condition met ends the request and drops what follows."""
        finish = None
        sp = req.sampling
        for n, tok in enumerate(toks, 1):
            req.output.append(tok)
            stop_token = (tok in self.eos and not sp.ignore_eos) or tok in sp.stop_token_ids
            if stop_token and len(req.output) >= sp.min_tokens:
                finish = "stop"
            elif len(req.output) >= req.max_tokens or req.tokens_len >= self.max_seq_len:
                finish = "length"
            if finish is not None:
                toks = toks[:n]
                break
        at_cap = [req.iters[loop] >= req.caps.get(loop, 0) for loop in self.loops]
        if finish is None and any(at_cap):
            finish = "length"  # a loop's cap is reached: never run it further
        out = Output(req.request_id, toks, finish, len(req.prompt), len(req.output))
        if sp.logprobs is not None:
            out.logprobs = req.step_logprobs[: len(toks)]
        if sp.prompt_logprobs is not None and len(req.output) == len(toks):  # the first output
            out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []  # computed by the prefill
            out.prompt_token_ids = list(req.prompt)
        if req.report:  # sent once, with the first tokens
            out.metadata, req.report = req.report, {}
        res.outputs.append((req.reply_to, out))
        if finish is not None:
            end(req, all(at_cap), "ok")
