"""Qwen3.5 with images (`Qwen3_5ForConditionalGeneration`): its vision tower, and the model
the gpu worker runs (the tower beside `Qwen35LM`, the hybrid text model).

The language model is `Qwen35LM` unchanged but for two inputs: `embeds` (the step's image
rows, put in place of their placeholder's embedding) and positions [3, T] (temporal,
height, width per row, as `shared.specs.vision_lm.mrope_positions` computes them: Qwen3.5's
`get_rope_index` gives still images the positions Qwen2.5-VL's does), rotated by the
interleaved multimodal RoPE (`layers/interleaved_mrope.py`).

The tower follows transformers' `Qwen3_5VisionModel` op for op, so its rows are
transformers' own bits on the same device and dtype. Unlike Qwen2.5-VL's tower it has no
windows (every block attends within each image frame), LayerNorms rather than RMSNorms, a
Conv3d patch embedding with a bias, a GELU (tanh) MLP without a gate, and learned position
embeddings: a square table of `num_position_embeddings` rows resampled to each image's
grid by bilinear interpolation (align_corners), computed as transformers does (four taps a
patch, their float32 weights, the weighted rows summed in tap order). Its 2-D RoPE is
Qwen2.5-VL's (each patch's row and column, half the pairs each). Patches come in merge-block
order (the processor's), and the merger (LayerNorm, a block's patches side by side, Linear,
GELU, Linear) makes one row per block.

Checkpoint names are transformers': `model.visual.*` for the tower (the Hub's files say the
same), the language model's as `Qwen35LM.load_weights` reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.modeling.base import TowerAndLM
from services.gpu_worker.modeling.decoder.lm import RowEmbeds
from services.gpu_worker.modeling.hybrid.qwen3_5 import LayerMeta, Qwen35LM
from services.gpu_worker.modeling.hybrid.qwen3_5_moe import Qwen35MoeLM
from services.gpu_worker.modeling.vision.qwen2_5_vl import PatchEmbed, VisionAttention

#: prefixes of the tower's tensors: transformers 5's files, then a bare `visual.` as the
#: Qwen2.5-VL Hub files have it
VISION_PREFIXES = ("model.visual.", "visual.")
#: Qwen3_5VisionConfig's defaults for keys a config.json may omit
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304, "num_heads": 16,
    "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
}
#: the LayerNorms' epsilon (transformers hard-codes it)
LN_EPS = 1e-6


class VisionMLP(nn.Module):
    """linear_fc2(act(linear_fc1(x))), no gate."""

    def __init__(self, dim: int, inter: int, act: str) -> None:
        super().__init__()
        if act not in ("gelu_pytorch_tanh", "gelu", "silu"):
            raise ValueError(f"vision hidden_act {act!r} is not supported")
        self.act = act
        self.linear_fc1 = nn.Linear(dim, inter)
        self.linear_fc2 = nn.Linear(inter, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        h = F.silu(h) if self.act == "silu" else F.gelu(h, approximate="tanh" if "tanh" in self.act else "none")
        return self.linear_fc2(h)


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, inter: int, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = VisionAttention(dim, heads)
        self.mlp = VisionMLP(dim, inter, act)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, rope)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm over each patch, each merge block's patches side by side, Linear, GELU, Linear."""

    def __init__(self, dim: int, out_dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.norm = nn.LayerNorm(dim, eps=LN_EPS)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.hidden))))


def block_order_coords(grids: list[tuple[int, int, int]], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) in its image, patches in merge-block order (each block's
    merge^2 patches row-major, the blocks row-major), every frame of every image in turn."""
    rows_out, cols_out = [], []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        rows_out.append(rows.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten().repeat(t))
        cols_out.append(cols.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten().repeat(t))
    return torch.cat(rows_out), torch.cat(cols_out)


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) taps into a `side`-long axis and their weights, for target
    `index` on an axis of `size`: transformers' `_interpolation_axis_taps_weights`,
    expression for expression (the same float32 rounding)."""
    index = index.to(torch.float32)
    src = index * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    distance = (src[:, None] - floor[:, None] - offsets).abs()
    return taps, (1 - distance).clamp(min=0)


