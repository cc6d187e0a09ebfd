"""The runners whose request is a prompt and then a loop over a fixed set of rows (DESIGN.md
§3 "Denoising loops": a diffusion model's denoising, a policy's flow matching): the step
that takes a request runs its prompt whole (`whole_prompts`) and writes its K/V, then every
step runs ONE iteration of each request's loop (vLLM v1's shape: the scheduler plans it,
`PlanEntry.loop`, writing and committing no row; the runner runs it; the output processor
sends the result when the loop ends). So a long loop shares the worker with the requests
that arrive while it runs (a 1-step image beside a 50-step video), a step never lasts a
whole loop (the step watchdog sees steps, not loops), and requests at different
iterations run their iterations in one forward where the model allows.

A request's loop state lives on it (`Request.loop`: its latents, its multistep scheduler's
history, its noise), carried exactly from one step to the next: each iteration computes
what the same iteration computed when the loop ran inside one step. An abort between
iterations drops the request and its state, and the scheduler frees its pages.
"""

from __future__ import annotations

from typing import Any

import torch

from services.gpu_worker.request import LoopState, Request
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.step_types import PlanEntry, StepPlan


class LoopStepsRunner(ModelRunner):
    """A step: the new entries' prompts (`start`: their loops set up), then one iteration of
    every live loop (`iterate`), then the result of each loop that ended (`result`)."""

    def execute(self, plan: StepPlan) -> list[list[int]]:
        for e in plan.entries:
            r = e.request
            if not e.loop and (r.num_computed != 0 or e.rows != len(r.prompt)):
                raise RuntimeError(f"request {r.request_id} was scheduled in part ({e.rows} of {len(r.prompt)} rows "
                                   f"from {r.num_computed}): its prompt runs whole")
            if e.loop and r.loop is None:
                raise RuntimeError(f"request {r.request_id} has no loop to iterate")
        with torch.inference_mode():
            fresh = [e for e in plan.entries if not e.loop]
            for e, loop in zip(fresh, self.start(fresh) if fresh else []):
                e.request.loop = loop
            live = [e.request for e in plan.entries if not _loop(e.request).finished]
            if live:
                self.iterate(live)
                for r in live:
                    _loop(r).done += 1
            for e in plan.entries:
                if _loop(e.request).finished:
                    e.request.pooled = self.result(e.request)
        return [[] for _ in plan.entries]

    def start(self, entries: list[PlanEntry]) -> list[LoopState]:
        """The new entries' prompts run (their K/V into their pages); each one's loop state."""
        raise NotImplementedError

    def iterate(self, reqs: list[Request]) -> None:
        """One iteration of each request's loop, its `loop.done`-th (counted after)."""
        raise NotImplementedError

    def result(self, req: Request) -> bytes:
        """A request's result once its loop ended (`Request.pooled`)."""
        raise NotImplementedError


def _loop(req: Request) -> LoopState:
    assert req.loop is not None  # set by `start` in the request's first step
    return req.loop


def state(req: Request) -> Any:
    """The runner's state of a request's loop."""
    return _loop(req).state


def iteration(req: Request) -> int:
    """The iteration of a request's loop this step runs (0 first)."""
    return _loop(req).done
