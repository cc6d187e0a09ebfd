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

from services.gpu_worker.modeling.decoder.lm import DecoderLM
from services.gpu_worker.modeling.vision.base import SiglipDecoderModel, load_vlm_weights
from services.gpu_worker.modeling.vision.siglip import Idefics3Connector, SiglipVisionTower
from shared.specs.vision_lm import text_config

TEXT_PREFIX, VISION_PREFIX, CONNECTOR_PREFIX = "model.text_model.", "model.vision_model.", "model.connector."


class Idefics3LM(SiglipDecoderModel):
    """Idefics3 / SmolVLM: tiles through the SigLIP tower and the pixel-shuffle connector, rows into the Llama LM."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.lm = DecoderLM(text_config(config))
        self.vision = SiglipVisionTower(config["vision_config"], bucketed_positions=True)
        hidden = int(config["vision_config"]["hidden_size"])
        self.connector = Idefics3Connector(hidden, self.lm.config.hidden_size, int(config.get("scale_factor", 2)))

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Each part's tensors by its prefix; the LM's renamed to `DecoderLM`'s own names."""
        load_vlm_weights(state, self.lm, text=(TEXT_PREFIX,), head=("lm_head.",),
                         parts=[(self.vision, (VISION_PREFIX,)), (self.connector, (CONNECTOR_PREFIX,))])

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [N, C, S, S] -> their rows [N * rows_per_tile, text hidden], in order."""
        rows = self.connector(self.vision(pixel_values))
        return rows.reshape(-1, rows.shape[-1])
