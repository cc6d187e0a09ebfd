"""BAGEL's understanding model: a SigLIP NaViT, an MLP connector, and the MoT LLM's
understanding weights as a `DecoderLM` (Qwen2 with q/k RMSNorm).

Op for op as ByteDance's `Bagel.forward_cache_update_vit` / `forward_inference` (mode "und"):
- the ViT: a Linear patch embedding over [patch * patch * 3] patches (the reference turns
  its Conv2d into this Linear before loading), plus `position_embedding(row * 70 +
  column)`; pre-norm encoder layers with bidirectional attention over the image's
  patches; the post LayerNorm (`SiglipEncoder` here, SDPA);
- `connector`: fc1, GELU (tanh), fc2; plus `vit_pos_embed.pos_embed[row * 70 + column]`
  (a fixed 2-D sin-cos table saved in the checkpoint);
- the LLM: the understanding copy of every projection, norm and MLP (`q_proj`, `q_norm`,
  `mlp`, `norm`, ...) with the untied `lm_head`.

Checkpoint names are the reference's (`ema.safetensors`): `language_model.model.*`,
`language_model.lm_head.*`, `vit_model.vision_model.*`, `connector.*`, `vit_pos_embed.*`.
The generation half (every `*_moe_gen` LLM tensor, `time_embedder.*`, `vae2llm.*`,
`llm2vae.*`, `latent_pos_embed.*`, and ae.safetensors' `encoder.*` / `decoder.*`) serves
no understanding request: it is left unread (`skip_prefixes`) or dropped at load, by
name, and anything else unknown is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.modeling.base import TowerAndLM
from services.gpu_worker.modeling.decoder.lm import DecoderLM, RowEmbeds
from services.gpu_worker.modeling.vision.base import load_vlm_weights
from services.gpu_worker.modeling.vision.siglip import SiglipEncoder
from shared.model_config import read_model_config
from shared.specs.bagel import bagel_text_config

#: BAGEL's `vit_max_num_patch_per_side`: position ids are row * 70 + column
MAX_PATCHES_PER_SIDE = 70
#: the generation half's tensors (module docstring), not read for understanding
GEN_PREFIXES = ("time_embedder.", "vae2llm.", "llm2vae.", "latent_pos_embed.", "encoder.", "decoder.")
TEXT, HEAD, VIT = "language_model.model.", "language_model.lm_head.", "vit_model.vision_model."


class _Embeddings(nn.Module):
    """The patches' Linear and the learned position table (the checkpoint's `embeddings.*`)."""

    def __init__(self, patch_dim: int, hidden: int, positions: int) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(patch_dim, hidden)
        self.position_embedding = nn.Embedding(positions, hidden)

    def forward(self, patches: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(patches) + self.position_embedding(position_ids)


class BagelVit(nn.Module):
    """SigLIP over one image's patches [n, patch * patch * 3] at position ids [n] -> [n, hidden]."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        cfg = dict(config)
        cfg["num_hidden_layers"] = int(cfg["num_hidden_layers"]) - 1  # BAGEL's app drops the last layer
        cfg.setdefault("layer_norm_eps", 1e-6)
        cfg.setdefault("hidden_act", "gelu_pytorch_tanh")
        hidden, patch = int(cfg["hidden_size"]), int(cfg["patch_size"])
        side = int(cfg["image_size"]) // patch
        self.embeddings = _Embeddings(3 * patch * patch, hidden, side * side)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(hidden, eps=float(cfg["layer_norm_eps"]))

    def forward(self, patches: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(patches, position_ids)[None]))[0]


class BagelConnector(nn.Module):
    """fc1, GELU (tanh), fc2: ViT rows to LLM rows."""

    def __init__(self, vit_hidden: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vit_hidden, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class BagelPosEmbed(nn.Module):
    """The fixed 2-D sin-cos table added to the connector's rows (the checkpoint's `pos_embed`)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(MAX_PATCHES_PER_SIDE**2, hidden), requires_grad=False)


class BagelUnderstanding(TowerAndLM):
    """`encode_images(patches, grids)` -> each image's LLM rows; the rest is the LLM's."""

    assigns_weights = True
    skip_prefixes = GEN_PREFIXES

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        text = msgspec.structs.replace(read_model_config(bagel_text_config(config)), qk_norm=True)
        self.lm = DecoderLM(text)
        self.vision = BagelVit(config["vit_config"])
        self.connector = BagelConnector(int(config["vit_config"]["hidden_size"]), text.hidden_size)
        self.vit_pos_embed = BagelPosEmbed(text.hidden_size)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Each part by its prefix; the generation copy of the LLM dropped by name."""
        state = {k: v for k, v in state.items() if "_moe_gen" not in k and not k.startswith(GEN_PREFIXES)}
        load_vlm_weights(state, self.lm, text=(TEXT,), head=(HEAD,),
                         parts=[(self.vision, (VIT,)), (self.connector, ("connector.",)),
                                (self.vit_pos_embed, ("vit_pos_embed.",))])

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Patches [sum(h * w), D] of images of grids [N, 3] (1, h, w) -> rows [sum(h * w), hidden]."""
        out, start = [], 0
        for _, h, w in grid_thw.tolist():
            rows = torch.arange(h, device=pixel_values.device)[:, None] * MAX_PATCHES_PER_SIDE
            ids = (rows + torch.arange(w, device=pixel_values.device)).reshape(-1)
            x = self.connector(self.vision(pixel_values[start : start + h * w], ids))
            out.append(x + self.vit_pos_embed.pos_embed[ids])
            start += h * w
        return torch.cat(out)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttnMetadata], sample_rows: torch.Tensor, embeds: RowEmbeds | None = None) -> torch.Tensor:
        return self.lm(input_ids, positions, kv_caches, metas, sample_rows, embeds)
