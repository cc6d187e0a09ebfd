"""Interleaved multimodal RoPE (Qwen3-VL, Qwen3.5): three positions a row (temporal,
height, width), the rotary pairs dealt out to them in turn rather than in blocks.

transformers' `Qwen3_5TextRotaryEmbedding.recomposition_frequencies` starts from the
temporal stream's angles and overwrites pair i with the height stream's where i % 3 == 1
and i < 3 * mrope_section[1], with the width stream's where i % 3 == 2 and i < 3 *
mrope_section[2]; the second half of the head repeats the first. So each table column
takes its angle from one stream, as in `MRotary` (Qwen2.5-VL), only the column -> stream
map differs: the gather over `Rotary`'s 1-D tables is the same and every value is the
table's own float32 angle, bitwise transformers'. Nothing requires the sections to sum to
the pairs (transformers' slices simply stop at the rotary dim): a config whose sections
cover more pairs than the head has (a tiny test model's partial rotary dim under the
default [11, 11, 10]) rotates as transformers does.
"""

from __future__ import annotations

import torch

from services.gpu_worker.layers.rope import MRotary, Rotary
from shared.model_config import RopeConfig


def interleaved_streams(pairs: int, section: tuple[int, ...]) -> list[int]:
    """The stream (0 temporal, 1 height, 2 width) of each of `pairs` rotary pairs."""
    streams = [0] * pairs
    for stream in (1, 2):
        length = section[stream] * 3 if len(section) > stream else 0
        for i in range(stream, min(length, pairs), 3):
            streams[i] = stream
    return streams


class InterleavedMRotary(MRotary):
    """`MRotary` with Qwen3.5's interleaved column -> stream map; 1-D positions [T] (a
    text row: all three streams equal) take `Rotary`'s path, as in `MRotary`."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_pos: int, section: tuple[int, ...]) -> None:
        # MRotary's own constructor insists on blocks that fill the head; interleaving does not
        self.section = tuple(section)
        Rotary.__init__(self, rope, head_dim, max_pos)

    def reset_buffers(self) -> None:
        Rotary.reset_buffers(self)
        if torch.empty(0).is_meta:
            return
        half = interleaved_streams(self.head_dim // 2, self.section)
        device = self.cos.device
        self.register_buffer("streams", torch.tensor(half * 2, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("columns", torch.arange(self.head_dim, device=device), persistent=False)
