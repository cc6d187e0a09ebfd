"""Lockstep: rank 0 plans, every rank runs the same forward on its shard.

Rank 0 is a whole worker (scheduler, KV manager, sampler); its runner builds each forward's
inputs from the plan as a one-rank runner does and broadcasts them (a `Forward`: each
label's rows and pages, the token ids, positions and the rows that sample) before running
them. The other ranks hold no request state: each builds the same attention metadata from
the same rows over its own KV pool (the same pages, its heads' share of each) and runs the
same forward, meeting rank 0 at every all-reduce. Only rank 0 gets the logits and samples.
Page copies are broadcast the same way. A heartbeat while idle keeps the others' wait
within the collectives' timeout and finds a dead rank before a request does.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.layers import prompt_rows
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.step_types import StepPlan
from services.gpu_worker.tp.group import GroupLost, TpGroup
from shared.memory import release_free_heap

log = logging.getLogger("mstar.tp")


class Forward(NamedTuple):
    """One forward's inputs, as rank 0 broadcasts them."""

    rows: dict  # label -> [AttnRows]
    ids: list[int]
    positions: list[int]
    sample_rows: list[int]
    first_prompt_row: int


class Copy(NamedTuple):
    copies: list[tuple[str, int, int]]


class Beat(NamedTuple):
    """Nothing to run: rank 0 is idle and alive."""


class Stop(NamedTuple):
    """The group is shutting down: the other ranks exit."""


class TpRunner(ModelRunner):
    """The decoder runner of a tensor-parallel rank: on rank 0 it broadcasts every forward
    before running it; on the others `follow` runs what rank 0 broadcast."""

    def __init__(self, model, spec, kv, caches, planner=None, *, group: TpGroup) -> None:
        self.group = group  # before the base's __init__, which asks `attention_shape`
        self._rows: dict = {}
        super().__init__(model, spec, kv, caches, planner)
        log.info("rank %d runs its layers one module at a time (the C decode stack's one call has no point for "
                 "the all-reduce between layers)", group.rank)

    def attention_shape(self) -> tuple[int, float | None]:
        return self.spec.config.num_attention_heads // self.group.size, self.spec.config.attn_softcap

    def _metadata(self, rows: dict[str, list]) -> dict[str, AttnMetadata]:
        self._rows = rows
        return super()._metadata(rows)

    def call_model(self, ids, positions, metas: dict[str, AttnMetadata], sample_rows, plan: StepPlan) -> torch.Tensor:
        try:
            self.group.broadcast(Forward(self._rows, ids.tolist(), positions.tolist(), sample_rows.tolist(),
                                         prompt_rows.start()))
            return super().call_model(ids, positions, metas, sample_rows, plan)
        except Exception as exc:  # the ranks are out of lockstep whatever failed
            raise GroupLost(f"tensor-parallel step failed: {exc}") from exc

    def copy_pages(self, copies: list[tuple[str, int, int]]) -> None:
        try:
            self.group.broadcast(Copy(copies))
        except Exception as exc:
            raise GroupLost(f"tensor-parallel page copy failed: {exc}") from exc
        super().copy_pages(copies)

    def beat(self) -> None:
        """Rank 0, idle: a heartbeat through the group (GroupLost where a rank is gone)."""
        try:
            self.group.broadcast(Beat())
        except Exception as exc:
            raise GroupLost(f"a tensor-parallel rank is gone: {exc}") from exc

    def stop(self) -> None:
        """Rank 0, shutting down: the other ranks exit (best effort: one may be gone)."""
        try:
            self.group.broadcast(Stop())
        except Exception as exc:
            log.warning("could not tell the other ranks to stop: %s", exc)

    # -- the other ranks -----------------------------------------------------------------

    def follow(self) -> None:
        """Run rank 0's forwards until it says stop (an error here ends this process, and
        the group with it)."""
        while True:
            msg = self.group.receive()
            if isinstance(msg, Stop):
                return
            if isinstance(msg, Copy):
                ModelRunner.copy_pages(self, msg.copies)
            elif isinstance(msg, Forward):
                self._run(msg)
            else:  # a heartbeat: rank 0 is idle, so this rank's freed step buffers go back as rank 0's do
                release_free_heap()

    def _run(self, f: Forward) -> None:
        metas = ModelRunner._metadata(self, f.rows)
        flat = torch.tensor(f.ids + f.positions + f.sample_rows, dtype=torch.int64, device=self.device)
        n, p = len(f.ids), len(f.ids) + len(f.positions)
        first = None if f.first_prompt_row >= n else f.first_prompt_row
        with torch.inference_mode(), prompt_rows.prompt_rows_from(first):
            ModelRunner.call_model(self, flat[:n], flat[n:p], metas, flat[p:], StepPlan([]))
