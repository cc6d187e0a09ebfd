"""The Wan VAE's decoder (diffusers' `AutoencoderKLWan.decode`: Wan 2.1, and Wan 2.2's
residual, patchified kind that Cosmos 3 uses), the decoder half only, with diffusers'
parameter names (`post_quant_conv.*`, `decoder.*`), so `vae/`'s safetensors load as saved
and the encoder's tensors are never read.

It decodes as diffusers does, one latent frame at a time through causal 3D convolutions
that keep the last two frames of each input (`Cache`: the `feat_cache` list and its index),
the first frame's temporal upsampling skipped (the "Rep" mark) and the residual shortcut's
first frames dropped (`first_chunk`); then unpatchifies and clamps to [-1, 1]. Decoding the
whole clip at once would differ at the first frame, so the loop is kept as is.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

CACHE_T = 2


class Cache:
    """The decoder's per-convolution frame cache, consumed in module order each frame."""

    def __init__(self, n: int) -> None:
        self.feats: list[Any] = [None] * n
        self.idx = 0

    def conv(self, conv: CausalConv3d, x: torch.Tensor) -> torch.Tensor:
        """`conv` over x after the cached frames; the cache keeps x's last two frames."""
        i = self.idx
        keep = x[:, :, -CACHE_T:].clone()
        if keep.shape[2] < 2 and self.feats[i] is not None:
            keep = torch.cat([self.feats[i][:, :, -1:].to(keep.device), keep], dim=2)
        x = conv(x, self.feats[i])
        self.feats[i] = keep
        self.idx += 1
        return x


class CausalConv3d(nn.Conv3d):
    """`WanCausalConv3d`: time padded on the left only (or by the cached frames)."""

    def __init__(self, cin: int, cout: int, kernel: int | tuple[int, int, int], stride: int = 1,
                 padding: int | tuple[int, int, int] = 0) -> None:
        super().__init__(cin, cout, kernel, stride, padding)
        p = cast(tuple[int, int, int], self.padding)
        self._pad = (p[2], p[2], p[1], p[1], 2 * p[0], 0)
        self.padding = (0, 0, 0)

    def forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        pad = list(self._pad)
        if cache_x is not None and self._pad[4] > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            pad[4] -= cache_x.shape[2]
        return super().forward(F.pad(x, pad))


