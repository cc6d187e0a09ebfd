"""The runner of world models (V-JEPA 2-AC): a request's rollout, one step of it a worker
step (runners/loop_steps.py).

A rollout request (`WorldSpec.process_prompt`) brings its context clip's pixels, its
actions and states (frames + steps - 1 rows each) and its steps. Its clip is encoded
once per content key (`clip_key`, the frames' bytes and preprocessing hashed by the data
worker): the tokens stay in a small LRU cache here, so many rollouts from one clip (a
planner's candidates), in one step or across requests, encode it once; each encode is
logged ("world encoder: clip ... encoded") so it can be counted. Then each worker step
runs one rollout step of every live request: at its step k a request predicts from its
frames so far (the context's, then the k predicted), and rollouts at the same frame run
as one batch of the predictor (requests that arrived at different times included); the
last frame's tokens of its output are the step's prediction. The predictor is frame-
block causal, so a frame's K/V never change once computed: each frame's rows (its
action, state and patch tokens) are written once into the request's pages of the frames
label, and each step after the first computes only the newest frame's rows, reading the
earlier ones' K/V from the pages. The predictions go back as float32 bytes on the
request (`Request.pooled`: steps x tokens x embed).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from services.gpu_worker.request import LoopState, Request
from services.gpu_worker.runners.loop_steps import LoopStepsRunner, state
from services.gpu_worker.step_types import PlanEntry
from shared.specs.base import WorldRunnerSpec

log = logging.getLogger("mstar.world_runner")

#: context clips whose tokens are kept (a planner's candidates share one)
CLIPS_KEPT = 32


@dataclass
class Rollout:
    """A request's rollout between steps: its frames not yet through the predictor (the
    context's, then the newest predicted), the frames whose K/V are in its pages, its
    predictions so far, its pages."""

    new: torch.Tensor
    pages: list[int]
    fed: int = 0
    out: list[torch.Tensor] = field(default_factory=list)


class WorldRunner(LoopStepsRunner):
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

    def start(self, entries: list[PlanEntry]) -> list[LoopState]:
        """Each entry's context clip's tokens (encoded once per clip); its rollout: its
        steps, never past its cap."""
        out = []
        for e in entries:
            r = e.request
            rollout = Rollout(self._clip(r.inputs["clip_key"], r.inputs.pop("pixel_values")),
                              e.pages[self.spec.label_name])
            out.append(LoopState(min(r.inputs["steps"], int(r.caps.get(self.spec.rollout_loop, 0))), rollout))
        return out

    def result(self, req: Request) -> bytes:
        rollout: Rollout = state(req)
        return torch.stack(rollout.out).float().cpu().numpy().astype("<f4").tobytes()

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

    def iterate(self, reqs: list[Request]) -> None:
        """One rollout step of each request. Its first runs the predictor over its context
        frames; each later one over its newest frame alone, reading the earlier frames' K/V
        from its pages (written by the steps before). Requests at the same frame with as
        many new frames run as one batch."""
        rollouts: list[Rollout] = [state(r) for r in reqs]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, ro in enumerate(rollouts):
            groups.setdefault((ro.fed, ro.new.shape[0]), []).append(i)
        for (start, t), members in groups.items():
            z = torch.stack([rollouts[i].new for i in members])
            acts = torch.stack([reqs[i].inputs["actions"][start:start + t] for i in members]).to(z)
            states = torch.stack([reqs[i].inputs["states"][start:start + t] for i in members]).to(z)
            pages = [rollouts[i].pages for i in members]
            past = self._read(pages, start) if start else None
            pred, kv = self.model.predict(z, acts, states, start, past)
            self._write(pages, start, kv)
            for j, i in enumerate(members):
                ro = rollouts[i]
                ro.out.append(pred[j, -1])
                ro.new, ro.fed = pred[j, -1:], start + t
        log.debug("world step: %d rollout(s) in %d batch(es)", len(reqs), len(groups))

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
