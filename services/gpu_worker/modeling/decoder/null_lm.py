"""The null model's torch side (see shared/specs/null_lm.py): no weights, no compute.

Same forward signature as `DecoderLM`. It writes zero K/V rows into its one-layer pool (so
the paged write path and its metadata run as for a real model) and returns logits that are
0 everywhere but 1 at the next printable ASCII byte after each sampled row's input id.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.gpu_worker.attention import AttnMetadata, write_kv
from services.gpu_worker.modeling.base import DecoderModel
from shared.specs.null_lm import FIRST_PRINTABLE, NUM_PRINTABLE


class NullLM(DecoderModel):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.config = cfg
        self.vocab_size = int(cfg["vocab_size"])
        self.kv_heads = int(cfg["num_key_value_heads"])
        self.head_dim = int(cfg["head_dim"])
        self._zeros: torch.Tensor | None = None  # zero K/V rows, grown on demand and sliced
        self._table: torch.Tensor | None = None  # [vocab, vocab]: next-token logits per input id

    def _zero_rows(self, n: int, like: torch.Tensor) -> torch.Tensor:
        z = self._zeros
        if z is None or z.shape[0] < n or z.dtype != like.dtype or z.device != like.device:
            z = self._zeros = torch.zeros(max(n, 64), self.kv_heads, self.head_dim, dtype=like.dtype,
                                          device=like.device)
        return z[:n]

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"the null model takes no weights, got {sorted(state)[:5]}")

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], metas: list[AttnMetadata],
                sample_rows: torch.Tensor):
        for cache, meta in zip(kv_caches, metas):
            rows = self._zero_rows(input_ids.shape[0], cache)
            write_kv(cache, rows, rows, meta)
        return self._next_logits(input_ids.device)[input_ids[sample_rows]]

    def _next_logits(self, device: torch.device) -> torch.Tensor:
        """Row t: the logits after input id t (one-hot at the next printable byte), built
        once, so a step's logits are one lookup rather than a chain of small ops."""
        table = self._table
        if table is None or table.device != device:
            ids = torch.arange(self.vocab_size, device=device)
            nxt = FIRST_PRINTABLE + (ids - FIRST_PRINTABLE + 1) % NUM_PRINTABLE
            table = self._table = F.one_hot(nxt, self.vocab_size).to(torch.float32)
        return table
