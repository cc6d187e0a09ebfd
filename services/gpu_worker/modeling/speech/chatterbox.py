"""Chatterbox's T3 on paged KV (the package's `T3`, shared/specs/chatterbox.py): a Llama
stack over input embeddings, the conditioning encoder (`T3CondEnc`: speaker projection,
Perceiver, emotion projection), the text and speech tables with their learned positions,
and the speech head.

Parameter names are t3_cfg.safetensors' (`tfmr.*`, `cond_enc.*`, `text_emb`, `speech_emb`,
`text_pos_emb.emb`, `speech_pos_emb.emb`, `text_head`, `speech_head`), so it loads as it
is; the folder's other files' tensors (S3Gen's `flow.*`, `mel2wav.*`, `tokenizer.*`,
`speaker_encoder.*`; the voice encoder's `lstm.*`, `proj.*`) are skipped. The Llama
layers are the decoder family's (`DecoderLayer`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.layers.rope import Rotary
from services.gpu_worker.modeling.base import GuidedSpeechModel
from services.gpu_worker.modeling.decoder.lm import MLP, DecoderLayer, RMSNorm
from shared.specs.chatterbox import ChatterboxSpec


class _Attention(nn.Module):
    """The Perceiver's `AttentionBlock2`: one LayerNorm on both inputs, q from the first,
    k / v from the second, scaled dot-product attention, projection, residual."""

    def __init__(self, channels: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(channels)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.proj_out = nn.Linear(channels, channels)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        b, n, c = x1.shape
        a, z = self.norm(x1), self.norm(x2)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, t.shape[1], self.heads, c // self.heads).permute(0, 2, 1, 3)

        h = F.scaled_dot_product_attention(split(self.to_q(a)), split(self.to_k(z)), split(self.to_v(z)))
        return x1 + self.proj_out(h.permute(0, 2, 1, 3).reshape(b, n, c))


class _Perceiver(nn.Module):
    def __init__(self, queries: int, query_size: int, dim: int, heads: int) -> None:
        super().__init__()
        self.pre_attention_query = nn.Parameter(torch.empty(1, queries, query_size))
        self.attn = _Attention(dim, heads)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pre = self.attn(self.pre_attention_query.expand(h.shape[0], -1, -1), h)
        return self.attn(pre, pre)


class _CondEnc(nn.Module):
    def __init__(self, spec: ChatterboxSpec, dim: int) -> None:
        super().__init__()
        p = spec.perceiver
        self.spkr_enc = nn.Linear(spec.t3["speaker_embed_size"], dim)
        self.emotion_adv_fc = nn.Linear(1, dim, bias=False)
        self.perceiver = _Perceiver(int(p["pre_attention_query_token"]), int(p["pre_attention_query_size"]),
                                    int(p["embedding_dim"]), int(p["num_attn_heads"]))


class _PosEmb(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim)


class _Stack(nn.Module):
    """The package's `tfmr` (a transformers LlamaModel): its layers and final norm."""

    def __init__(self, spec: ChatterboxSpec) -> None:
        super().__init__()
        cfg = spec.config
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class T3Model(GuidedSpeechModel):
    assigns_weights = True
    skip_prefixes = ("flow.", "mel2wav.", "tokenizer.", "speaker_encoder.", "lstm.", "proj.", "similarity_",
                     "tfmr.embed_tokens.")

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        spec = ChatterboxSpec(config, page_size=16)
        self.spec = spec
        cfg, t3 = spec.config, spec.t3
        dim = cfg.hidden_size
        self.tfmr = _Stack(spec)
        self.cond_enc = _CondEnc(spec, dim)
        self.text_emb = nn.Embedding(t3["text_tokens_dict_size"], dim)
        self.speech_emb = nn.Embedding(t3["speech_tokens_dict_size"], dim)
        self.text_pos_emb = _PosEmb(t3["max_text_tokens"] + 2, dim)
        self.speech_pos_emb = _PosEmb(t3["max_speech_tokens"] + 4, dim)
        self.text_head = nn.Linear(dim, t3["text_tokens_dict_size"], bias=False)
        self.speech_head = nn.Linear(dim, t3["speech_tokens_dict_size"], bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = {k: v for k, v in state.items() if not k.startswith(self.skip_prefixes) and "rotary" not in k}
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if "rotary" not in k]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match Chatterbox's T3: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")

    def reset_buffers(self) -> None:
        self.rotary.reset_buffers()

    def prepare(self) -> None:
        """One GEMM for q/k/v and one for gate/up in every layer."""
        for layer in cast("Iterable[DecoderLayer]", self.tfmr.layers):
            layer.self_attn.fuse()
            assert isinstance(layer.mlp, MLP)
            layer.mlp.fuse()

    def cond_rows(self, speaker_emb: torch.Tensor, prompt_tokens: torch.Tensor, exaggeration: float) -> torch.Tensor:
        """The conditioning prefix [cond_rows, hidden] (`T3.prepare_conditioning`): the
        speaker projected, the Perceiver over the voice's prompt speech tokens (their
        embeddings plus speech positions 0...), the exaggeration projected."""
        w = self.speech_emb.weight
        spk = self.cond_enc.spkr_enc(speaker_emb.to(w).view(1, -1))
        tokens = prompt_tokens.to(device=w.device, dtype=torch.long).view(1, -1)
        prompt = self.speech_emb(tokens) + self.speech_pos_emb.emb(torch.arange(tokens.shape[1], device=w.device))
        perceived = self.cond_enc.perceiver(prompt)[0]
        emotion = self.cond_enc.emotion_adv_fc(torch.full((1, 1), float(exaggeration), dtype=w.dtype, device=w.device))
        return torch.cat([spk, perceived, emotion])

    def text_rows(self, ids: torch.Tensor, at: torch.Tensor, guided: torch.Tensor) -> torch.Tensor:
        """Text rows: `text_emb[id]` (zero in a guidance row, `guided`) + text position `at`."""
        emb = self.text_emb(ids) * (~guided).to(self.text_emb.weight.dtype)[:, None]
        return emb + self.text_pos_emb.emb(at)

    def speech_rows(self, tokens: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Speech rows: `speech_emb[token]` + speech position `at`."""
        return self.speech_emb(tokens) + self.speech_pos_emb.emb(at)

    def backbone(self, x: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                 meta: AttnMetadata) -> torch.Tensor:
        rope = self.rotary.tables(positions, x.dtype)
        for layer, cache in zip(self.tfmr.layers, caches):
            x = layer(x, rope, cache, meta)
        return self.tfmr.norm(x)

    def speech_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.speech_head(hidden).float()
