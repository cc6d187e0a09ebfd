"""Qwen3-Omni's audio encoder (transformers' `Qwen3OmniMoeAudioEncoder`), op for op, so its
rows are transformers' own bits on the same device and dtype.

A clip's log-mel features [mel bins, frames] are cut into windows of 2 * n_window frames
(the last one shorter), each window right-padded to the longest, and each run through three
stride-2 3x3 convolutions (GELU after each), flattened over (channels, mel) and projected
(`conv_out`), plus a sinusoidal position per row of its window; the padding rows are then
dropped. The transformer layers (pre-LayerNorm, bidirectional attention, a GELU MLP) attend
within attention windows of n_window_infer / (2 * n_window) conv windows' rows; a final
LayerNorm, proj1, GELU and proj2 give rows of the text model's width.

The window sizes depend on the longest conv window of the clips encoded together, as in
transformers: the runner encodes one request's clips at a time, as transformers does for
one prompt. Attention runs one SDPA call per window, as transformers' non-flash path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: Qwen3OmniMoeAudioEncoderConfig's defaults
AUDIO_DEFAULTS: dict[str, Any] = {
    "num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
    "d_model": 1280, "activation_function": "gelu", "scale_embedding": False, "max_source_positions": 1500,
    "n_window": 50, "output_dim": 3584, "n_window_infer": 800, "conv_chunksize": 500, "downsample_hidden_size": 480,
}


def conv_rows(frames: torch.Tensor, n_window: int) -> torch.Tensor:
    """Rows the convolutions make of `frames` mel frames: transformers'
    `_get_feat_extract_output_lengths`."""
    leave = frames % (n_window * 2)
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (frames // (n_window * 2)) * 13


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """transformers' `SinusoidsPositionEmbedding` table [length, channels] (sin half, cos half)."""
    import numpy as np

    log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2).float())
    scaled_time = torch.arange(length)[:, np.newaxis] * inv_timescales[np.newaxis, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


class AudioAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).reshape(n, self.heads, -1).transpose(0, 1).unsqueeze(0)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        lengths = [b - a for a, b in pairwise(cu_seqlens)]
        outs = [F.scaled_dot_product_attention(qs, ks, vs, scale=self.head_dim**-0.5)
                for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))]
        o = torch.cat([t.transpose(1, 2) for t in outs], dim=1)  # [1, n, heads, head_dim]
        return self.out_proj(o.reshape(n, -1))


class AudioLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        dim = int(cfg["d_model"])
        self.self_attn = AudioAttention(dim, int(cfg["encoder_attention_heads"]))
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, int(cfg["encoder_ffn_dim"]))
        self.fc2 = nn.Linear(int(cfg["encoder_ffn_dim"]), dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cu_seqlens)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class Qwen3OmniAudioEncoder(nn.Module):
    """Features [mel bins, sum(frames)] of clips of `frames` [N] mel frames each -> rows
    [sum(conv_rows(frames)), output_dim], clip after clip."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        cfg = {**AUDIO_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        if cfg["activation_function"] != "gelu":
            raise ValueError(f"audio activation_function {cfg['activation_function']!r} is not supported")
        dim, hidden, mel = int(cfg["d_model"]), int(cfg["downsample_hidden_size"]), int(cfg["num_mel_bins"])
        self.n_window, self.n_window_infer = int(cfg["n_window"]), int(cfg["n_window_infer"])
        self.conv_chunksize = int(cfg["conv_chunksize"])
        self.embed_scale = math.sqrt(dim) if cfg["scale_embedding"] else 1.0
        self.positions, self.dim = int(cfg["max_source_positions"]), dim
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv_out = nn.Linear(hidden * ((((mel + 1) // 2 + 1) // 2 + 1) // 2), dim, bias=False)
        self.layers = nn.ModuleList(AudioLayer(cfg) for _ in range(int(cfg["encoder_layers"])))
        self.ln_post = nn.LayerNorm(dim)
        self.proj1 = nn.Linear(dim, dim)
        self.proj2 = nn.Linear(dim, int(cfg["output_dim"]))

    def forward(self, features: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        chunks = self._chunk_lengths(frames)
        padded = nn.utils.rnn.pad_sequence(features.T.split(chunks.tolist(), dim=0), batch_first=True).transpose(1, 2)
        x = padded.unsqueeze(1).to(self.conv2d1.weight.dtype)
        convolved = []
        for part in x.split(self.conv_chunksize, dim=0):
            h = F.gelu(self.conv2d1(part))
            h = F.gelu(self.conv2d2(h))
            convolved.append(F.gelu(self.conv2d3(h)))
        h = torch.cat(convolved, dim=0)
        b, c, f, t = h.size()
        h = self.conv_out(h.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))
        h = h + sinusoids(self.positions, self.dim)[:t].unsqueeze(0).to(h.device, h.dtype)
        rows = conv_rows(chunks, self.n_window)
        valid = (torch.arange(int(rows.max())) < rows.unsqueeze(1)).flatten().nonzero().squeeze(-1)
        x = torch.index_select(h.reshape(-1, h.shape[-1]), 0, valid.to(h.device))
        cu = self._windows(frames, int(rows.max()))
        for layer in self.layers:
            x = layer(x, cu)
        return self.proj2(F.gelu(self.proj1(self.ln_post(x))))

    def _chunk_lengths(self, frames: torch.Tensor) -> torch.Tensor:
        """Each clip's conv windows' frame counts, clip after clip (transformers'
        `chunk_and_pad_features`)."""
        size = self.n_window * 2
        out: list[int] = []
        for n in frames.tolist():
            full, tail = divmod(int(n), size)
            out.extend([size] * full + ([tail] if tail else []))
        return torch.tensor(out, dtype=torch.long)

    def _windows(self, frames: torch.Tensor, longest: int) -> list[int]:
        """Attention windows' bounds over the rows (transformers' `get_audio_cu_seqlens`):
        `longest` conv window's rows times the conv windows an attention window spans."""
        window = longest * (self.n_window_infer // (self.n_window * 2))
        cu = [0]
        for n in conv_rows(frames, self.n_window).tolist():
            base = cu[-1]
            cu.extend(base + window * (i + 1) for i in range(n // window))
            if n % window:
                cu.append(cu[-1] + n % window)
        return cu
