"""The runner of hybrid linear-attention models (Qwen3.5): the decoder runner, with the
state label's rows turned into the step's `StateBatch` rather than attention metadata.

A request's state label holds one page of the state pool (its slot) from its first chunk
to its end (the pool's page is a whole sequence). The batch says, per request of the step,
its rows, its slot and whether the slot's state starts at zero (the first rows it
computes: a freshly taken slot holds a finished request's state, never cleared by the pool).
"""

from __future__ import annotations

from typing import cast

import numpy as np

from services.gpu_worker.attention import AttnMetadata, AttnRows, HostStep, KernelBuilder, cpu_backend
from services.gpu_worker.layers.delta_rule import StateBatch
from services.gpu_worker.modeling.hybrid.cpu_stack import StateHost, state_host
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.step_types import StepPlan


class HybridRunner(ModelRunner):
    def _state_labels(self) -> set[str]:
        return {lab.name for lab in self.spec.kv_labels if self.kv.pools[lab.pool].config.is_state}

    def _backend(self) -> str:
        """As the decoder's, over the attention pools only (a state pool holds no KV pages)."""
        if self.planner is not None:
            return "flashinfer"
        if self.device.type != "cpu":
            return "torch"
        import torch

        heads, softcap = self.attention_shape()
        compute = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        picks = {cpu_backend(layers[0].dtype, compute, softcap, heads, layers[0].shape[3])
                 for name, layers in self.caches.items() if not self.kv.pools[name].config.is_state}
        return "kernel" if picks == {"kernel"} else "torch"

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """The step, after copying each prefix hit's state snapshot into its request's slot
        (reserved by now: the step's rows took it)."""
        for e in plan.entries:
            kv = e.request.kv
            if kv is not None and kv.restores:
                self.copy_pages([(kv.labels[name].label.pool, page, kv.labels[name].pages[0])
                                 for name, page in kv.restores.items()])
                self.kv.end_restores(kv.request_id)
        return super().execute(plan)

    def _run_on_host(self, rows: dict[str, list], ids: list[int], positions: list[int],
                     sample_rows: list[int]) -> np.ndarray | None:
        """The decoder's whole step in the C stack's one call (modeling/hybrid/cpu_stack.py),
        the state label's rows as the linear layers' `StateHost` (what `state_batch` says)."""
        stack, builder = self.host_stack, self.builder
        assert stack is not None and isinstance(builder, KernelBuilder)
        states = self._state_labels()
        host: dict[str, HostStep | StateHost | None] = {
            name: state_host(r) if name in states else builder.host(r, self.page_sizes[name], self.windows[name])
            for name, r in rows.items()}
        metas = cast("list[HostStep | None]", [host[name] for name in self.spec.layer_labels])  # (and StateHosts)
        return stack.run_step(ids, positions, sample_rows, metas, self.layer_caches)

    def _metadata(self, rows: dict[str, list]) -> dict[str, AttnMetadata]:
        states = self._state_labels()
        metas = super()._metadata({name: r for name, r in rows.items() if name not in states})
        for name in states:
            metas[name] = state_batch(rows[name], self.device)  # type: ignore[assignment]
        return metas


def state_batch(rows: list[AttnRows], device) -> StateBatch:
    """Each request's rows of the step, its slot (the one page of its state label) and
    whether its state starts at zero (no row computed before this step)."""
    bounds = [0]
    for r in rows:
        bounds.append(bounds[-1] + r.new)
    return StateBatch.build(bounds, [r.pages[0] for r in rows], [r.cached == 0 for r in rows])
