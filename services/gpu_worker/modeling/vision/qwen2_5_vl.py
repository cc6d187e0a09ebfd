"""Qwen2.5-VL: a native-resolution ViT with windowed attention, a 2 x 2 patch merger, and a
Qwen2 LM with multimodal RoPE.

The language model is `DecoderLM` (the same paged attention and kernels as text models)
built with the config's `mrope_section`, so `forward` takes positions [3, T] (temporal,
height, width per row: `shared.specs.vision_lm.mrope_positions`). `encode_images` turns
whole images (flattened patches and their grids) into the rows that replace their image
tokens' embeddings.

The vision tower follows transformers' `Qwen2_5_VisionTransformerPretrainedModel` op for
op, so its rows are transformers' own bits on the same device and dtype:

- a Conv3d patch embedding over (temporal_patch, patch, patch) cubes, bias-free;
- 2-D RoPE: each patch's (row, column) in its image, half the rotary pairs each, computed
  in float32 and applied to q and k in float32;
- the patches reordered into windows of `window_size` pixels (whole merge blocks, the
  blocks of a window row-major, windows row-major; edge windows smaller), attention
  (bidirectional, SDPA) within each window, except in `fullatt_block_indexes` layers,
  within each image frame; one SDPA call per window or frame, as transformers' non-flash
  path, because batching them would change the kernel and so the rounding;
- pre-norm blocks of RMSNorm, attention with a qkv projection, and a SwiGLU MLP with
  biases; then the merger: RMSNorm, the 2 x 2 block's patches concatenated, Linear, GELU,
  Linear; finally the window order undone.

Checkpoint names are transformers': transformers 5 saves `model.visual.*`,
`model.language_model.*` and `lm_head.*`; the Hub's original files say `visual.*`,
`model.*` (the LM) and `lm_head.*`. Both load.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.modeling.base import TowerAndLM
from services.gpu_worker.modeling.decoder.lm import DecoderLM, RowEmbeds
from services.gpu_worker.modeling.vision.base import load_vlm_weights
from shared.specs.vision_lm import qwen25_vl_text_config

#: (vision tower, language model) prefixes of transformers 5's files, then of the Hub's
PREFIXES = (("model.visual.", "model.language_model."), ("visual.", "model."))
#: Qwen2_5_VLVisionConfig's defaults for keys a config.json may omit
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420, "num_heads": 16,
    "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    "out_hidden_size": 3584, "fullatt_block_indexes": (7, 15, 23, 31),
}


class VisionRMSNorm(nn.Module):
    """transformers' Qwen2_5_VLRMSNorm: float32 statistics, then weight * x in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment of `cu_seqlens` (windows or frames)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = (t.unsqueeze(-2).float() for t in rope)
        q = ((q.float() * cos) + (_rotate_half(q.float()) * sin)).to(x.dtype)
        k = ((k.float() * cos) + (_rotate_half(k.float()) * sin)).to(x.dtype)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, head_dim]
        lengths = [b - a for a, b in pairwise(cu_seqlens)]
        outs = [F.scaled_dot_product_attention(qs, ks, vs, scale=self.head_dim**-0.5)
                for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))]
        o = torch.cat([t.transpose(1, 2) for t in outs], dim=1)  # [1, n, heads, head_dim]
        return self.proj(o.reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU with biases: down(act(gate(x)) * up(x))."""

    def __init__(self, dim: int, inter: int, act: str) -> None:
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision hidden_act {act!r} is not supported")
        self.act = act
        self.gate_proj = nn.Linear(dim, inter)
        self.up_proj = nn.Linear(dim, inter)
        self.down_proj = nn.Linear(inter, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        act = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh" if "tanh" in self.act else "none")
        return self.down_proj(act * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        dim = int(cfg["hidden_size"])
        self.norm1 = VisionRMSNorm(dim)
        self.norm2 = VisionRMSNorm(dim)
        self.attn = VisionAttention(dim, int(cfg["num_heads"]))
        self.mlp = VisionMLP(dim, int(cfg["intermediate_size"]), str(cfg["hidden_act"]))

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, rope)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Each flattened (temporal_patch, patch, patch) cube of every channel -> one row, by
    a Conv3d whose kernel is the cube (transformers' op, so its rounding): bias-free in
    Qwen2.5-VL, with a bias in Qwen3.5's tower."""

    def __init__(self, channels: int, dim: int, temporal: int, patch: int, bias: bool = False) -> None:
        super().__init__()
        self.shape = (-1, channels, temporal, patch, patch)
        self.dim = dim
        self.proj = nn.Conv3d(channels, dim, kernel_size=self.shape[2:], stride=self.shape[2:], bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.view(self.shape).to(self.proj.weight.dtype)).view(-1, self.dim)


class PatchMerger(nn.Module):
    """RMSNorm, each merge block's patches side by side, Linear, GELU, Linear."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = VisionRMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen25VisionTower(nn.Module):
    """Patches [sum(t * h * w), C * temporal_patch * patch^2] of images of grids [N, 3]
    -> merged rows [sum(t * h * w) / merge^2, out_hidden_size], image after image."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        cfg = {**VISION_DEFAULTS, **config}
        self.dim, self.heads = int(cfg["hidden_size"]), int(cfg["num_heads"])
        self.channels, self.patch = int(cfg["in_channels"]), int(cfg["patch_size"])
        self.temporal, self.merge = int(cfg["temporal_patch_size"]), int(cfg["spatial_merge_size"])
        self.window = int(cfg["window_size"])
        self.full_blocks = frozenset(int(i) for i in cfg["fullatt_block_indexes"])
        self.theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.patch_embed = PatchEmbed(self.channels, self.dim, self.temporal, self.patch)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(int(cfg["depth"])))
        self.merger = PatchMerger(int(cfg["out_hidden_size"]), self.dim, self.merge)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        window_index, cu_windows = self.window_index(grids)
        unit = self.merge * self.merge
        frames = [0]  # full attention: within each frame of each image
        for t, h, w in grids:
            start = frames[-1]
            frames.extend(start + h * w * (i + 1) for i in range(t))
        x = self.patch_embed(pixels)
        n = x.shape[0]
        order = window_index.to(x.device)
        x = x.reshape(n // unit, unit, -1)[order].reshape(n, -1)
        cos, sin = self.rope_tables(grids, x.device)
        rope = (cos.reshape(n // unit, unit, -1)[order].reshape(n, -1),
                sin.reshape(n // unit, unit, -1)[order].reshape(n, -1))
        for i, block in enumerate(self.blocks):
            x = block(x, frames if i in self.full_blocks else cu_windows, rope)
        return self.merger(x)[torch.argsort(order)]

    def rope_tables(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim] of each patch's (row, column) in its image (patches in
        merge-block order), as transformers' axial vision rotary embedding computes them."""
        m, spatial = self.merge, (self.dim // self.heads) // 2
        ids = []
        for t, h, w in grids:
            rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            rows = rows.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
            cols = cols.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
            ids.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
        position_ids = torch.cat(ids).to(device)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        freqs = position_ids[..., None].float() * inv_freq.to(device)
        cos, sin = freqs.cos(), freqs.sin()
        cos, sin = (torch.cat([f[:, 0], f[:, 1]], dim=-1) for f in (cos, sin))
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)

    def window_index(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """(the merge blocks in window order, the windows' cumulative patch counts): windows
        of `window_size` pixels (whole merge blocks), row-major in each frame, their blocks
        row-major, the edge windows cut short (transformers' `get_vision_window_index`)."""
        side = self.window // self.merge // self.patch
        unit = self.merge * self.merge
        order: list[torch.Tensor] = []
        cu = [0]
        base = 0
        for t, h, w in grids:
            lh, lw = h // self.merge, w // self.merge
            index = torch.arange(t * lh * lw).reshape(t, lh, lw)
            pad_h, pad_w = side - lh % side, side - lw % side
            wh, ww = (lh + pad_h) // side, (lw + pad_w) // side
            padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
            padded = padded.reshape(t, wh, side, ww, side).permute(0, 1, 3, 2, 4).reshape(t, wh * ww, side, side)
            sizes = (padded != -100).sum([2, 3]).reshape(-1)
            flat = padded.reshape(-1)
            order.append(flat[flat != -100] + base)
            cu.extend((sizes.cumsum(0) * unit + cu[-1]).tolist())
            base += t * lh * lw
        bounds = [cu[0]] + [b for a, b in pairwise(cu) if b != a]  # unique_consecutive
        return torch.cat(order), bounds


class Qwen25VLModel(TowerAndLM):
    assigns_weights = True

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        text, section = qwen25_vl_text_config(config)
        self.lm = DecoderLM(text, mrope_section=section)
        self.vision = Qwen25VisionTower(config.get("vision_config") or {})

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """The tower's tensors by its prefix; the LM's renamed to `DecoderLM`'s own names."""
        vision_prefix, text_prefix = next(((v, t) for v, t in PREFIXES if any(k.startswith(v) for k in state)),
                                          PREFIXES[0])
        load_vlm_weights(state, self.lm, text=(text_prefix,), head=("lm_head.",),
                         parts=[(self.vision, (vision_prefix,))])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttnMetadata], sample_rows: torch.Tensor, embeds: RowEmbeds | None = None) -> torch.Tensor:
        return self.lm(input_ids, positions, kv_caches, metas, sample_rows, embeds)
