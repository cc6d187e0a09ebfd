"""Decoder-based embedding models (Qwen3-Embedding and the like): the decoder LM's layers,
causal as in training, and its final norm; no LM head. Each prompt's last row, pooled by
the runner, is the embedding.

Such a folder's config says `Qwen3ForCausalLM` but sentence-transformers saves the bare
model: its weights have no `model.` prefix and there is no `lm_head`, so the names get the
prefix back and the head is never built (`prepare` packs a one-row stand-in, which keeps
its path for the layers' GEMMs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.modeling.base import PoolingModel
from services.gpu_worker.modeling.decoder.lm import DecoderLM
from shared.model_config import ModelConfig


class DecoderEmbedder(DecoderLM, PoolingModel):
    def __init__(self, config: Mapping[str, Any] | ModelConfig) -> None:
        super().__init__(config)
        if not self.tied:
            del self.lm_head
        self.tied = True  # no head of its own: the embedding table stands in where one is read

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        if not any(k.startswith("model.") for k in state):
            state = {f"model.{k}": v for k, v in state.items()}  # a bare model's names
        state.pop("lm_head.weight", None)
        super().load_weights(state)

    def _head_rows(self, weight: torch.Tensor) -> torch.Tensor:
        return weight[:1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor,  # type: ignore[override]
                kv_caches: list[torch.Tensor], metas: list[AttnMetadata]) -> torch.Tensor:
        return self.model.norm(self.hidden(input_ids, positions, kv_caches, metas))
