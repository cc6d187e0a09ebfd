"""The runner of robot policies (Pi0): a request's prefix into paged KV, then its
flow-matching loop.

A policy request's prompt (its cameras' image rows, the prompt's tokens) runs whole in one
step, bidirectionally (`whole_prompts`), and writes every layer's K/V into the request's
pages: its footprint is those rows, nothing grows. In the same step the action expert runs
the `flow_loop`, a fixed number of Euler steps (the request's cap; never past it) from the
noise the request brings (t = 1) to its actions (t = 0); each step is one forward of every
request of the step together (chunk + 1 rows each), reading each layer's prefix K/V,
gathered once from the pages, read-only. The actions go back as float32 bytes on the
request (`Request.pooled`), the output processor sends them as its one output, and its
pages are released as any pooling request's.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from services.gpu_worker.attention import AttnRows
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.step_types import StepPlan
from shared.specs.base import PolicyRunnerSpec

log = logging.getLogger("mstar.policy_runner")


class PolicyRunner(ModelRunner):
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

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """Every entry's prefix in one forward, then their flow-matching steps together."""
        label = self.spec.label_name
        rows: list[AttnRows] = []
        ids: list[int] = []
        for e in plan.entries:
            r, n = e.request, e.rows
            if r.num_computed != 0 or n != len(r.prompt):
                raise RuntimeError(f"policy request {r.request_id} was scheduled in part ({n} of {len(r.prompt)} "
                                   f"rows from {r.num_computed}): its prefix runs whole")
            rows.append(AttnRows(e.pages[label], 0, 0, n, False))
            ids.extend(r.prompt)
        lengths = [len(e.request.prompt) for e in plan.entries]
        log.debug("policy step: %d request(s), prefixes of %s rows", len(lengths), lengths)
        meta = self.builder.build(rows, self.page_sizes[label], None, causal=False)
        with torch.inference_mode():
            flat = torch.tensor(ids, dtype=torch.long, device=self.device)
            positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
            pixels = torch.cat([e.request.inputs["pixel_values"] for e in plan.entries]).to(self.device)
            image_at = torch.nonzero(flat == self.spec.image_token_id).view(-1)
            self.model.prefix(flat, positions, self.model.encode_images(pixels), image_at, self.layer_caches,
                              [meta] * len(self.layer_caches))
            actions = self._flow([e.request for e in plan.entries], [e.pages[label] for e in plan.entries], lengths)
        for e, chunk in zip(plan.entries, actions.float().cpu()):
            e.request.pooled = chunk.numpy().astype("<f4").tobytes()
        return [[] for _ in plan.entries]

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

    def _flow(self, reqs: list, pages: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """Euler steps of the flow from t = 1 (the noise) to t = 0, each request its own cap
        of steps (`flow_loop`): a request past its cap keeps its actions while others go on."""
        prefix_kv, prefix_mask = self._prefix_kv(pages, lengths)
        dtype = prefix_kv[0][0].dtype  # the model's (a bfloat16 checkpoint's expert takes bfloat16 rows)
        noise = torch.stack([r.inputs["noise"] for r in reqs]).to(self.device)  # float32: the Euler sums
        state_rows = self.model.embed_state(torch.stack([r.inputs["state"] for r in reqs]).to(self.device, dtype))
        caps = [int(r.caps.get(self.spec.flow_loop, 0)) for r in reqs]
        rows = noise.shape[1] + int(self.model.state_row)
        positions = torch.tensor(lengths, device=self.device)[:, None] + torch.arange(rows, device=self.device)
        for step in range(max(caps, default=0)):
            live = [i for i, cap in enumerate(caps) if step < cap]
            at = torch.tensor(live, device=self.device)
            # as transformers: dt = -1 / steps, t = 1 + step * dt (Python floats), x += dt * v
            dts = [-1.0 / caps[i] for i in live]
            time = torch.tensor([1.0 + step * dt for dt in dts], dtype=torch.float32, device=self.device)
            if len(live) == len(reqs):
                v = self.model.velocity(state_rows, noise.to(dtype), time, prefix_kv, prefix_mask, positions)
            else:
                kv = [(k[at], v[at]) for k, v in prefix_kv]
                v = self.model.velocity(state_rows[at], noise[at].to(dtype), time, kv, prefix_mask[at], positions[at])
            for j, i in enumerate(live):
                noise[i] = noise[i] + dts[j] * v[j]
        return noise
