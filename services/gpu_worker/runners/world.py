"""The runner of world models (V-JEPA 2-AC): a request's rollout, in the step that takes it.

A rollout request (`WorldSpec.process_prompt`) brings its context clip's pixels, its
actions and states (frames + steps - 1 rows each) and its steps. Its clip is encoded once
per content key (`clip_key`, the frames' bytes and preprocessing hashed by the data
worker): the tokens stay in a small LRU cache here, so many rollouts from one clip (a
planner's candidates), in one step or across requests, encode it once; each encode is
logged ("world encoder: clip ... encoded") so it can be counted. Then the rollouts of every
request of the step go step by step together: at step k a request predicts from its
frames so far (the context's, then the k predicted), and rollouts at the same frame run
as one batch of the predictor; the last frame's tokens of its output are the step's
prediction. The predictor is frame-block causal, so a frame's K/V never change once
computed: each frame's rows (its action, state and patch tokens) are written once into
the request's pages of the frames label, and each step after the first computes only the
newest frame's rows, reading the earlier ones' K/V from the pages. The predictions
go back as float32 bytes on the request (`Request.pooled`: steps x tokens x embed).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.step_types import StepPlan
from shared.specs.base import WorldRunnerSpec

log = logging.getLogger("mstar.world_runner")

#: context clips whose tokens are kept (a planner's candidates share one)
CLIPS_KEPT = 32


class WorldRunner(ModelRunner):
    SPEC = WorldRunnerSpec

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clips: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encodes = 0

    def _layer_caches(self) -> list[torch.Tensor]:
        return list(self.caches[self.spec.label(self.spec.label_name).pool])

    def attention_shape(self) -> tuple[int, float | None]:
        return self.spec.heads, None

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """`tensors`: input_ids (placeholders), pixel_values [frames, 3, H, W], actions and
        states [frames + steps - 1, A], steps [1], clip_key [32] uint8."""
        prompt, _ = super().make_request(tensors)
        for name in ("pixel_values", "actions", "states", "steps", "clip_key"):
            if name not in tensors:
                raise ValueError(f"a rollout request needs tensor {name!r}")
        inputs: dict = {name: torch.from_numpy(np.ascontiguousarray(tensors[name], dtype=np.float32))
                        for name in ("pixel_values", "actions", "states")}
        inputs["steps"] = int(tensors["steps"].reshape(-1)[0])
        inputs["clip_key"] = bytes(np.asarray(tensors["clip_key"], dtype=np.uint8)).hex()
        return prompt, inputs

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """Every entry's rollout, the steps of all of them together."""
        for e in plan.entries:
            r = e.request
            if r.num_computed != 0 or e.rows != len(r.prompt):
                raise RuntimeError(f"rollout request {r.request_id} was scheduled in part: its rollout runs whole")
        reqs = [e.request for e in plan.entries]
        with torch.inference_mode():
            context = [self._clip(r.inputs["clip_key"], r.inputs["pixel_values"]) for r in reqs]
            out = self._rollout(reqs, context, [e.pages[self.spec.label_name] for e in plan.entries])
        for r, steps in zip(reqs, out):
            r.pooled = torch.stack(steps).float().cpu().numpy().astype("<f4").tobytes()
        return [[] for _ in reqs]

    def _clip(self, key: str, pixels: torch.Tensor) -> torch.Tensor:
        """The clip's tokens [frames, tokens, embed]: from the cache, else encoded (logged)."""
        hit = self.clips.get(key)
        if hit is not None:
            self.clips.move_to_end(key)
            return hit
        dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        tokens = self.model.encode(pixels.to(self.device, dtype))
        self.encodes += 1
        log.info("world encoder: clip %s encoded (%d frames; %d encodes in all)", key[:16], pixels.shape[0],
                 self.encodes)
        self.clips[key] = tokens
        while len(self.clips) > CLIPS_KEPT:
            self.clips.popitem(last=False)
        return tokens

    def _rollout(self, reqs: list, context: list[torch.Tensor], pages: list[list[int]]) -> list[list[torch.Tensor]]:
        """Each request's predicted frames. Its first pass runs the predictor over its context
        frames; each later one over its newest frame alone, reading the earlier frames' K/V
        from its pages (written by the passes before). Requests at the same frame with as
        many new frames run as one batch."""
        new = [c for c in context]  # each request's frames not yet through the predictor
        fed = [0] * len(reqs)  # frames whose K/V are in the pages
        out: list[list[torch.Tensor]] = [[] for _ in reqs]
        caps = [min(r.inputs["steps"], int(r.caps.get(self.spec.rollout_loop, 0))) for r in reqs]
        for step in range(max(caps, default=0)):
            groups: dict[tuple[int, int], list[int]] = {}
            for i, cap in enumerate(caps):
                if step < cap:
                    groups.setdefault((fed[i], new[i].shape[0]), []).append(i)
            for (start, t), members in groups.items():
                z = torch.stack([new[i] for i in members])
                acts = torch.stack([reqs[i].inputs["actions"][start:start + t] for i in members]).to(z)
                states = torch.stack([reqs[i].inputs["states"][start:start + t] for i in members]).to(z)
                past = self._read([pages[i] for i in members], start) if start else None
                pred, kv = self.model.predict(z, acts, states, start, past)
                self._write([pages[i] for i in members], start, kv)
                for j, i in enumerate(members):
                    out[i].append(pred[j, -1])
                    new[i], fed[i] = pred[j, -1:], start + t
            log.debug("world step %d: %d rollout(s) in %d batch(es)", step, sum(map(len, groups.values())),
                      len(groups))
        return out

    def _slots(self, pages: list[int], first: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, slot) of each of rows [first, first + rows) of a request's frames label."""
        size = self.page_sizes[self.spec.label_name]
        at = torch.arange(first, first + rows)
        table = torch.tensor(pages, dtype=torch.long)
        return table[at // size].to(self.device), (at % size).to(self.device)

    def _read(self, pages: list[list[int]], frames: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V [B, heads, rows, head_dim] of the first `frames` frames."""
        rows = frames * (self.spec.tokens_per_frame + 2)
        where = [self._slots(p, 0, rows) for p in pages]
        dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        out = []
        for cache in self.layer_caches:
            k = torch.stack([cache[pg, 0, sl] for pg, sl in where]).transpose(1, 2).to(dtype)
            v = torch.stack([cache[pg, 1, sl] for pg, sl in where]).transpose(1, 2).to(dtype)
            out.append((k, v))
        return out

    def _write(self, pages: list[list[int]], frames: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The new rows' K and V (each layer's [B, heads, rows, head_dim]), after the first
        `frames` frames of each request's frames label."""
        first = frames * (self.spec.tokens_per_frame + 2)
        where = [self._slots(p, first, kv[0][0].shape[2]) for p in pages]
        for cache, (k, v) in zip(self.layer_caches, kv):
            for b, (pg, sl) in enumerate(where):
                cache[pg, 0, sl] = k[b].transpose(0, 1).to(cache.dtype)
                cache[pg, 1, sl] = v[b].transpose(0, 1).to(cache.dtype)
