"""V-JEPA 2-AC (`VJEPA2ACWorldModel`): the video ViT encoder and the action-conditioned
predictor (`cc-vjepa2`'s `VisionTransformer` with RoPE and `VisionTransformerPredictorAC`),
with the same parameter names, so `model.safetensors` holds their state dicts under
`encoder.` and `predictor.`.

The math is the package's, kept bit for bit where it is odd: the 3-axis RoPE of a head
(depth, height, width, each `2 * ((head_dim // 3) // 2)` dims, the rest unrotated) pairs
neighbouring dims but repeats the frequencies as [f, f] halves rather than interleaving
them (the "subtle bug" Meta kept for its checkpoints); an action or state token rotates
only its depth part, at its frame's index; attention is frame-block causal (a token sees
every token of its frame and of the frames before it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.modeling.base import WorldModel


def rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`vjepa2.models.utils.modules.rotate_queries_or_keys`: x [B, heads, N, D], pos [N]."""
    d = x.shape[-1]
    omega = torch.arange(d // 2, dtype=x.dtype, device=x.device)
    omega /= d / 2.0
    omega = 1.0 / 10000**omega
    freq = pos.to(x.dtype)[:, None] * omega[None, :]
    sin, cos = freq.sin().repeat(1, 2), freq.cos().repeat(1, 2)
    y = x.unflatten(-1, (-1, 2))
    y = torch.stack((-y[..., 1], y[..., 0]), dim=-1).flatten(-2)
    return x * cos + y * sin


def rope3(x: torch.Tensor, part: int, depth: torch.Tensor, height: torch.Tensor | None,
          width: torch.Tensor | None) -> torch.Tensor:
    """Rotate the depth, height and width parts (`part` dims each) of x [B, heads, N, D];
    with no height / width (action and state tokens) only the depth part turns."""
    pieces = [rotate(x[..., :part], depth)]
    s = part
    if height is not None and width is not None:
        pieces += [rotate(x[..., s: s + part], height), rotate(x[..., s + part: s + 2 * part], width)]
        s += 2 * part
    return torch.cat([*pieces, x[..., s:]], dim=-1)


class Mlp(nn.Module):
    """`MLP` (GELU: fc1, fc2) or `SwiGLUFFN` (fc1, fc2 gates, fc3), as the config's use_silu."""

    def __init__(self, dim: int, ratio: float, silu: bool, wide: bool) -> None:
        super().__init__()
        hidden = int(dim * ratio)
        self.silu = silu
        if silu:
            if wide:
                hidden = (int(2 * hidden / 3) + 7) // 8 * 8
            self.fc1, self.fc2, self.fc3 = nn.Linear(dim, hidden), nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        else:
            self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu:
            return self.fc3(F.silu(self.fc1(x)) * self.fc2(x))
        return self.fc2(F.gelu(self.fc1(x)))


class Attn(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.part = 2 * ((dim // heads // 3) // 2)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)


class Block(nn.Module):
    """A pre-norm block: attention with 3-axis RoPE, then the MLP."""

    def __init__(self, cfg: Mapping[str, Any], dim: int) -> None:
        super().__init__()
        eps = float(cfg.get("layer_norm_eps", 1e-6))
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.attn = Attn(dim, int(cfg["num_heads"]))
        self.mlp = Mlp(dim, float(cfg.get("mlp_ratio", 4.0)), bool(cfg.get("use_silu", False)),
                       bool(cfg.get("wide_silu", True)))

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, heads, N, head_dim] of the normed rows x [B, N, dim]."""
        q, k, v = self.attn.qkv(x).unflatten(-1, (3, self.attn.heads, -1)).permute(2, 0, 3, 1, 4)
        return q, k, v

    def finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.attn.proj(out.transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


def grid_positions(tokens: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each of a frame's `tokens` patches, row-major, as floats."""
    ids = torch.arange(tokens, device=device)
    return (ids // width).float(), (ids % width).float()


class PatchEmbed(nn.Module):
    """`PatchEmbed3D`: one Conv3d over (tubelet, patch, patch)."""

    def __init__(self, dim: int, patch: int, tubelet: int) -> None:
        super().__init__()
        self.proj = nn.Conv3d(3, dim, (tubelet, patch, patch), (tubelet, patch, patch))


def blocks_of(modules: nn.ModuleList) -> list[Block]:
    return cast(list[Block], list(modules))


class Encoder(nn.Module):
    """The video ViT with RoPE, each frame one tubelet (the frame twice)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        dim, patch, tubelet = int(cfg["embed_dim"]), int(cfg.get("patch_size", 16)), int(cfg.get("tubelet_size", 2))
        self.tubelet = tubelet
        self.patch_embed = PatchEmbed(dim, patch, tubelet)
        self.blocks = nn.ModuleList(Block(cfg, dim) for _ in range(int(cfg["depth"])))
        self.norm = nn.LayerNorm(dim, eps=float(cfg.get("layer_norm_eps", 1e-6)))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, H, W] -> each frame's tokens [N, H*W/patch^2, dim], layer-normed
        (no affine) as `forward_target` normalizes the targets."""
        clip = pixels.unsqueeze(2).expand(-1, -1, self.tubelet, -1, -1)
        conv = self.patch_embed.proj(clip)  # [N, dim, 1, gh, gw]
        width = conv.shape[-1]
        x = conv.flatten(2).transpose(1, 2)
        h, w = grid_positions(x.shape[1], width, x.device)
        depth = torch.zeros_like(h)
        for blk in blocks_of(self.blocks):
            q, k, v = blk.qkv(blk.norm1(x))
            part = blk.attn.part
            x = blk.finish(x, rope3(q, part, depth, h, w), rope3(k, part, depth, h, w), v, None)
        x = self.norm(x)
        return F.layer_norm(x, (x.shape[-1],))


class Predictor(nn.Module):
    """`VisionTransformerPredictorAC`: per frame [action, state, patches...], frame-block causal."""

    def __init__(self, cfg: Mapping[str, Any], embed_dim: int, grid: int) -> None:
        super().__init__()
        dim, actions = int(cfg["predictor_embed_dim"]), int(cfg.get("action_embed_dim", 7))
        self.grid = grid
        self.predictor_embed = nn.Linear(embed_dim, dim)
        self.action_encoder = nn.Linear(actions, dim)
        self.state_encoder = nn.Linear(actions, dim)
        self.extrinsics_encoder = nn.Linear(actions - 1, dim)
        self.predictor_blocks = nn.ModuleList(Block(cfg, dim) for _ in range(int(cfg["depth"])))
        self.predictor_norm = nn.LayerNorm(dim, eps=float(cfg.get("layer_norm_eps", 1e-6)))
        self.predictor_proj = nn.Linear(dim, embed_dim)

    def forward(self, z: torch.Tensor, actions: torch.Tensor, states: torch.Tensor, start: int = 0,
                past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """z [B, T, tokens, embed], the rollout's frames `start` to `start + T - 1`, with their
        actions and states [B, T, A]; `past`: each layer's K and V [B, heads, rows, head_dim]
        (RoPE applied) of the frames before `start`, which the frame-block causal mask lets
        every new row see (and no earlier row see a new one, so they never change). Returns
        the new frames' output [B, T, tokens, embed], layer-normed (no affine) as Meta's
        `_step_predictor` does, and each layer's K and V of the new rows."""
        t, n = z.shape[1], z.shape[2]
        x = torch.cat([self.action_encoder(actions)[:, :, None], self.state_encoder(states)[:, :, None],
                       self.predictor_embed(z)], dim=2).flatten(1, 2)  # [B, T * (2 + n), dim]
        frame = torch.arange(start, start + t, device=z.device).repeat_interleave(n + 2)
        mask = frame[:, None] >= torch.arange(start + t, device=z.device).repeat_interleave(n + 2)[None, :]
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, blk in enumerate(blocks_of(self.predictor_blocks)):
            q, k, v = self._rotated(blk, x, start, t, n)
            kept.append((k, v))
            if past is not None:
                k, v = torch.cat([past[i][0], k], dim=2), torch.cat([past[i][1], v], dim=2)
            x = blk.finish(x, q, k, v, mask)
        x = x.unflatten(1, (t, n + 2))[:, :, 2:]
        x = self.predictor_proj(self.predictor_norm(x))
        return F.layer_norm(x, (x.shape[-1],)), kept

    def _rotated(self, blk: Block, x: torch.Tensor, start: int, t: int, n: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, heads, T * (2 + n), head_dim] of rows x, RoPE applied as
        `ACRoPEAttention` does: a frame's patches by (frame, row, column), its action and
        state tokens by frame only."""
        q, k, v = (p.unflatten(2, (t, n + 2)) for p in blk.qkv(blk.norm1(x)))
        part = blk.attn.part
        h, w = grid_positions(n, self.grid, x.device)
        depth = torch.arange(start, start + t, device=x.device).float()
        rows = depth.repeat_interleave(n)
        out = []
        for y in (q, k):
            patches = rope3(y[:, :, :, 2:].flatten(2, 3), part, rows, h.repeat(t), w.repeat(t)).unflatten(2, (t, n))
            conds = torch.stack([rope3(y[:, :, :, i], part, depth, None, None) for i in (0, 1)], dim=3)
            out.append(torch.cat([conds, patches], dim=3).flatten(2, 3))
        return out[0], out[1], v.flatten(2, 3)


class VJepa2ACWorld(WorldModel):
    """The encoder and the predictor of one V-JEPA 2-AC checkpoint."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        enc, pred = dict(config["encoder"]), dict(config["predictor"])
        grid = int(enc.get("img_size", 256)) // int(enc.get("patch_size", 16))
        self.encoder = Encoder(enc)
        self.predictor = Predictor(pred, int(enc["embed_dim"]), grid)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"V-JEPA 2-AC checkpoint: missing {sorted(missing)[:8]}, "
                             f"unexpected {sorted(unexpected)[:8]}")

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.encoder(pixels)

    def predict(self, z: torch.Tensor, actions: torch.Tensor, states: torch.Tensor, start: int,
                past: list[tuple[torch.Tensor, torch.Tensor]] | None
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        return self.predictor(z, actions, states, start, past)
