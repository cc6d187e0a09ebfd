"""Continuous batching: one engine step in three parts, as vLLM names them.

    plan = scheduler.schedule()                 # scheduler.py: admit + which rows run -> StepPlan
    scheduler.reserve(plan)                     #   ... and the pages they write
    sampled = runner.execute(plan)              # runners/base.py: plan -> inputs -> model -> sampled tokens
    kept = outputs.kept(plan, sampled)          # outputs.py: what a verify step keeps
    scheduler.commit(plan, kept)                # scheduler.py: the kept rows committed
    outputs.emit(request, tokens)               # outputs.py: stop checks, caps -> Output, ended?
    scheduler.remove(ended)                     # scheduler.py: pages back -> Finished

The three parts are peers that exchange the values of step_types.py; only the scheduler
changes KV state (reserve, commit, remove, admission and scratch rows), the runner and
the output processor read it.

Requests join the running batch between steps, and prefill chunks share a step with
decode rows under a token budget. Every model runs through this one loop; what is special
about a kind of model is its runner (runners/encdec.py for Whisper, runners/pooling.py for
embedding and scoring models, whose one step ends the request with its pooled result). A failed forward fails
the requests in it; a layout violation fails only its request; every page a request held
returns to its pool however it ends.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from services.gpu_worker.guided import Guides
from services.gpu_worker.kv_manager import FootprintOverrun, KVManager
from services.gpu_worker.outputs import OutputProcessor
from services.gpu_worker.request import Request
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.sampler import make_generator
from services.gpu_worker.scheduler import Scheduler
from services.gpu_worker.speculative import NgramProposer
from services.gpu_worker.step_types import (
    OVERRUN,
    Failure,
    Finished,
    Kept,
    PlanEntry,
    StepPlan,
    StepResult,
    error_frame,
)
from services.gpu_worker.stop_check import StopChecks
from services.gpu_worker.tp.group import GroupLost
from shared.errors import ErrorKind, new_error_id
from shared.frames import NewRequest

log = logging.getLogger("mstar.engine")

__all__ = ["DeviceLost", "Engine", "Finished", "StepResult", "device_lost"]

#: CUDA errors after which the context is unusable: every later kernel launch fails too
#: (the "sticky" errors of the CUDA runtime), so the worker process must start again
STICKY_CUDA_ERRORS = (
    "illegal memory access", "ECC error", "unspecified launch failure",
    "device-side assert triggered", "misaligned address", "illegal instruction",
    "CUDA error: unknown error", "device not ready", "hardware stack error",
)


def device_lost(exc: BaseException) -> bool:
    """True for an exception that leaves the accelerator unusable (not for a step that
    failed on bad input, an out-of-memory, or anything on the CPU)."""
    text = str(exc)
    return ("CUDA error" in text or "cudaError" in text or "CUDA" in type(exc).__name__
            or type(exc).__name__ == "AcceleratorError") and any(e in text for e in STICKY_CUDA_ERRORS)


#: what a request in flight is told when a tensor-parallel rank of its worker dies (a 503)
GROUP_LOST = "a tensor-parallel rank of the worker failed; the worker group is restarting"


class DeviceLost(Exception):
    """A step failed with an error that leaves the device unusable: `result` fails every
    request the worker holds; the worker sends it and exits so it is restarted."""

    def __init__(self, cause: BaseException, result: StepResult) -> None:
        super().__init__(str(cause))
        self.cause, self.result = cause, result


class Engine:
    def __init__(self, kv: KVManager, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor,
                 ngram: tuple[int, int] | None = None, guides: Guides | None = None,
                 stops: StopChecks | None = None) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.runner = runner
        self.outputs = outputs
        #: (longest, shortest) n-gram of prompt lookup, for requests that speculate; None: off
        self.ngram = ngram
        #: grammar state for constrained requests, over the model's tokenizer (None: none known)
        self.guides = guides
        #: stop strings the worker checks (`SamplingParams.stop`), over the same tokenizer
        self.stops = stops

    # -- what the worker reads ---------------------------------------------------------

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.runner.holding

    @property
    def spec_draft_tokens(self) -> int:
        return self.outputs.draft_tokens

    @property
    def spec_accepted_tokens(self) -> int:
        return self.outputs.accepted_tokens

    # -- intake and aborts -------------------------------------------------------------

    def add(self, req: NewRequest, tensors: dict[str, np.ndarray]) -> None:
        """Ingest and queue a request; raises ValueError on a request this worker refuses."""
        if req.request_id in self.scheduler.ids:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.max_tokens is None or req.max_tokens < 1:
            raise ValueError("NewRequest reached the worker without max_tokens")
        self.runner.check_layout(set(req.kv_layout))
        prompt, inputs = self.runner.make_request(tensors)
        kv = self.scheduler.ingest(req)
        r = Request(req.request_id, req.reply_to, req.sampling, req.max_tokens, dict(req.loop_caps), prompt, kv,
                    make_generator(req.sampling.seed), iters=dict.fromkeys(self.scheduler.loops, 0),
                    ready=not self.runner.needs_prepare,
                    inputs=inputs, metadata=dict(req.metadata))
        grammar = req.sampling.grammar
        if grammar is not None:  # constrained
            if self.guides is None:
                raise ValueError("this worker has no tokenizer for constrained decoding")
            r.guide = self.guides.new(grammar)
        elif self.ngram is not None and req.sampling.greedy:
            r.proposer = NgramProposer(*self.ngram)  # a constrained request does not speculate
        self._sampling_extras(r)
        if req.sampling.stop:
            if self.stops is None:
                raise ValueError("this worker has no tokenizer for stop strings")
            r.stop_check = self.stops.make(req.sampling.stop)
        self.scheduler.add(r)

    def _sampling_extras(self, r: Request) -> None:
        """What min_tokens masks: EOS unless ignore_eos, and stop_token_ids."""
        sp = r.sampling
        if sp.min_tokens:
            r.stop_ids = tuple(sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.outputs.eos)))

    def abort(self, request_id: str) -> tuple[str, int] | None:
        """Drop a request wherever it is; returns (reply_to, pages released) if it was here."""
        found = self.scheduler.remove(request_id)
        return None if found is None else (found[0].reply_to, found[1])

    # -- a step ------------------------------------------------------------------------

    def step(self) -> StepResult:
        res = StepResult()
        if self.runner.holding:  # outputs whose sound is made (wait for one when idle)
            ready, failed = self.runner.ready_outputs(wait=not self.scheduler.has_work)
            res.outputs += ready
            res.errors += failed
        admitted = self.scheduler.admit()
        if admitted and self.runner.needs_prepare:
            self._prepare(admitted, res)
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        labels = self.runner.step_labels
        try:
            for failure in self.scheduler.reserve(plan, labels):  # an overrun with no page to spare fails alone
                self._fail(failure, res)
            for failure in self.scheduler.reserve_scratch(plan, self.runner.step_scratch):
                self._fail(failure, res)
            sampled = self.runner.execute(plan) if plan.entries else []
            self.scheduler.drop_step_scratch(plan)  # scratch: released after its step
        except GroupLost as exc:  # a tensor-parallel rank is gone: the group cannot step again
            log.critical("%s; failing every request and exiting so the group restarts", exc)
            raise DeviceLost(exc, self.fail_all(ErrorKind.WORKER_FAILED, GROUP_LOST)) from exc
        except Exception as exc:
            error_id = new_error_id()
            log.exception("step failed (error_id=%s); failing its %d requests", error_id, len(plan.entries))
            for e in plan.entries:
                res.errors.append((e.request.reply_to, error_frame(e.request.request_id, ErrorKind.INTERNAL,
                                                                  "internal error in the model step", error_id)))
                self._finish(e.request, False, "error", res)
            if device_lost(exc):
                rest = self.fail_all(ErrorKind.WORKER_FAILED, "the worker's device failed; it is restarting")
                res.errors += rest.errors
                res.finished += rest.finished
                raise DeviceLost(exc, res) from exc
            return res
        kept = self.outputs.kept(plan, sampled)
        # a layout violation fails its request alone
        gone = {id(f.request) for f in self._fail_each(self.scheduler.commit(plan, kept, labels), res)}
        copies = self.scheduler.take_copies()
        if copies:  # now, while every source page is still its request's
            self.runner.copy_pages(copies)
        self._emit_all(plan, kept, gone, res)
        self.scheduler.observe(plan, time.perf_counter() - t0)  # the step-cost model learns its time
        return res

    def _emit_all(self, plan: StepPlan, kept: list[Kept], gone: set[int], res: StepResult) -> None:
        """Each entry's output (ending the requests it ends); an entry that made no token
        and no result sends nothing, but an in-step loop's iteration its progress, where
        the runner reports it (a video job's `progress`)."""
        for entry, k in zip(plan.entries, kept):
            req = entry.request
            if id(req) in gone:
                continue
            if not (k.tokens or req.pooled is not None):
                if req.loop is not None and self.runner.reports_progress:
                    res.outputs.append((req.reply_to, self.outputs.progress(req)))
                continue
            emitted = self._emit(entry, k.tokens)
            if not self.runner.on_emit(req, emitted.reply_to, emitted.output):
                res.outputs.append((emitted.reply_to, emitted.output))
            if emitted.ended:
                self._finish(req, emitted.ran_to_caps, "ok", res)

    def _emit(self, entry: PlanEntry, tokens: list[int]):
        """The step's output of `entry`: a later stage's is the runner's (`emit_stage`). The
        first stage's may open the later one (`open_stage`: an omni talker starts at the
        thinker's first token), and its end does not end the request while the later stage
        runs or is still to run (`next_stage`); where the later stage ended first, the
        request ends with the first, every loop at its cap only if both stages' were."""
        req = entry.request
        if entry.stage:
            return self.runner.emit_stage(req, tokens)
        emitted = self.outputs.emit(req, tokens)
        if not emitted.ended:
            self.runner.open_stage(req)
        elif self.runner.next_stage(req, emitted.output, emitted.ran_to_caps):
            req.proposer = None  # (a later stage never speculates)
            return emitted._replace(ended=False)
        elif req.stage is not None:
            return emitted._replace(ran_to_caps=emitted.ran_to_caps and req.stage.at_caps)
        return emitted

    def _prepare(self, admitted: list[Request], res: StepResult) -> None:
        """Admission work (an encoder pass, a probe): the scheduler reserves the rows it
        writes, the runner writes them, the scheduler commits them (a probe's scratch is
        given back); then the request is ready to schedule."""
        pages: dict[str, dict[str, list[int]]] = {}
        rows = {r.request_id: self.runner.admission_rows(r) for r in admitted}
        todo = []
        for r in admitted:
            try:
                pages[r.request_id] = self.scheduler.reserve_rows(r, rows[r.request_id])
            except FootprintOverrun as exc:
                self._fail(Failure(r, OVERRUN, exc), res)
                continue
            todo.append(r)
        failed = {id(f.request) for f in self._fail_each(self.runner.prepare(todo, pages), res)}
        ready = []
        for r in todo:
            if id(r) in failed:
                continue
            broken = self.scheduler.commit_rows(r, rows[r.request_id])
            if broken is not None:
                self._fail(broken, res)
                continue
            r.ready = True
            r.inputs.clear()  # what the admission work read is no longer needed
            ready.append(r)
        probes, scratch = [], {}
        for r in ready:
            writes = self.runner.scratch_rows(r)
            if not writes:
                continue
            try:
                scratch[r.request_id] = self.scheduler.reserve_rows(r, writes)
            except FootprintOverrun as exc:
                self._fail(Failure(r, OVERRUN, exc), res)
                continue
            probes.append(r)
        if probes:
            failures = self.runner.probe(probes, scratch)
            for r in probes:
                self.scheduler.drop_scratch(r, list(scratch[r.request_id]))  # scratch: released after its step
            self._fail_each(failures, res)

    def _fail_each(self, failures: list[Failure], res: StepResult) -> list[Failure]:
        for failure in failures:
            self._fail(failure, res)
        return failures

    def _fail(self, failure: Failure, res: StepResult) -> None:
        """End a request that failed alone: an error with an id (the cause logged under it)."""
        req = failure.request
        error_id = new_error_id()
        log.error("request %s failed (error_id=%s): %s", req.request_id, error_id, failure.cause or failure.message)
        res.errors.append((req.reply_to, error_frame(req.request_id, ErrorKind.INTERNAL, failure.message, error_id)))
        self._finish(req, False, "error", res)

    def _finish(self, req: Request, ran_to_caps: bool, status: str, res: StepResult) -> None:
        found = self.scheduler.remove(req.request_id, ran_to_caps)
        if found is not None:
            res.finished.append(Finished(req.request_id, found[1], status))

    def fail_all(self, kind: ErrorKind, message: str) -> StepResult:
        """End every request (at shutdown); pages all return to the pools."""
        res = StepResult()
        for r in list(self.scheduler.running) + list(self.scheduler.waiting):
            found = self.scheduler.remove(r.request_id)
            assert found is not None  # it was running or waiting
            res.finished.append(Finished(r.request_id, found[1], "error"))
            res.errors.append((r.reply_to, error_frame(r.request_id, kind, message)))
        return res
