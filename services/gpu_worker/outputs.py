"""The third part of a step: what the sampled tokens mean for each request.

For each plan entry: keep what a speculative verify accepted (`kept`: the rows the
scheduler then commits), then emit the tokens with the first stop condition met (`emit`):
EOS (unless ignore_eos) or one of the request's `stop_token_ids` (neither before
`min_tokens` tokens), max_tokens, max_seq_len, or a loop's cap, which is never run past.
It reads the request's counters (the scheduler has committed its rows and counted its
iterations) and changes no KV state: which requests end is its answer, ending them is the
scheduler's job.
"""

from __future__ import annotations

import logging

from services.gpu_worker.request import Request
from services.gpu_worker.speculative import accept_greedy
from services.gpu_worker.step_types import Emitted, Kept, PlanEntry, StepPlan
from shared.frames import Output

log = logging.getLogger("mstar.outputs")


class OutputProcessor:
    def __init__(self, step_loops: tuple[str, ...], eos_ids: list[int], max_seq_len: int) -> None:
        #: the loops a decode step iterates (each committed token is one iteration of each)
        self.loops = step_loops
        self.eos = set(eos_ids)
        self.max_seq_len = max_seq_len
        #: speculative drafts verified, and accepted, over the worker's life
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def kept(self, plan: StepPlan, sampled: list[list[int]]) -> list[Kept]:
        """Per entry, the rows its step keeps and the tokens it emits."""
        return [self._kept(entry, toks) for entry, toks in zip(plan.entries, sampled)]

    def _kept(self, entry: PlanEntry, toks: list[int]) -> Kept:
        """A verify step keeps the accepted drafts and then the model's own token after
        them (a correction, or one past the last draft when all were accepted); the rows
        kept are the last token's and the accepted drafts'."""
        if not entry.drafts:
            return Kept(entry.rows, toks)
        accepted = accept_greedy(entry.drafts, toks)
        self.draft_tokens += len(entry.drafts)
        self.accepted_tokens += accepted
        return Kept(accepted + 1, toks[: accepted + 1])

    def progress(self, req: Request) -> Output:
        """An in-step loop's progress after an iteration (no token, no result yet): its
        iterations done and in all."""
        assert req.loop is not None
        return Output(req.request_id, [], None, len(req.prompt), 0, steps_done=req.loop.done,
                      steps_total=req.loop.total)

    def emit(self, req: Request, toks: list[int]) -> Emitted:
        """Append the step's tokens (several after a verify step) as one Output; the first
        stop condition met ends the request and drops what follows. A pooling request's
        result is its one output, which ends it."""
        if req.pooled is not None:
            out = Output(req.request_id, [], "stop", len(req.prompt), 0, req.cached_tokens, pooled=req.pooled)
            if req.loop is not None:
                out.steps_done = out.steps_total = req.loop.total
            return Emitted(out, req.reply_to, True, True)
        finish = None
        sp = req.sampling
        for n, tok in enumerate(toks, 1):
            req.output.append(tok)
            stop_token = (tok in self.eos and not sp.ignore_eos) or tok in sp.stop_token_ids
            if stop_token and len(req.output) >= sp.min_tokens:
                finish = "stop"
            elif req.stop_check is not None and req.stop_check.push(tok):
                finish = "stop"  # a stop string ends at this token (`SamplingParams.stop`)
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
        if len(req.output) == len(toks):  # the first output
            out.cached_tokens = req.cached_tokens
        if sp.prompt_logprobs is not None and len(req.output) == len(toks):  # the first output
            out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []  # computed by the prefill
            out.prompt_token_ids = list(req.prompt)
        if req.report:  # sent once, with the first tokens
            out.metadata, req.report = req.report, {}
        return Emitted(out, req.reply_to, finish is not None, all(at_cap))
