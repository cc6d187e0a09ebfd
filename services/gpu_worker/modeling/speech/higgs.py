"""Higgs Audio v2's Llama stack on paged KV (`HiggsAudioV2ForConditionalGeneration` without
its codec, which services/gpu_worker/codecs/higgs_codec.py is).

Parameter names are the checkpoint's (`model.layers.N.*`, `model.embed_tokens`,
`model.embed_audio_tokens.embed_audio_tokens`, `model.norm`, `audio_lm_head`), so its
safetensors load as they are. Each layer is the decoder family's Llama layer plus the
"dual FFN" (transformers' `HiggsAudioV2DecoderLayer`): audio rows take
`audio_input_layernorm` before the shared attention and `audio_post_attention_layernorm` +
`audio_mlp` after it, text rows the Llama ones. A step's rows are text rows (embedded by
`embed_tokens`) and frame rows (the sum of the frame's 8 codebook embeddings, code +
codebook * codebook_size in one table, summed in codebook order as transformers sums);
`code_logits` is the audio head on the rows that sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.layers.rope import Rotary
from services.gpu_worker.modeling.base import MultiCodeModel
from services.gpu_worker.modeling.decoder.lm import MLP, DecoderLayer, RMSNorm
from shared.model_config import ModelConfig
from shared.specs.csm import llama_config


class RowKinds:
    """Which of a step's rows are audio: all, none, or the index sets of each kind."""

    def __init__(self, audio: torch.Tensor) -> None:
        n, k = audio.numel(), int(audio.sum())
        self.all_audio, self.all_text = k == n, k == 0
        self.audio_idx = audio.nonzero().view(-1)
        self.text_idx = (~audio).nonzero().view(-1)

    def apply(self, x: torch.Tensor, text_fn, audio_fn) -> torch.Tensor:
        """`text_fn` on the text rows, `audio_fn` on the audio rows, in place of each."""
        if self.all_audio:
            return audio_fn(x)
        if self.all_text:
            return text_fn(x)
        out = torch.empty_like(x)
        out[self.text_idx] = text_fn(x[self.text_idx])
        out[self.audio_idx] = audio_fn(x[self.audio_idx])
        return out


class HiggsLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.audio_mlp = MLP(cfg)
        self.audio_input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.audio_post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, cache, meta, kinds: RowKinds | None = None):
        assert kinds is not None
        h = kinds.apply(x, self.input_layernorm, self.audio_input_layernorm)
        x = self.self_attn(h, rope, cache, meta).add_(x)
        return kinds.apply(x, lambda t: self.mlp(self.post_attention_layernorm(t)).add_(t),
                           lambda a: self.audio_mlp(self.audio_post_attention_layernorm(a)).add_(a))


class _AudioEmbeddings(nn.Module):
    def __init__(self, rows: int, hidden: int) -> None:
        super().__init__()
        self.embed_audio_tokens = nn.Embedding(rows, hidden)


class _Model(nn.Module):
    def __init__(self, cfg: ModelConfig, codebook_rows: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_audio_tokens = _AudioEmbeddings(codebook_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(HiggsLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HiggsModel(MultiCodeModel):
    assigns_weights = True

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.num_codebooks = int(config.get("num_codebooks") or 8)
        self.codebook_size = int(config.get("codebook_size") or 1026)
        self.cfg = llama_config(config, int(config["vocab_size"]))
        self.model = _Model(self.cfg, self.num_codebooks * self.codebook_size)
        self.audio_lm_head = nn.Linear(self.cfg.hidden_size, self.num_codebooks * self.codebook_size, bias=False)
        self.rotary = Rotary(self.cfg.rope, self.cfg.head_dim, self.cfg.max_position_embeddings)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = {k: v for k, v in state.items()
                 if "rotary_emb" not in k and not k.startswith("text_lm_head.") and "audio_tokens_offsets" not in k}
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if "rotary" not in k]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match Higgs Audio v2: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")

    def reset_buffers(self) -> None:
        self.rotary.reset_buffers()

    def prepare(self) -> None:
        """One GEMM for q/k/v and one for gate/up in every layer's MLPs."""
        for layer in cast("Iterable[HiggsLayer]", self.model.layers):
            layer.self_attn.fuse()
            for mlp in (layer.mlp, layer.audio_mlp):
                assert isinstance(mlp, MLP)
                mlp.fuse()

    def frame_embeds(self, frames: torch.Tensor) -> torch.Tensor:
        """Frames [F, num_codebooks] -> input rows [F, hidden]: the codebooks' embeddings summed."""
        offsets = torch.arange(self.num_codebooks, device=frames.device) * self.codebook_size
        return F.embedding(frames + offsets, self.model.embed_audio_tokens.embed_audio_tokens.weight).sum(dim=1)

    def backbone(self, text_ids: torch.Tensor, text_rows: torch.Tensor, frames: torch.Tensor,
                 frame_rows: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                 meta: AttnMetadata) -> torch.Tensor:
        """A step's rows (text rows at `text_rows`, frame rows at `frame_rows`) through the
        stack, the frame rows on the audio norms and MLPs; every row's hidden state after
        the final norm [T, hidden]."""
        table = self.model.embed_tokens.weight
        t = text_rows.numel() + frame_rows.numel()
        x = torch.empty(t, self.cfg.hidden_size, dtype=table.dtype, device=table.device)
        audio = torch.zeros(t, dtype=torch.bool, device=table.device)
        if text_rows.numel():
            x[text_rows] = self.model.embed_tokens(text_ids)
        if frame_rows.numel():
            x[frame_rows] = self.frame_embeds(frames)
            audio[frame_rows] = True
        kinds = RowKinds(audio)
        rope = self.rotary.tables(positions, x.dtype)
        for layer, cache in zip(self.model.layers, caches):
            x = layer(x, rope, cache, meta, kinds)
        return self.model.norm(x)

    def code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The audio head on `hidden` [B, hidden] -> [B, num_codebooks, codebook_size], float32."""
        return self.audio_lm_head(hidden).float().view(-1, self.num_codebooks, self.codebook_size)
