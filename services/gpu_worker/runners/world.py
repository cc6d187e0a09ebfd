"""The runner of world models (V-JEPA 2-AC): a request's rollout, in the step that takes it.

A rollout request (`WorldSpec.process_prompt`) brings its context clip's pixels, its
actions and states (frames + steps - 1 rows each) and its steps. Its clip is encoded once
per content key (`clip_key`, the frames' bytes and preprocessing hashed by the data
worker): the tokens stay in a small LRU cache here, so many rollouts from one clip (a
planner's candidates), in one step or across requests, encode it once; each encode is
logged ("world encoder: clip ... encoded") so it can be counted. Then the rollouts of every
request of the step go step by step together: at step k a request predicts from its
frames so far (the context's, then the k predicted), and rollouts with as many frames run
as one batch of the predictor; the last frame's tokens of its output are the step's
prediction. This first version recomputes the predictor over every frame at each step
(no K/V kept: the pages reserved for the frames label are not written). The predictions
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
            out = self._rollout(reqs, context)
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

    def _rollout(self, reqs: list, context: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Each request's predicted frames; at each step the live requests with the same
        number of frames so far run as one batch."""
        frames = [list(c.unbind(0)) for c in context]
        out: list[list[torch.Tensor]] = [[] for _ in reqs]
        caps = [min(r.inputs["steps"], int(r.caps.get(self.spec.rollout_loop, 0))) for r in reqs]
        for step in range(max(caps, default=0)):
            groups: dict[int, list[int]] = {}
            for i, cap in enumerate(caps):
                if step < cap:
                    groups.setdefault(len(frames[i]), []).append(i)
            for t, members in groups.items():
                z = torch.stack([torch.stack(frames[i]) for i in members])
                dtype = z.dtype
                acts = torch.stack([reqs[i].inputs["actions"][:t] for i in members]).to(self.device, dtype)
                states = torch.stack([reqs[i].inputs["states"][:t] for i in members]).to(self.device, dtype)
                nxt = self.model.predict(z, acts, states)[:, -1]
                for j, i in enumerate(members):
                    frames[i].append(nxt[j])
                    out[i].append(nxt[j])
            log.debug("world step %d: %d rollout(s) in %d batch(es)", step, sum(map(len, groups.values())),
                      len(groups))
        return out
