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

Budgeting by time (`Limits.itl_target_s` > 0): every step, decode rows always go; the
prefill chunks beside them are cut so the step's predicted time (`step_costs.StepCosts`,
learned at warm-up and from every step since) stays within the target, since every
running stream waits for the whole step. A step with no decode row (an idle engine) fills
the token budget, so a lone prompt's first token is not held back; so does a step whose
decode rows are no more than `1 / IDLE_RATIO` (a quarter) of the prompts waiting beside
them: a wave of prompts that arrived together (all but the few the previous step caught) is
prefilled at once and then decodes in step with them, at the cost of one long gap for those
few, rather than being dribbled in while they run ahead (which spreads every later prefill
over every stream's decode steps). A quarter, not one to one: one to three prompts beside
as many streams are not a wave, and prefilling them whole stalled the streams for their
whole prompts (~0.65 s at 2,048 tokens on the bench checkpoint: 15 such gaps in 2,048 at c4
under a 15 ms target, the P99 inter-token latency; docs/benchmarks.md). Prompts always
move: at least `MIN_PREFILL_ROWS` rows a step whatever the target, and under a load the
target cannot hold, prompts pile up until the streams finish or the prompts are four times
their number, and the next step prefills at the full budget. The target
changes only when rows run, never what they compute: each row sees the same keys whatever
chunk it came in, so every request gets the same tokens.

A model whose loop runs inside the step (a denoising or flow-matching loop, DESIGN.md §3
"Denoising loops") runs its prompt in the step that takes it, and then one iteration of
its loop a step (`Request.loop`, `PlanEntry.loop`): such an entry writes no row and
commits none (its K/V were written by its prompt's step, read-only since), so a long loop
shares the worker with the requests that arrive while it runs, and requests at different
iterations share a step (the runner batches their forwards where the model allows).

A prompt chunk never ends inside a bidirectional block (`Span.bidirectional`: Gemma 3's
image tokens, which attend to each other both ways): it stops before a block that does not
fit, and a block that does not fit even a step of its own runs whole as the step's first
chunk (`whole_blocks`). Models without such blocks chunk as before.

Prompt logprobs (`prompt_logprobs`, OpenAI's `echo` + `logprobs`) need the LM head over
every prompt row, a `[rows x vocabulary]` float32 block (393 MB for a 2,000-token prompt on
a 49k vocabulary). The step's rows of such chunks are capped at `Limits.max_logit_rows`,
so its extra memory is bounded by that many rows x the vocabulary whatever the prompt
length; those rows count as sampled rows in the step's shape, so a time target cuts
them as it cuts prefill.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.gpu_worker.kv_manager import (
    DoesNotFit,
    FootprintOverrun,
    KVManager,
    LayoutViolation,
    RequestKV,
    snapshot_cut,
)
from services.gpu_worker.request import Request
from services.gpu_worker.step_costs import StepCosts, StepShape, chunk_shape
from services.gpu_worker.step_types import LAYOUT_VIOLATED, OVERRUN, Failure, Kept, PlanEntry, StepPlan
from shared.frames import NewRequest
from shared.layout import KVLabel, block_boundary

#: prompt rows a step beside decode rows may always prefill, whatever the time target. 8,
#: not 16: where a tight target leaves no room beside the decode rows, a chunk of 16 made
#: every such step overshoot it (bench checkpoint, c4, 2,048-token prompts, a 10 ms target:
#: P99 inter-token latency 18.1-18.2 ms with 16, 14.4-15.2 with 8, at 104-108 against 118-124
#: tokens/s; docs/benchmarks.md)
MIN_PREFILL_ROWS = 8
#: a step is as good as idle when its decode rows x this are no more than the prompts waiting
IDLE_RATIO = 4.0


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int
    max_batch_tokens: int
    max_seq_len: int
    #: most requests admitted in one step (an encoder pass each holds up the running ones)
    max_admissions: int | None = None
    #: a step's time target in seconds when decode rows run (0: the token budget alone)
    itl_target_s: float = 0.0
    #: most prompt rows a step puts through the LM head for prompt logprobs (0: no cap)
    max_logit_rows: int = 0


class Scheduler:
    def __init__(self, kv: KVManager, limits: Limits, step_loops: tuple[str, ...], speculative_k: int = 0,
                 whole_prompts: bool = False) -> None:
        self.kv = kv
        #: a prompt runs in one step or waits (an encoder's bidirectional attention)
        self.whole_prompts = whole_prompts
        self.limits = limits
        #: the loops a decode step iterates: drafts never run any of them past its cap
        self.loops = step_loops
        self.speculative_k = speculative_k
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.ids: dict[str, Request] = {}
        #: page copies the commits asked for (`take_copies`)
        self.copies: list[tuple[str, int, int]] = []
        #: what a step costs, learned (the engine reports every step's time)
        self.costs = StepCosts()

    # -- KV changes: the scheduler is the one part of a step that makes them ------------

    def ingest(self, req: NewRequest) -> RequestKV:
        """The request's KV bookkeeping from its layouts (each label's footprint); DoesNotFit
        when its footprint exceeds a whole pool. A request that wants its prompt's logprobs
        computes every prompt row (no prefix-cache hit, as vLLM skips the cache for it)."""
        kv = self.kv.ingest_request(req)
        if not self.kv.fits_at_all(kv):
            raise DoesNotFit("footprint exceeds the pool")
        if req.sampling.prompt_logprobs is not None:
            for st in kv.labels.values():
                st.row_keys = ()
        return kv

    def reserve(self, plan: StepPlan, labels: tuple[KVLabel, ...]) -> list[Failure]:
        """Pages for every entry's rows on each label the step writes, before the forward
        writes them. An entry whose layout under-states what it writes and finds no page
        nobody reserved fails alone (it leaves the plan); every other entry runs."""
        return self._reserve_each(plan, lambda e: {lab.name: e.rows for lab in entry_labels(e, labels)},
                                  scratch=False)

    def reserve_scratch(self, plan: StepPlan, rows_of: Callable[[PlanEntry], dict[str, int]]) -> list[Failure]:
        """Pages for the scratch rows each entry's forward writes past its committed rows
        (`rows_of`: the runner's `step_scratch`), given back by `drop_step_scratch` after
        the step; an entry that finds no page fails alone, as in `reserve`."""
        return self._reserve_each(plan, rows_of, scratch=True)

    def _reserve_each(self, plan: StepPlan, rows_of: Callable[[PlanEntry], dict[str, int]],
                      scratch: bool) -> list[Failure]:
        failed = []
        for e in plan.entries:
            try:
                for label, n in rows_of(e).items():
                    e.pages[label] = self.kv.reserve_rows(e.request.request_id, label, n)
                    if scratch:
                        e.scratch.append(label)
            except FootprintOverrun as exc:
                failed.append(Failure(e.request, OVERRUN, exc))
        if failed:
            gone = {id(f.request) for f in failed}
            plan.entries = [e for e in plan.entries if id(e.request) not in gone]
        return failed

    def drop_step_scratch(self, plan: StepPlan) -> None:
        """Give back the scratch pages of a step's entries (`reserve_scratch`)."""
        for e in plan.entries:
            self.drop_scratch(e.request, e.scratch)
            e.scratch = []

    def reserve_rows(self, req: Request, rows: dict[str, int]) -> dict[str, list[int]]:
        """Pages for rows a request writes outside a plan (an encoder's rows at admission,
        a probe's scratch), per label; FootprintOverrun as `reserve`."""
        return {label: self.kv.reserve_rows(req.request_id, label, n) for label, n in rows.items()}

    def commit(self, plan: StepPlan, kept: list[Kept], labels: tuple[KVLabel, ...]) -> list[Failure]:
        """Commit the rows each entry keeps on every label the step wrote; in the decode
        loop each row is one iteration of every step loop (a verify step commits the last
        token and its accepted drafts). A commit that breaks the request's layout (checked
        under MSTAR_KV_DEBUG_ASSERTS=1) fails that request alone."""
        failed = []
        for entry, k in zip(plan.entries, kept):
            req = entry.request
            try:
                for lab in entry_labels(entry, labels):
                    if entry.decode:
                        for _ in range(k.rows):
                            self.kv.commit(req.request_id, lab.name, 1, lab.grows_on)
                    else:
                        self.kv.commit(req.request_id, lab.name, k.rows, None)
            except LayoutViolation as exc:
                failed.append(Failure(req, LAYOUT_VIOLATED, exc))
                continue
            if entry.stage:
                _stage_committed(req, entry, k.rows)
                continue
            req.num_computed += k.rows
            if entry.decode:
                for loop in self.loops:
                    req.iters[loop] += k.rows
            elif req.kv is not None and req.kv.snapshot_rows:
                self.copies += self.kv.take_snapshots(req.request_id)
        return failed

    def take_copies(self) -> list[tuple[str, int, int]]:
        """(pool, source page, destination page) copies the last commits asked for (a
        hybrid's state snapshots), for the runner to make before the next step."""
        copies, self.copies = self.copies, []
        return copies

    def commit_rows(self, req: Request, rows: dict[str, int]) -> Failure | None:
        """Commit rows `reserve_rows` gave (one span per label); a Failure if that breaks
        the layout."""
        try:
            for label, n in rows.items():
                self.kv.commit(req.request_id, label, n, None)
        except LayoutViolation as exc:
            return Failure(req, LAYOUT_VIOLATED, exc)
        return None

    def drop_scratch(self, req: Request, labels: list[str]) -> None:
        """Give back the scratch rows a probe wrote (never committed)."""
        for label in labels:
            self.kv.drop_scratch(req.request_id, label)

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
            if not req.output:  # a preempted request's re-admission is not its prompt's hit
                req.cached_tokens = min(req.num_computed, len(req.prompt))
            self.running.append(req)
            admitted.append(req)
        return admitted

    def schedule(self) -> StepPlan:
        ready = [r for r in self.running if r.ready]
        plan = StepPlan()
        budget = self._plan_decodes([r for r in ready if r.decoding and r.loop is None], plan)
        # an in-step loop's next iteration: no row, so no budget (after the decode rows, before the prompts)
        plan.entries += [PlanEntry(r, 0, True, loop=True) for r in ready if r.loop is not None]
        seconds, floor = self._prefill_allowance(plan)
        logit_rows = self.limits.max_logit_rows or self.limits.max_batch_tokens
        first = True  # no prompt chunk in the plan yet
        for r in ready:
            if r.decoding:
                continue
            if budget <= 0:
                break
            left = len(r.prompt) - r.num_computed
            n = min(left, budget)
            scored = r.sampling.prompt_logprobs is not None
            if scored:
                if logit_rows <= 0:
                    continue  # this step's logit rows are spent: a later step takes it
                n = min(n, logit_rows)
            if seconds is not None:
                n = max(self.costs.chunk_within(seconds, r.num_computed, n, scored), min(n, floor))
            if r.kv is not None:  # (a plan made outside an engine may have no KV state)
                n = whole_blocks(r.kv.blocks, r.num_computed, n, first)
                if r.kv.snapshot_rows and self.kv.prefix_cache:  # a hybrid's state is whole only at a chunk's end
                    n = snapshot_cut(r.kv.snapshot_rows, r.num_computed, n)
            if n <= 0:
                break  # (a block that does not fit waits, and nothing behind it jumps ahead)
            if seconds is not None:
                seconds -= self.costs.predict(_shape(r, n, left)) - self.costs.predict(StepShape())
                floor -= n
            if self.whole_prompts and n < left:
                break  # it waits for a step with room for all of it, and nothing behind it jumps ahead
            if scored:
                logit_rows -= n
            plan.entries.append(PlanEntry(r, n, False))
            plan.shape += _shape(r, n, left)
            budget -= n
            first = False
        return plan

    def _prefill_allowance(self, plan: StepPlan) -> tuple[float | None, int]:
        """(seconds the prefill chunks may add to this step, or None for no time limit;
        rows they may take whatever the time): no limit when the target is off, the costs
        are not learned yet, or the engine is (as good as) idle: no decode row runs, or no
        more than 1 / IDLE_RATIO per prompt waiting beside them."""
        target = self.limits.itl_target_s
        if target <= 0 or not self.costs.ready or not plan.entries:
            return None, 0
        prompts = sum(1 for r in self.running if r.ready and not r.decoding)
        if len(plan.entries) * IDLE_RATIO <= prompts:
            return None, 0
        return target - self.costs.predict(plan.shape), MIN_PREFILL_ROWS

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """A step ran: its wall time teaches the step-cost model (when a target uses it)."""
        if plan.entries and self.limits.itl_target_s > 0:
            self.costs.observe(plan.shape, seconds)

    def _plan_decodes(self, decodes: list[Request], plan: StepPlan) -> int:
        """Each decoding request's entries (a row and its drafts; its later stage's rows
        where that stage is ready, beside or after the first's); the batch tokens left."""
        # (a later stage's first step writes its prompt rows: they count as a prefill's)
        budget = self.limits.max_batch_tokens - sum(
            (0 if r.stage is not None and r.stage.earlier_done else 1)
            + (r.stage.rows if r.stage is not None and r.stage.ready(len(r.output)) else 0) for r in decodes)
        for r in decodes:
            stage = r.stage
            if stage is None or not stage.earlier_done:
                drafts = self._drafts(r, budget) if r.proposer is not None and budget > 0 else []
                budget -= len(drafts)
                plan.entries.append(PlanEntry(r, 1 + len(drafts), True, drafts))
                plan.shape += chunk_shape(r.num_computed, 1 + len(drafts), 1 + len(drafts))
            if stage is not None and stage.ready(len(r.output)):  # its prompt rows, then a row an iteration
                plan.entries.append(PlanEntry(r, stage.rows, stage.started, stage=True))
                plan.shape += chunk_shape(0, stage.rows, 1)
        return budget

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Prompt-lookup drafts for this step, never more than the request may still emit
        after the token this step samples anyway: its loop cap, max_tokens, max_seq_len."""
        left = min(req.caps.get(loop, 0) - req.iters[loop] for loop in self.loops)
        k = min(self.speculative_k, budget, left - 1,
                req.max_tokens - len(req.output) - 1, self.limits.max_seq_len - req.tokens_len - 1)
        assert req.proposer is not None  # asked only for a request that speculates
        return req.proposer.propose(req.prompt + req.output, k) if k > 0 else []


def entry_labels(entry: PlanEntry, labels: tuple[KVLabel, ...]) -> tuple[KVLabel, ...]:
    """The labels an entry's rows are written on: the step's, or its request's later stage's."""
    stage = entry.request.stage
    return stage.labels if entry.stage and stage is not None else labels


def _stage_committed(req: Request, entry: PlanEntry, rows: int) -> None:
    """A later stage's step committed: its first (the stage's prompt) or one iteration of
    its loop; every step after the first writes a row."""
    stage = req.stage
    assert stage is not None
    if entry.decode:
        req.iters[stage.loop] = req.iters.get(stage.loop, 0) + rows
    stage.started, stage.rows = True, 1
    stage.steps += 1


def whole_blocks(blocks: tuple[tuple[int, int], ...], computed: int, n: int, first: bool) -> int:
    """A prompt chunk of `n` rows from row `computed`, cut so it ends inside no
    bidirectional block (`RequestKV.blocks`): a block's rows see the rows after them, so
    they are computed in one forward, never split between steps. Where the cut leaves
    nothing (the chunk starts at a block that does not fit), the block runs whole if it is
    the step's first prompt chunk (over the step's budget: a block longer than any budget
    must still run, and a prompt always moves), else 0 (it waits for a step where it is
    first). No blocks (every other model): `n` as it was."""
    if not blocks:
        return n
    end = block_boundary(computed + n, blocks)
    if end > computed:
        return end - computed
    if not first:
        return 0
    return next(stop for start, stop in blocks if start <= computed < stop) - computed


def _shape(r: Request, n: int, left: int) -> StepShape:
    """A prefill chunk's shape: its rows, and as sampled rows (through the LM head) the one
    that ends the prompt plus, for prompt logprobs, every row that predicts a prompt token."""
    head = int(n == left)
    if r.sampling.prompt_logprobs is not None:
        head += max(0, min(r.num_computed + n, len(r.prompt) - 1) - r.num_computed)
    return chunk_shape(r.num_computed, n, head)
