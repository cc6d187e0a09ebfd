"""The runner of robot policies (Pi0): a request's prefix into paged KV, then its
flow-matching loop, one Euler step a worker step (runners/loop_steps.py).

A policy request's prompt (its cameras' image rows, the prompt's tokens) runs whole in one
step, bidirectionally (`whole_prompts`), and writes every layer's K/V into the request's
pages: its footprint is those rows, nothing grows. From that step on, the action expert
runs the `flow_loop`, a fixed number of Euler steps (the request's cap; never past it)
from the noise the request brings (t = 1) to its actions (t = 0), one a worker step; each
worker step's Euler steps are one forward of every live request together (chunk + 1 rows
each), requests that arrived at different times at their own step, each reading each
layer's prefix K/V gathered from its pages, read-only. The actions go back as float32 bytes on the
request (`Request.pooled`), the output processor sends them as its one output, and its
pages are released as any pooling request's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from services.gpu_worker.attention import AttnRows
from services.gpu_worker.request import LoopState, Request
from services.gpu_worker.runners.loop_steps import LoopStepsRunner, iteration, state
from services.gpu_worker.step_types import PlanEntry
from shared.specs.base import PolicyRunnerSpec

log = logging.getLogger("mstar.policy_runner")


@dataclass
class Flow:
    """A request's flow between steps: its actions so far (float32 [chunk, action dim]), its
    state's row, its prefix's rows and pages (read-only)."""

    x: torch.Tensor
    state_row: torch.Tensor
    length: int
    pages: list[int]


class PolicyRunner(LoopStepsRunner):
    SPEC = PolicyRunnerSpec

    def _layer_caches(self) -> list[torch.Tensor]:
        return list(self.caches[self.spec.label(self.spec.label_name).pool])

    def attention_shape(self) -> tuple[int, float | None]:
        return self.spec.heads, None

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """`tensors`: input_ids [P], pixel_values [cameras, C, H, W], state [max state dim],
        noise [chunk, max action dim] (`PolicySpec.process_prompt`)."""
        prompt, _ = super().make_request(tensors)
        for name in ("pixel_values", "state", "noise"):
            if name not in tensors:
                raise ValueError(f"a policy request needs tensor {name!r}")
        rows = int(np.count_nonzero(np.asarray(prompt) == self.spec.image_token_id))
        if rows != tensors["pixel_values"].shape[0] * self.spec.rows_per_image:
            raise ValueError(f"the prompt holds {rows} image tokens for {tensors['pixel_values'].shape[0]} camera(s)")
        return prompt, {name: torch.from_numpy(np.ascontiguousarray(tensors[name], dtype=np.float32))
                        for name in ("pixel_values", "state", "noise")}

    def start(self, entries: list[PlanEntry]) -> list[LoopState]:
        """Every new entry's prefix in one forward (its K/V into its pages); its flow: its
        noise (t = 1), its state's row, its cap of steps."""
        label = self.spec.label_name
        rows = [AttnRows(e.pages[label], 0, 0, e.rows, False) for e in entries]
        ids = [t for e in entries for t in e.request.prompt]
        lengths = [len(e.request.prompt) for e in entries]
        log.debug("policy step: %d new request(s), prefixes of %s rows", len(lengths), lengths)
        meta = self.builder.build(rows, self.page_sizes[label], None, causal=False)
        flat = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        pixels = torch.cat([e.request.inputs["pixel_values"] for e in entries]).to(self.device)
        image_at = torch.nonzero(flat == self.spec.image_token_id).view(-1)
        self.model.prefix(flat, positions, self.model.encode_images(pixels), image_at, self.layer_caches,
                          [meta] * len(self.layer_caches))
        # the model's dtype (a bfloat16 checkpoint's expert takes bfloat16 rows)
        dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        states = self.model.embed_state(torch.stack([e.request.inputs["state"] for e in entries]).to(self.device,
                                                                                                       dtype))
        loops = [LoopState(int(e.request.caps.get(self.spec.flow_loop, 0)),
                           Flow(e.request.inputs["noise"].to(self.device), states[i:i + 1], n, e.pages[label]))
                 for i, (e, n) in enumerate(zip(entries, lengths))]
        for e in entries:
            e.request.inputs.clear()  # in its pages and its flow now, not kept for the loop's steps
        return loops

    def iterate(self, reqs: list[Request]) -> None:
        """One Euler step of each request's flow from t = 1 (the noise) to t = 0, each at its
        own step of its own cap (`flow_loop`), every request in one forward."""
        flows: list[Flow] = [state(r) for r in reqs]
        lengths = [f.length for f in flows]
        prefix_kv, prefix_mask = self._prefix_kv([f.pages for f in flows], lengths)
        dtype = prefix_kv[0][0].dtype
        noise = torch.stack([f.x for f in flows])  # float32: the Euler sums
        rows = noise.shape[1] + int(self.model.state_row)
        positions = torch.tensor(lengths, device=self.device)[:, None] + torch.arange(rows, device=self.device)
        # as transformers: dt = -1 / steps, t = 1 + step * dt (Python floats), x += dt * v
        dts = [-1.0 / r.loop.total for r in reqs if r.loop is not None]
        time = torch.tensor([1.0 + iteration(r) * dt for r, dt in zip(reqs, dts)], dtype=torch.float32,
                            device=self.device)
        v = self.model.velocity(torch.cat([f.state_row for f in flows]), noise.to(dtype), time, prefix_kv,
                                prefix_mask, positions)
        for j, f in enumerate(flows):
            f.x = f.x + dts[j] * v[j]

    def result(self, req: Request) -> bytes:
        flow: Flow = state(req)
        return flow.x.float().cpu().numpy().astype("<f4").tobytes()

    def _prefix_kv(self, pages: list[list[int]], lengths: list[int]
                   ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Each layer's prefix K and V [B, Pmax, kv heads, D] gathered from the pages (a copy:
        the pages are only read), and which rows are real [B, Pmax]."""
        page_size = self.page_sizes[self.spec.label_name]
        width = max(len(p) for p in pages)
        table = torch.tensor([p + [p[0]] * (width - len(p)) for p in pages], dtype=torch.long, device=self.device)
        most = max(lengths)
        dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        out = []
        for cache in self.layer_caches:
            _, _, _, h, d = cache.shape
            kv = cache.index_select(0, table.view(-1)).view(len(pages), width, 2, page_size, h, d)
            kv = kv.permute(0, 2, 1, 3, 4, 5).reshape(len(pages), 2, width * page_size, h, d)[:, :, :most]
            out.append((kv[:, 0].to(dtype), kv[:, 1].to(dtype)))
        held = torch.tensor(lengths, device=self.device)
        return out, torch.arange(most, device=self.device)[None, :] < held[:, None]
