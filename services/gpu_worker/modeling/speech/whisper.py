"""Whisper in torch: a dense encoder run once per request, a decoder over paged KV.

Parameter names follow Hugging Face's `WhisperForConditionalGeneration` (model.encoder.*,
model.decoder.*; proj_out tied to the decoder's embed_tokens) so `load_state_dict` takes
the checkpoint as-is. The decoder's two attentions read two labels of two pools:
self-attention the "self" pages (causal, written each step), cross-attention the "cross"
pages, which `write_cross` fills once from the encoder output (each layer's encoder_attn
k_proj / v_proj of the 1500 frames), so no decode step ever recomputes them.

As in transformers, queries are scaled before the product (`q_proj(x) * head_dim**-0.5`,
then attention with scale 1), and Whisper's `scale_embedding` is not applied.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention import AttnMetadata, paged_attention, write_kv
from services.gpu_worker.modeling.base import EncoderDecoderModel


def _act(cfg: dict):
    name = cfg.get("activation_function", "gelu")
    if name != "gelu":
        raise NotImplementedError(f"activation_function {name!r} is not supported")
    return F.gelu


class Attention(nn.Module):
    """Whisper's attention projections (k_proj has no bias)."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention over a whole batch [B, S, d] (the encoder)."""
        b, s, _ = x.shape
        q = (self.q_proj(x) * self.scaling).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.out_proj(o.transpose(1, 2).reshape(b, s, -1))

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        return self.k_proj(x).view(t, self.heads, self.head_dim), self.v_proj(x).view(t, self.heads, self.head_dim)

    def paged_self(self, x: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """Write this step's rows into the "self" pages, then attend over them (causal)."""
        t = x.shape[0]
        k, v = self.kv(x)
        write_kv(cache, k, v, meta)
        return self._attend(x, cache, meta, t)

    def paged_cross(self, x: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """Attend over the "cross" pages `write_cross` filled (every query sees every frame)."""
        return self._attend(x, cache, meta, x.shape[0])

    def _attend(self, x: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata, t: int) -> torch.Tensor:
        q = (self.q_proj(x) * self.scaling).view(t, self.heads, self.head_dim)
        o = paged_attention(q, cache, meta, 1.0)
        return self.out_proj(o.reshape(t, -1))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        d = cfg["d_model"]
        self.self_attn = Attention(d, cfg["encoder_attention_heads"])
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg["encoder_ffn_dim"])
        self.fc2 = nn.Linear(cfg["encoder_ffn_dim"], d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _act(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.dense(self.self_attn_layer_norm(x))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class Encoder(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        d = cfg["d_model"]
        self.conv1 = nn.Conv1d(cfg["num_mel_bins"], d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg["max_source_positions"], d)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg["encoder_layers"]))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(input_features))
        x = F.gelu(self.conv2(x)).permute(0, 2, 1)
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        d, heads = cfg["d_model"], cfg["decoder_attention_heads"]
        self.self_attn = Attention(d, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = Attention(d, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg["decoder_ffn_dim"])
        self.fc2 = nn.Linear(cfg["decoder_ffn_dim"], d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _act(cfg)

    def forward(self, x, self_cache, self_meta, cross_cache, cross_meta):
        x = x + self.self_attn.paged_self(self.self_attn_layer_norm(x), self_cache, self_meta)
        x = x + self.encoder_attn.paged_cross(self.encoder_attn_layer_norm(x), cross_cache, cross_meta)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class Decoder(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        d = cfg["d_model"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], d)
        self.embed_positions = nn.Embedding(cfg["max_target_positions"], d)  # learned
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["decoder_layers"]))
        self.layer_norm = nn.LayerNorm(d)


class Backbone(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)


class WhisperModel(EncoderDecoderModel):
    """`encode(input_features [B, n_mels, 3000]) -> [B, 1500, d_model]`;
    `write_cross(encoder_rows [N, d_model], cross_caches, cross_meta)`;
    `forward(input_ids [T], positions [T], self_caches, self_meta, cross_caches, cross_meta,
    sample_rows) -> logits [len(sample_rows), vocab]`. `*_caches[i]` is decoder layer i's
    tensor of that label's pool; one metadata per label serves every layer."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.tied = bool(cfg.get("tie_word_embeddings", True))
        if not self.tied:
            self.proj_out = nn.Linear(cfg["d_model"], cfg["vocab_size"], bias=False)
        self.n_frames = int(cfg["max_source_positions"])

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        if self.tied:
            state = {k: v for k, v in state.items() if k != "proj_out.weight"}
        missing, unexpected = self.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def encode(self, input_features: torch.Tensor) -> torch.Tensor:
        if input_features.dim() == 2:
            input_features = input_features.unsqueeze(0)
        want = 2 * self.n_frames
        if input_features.shape[-1] != want:
            raise ValueError(f"Whisper's encoder takes {want} mel frames, got {input_features.shape[-1]}")
        return self.model.encoder(input_features)

    def write_cross(self, encoder_rows: torch.Tensor, cross_caches: list[torch.Tensor],
                    cross_meta: AttnMetadata) -> None:
        """Each decoder layer's cross K/V of the encoder rows, into the "cross" pages the
        metadata's slots name (rows of several requests may be concatenated)."""
        for layer, cache in zip(cast("Iterable[DecoderLayer]", self.model.decoder.layers), cross_caches):
            k, v = layer.encoder_attn.kv(encoder_rows)
            write_kv(cache, k, v, cross_meta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, self_caches: list[torch.Tensor],
                self_meta: AttnMetadata, cross_caches: list[torch.Tensor], cross_meta: AttnMetadata,
                sample_rows: torch.Tensor) -> torch.Tensor:
        dec = self.model.decoder
        x = dec.embed_tokens(input_ids) + dec.embed_positions(positions)
        for layer, sc, cc in zip(dec.layers, self_caches, cross_caches):
            x = layer(x, sc, self_meta, cc, cross_meta)
        x = dec.layer_norm(x[sample_rows])
        w = dec.embed_tokens.weight if self.tied else self.proj_out.weight
        return F.linear(x, w)
