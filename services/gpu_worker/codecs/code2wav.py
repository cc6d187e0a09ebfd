"""Qwen3-Omni's Code2Wav: the talker's codes -> 24 kHz sound, whole or streamed exactly.

transformers' `Qwen3OmniMoeCode2Wav` is the reference (tests/unit/test_code2wav.py); this is
the same arithmetic in plain torch (transformers is not a runtime dependency), over the
`code2wav.*` weights of a Qwen3-Omni folder:

    codes [Q, n] -> mean of the Q codebooks' embeddings -> transformer (causal, sliding
    window, RoPE, layer scale) -> upsample (transposed conv + ConvNeXt block, x2 x2)
    -> decoder (causal conv, blocks of SnakeBeta + transposed conv + residual units,
    x8 x5 x4 x3) -> SnakeBeta -> causal conv -> clamp to [-1, 1]

Causality. Every conv is padded on the left only and the transformer attends to the past,
but each decoder block's transposed conv (kernel 2r, stride r) is trimmed by r on both
sides: its output sample j reads inputs floor(j / r) and floor(j / r) + 1, and a chunk of n
inputs yields (n - 1) * r outputs, so the decode of n frames is a little shorter than
n * 1920 samples. What it yields does not depend on later frames, so the decode of a
prefix of the codes is a prefix of the decode of all of them (same operations on the same
inputs, up to float summation order).

Whole clips follow transformers' `chunked_decode` (what `generate(return_audio=True)`
runs): chunks of `chunk_size` frames, each decoded with up to `left_context` frames before
it whose samples are dropped. `Code2WavStream` emits the same samples as they become
final: after each push it decodes the current chunk (with its left context) so far and
sends the samples past those already sent; it re-decodes at most `chunk_size +
left_context` frames a push, and `min_frames` pushes' worth may be gathered first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

PREFIX = "code2wav."
#: transformers' `generate` decodes in chunks of 300 frames with 25 frames of left context
CHUNK_SIZE, LEFT_CONTEXT = 300, 25
SNAKE_EPS = 1e-9
#: a transposed conv of the decoder: (x, weights, name, stride) -> x upsampled
ConvT = Callable[[torch.Tensor, Mapping[str, torch.Tensor], str, int], torch.Tensor]


class Code2WavSettings:
    """Code2Wav's shape, from `Qwen3OmniMoeConfig.code2wav_config`."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.codebook_size = int(cfg.get("codebook_size", 2048))
        self.quantizers = int(cfg.get("num_quantizers", 16))
        self.hidden = int(cfg.get("hidden_size", 1024))
        self.layers = int(cfg.get("num_hidden_layers", 8))
        self.heads = int(cfg.get("num_attention_heads", 16))
        self.kv_heads = int(cfg.get("num_key_value_heads") or self.heads)
        self.head_dim = int(cfg.get("head_dim") or self.hidden // self.heads)
        self.window = int(cfg.get("sliding_window", 72))
        self.eps = float(cfg.get("rms_norm_eps", 1e-5))
        self.rates = [int(r) for r in cfg.get("upsample_rates") or (8, 5, 4, 3)]
        self.ratios = [int(r) for r in cfg.get("upsampling_ratios") or (2, 2)]
        self.decoder_dim = int(cfg.get("decoder_dim", 1536))
        rope = cfg.get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        if cfg.get("hidden_act", "silu") != "silu" or rope.get("rope_type", "default") != "default" \
                or cfg.get("attention_bias", False):
            raise ValueError("only Code2Wav's own arithmetic is implemented: SiLU MLPs, default RoPE, "
                             "no attention bias")
        self.samples_per_frame = math.prod(self.rates + self.ratios)
        self.sample_rate = 24000


def load_prefixed(folder: Path, prefix: str, what: str) -> dict[str, torch.Tensor]:
    """The `prefix*` tensors of the folder's safetensors, prefix stripped, as float32 (the
    others are not read); a ValueError naming `what` when there are none."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.startswith(prefix):
                    out[key[len(prefix):]] = f.get_tensor(key).float()
    if not out:
        raise ValueError(f"{folder}: no {what} ({prefix}*) in its safetensors")
    return out


def load_code2wav_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The `code2wav.*` tensors of the folder's safetensors, prefix stripped, as float32."""
    return load_prefixed(folder, PREFIX, "Code2Wav weights")


class Code2WavCodec:
    """Code2Wav's weights and its decode; `stream()` makes one request's `Code2WavStream`."""

    def __init__(self, folder: str | Path, config: Mapping[str, Any], device: torch.device | str = "cpu") -> None:
        self._load(Code2WavSettings(config), load_code2wav_weights(Path(folder)), device)
        self.sample_rate = self.s.sample_rate

    def _load(self, settings: Code2WavSettings, weights: Mapping[str, torch.Tensor],
              device: torch.device | str) -> None:
        """Settings, weights (moved to `device`) and RoPE frequencies: what every codec over
        Code2Wav's arithmetic holds (Qwen3-TTS' reads them from another folder)."""
        self.s, self.device = settings, torch.device(device)
        self.w = {k: v.to(self.device) for k, v in weights.items()}
        self.codebook_size = settings.codebook_size
        self.quantizers = settings.quantizers
        self.samples_per_frame = settings.samples_per_frame
        half = settings.head_dim // 2
        self.inv_freq = 1.0 / (settings.theta ** (torch.arange(0, 2 * half, 2, dtype=torch.int64).float()
                                                  / settings.head_dim)).to(self.device)

    def stream(self, min_frames: int = 1) -> Code2WavStream:
        return Code2WavStream(self, min_frames)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """The whole clip of `codes` [frames, Q], as transformers' `chunked_decode`."""
        st = self.stream()
        return np.concatenate([st.push(codes), st.finish()])

    def check(self, codes: np.ndarray) -> np.ndarray:
        codes = np.asarray(codes, dtype=np.int64).reshape(-1, self.quantizers)
        if len(codes) and (codes.min() < 0 or codes.max() >= self.codebook_size):
            raise ValueError(f"Code2Wav codes must be in [0, {self.codebook_size})")
        return codes

    @torch.inference_mode()
    def forward(self, codes: np.ndarray) -> torch.Tensor:
        """Samples [m] of `codes` [n, Q] decoded alone (transformers' `Code2Wav.forward`)."""
        s, w = self.s, self.w
        idx = torch.from_numpy(codes.T.copy()).to(self.device)  # [Q, n]
        offset = (torch.arange(s.quantizers, device=self.device) * s.codebook_size)[:, None]
        x = F.embedding(idx + offset, w["code_embedding.weight"]).mean(0)[None]  # [1, n, hidden]
        return decode_tail(self._transformer(x).transpose(1, 2), w, s, _conv_t)

    def _transformer(self, x: torch.Tensor) -> torch.Tensor:
        """[1, n, hidden] through the pre-transformer: causal attention over the last
        `sliding_window` positions, positions from 0."""
        s, w = self.s, self.w
        n = x.shape[1]
        pos = torch.arange(n, device=self.device)
        freqs = pos[:, None].float() * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        mask = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - s.window)
        for i in range(s.layers):
            p = f"pre_transformer.layers.{i}."
            h = _rms(x, w[p + "input_layernorm.weight"], s.eps)
            x = x + w[p + "self_attn_layer_scale.scale"] * self._attend(h, p + "self_attn.", cos, sin, mask)
            h = _rms(x, w[p + "post_attention_layernorm.weight"], s.eps)
            gate = F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"]))
            mlp = F.linear(gate * F.linear(h, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])
            x = x + w[p + "mlp_layer_scale.scale"] * mlp
        return _rms(x, w["pre_transformer.norm.weight"], s.eps)

    def _attend(self, h: torch.Tensor, p: str, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        s, w = self.s, self.w
        n = h.shape[1]
        q = F.linear(h, w[p + "q_proj.weight"]).view(1, n, s.heads, s.head_dim).transpose(1, 2)
        k = F.linear(h, w[p + "k_proj.weight"]).view(1, n, s.kv_heads, s.head_dim).transpose(1, 2)
        v = F.linear(h, w[p + "v_proj.weight"]).view(1, n, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = s.heads // s.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s.head_dim ** -0.5)
        return F.linear(o.transpose(1, 2).reshape(1, n, -1), w[p + "o_proj.weight"])


class Code2WavStream:
    """One request's decode. `push(frames)` returns the samples the frames made final
    (see the module docstring); `finish` returns whatever is still held back."""

    def __init__(self, codec: Code2WavCodec, min_frames: int = 1) -> None:
        self.c = codec
        self.min_frames = max(1, int(min_frames))
        self.codes = np.zeros((0, codec.quantizers), dtype=np.int64)
        self.chunk_start = 0  # first frame of the chunk being decoded
        self.sent = 0  # samples of the current chunk already returned
        self.waiting = 0  # frames pushed since the last decode

    def push(self, frames: np.ndarray) -> np.ndarray:
        frames = self.c.check(frames)
        self.codes = np.concatenate([self.codes, frames])
        self.waiting += len(frames)
        if self.waiting < self.min_frames:
            return np.zeros(0, dtype=np.float32)
        return self.finish()

    def finish(self) -> np.ndarray:
        """Decode what arrived: the current chunk so far, then (past `CHUNK_SIZE` frames)
        each later chunk, as `chunked_decode` cuts them."""
        out: list[np.ndarray] = []
        self.waiting = 0
        while len(self.codes) > self.chunk_start:
            end = min(self.chunk_start + CHUNK_SIZE, len(self.codes))
            context = min(LEFT_CONTEXT, self.chunk_start)
            wave = self.c.forward(self.codes[self.chunk_start - context: end])
            wave = wave[context * self.c.samples_per_frame:]
            out.append(wave[self.sent:].float().cpu().numpy())
            self.sent = wave.shape[0]
            if end - self.chunk_start < CHUNK_SIZE:
                break
            self.chunk_start, self.sent = end, 0
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


def decode_tail(x: torch.Tensor, w: Mapping[str, torch.Tensor], s: Code2WavSettings, conv_t: ConvT) -> torch.Tensor:
    """The transformer's output [1, hidden, n] -> samples [m]: upsample (transposed conv +
    ConvNeXt, per ratio), decoder (causal conv; per rate SnakeBeta, transposed conv, three
    residual units), SnakeBeta, causal conv, clamp to [-1, 1]. `conv_t` is the transposed
    conv: Code2Wav's trims both ends (`_conv_t`), Qwen3-TTS' codec the right only."""
    for i, ratio in enumerate(s.ratios):
        x = conv_t(x, w, f"upsample.{i}.0.conv", ratio)
        x = _convnext(x, w, f"upsample.{i}.1.")
    x = _causal_conv(x, w, "decoder.0.conv")
    for i, rate in enumerate(s.rates, start=1):
        x = _snake(x, w, f"decoder.{i}.block.0.")
        x = conv_t(x, w, f"decoder.{i}.block.1.conv", rate)
        for j, dilation in enumerate((1, 3, 9), start=2):
            p = f"decoder.{i}.block.{j}."
            h = _causal_conv(_snake(x, w, p + "act1."), w, p + "conv1.conv", dilation)
            x = x + _causal_conv(_snake(h, w, p + "act2."), w, p + "conv2.conv")
    n = len(s.rates) + 1
    x = _causal_conv(_snake(x, w, f"decoder.{n}."), w, f"decoder.{n + 1}.conv")
    return x.clamp(-1, 1).reshape(-1)


def _convnext(x: torch.Tensor, w: Mapping[str, torch.Tensor], p: str) -> torch.Tensor:
    """ConvNeXt block: causal depthwise conv, LayerNorm, MLP (GELU), gamma, residual."""
    h = _causal_conv(x, w, p + "dwconv.conv", groups=x.shape[1]).transpose(1, 2)
    h = F.layer_norm(h, (h.shape[-1],), w[p + "norm.weight"], w[p + "norm.bias"], 1e-6)
    h = F.linear(F.gelu(F.linear(h, w[p + "pwconv1.weight"], w[p + "pwconv1.bias"])),
                 w[p + "pwconv2.weight"], w[p + "pwconv2.bias"])
    return x + (w[p + "gamma"] * h).transpose(1, 2)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _snake(x: torch.Tensor, w: Mapping[str, torch.Tensor], p: str) -> torch.Tensor:
    """SnakeBeta: x + sin^2(x * e^alpha) / (e^beta + 1e-9), per channel."""
    alpha, beta = w[p + "alpha"].exp()[None, :, None], w[p + "beta"].exp()[None, :, None]
    return x + (1.0 / (beta + SNAKE_EPS)) * torch.sin(x * alpha).pow(2)


def _causal_conv(x: torch.Tensor, w: Mapping[str, torch.Tensor], name: str, dilation: int = 1,
                 groups: int = 1) -> torch.Tensor:
    """A stride-1 conv padded on the left by its reach ((kernel - 1) * dilation)."""
    weight = w[name + ".weight"]
    x = F.pad(x, ((weight.shape[-1] - 1) * dilation, 0))
    return F.conv1d(x, weight, w.get(name + ".bias"), dilation=dilation, groups=groups)


def _conv_t(x: torch.Tensor, w: Mapping[str, torch.Tensor], name: str, stride: int) -> torch.Tensor:
    """A transposed conv with (kernel - stride) samples cut from each end."""
    weight = w[name + ".weight"]
    trim = weight.shape[-1] - stride
    y = F.conv_transpose1d(x, weight, w.get(name + ".bias"), stride=stride)
    return y[..., trim: y.shape[-1] - trim] if trim else y
