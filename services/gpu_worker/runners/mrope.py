"""The runner hooks of a vision-language model with multimodal RoPE (Qwen2.5-VL).

What `VisionRunner` does (the tower at admission, its rows in place of the image tokens'
embeddings at prefill, the prefix cache's images not encoded), with two differences:

1. an image is one grid of patches of its own size, encoded whole (its windows and its
   2-D RoPE span the image), giving t * h * w / merge^2 rows: `_encode` passes the
   tower every image whose rows are not all in the prefix cache, with its grid;
2. positions are three per row (temporal, height, width): a prompt row's come from the
   request's "mrope_positions" tensor, which the spec computed as transformers'
   `get_rope_index` does (`shared.specs.vision_lm.mrope_positions`); a generated row r
   has r + delta in all three, delta = the prompt's largest position + 1 - its length
   (`mrope_delta`). Both stay in `Request.metadata` from admission on (its `inputs`
   are dropped then). The model gets them as [3, T] (`positions`, `position_streams`).

Rows and KV are the decoder's: a row's KV row is its index, whatever its position, so the
footprint, the pages and the prefix cache are untouched (an image's rows are keyed by its
content hash, which covers its grid: equal keys mean equal positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.gpu_worker.request import Request
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.runners.vision import VisionRunner
from services.gpu_worker.step_types import Failure
from shared.specs.base import MropeVisionRunnerSpec


class MropeVisionRunner(VisionRunner):
    SPEC = MropeVisionRunnerSpec
    position_streams = 3

    def __init__(self, model, spec, kv, caches: dict[str, list[torch.Tensor]], planner=None) -> None:
        super().__init__(model, spec, kv, caches, planner)
        self.merge = int(spec.merge_size)
        #: the tokens whose rows come from the vision tower (Qwen3-Omni: its video token too)
        self.vision_ids = np.asarray([self.image_token_id], dtype=np.int64)

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """`tensors`: "input_ids" int [P], "mrope_positions" int [3, P], and, when the
        prompt holds images, "pixel_values" float [patches, patch dim] and "image_grid_thw"
        int [images, 3] (`Qwen25VLSpec.process_prompt`). ValueError when they disagree."""
        prompt, _ = ModelRunner.make_request(self, tensors)
        mrope = tensors.get("mrope_positions")
        if mrope is None or mrope.shape != (3, len(prompt)):
            raise ValueError(f"a request needs tensor 'mrope_positions' [3, {len(prompt)}], got "
                             f"{None if mrope is None else mrope.shape}")
        rows = np.array(mrope.T, dtype=np.int64, order="C")  # [P, 3]: a row's three, row-major (a copy)
        inputs: dict = {"mrope": rows, "mrope_delta": int(rows.max()) + 1 - len(prompt) if len(prompt) else 0}
        where = np.flatnonzero(np.isin(np.asarray(prompt), self.vision_ids))
        pixels, grids = tensors.get("pixel_values"), tensors.get("image_grid_thw")
        grids = np.zeros((0, 3), dtype=np.int64) if grids is None else np.array(grids, dtype=np.int64).reshape(-1, 3)
        patches = int(grids.prod(axis=1).sum())
        if len(where) != patches // self.merge**2 or (0 if pixels is None else pixels.shape[0]) != patches:
            raise ValueError(f"the prompt holds {len(where)} image tokens and {0 if pixels is None else len(pixels)} "
                             f"patches; its image grids {grids.tolist()} make {patches // self.merge**2} and {patches}")
        if pixels is not None and patches:
            # a copy: the received frame is read-only (and need not outlive this call)
            inputs.update(pixels=torch.from_numpy(np.array(pixels, dtype=np.float32)), grids=grids, where=where)
        return prompt, inputs

    def prepare(self, admitted: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """Keep each request's positions on it for its steps (its `inputs` are dropped once
        admitted), then encode the images as `VisionRunner` does."""
        for r in admitted:
            r.metadata["mrope_positions"] = r.inputs["mrope"]
            r.metadata["mrope_delta"] = r.inputs["mrope_delta"]
        return super().prepare(admitted, pages)

    def _encode(self, reqs: list[Request]) -> None:
        """One tower pass over every image of `reqs` whose rows are not all computed (in the
        prefix cache); each request keeps those images' rows and their prompt positions."""
        batch, grids, keep = [], [], []
        for r in reqs:
            grid: np.ndarray = r.inputs["grids"]
            patches = grid.prod(axis=1)
            rows = patches // self.merge**2
            last = r.inputs["where"][np.cumsum(rows) - 1]
            needed = np.flatnonzero(last >= r.num_computed)  # a suffix of the images
            keep.append((r, needed, rows))
            if len(needed):
                first = int(patches[: needed[0]].sum())
                batch.append(r.inputs["pixels"][first:])
                grids.append(grid[needed])
        if not batch:
            return
        with torch.inference_mode():
            out = self.model.encode_images(torch.cat(batch).to(self.device, self.dtype),
                                           torch.from_numpy(np.concatenate(grids)))
        start = 0
        for r, needed, rows in keep:
            if not len(needed):
                continue
            skipped, n = int(rows[: needed[0]].sum()), int(rows[needed].sum())
            r.embeds = (r.inputs["where"][skipped:], out[start : start + n])
            start += n

    def positions(self, req: Request, start: int, n: int) -> Sequence[int]:
        """Rows [start, start + n): prompt rows' three positions from the request's tensor,
        generated rows' row + delta three times; row-major."""
        mrope: np.ndarray = req.metadata["mrope_positions"]
        prompt = len(mrope)
        if start >= prompt:  # decoding: one row a step (more under speculation)
            delta = req.metadata["mrope_delta"]
            return [p + delta for p in range(start, start + n) for _ in range(3)]
        out = mrope[start : start + n].ravel().tolist()
        if start + n > prompt:  # a chunk that runs past the prompt (drafts after it)
            out += self.positions(req, prompt, start + n - prompt)
        return out
