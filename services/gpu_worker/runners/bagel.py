"""The runner hooks of BAGEL's understanding path: image blocks whose rows share one RoPE position.

What `MropeVisionRunner` does for images (each image one grid of patches, encoded whole at
admission unless the prefix cache holds its rows; its rows in place of the placeholders'
embeddings at prefill) and what `VisionRunner` does for bidirectional blocks (each image
block, tags and patches, attends to itself both ways in prefill), with one position per
row that is not its index: a prompt row's from the request's "rope_positions" tensor
(`shared.specs.bagel`: an image block's rows all at one position), a generated row r at
r + delta, delta = the prompt's last position + 1 - its length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.gpu_worker.request import Request
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.runners.mrope import MropeVisionRunner
from services.gpu_worker.step_types import Failure


class BagelRunner(MropeVisionRunner):
    position_streams = 1

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """`tensors`: "input_ids" int [P], "rope_positions" int [P], and, when the prompt
        holds images, "pixel_values" float [patches, patch dim] and "image_grid_thw" int
        [images, 3] (`BagelSpec.process_prompt`). ValueError when they disagree."""
        prompt, _ = ModelRunner.make_request(self, tensors)
        pos = tensors.get("rope_positions")
        if pos is None or pos.shape != (len(prompt),):
            raise ValueError(f"a request needs tensor 'rope_positions' [{len(prompt)}], got "
                             f"{None if pos is None else pos.shape}")
        rows = np.array(pos, dtype=np.int64)
        inputs: dict = {"rope": rows, "rope_delta": int(rows[-1]) + 1 - len(prompt) if len(prompt) else 0}
        where = np.flatnonzero(np.asarray(prompt) == self.image_token_id)
        pixels, grids = tensors.get("pixel_values"), tensors.get("image_grid_thw")
        grids = np.zeros((0, 3), dtype=np.int64) if grids is None else np.array(grids, dtype=np.int64).reshape(-1, 3)
        patches = int(grids.prod(axis=1).sum())
        if len(where) != patches or (0 if pixels is None else pixels.shape[0]) != patches:
            raise ValueError(f"the prompt holds {len(where)} image tokens and {0 if pixels is None else len(pixels)} "
                             f"patches; its image grids {grids.tolist()} make {patches}")
        if pixels is not None and patches:
            inputs.update(pixels=torch.from_numpy(np.array(pixels, dtype=np.float32)), grids=grids, where=where)
        return prompt, inputs

    def prepare(self, admitted: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """Keep each request's positions on it (its `inputs` are dropped once admitted), then
        encode its images."""
        for r in admitted:
            r.metadata["rope_positions"] = r.inputs["rope"]
            r.metadata["rope_delta"] = r.inputs["rope_delta"]
        return super(MropeVisionRunner, self).prepare(admitted, pages)

    def positions(self, req: Request, start: int, n: int) -> Sequence[int]:
        """Rows [start, start + n): prompt rows' from the request's tensor, generated rows'
        row + delta."""
        pos: np.ndarray = req.metadata["rope_positions"]
        prompt = len(pos)
        if start >= prompt:
            delta = req.metadata["rope_delta"]
            return range(start + delta, start + n + delta)
        out = pos[start : start + n].tolist()
        if start + n > prompt:
            out += list(self.positions(req, prompt, start + n - prompt))
        return out
