"""Gemma 3 with images: a SigLIP vision tower, the multimodal projector and the Gemma 3 LM.

The language model is `DecoderLM` (Gemma 3 text: its sliding and full layers, (1 + w)
norms, embedding scale); `encode_images` turns a request's images into the rows that
replace its soft tokens' embeddings (`forward(..., embeds=...)`), after the embedding scale
as in transformers (image features are not scaled). The bidirectional attention among an
image's rows is the attention metadata's (`Span.bidirectional`), not the model's.

Checkpoint names: transformers 5 saves `language_model.model.*` (the LM; `lm_head.weight`
only when untied), `vision_tower.*` and `multi_modal_projector.*`; its in-memory names
are `model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`,
and Google's published files say `vision_tower.vision_model.*`. Every form is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.modeling.decoder.lm import DecoderLM, RowEmbeds
from services.gpu_worker.modeling.vision.base import SiglipDecoderModel, load_vlm_weights
from services.gpu_worker.modeling.vision.siglip import SiglipVisionTower
from shared.specs.vision_lm import gemma3_image_token_id, gemma3_text_config

#: (prefix as saved, the part's own prefix), longest first where one starts another
TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
HEAD_PREFIXES = ("language_model.lm_head.", "lm_head.")
VISION_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                   "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm, as transformers' `Gemma3RMSNorm` computes it: in float32, scaled by
    (1 + w), then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Gemma3Projector(nn.Module):
    """`Gemma3MultiModalProjector`: the tower's patch grid average-pooled to
    `mm_tokens_per_image` tokens, RMS-normed, multiplied by `mm_input_projection_weight`
    [vision hidden, text hidden]."""

    def __init__(self, vision: Mapping[str, Any], text_hidden: int, tokens: int) -> None:
        super().__init__()
        hidden = int(vision["hidden_size"])
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(hidden, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(hidden, float(vision.get("layer_norm_eps", 1e-6)))
        self.patches = int(vision["image_size"]) // int(vision["patch_size"])
        side = int(tokens**0.5)
        if side * side != tokens or self.patches % side:
            raise ValueError(f"mm_tokens_per_image {tokens} is not a square dividing the {self.patches}^2 patch grid")
        self.kernel = self.patches // side

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, _, hidden = features.shape
        grid = features.transpose(1, 2).reshape(n, hidden, self.patches, self.patches).contiguous()
        pooled = nn.functional.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel)
        normed = self.mm_soft_emb_norm(pooled.flatten(2).transpose(1, 2))
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(features)


class Gemma3VisionLM(SiglipDecoderModel):
    """Gemma 3 with images: the SigLIP tower and the pooling projector, rows into the Gemma 3 LM."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.lm = DecoderLM(gemma3_text_config(config))
        self.vision = SiglipVisionTower(config["vision_config"], bucketed_positions=False)
        tokens = int(config.get("mm_tokens_per_image", 256))
        self.projector = Gemma3Projector(config["vision_config"], self.lm.config.hidden_size, tokens)
        #: transformers embeds an image token past the vocabulary as id 0 (its rows are replaced)
        self.oov_image_token = gemma3_image_token_id(config) >= self.lm.config.vocab_size

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Each part's tensors by its prefixes (every saved form); the LM's renamed to
        `DecoderLM`'s own names."""
        load_vlm_weights(state, self.lm, text=TEXT_PREFIXES, head=HEAD_PREFIXES,
                         parts=[(self.vision, VISION_PREFIXES), (self.projector, PROJECTOR_PREFIXES)])

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images [N, C, S, S] -> their rows [N * mm_tokens_per_image, text hidden], in order."""
        rows = self.projector(self.vision(pixel_values))
        return rows.reshape(-1, rows.shape[-1])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttnMetadata], sample_rows: torch.Tensor, embeds: RowEmbeds | None = None) -> torch.Tensor:
        if self.oov_image_token:
            input_ids = torch.where(input_ids >= self.lm.config.vocab_size, 0, input_ids)
        return self.lm(input_ids, positions, kv_caches, metas, sample_rows, embeds)
