"""Qwen3-Omni's thinker (the text-out half of `Qwen3OmniMoeForConditionalGeneration`): a
Qwen3-MoE `DecoderLM` with interleaved multimodal RoPE and deepstack, its vision tower and
its audio encoder.

- The language model is `DecoderLM` over the thinker's `text_config` (Qwen3-MoE: the sparse
  layers' experts are `layers/moe.py`'s), its RoPE the interleaved M-RoPE of Qwen3.5
  (`layers/interleaved_mrope.py`: transformers' `recomposition_frequencies` is the same map).
- The vision tower is Qwen3.5's (`Qwen35VisionTower`: learned positions resampled to the
  grid, frame-wise attention) with Qwen3-Omni's mergers: `merger` (LayerNorm per patch,
  Linear, GELU, Linear) and one `merger_list[i]` per `deepstack_visual_indexes[i]` (LayerNorm
  over the merged block instead), fed by that block's output. `encode_images` returns each
  image row's main row and its deepstack rows side by side ([rows, hidden * (1 + D)]), so the
  runner keeps and hands them on as one row.
- Deepstack: after LLM layer i < D, an image or video row's hidden state gets its i-th
  deepstack row added (transformers' `_deepstack_process`); which step rows are vision rows
  the model reads from the ids (the image and video tokens), so audio rows (whose values are the audio encoder's, their
  deepstack columns zero) are left alone.
- `encode_audio` is `Qwen3OmniAudioEncoder` (modeling/speech/qwen3_omni_audio.py).

Checkpoint names are the release's: `thinker.model.*` and `thinker.lm_head.*` (the LM),
`thinker.visual.*`, `thinker.audio_tower.*`; the talker's and Code2Wav's (`talker.*`,
`code2wav.*`) are not read here (`skip_prefixes`): the speech stage loads them
(runners/omni_speech.py) where the folder has voices.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.layers.interleaved_mrope import InterleavedMRotary
from services.gpu_worker.layers.rope import Rotary
from services.gpu_worker.modeling.base import TowerAndLM
from services.gpu_worker.modeling.decoder.lm import DecoderLM, RowEmbeds
from services.gpu_worker.modeling.hybrid.qwen3_5_vision import LN_EPS, Qwen35VisionTower, position_taps
from services.gpu_worker.modeling.speech.qwen3_omni_audio import Qwen3OmniAudioEncoder
from services.gpu_worker.modeling.vision.base import load_vlm_weights
from shared.model_config import read_model_config
from shared.specs.qwen3_omni import IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, omni_text_config

#: the thinker's parts' prefixes in a release's files
LM_PREFIX, HEAD_PREFIX, VISION_PREFIX, AUDIO_PREFIX = "thinker.model.", "thinker.lm_head.", "thinker.visual.", \
    "thinker.audio_tower."
#: the parts this step does not serve (speech out)
SKIPPED = ("talker.", "code2wav.")


class OmniPatchMerger(nn.Module):
    """LayerNorm (per patch, or over each merged block: `postshuffle`), each merge block's
    patches side by side, Linear, GELU, Linear (transformers' `Qwen3OmniMoeVisionPatchMerger`)."""

    def __init__(self, dim: int, out_dim: int, merge: int, postshuffle: bool) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.postshuffle = postshuffle
        self.ln_q = nn.LayerNorm(self.hidden if postshuffle else dim, eps=LN_EPS)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_q(x.view(-1, self.hidden) if self.postshuffle else x).view(-1, self.hidden)
        return self.mlp(h)


class OmniVisionTower(Qwen35VisionTower):
    """Qwen3.5's tower with Qwen3-Omni's mergers and deepstack rows; see the module docstring."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        out = int(config.get("out_hidden_size", 3584))
        self.deepstack = [int(i) for i in config.get("deepstack_visual_indexes", (8, 16, 24))]
        self.merger = OmniPatchMerger(self.dim, out, self.merge, postshuffle=False)  # type: ignore[assignment]
        self.merger_list = nn.ModuleList(OmniPatchMerger(self.dim, out, self.merge, postshuffle=True)
                                         for _ in self.deepstack)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        frames = [0]
        for t, h, w in grids:  # one attention sequence a frame (a video's temporal patches apart)
            start = frames[-1]
            frames.extend(start + h * w * (i + 1) for i in range(t))
        x = self.patch_embed(pixels)
        indices, weights = position_taps(grids, self.merge, self.side)
        device = x.device
        pos = (self.pos_embed(indices.to(device)) * weights.to(device)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        rope = self.rope_tables(grids, device)
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, frames, rope)
            if i in self.deepstack:
                deep.append(self.merger_list[self.deepstack.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)


@dataclass
class HiddenTap:
    """Rows whose hidden state after `layer` layers (0: the input embeddings) a forward keeps
    in `out`, before deepstack adds to them: what transformers' `hidden_states[layer]`
    holds, and what the talker reads at a prompt's image and audio rows
    (`talker_config.accept_hidden_layer`)."""

    layer: int
    rows: torch.Tensor
    out: torch.Tensor | None = None


class OmniTextLM(DecoderLM):
    """`DecoderLM` with interleaved M-RoPE and deepstack (see the module docstring)."""

    #: set by the caller around a forward whose rows the talker reads
    tap: HiddenTap | None = None

    def __init__(self, config: Mapping[str, Any], section: tuple[int, ...], image_token_id: int,
                 video_token_id: int = VIDEO_TOKEN_ID) -> None:
        cfg = read_model_config(config)
        super().__init__(cfg)
        self.rotaries = nn.ModuleDict({t: InterleavedMRotary(cast("Rotary", r).rope, cfg.head_dim,
                                                             cfg.max_position_embeddings, section)
                                       for t, r in self.rotaries.items()})
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id

    def prepare(self) -> None:
        super().prepare()
        self.cpu_stack = None  # three positions a row, and deepstack: the modules run every step

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
               metas: list[AttnMetadata], embeds: RowEmbeds | None = None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        width = x.shape[1]
        deep_rows, deep = None, None
        if embeds is not None:
            rows, values = embeds
            x[rows] = values[:, :width].to(x.dtype)
            if values.shape[1] > width:
                ids = input_ids[rows]
                visual = (ids == self.image_token_id) | (ids == self.video_token_id)
                deep_rows = rows[visual]
                layers = values.shape[1] // width - 1
                deep = values[visual, width:].to(x.dtype).view(len(deep_rows), layers, width)
        rotaries = cast("Iterable[tuple[str, Rotary]]", self.rotaries.items())
        ropes = {t: rot.tables(positions, x.dtype) for t, rot in rotaries}
        tap = self.tap
        if tap is not None and tap.layer == 0:
            tap.out = x[tap.rows].clone()
        for i, (layer, cache, meta, kind) in enumerate(zip(self.model.layers, kv_caches, metas, self.layer_rope)):
            x = layer(x, ropes[kind], cache, meta)
            if tap is not None and tap.layer == i + 1:
                tap.out = x[tap.rows].clone()
            if deep is not None and deep_rows is not None and i < deep.shape[1] and len(deep_rows):
                x[deep_rows] = x[deep_rows] + deep[:, i]
        return x


class Qwen3OmniThinker(TowerAndLM):
    """The thinker: `forward` is the LM's with the step's image and audio rows (`embeds`)
    and positions [3, T]."""

    assigns_weights = True
    skip_prefixes = SKIPPED

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        thinker = config.get("thinker_config") or {}
        text, section = omni_text_config(config)
        self.lm = OmniTextLM(text, section, int(thinker.get("image_token_id", IMAGE_TOKEN_ID)),
                             int(thinker.get("video_token_id", VIDEO_TOKEN_ID)))
        self.vision = OmniVisionTower(thinker.get("vision_config") or {})
        self.audio = Qwen3OmniAudioEncoder(thinker.get("audio_config") or {})

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """The LM's tensors renamed to `DecoderLM`'s, the tower's and the encoder's strictly
        by prefix; the talker's and Code2Wav's dropped."""
        state = {k: v for k, v in state.items() if not k.startswith(SKIPPED)}
        load_vlm_weights(state, self.lm, text=(LM_PREFIX,), head=(HEAD_PREFIX,),
                         parts=[(self.vision, (VISION_PREFIX,)), (self.audio, (AUDIO_PREFIX,))])

    def encode_audio(self, features: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """One request's clips (features [mel bins, sum(frames)]) -> rows [sum(rows), hidden]."""
        return self.audio(features, frames)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttnMetadata], sample_rows: torch.Tensor, embeds: RowEmbeds | None = None) -> torch.Tensor:
        return self.lm(input_ids, positions, kv_caches, metas, sample_rows, embeds)