class RMSNorm(nn.Module):
    """`WanRMS_norm` (no bias): L2-normalized over channels, times sqrt(dim) and gamma."""

    def __init__(self, dim: int, images: bool = True) -> None:
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones((dim, 1, 1) if images else (dim, 1, 1, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.dtype in (torch.float16, torch.bfloat16)
        return F.normalize(x.float() if wide else x, dim=1).to(x.dtype) * self.scale * self.gamma


class Upsample(nn.Upsample):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).type_as(x)


class Resample(nn.Module):
    """`WanResample`'s upsampling modes: 2x nearest-exact then a 3x3 conv per frame; for
    "upsample3d" first a causal time conv that doubles the frames (not on the first frame)."""

    def __init__(self, dim: int, mode: str, out_dim: int | None = None) -> None:
        super().__init__()
        self.mode = mode
        self.resample = nn.Sequential(Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                                      nn.Conv2d(dim, out_dim if out_dim is not None else dim // 2, 3, padding=1))
        if mode == "upsample3d":
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        b, c, t, h, w = x.size()
        if self.mode == "upsample3d":
            i = cache.idx
            if cache.feats[i] is None:
                cache.feats[i] = "Rep"
            else:
                keep = x[:, :, -CACHE_T:].clone()
                if keep.shape[2] < 2 and cache.feats[i] != "Rep":
                    keep = torch.cat([cache.feats[i][:, :, -1:].to(keep.device), keep], dim=2)
                if keep.shape[2] < 2 and cache.feats[i] == "Rep":
                    keep = torch.cat([torch.zeros_like(keep), keep], dim=2)
                x = self.time_conv(x) if cache.feats[i] == "Rep" else self.time_conv(x, cache.feats[i])
                cache.feats[i] = keep
                x = x.reshape(b, 2, c, t, h, w)
                x = torch.stack((x[:, 0], x[:, 1]), 3).reshape(b, c, t * 2, h, w)
            cache.idx += 1
        t = x.shape[2]
        x = self.resample(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        return x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = RMSNorm(cin, images=False), CausalConv3d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = RMSNorm(cout, images=False), CausalConv3d(cout, cout, 3, padding=1)
        self.conv_shortcut: nn.Module = CausalConv3d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        h = self.conv_shortcut(x)
        x = cache.conv(self.conv1, F.silu(self.norm1(x)))
        return cache.conv(self.conv2, F.silu(self.norm2(x))) + h


class AttentionBlock(nn.Module):
    """`WanAttentionBlock`: one head over each frame's pixels."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.to_qkv, self.proj = nn.Conv2d(dim, dim * 3, 1), nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        b, c, t, h, w = x.size()
        x = self.norm(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        qkv = self.to_qkv(x).reshape(b * t, 1, c * 3, -1).permute(0, 1, 3, 2).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)
        x = F.scaled_dot_product_attention(q, k, v)
        x = self.proj(x.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w))
        return x.view(b, t, c, h, w).permute(0, 2, 1, 3, 4) + identity


class MidBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attentions = nn.ModuleList([AttentionBlock(dim)])
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        x = self.resnets[0](x, cache)
        return self.resnets[1](self.attentions[0](x), cache)


def dup_up(x: torch.Tensor, cout: int, factor_t: int, factor_s: int, first_chunk: bool) -> torch.Tensor:
    """`DupUp3D`: channels repeated into time and space (the residual up block's shortcut)."""
    factor = factor_t * factor_s * factor_s
    x = x.repeat_interleave(cout * factor // x.size(1), dim=1)
    x = x.view(x.size(0), cout, factor_t, factor_s, factor_s, x.size(2), x.size(3), x.size(4))
    x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).contiguous()
    x = x.view(x.size(0), cout, x.size(2) * factor_t, x.size(4) * factor_s, x.size(6) * factor_s)
    return x[:, :, factor_t - 1:] if first_chunk else x


class UpBlock(nn.Module):
    """`WanResidualUpBlock` (residual: a `dup_up` shortcut) or `WanUpBlock`."""

    def __init__(self, cin: int, cout: int, blocks: int, mode: str | None, residual: bool) -> None:
        super().__init__()
        self.residual, self.cout = residual, cout
        self.factor_t = 2 if mode == "upsample3d" else 1
        self.resnets = nn.ModuleList([ResidualBlock(cin if i == 0 else cout, cout) for i in range(blocks + 1)])
        up = None if mode is None else Resample(cout, mode, cout if residual else None)
        if residual:
            self.upsampler = up
        else:
            self.upsamplers = nn.ModuleList([up]) if up is not None else None

    def forward(self, x: torch.Tensor, cache: Cache, first_chunk: bool) -> torch.Tensor:
        shortcut = x.clone()
        for resnet in self.resnets:
            x = resnet(x, cache)
        up = self.upsampler if self.residual else (self.upsamplers[0] if self.upsamplers is not None else None)
        if up is not None:
            x = up(x, cache)
            if self.residual:
                x = x + dup_up(shortcut, self.cout, self.factor_t, 2, first_chunk)
        return x


class Decoder(nn.Module):
    """`WanDecoder3d`."""

    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        mult, blocks = list(c.get("dim_mult", [1, 2, 4, 4])), int(c.get("num_res_blocks", 2))
        base = int(c.get("decoder_base_dim") or c.get("base_dim", 96))
        residual = bool(c.get("is_residual", False))
        t_up = list(c.get("temperal_downsample", [False, True, True]))[::-1]
        dims = [base * u for u in [mult[-1], *mult[::-1]]]
        self.conv_in = CausalConv3d(int(c.get("z_dim", 16)), dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        ups = []
        for i, (cin, cout) in enumerate(itertools.pairwise(dims)):
            if i > 0 and not residual:
                cin //= 2  # Wan 2.1: the upsampler halved the channels
            up = i != len(mult) - 1
            mode = ("upsample3d" if t_up[i] else "upsample2d") if up else None
            ups.append(UpBlock(cin, cout, blocks, mode, residual))
        self.up_blocks = nn.ModuleList(ups)
        self.norm_out = RMSNorm(dims[-1], images=False)
        self.conv_out = CausalConv3d(dims[-1], int(c.get("out_channels", 3)), 3, padding=1)

    def forward(self, x: torch.Tensor, cache: Cache, first_chunk: bool) -> torch.Tensor:
        x = self.mid_block(cache.conv(self.conv_in, x), cache)
        for up in self.up_blocks:
            x = up(x, cache, first_chunk)
        return cache.conv(self.conv_out, F.silu(self.norm_out(x)))


class WanVAEDecoder(nn.Module):
    """`AutoencoderKLWan.decode` of raw latents [B, z, T, h, w] -> [B, 3, F, H, W] in [-1, 1]."""

    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        z = int(c.get("z_dim", 16))
        self.patch = int(c.get("patch_size") or 1)
        self.post_quant_conv = CausalConv3d(z, z, 1)
        self.decoder = Decoder(c)
        self.convs = sum(isinstance(m, CausalConv3d) for m in self.decoder.modules())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        cache = Cache(self.convs)
        x = self.post_quant_conv(z)
        frames = []
        for i in range(x.shape[2]):
            cache.idx = 0
            frames.append(self.decoder(x[:, :, i:i + 1], cache, first_chunk=i == 0))
        return unpatchify(torch.cat(frames, 2), self.patch).clamp(-1.0, 1.0)


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    if p == 1:
        return x
    b, cp, f, h, w = x.shape
    x = x.view(b, cp // (p * p), p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2).contiguous()
    return x.view(b, cp // (p * p), f, h * p, w * p)