def position_taps(grids: list[tuple[int, int, int]], merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [patches, 4] into the flattened side x side table, weights [patches, 4]):
    the learned position table resampled to each image's grid, as transformers'
    `get_vision_interpolation_indices_and_weights(mode="bilinear", align_corners=True)`."""
    rows, cols = block_order_coords(grids, merge)
    heights = torch.cat([torch.full((t * h * w,), h, dtype=torch.int64) for t, h, w in grids])
    widths = torch.cat([torch.full((t * h * w,), w, dtype=torch.int64) for t, h, w in grids])
    h_taps, h_weights = _axis_taps(rows, heights, side)
    w_taps, w_weights = _axis_taps(cols, widths, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


class Qwen35VisionTower(nn.Module):
    """Patches [sum(t * h * w), C * temporal_patch * patch^2] of images of grids [N, 3]
    -> merged rows [sum(t * h * w) / merge^2, out_hidden_size], image after image."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        cfg = {**VISION_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        self.dim, self.heads = int(cfg["hidden_size"]), int(cfg["num_heads"])
        self.merge = int(cfg["spatial_merge_size"])
        self.theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        positions = int(cfg["num_position_embeddings"])
        self.side = int(positions**0.5)
        self.patch_embed = PatchEmbed(int(cfg["in_channels"]), self.dim, int(cfg["temporal_patch_size"]),
                                      int(cfg["patch_size"]), bias=True)
        self.pos_embed = nn.Embedding(positions, self.dim)
        self.blocks = nn.ModuleList(VisionBlock(self.dim, self.heads, int(cfg["intermediate_size"]),
                                                str(cfg["hidden_act"])) for _ in range(int(cfg["depth"])))
        self.merger = PatchMerger(self.dim, int(cfg["out_hidden_size"]), self.merge)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        frames = [0]  # attention within each frame of each image
        for t, h, w in grids:
            start = frames[-1]  # (a generator reading frames[-1] would see it grow)
            frames.extend(start + h * w * (i + 1) for i in range(t))
        x = self.patch_embed(pixels)
        indices, weights = position_taps(grids, self.merge, self.side)
        device = x.device
        pos = (self.pos_embed(indices.to(device)) * weights.to(device)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        rope = self.rope_tables(grids, device)
        for block in self.blocks:
            x = block(x, frames, rope)
        return self.merger(x)

    def rope_tables(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim] of each patch's (row, column): transformers' axial
        `Qwen3_5VisionRotaryEmbedding` (float32 angles, rows' then columns' pairs, twice)."""
        spatial = (self.dim // self.heads) // 2
        rows, cols = block_order_coords(grids, self.merge)
        position_ids = torch.stack([rows, cols], dim=-1).to(device)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        freqs = position_ids[..., None].float() * inv_freq.to(device)
        cos, sin = freqs.cos(), freqs.sin()
        cos, sin = (torch.cat([f[:, 0], f[:, 1]], dim=-1) for f in (cos, sin))
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


class Qwen35VLModel(TowerAndLM):
    """The tower and the hybrid text model; `forward` is `Qwen35LM`'s with the step's image
    rows (`embeds`) and positions [3, T] (or [T] for a step of text rows only)."""

    assigns_weights = True

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        # Qwen3.5-MoE's (`Qwen3_5MoeForConditionalGeneration`): the same tower, the text model with experts
        lm = Qwen35MoeLM if config.get("model_type") == "qwen3_5_moe" else Qwen35LM
        self.lm = lm(config)
        self.vision = Qwen35VisionTower(config.get("vision_config") or {})

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """The tower's tensors by their prefix (strictly: a missing one is an error); the
        rest is the language model's."""
        prefix = next((p for p in VISION_PREFIXES if any(k.startswith(p) for k in state)), VISION_PREFIXES[0])
        vision = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        missing, unexpected = self.vision.load_state_dict(vision, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"the vision tower's tensors do not match: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        self.lm.load_weights({k: v for k, v in state.items() if not k.startswith(prefix)})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                kv_caches: list[torch.Tensor], metas: list[LayerMeta], sample_rows: torch.Tensor,
                embeds: RowEmbeds | None = None) -> torch.Tensor:
        return self.lm(input_ids, positions, kv_caches, metas, sample_rows, embeds)
