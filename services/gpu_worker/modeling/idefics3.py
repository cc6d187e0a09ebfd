"""Idefics3 / SmolVLM: a SigLIP vision tower, a pixel-shuffle connector and a Llama LM.

The language model is `DecoderLM` (the same paged attention and kernels as text
models); `encode_images` turns a request's tiles into the rows that replace its image
tokens' embeddings (`forward(..., embeds=...)`). Checkpoint names are transformers':
`model.text_model.*` and `lm_head.*` for the LM, `model.vision_model.*` for the tower,
`model.connector.*` for the connector.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.modeling.base import VisionDecoderModel
from services.gpu_worker.modeling.decoder_lm import DecoderLM, RowEmbeds
from services.gpu_worker.modeling.siglip import Idefics3Connector, SiglipVisionTower, load_prefixed
from shared.specs.vision_lm import text_config

TEXT_PREFIX, VISION_PREFIX, CONNECTOR_PREFIX = "model.text_model.", "model.vision_model.", "model.connector."


class Idefics3LM(VisionDecoderModel):
    assigns_weights = True

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.lm = DecoderLM(text_config(config))
        self.vision = SiglipVisionTower(config["vision_config"], bucketed_positions=True)
        hidden = int(config["vision_config"]["hidden_size"])
        self.connector = Idefics3Connector(hidden, self.lm.config.hidden_size, int(config.get("scale_factor", 2)))

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Each part's tensors by its prefix; the LM's renamed to `DecoderLM`'s own names."""
        text = {"model." + k[len(TEXT_PREFIX):]: v for k, v in state.items() if k.startswith(TEXT_PREFIX)}
        text.update({k: v for k, v in state.items() if k.startswith("lm_head.")})
        self.lm.load_weights(text)
        vision = {k: v for k, v in state.items() if k.startswith(VISION_PREFIX)}
        self.vision.to_empty(device="cpu")
        load_prefixed(self.vision, vision, VISION_PREFIX)
        self.connector.to_empty(device="cpu")
        load_prefixed(self.connector, {k: v for k, v in state.items() if k.startswith(CONNECTOR_PREFIX)},
                      CONNECTOR_PREFIX)
        known = (TEXT_PREFIX, VISION_PREFIX, CONNECTOR_PREFIX, "lm_head.")
        unknown = sorted(k for k in state if not k.startswith(known))
        if unknown:
            raise ValueError(f"checkpoint tensors no part of the model takes: {unknown[:5]}")

    def reset_buffers(self) -> None:
        self.lm.reset_buffers()
        self.vision.reset_buffers()

    def prepare(self) -> None:
        self.lm.prepare()

    def warm_gemms(self, max_rows: int, max_sample_rows: int) -> int:
        return self.lm.warm_gemms(max_rows, max_sample_rows)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [N, C, S, S] -> their rows [N * rows_per_tile, text hidden], in order."""
        rows = self.connector(self.vision(pixel_values))
        return rows.reshape(-1, rows.shape[-1])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttnMetadata], sample_rows: torch.Tensor, embeds: RowEmbeds | None = None) -> torch.Tensor:
        return self.lm(input_ids, positions, kv_caches, metas, sample_rows, embeds)
