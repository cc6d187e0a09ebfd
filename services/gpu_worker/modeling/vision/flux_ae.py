"""FLUX's autoencoder (BAGEL's `ae.safetensors`), op for op as black-forest-labs' code
(which BAGEL's `modeling/autoencoder.py` copies).

Decoder (`decoder.*`): conv in, a middle of ResNet / single-head attention / ResNet,
`num_res_blocks + 1` ResNet blocks a level with nearest-neighbour 2x upsampling between
levels, GroupNorm(32) + swish + conv out. `decode(z)` undoes the latent scaling first
(`z / scale_factor + shift_factor`).

Encoder (`encoder.*`, what an edit's input image goes through): conv in, `num_res_blocks`
ResNet blocks a level with a stride-2 conv between levels (padded right and bottom by
one, as FLUX pads), the same middle, GroupNorm(32) + swish + conv out to 2 x z channels
(the diagonal Gaussian's mean and log-variance). `encode(x, noise)` samples it as the
reference's `DiagonalGaussian(sample=True)` does, `mean + exp(logvar / 2) * noise`, with
the noise given (the reference draws `randn_like(mean)` from the global generator; the
caller draws the same numbers from its own), then scales it (`scale * (z - shift)`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _norm(ch: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=ch, eps=1e-6, affine=True)


def _swish(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), written as FLUX writes it (not F.silu: the same rounding)."""
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = _norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = _norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(_swish(self.norm1(x)))
        h = self.conv2(_swish(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.norm = _norm(ch)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(ch, ch, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        b, c, hh, ww = x.shape
        q, k, v = (m(h).reshape(b, 1, c, hh * ww).transpose(2, 3).contiguous() for m in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b, c, hh, ww)
        return x + self.proj_out(o)


class Upsample(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class Encoder(nn.Module):
    """The checkpoint's `encoder.*` (module names as FLUX's)."""

    def __init__(self, in_ch: int, ch: int, ch_mult: list[int], num_res_blocks: int, z_channels: int) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(in_ch, ch, 3, padding=1)
        mults = (1, *ch_mult)
        downs: list[nn.Module] = []
        block_in = ch
        for level in range(len(ch_mult)):
            down = nn.Module()
            blocks = []
            block_in = ch * mults[level]
            for _ in range(num_res_blocks):
                blocks.append(ResnetBlock(block_in, ch * ch_mult[level]))
                block_in = ch * ch_mult[level]
            down.block, down.attn = nn.ModuleList(blocks), nn.ModuleList()
            if level != len(ch_mult) - 1:
                down.downsample = Downsample(block_in)
            downs.append(down)
        self.down = nn.ModuleList(downs)
        self.mid = nn.Module()
        self.mid.block_1, self.mid.attn_1 = ResnetBlock(block_in, block_in), AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in)
        self.norm_out, self.conv_out = _norm(block_in), nn.Conv2d(block_in, 2 * z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level, down in enumerate(self.down):
            d: Any = down
            for block in d.block:
                h = block(h)
            if level != len(self.down) - 1:
                h = d.downsample(h)
        mid: Any = self.mid
        h = mid.block_2(mid.attn_1(mid.block_1(h)))
        return self.conv_out(_swish(self.norm_out(h)))


class Decoder(nn.Module):
    """The checkpoint's `decoder.*` (module names as FLUX's)."""

    def __init__(self, ch: int, out_ch: int, ch_mult: list[int], num_res_blocks: int, z_channels: int) -> None:
        super().__init__()
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1, self.mid.attn_1 = ResnetBlock(block_in, block_in), AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in)
        ups: list[nn.Module] = []
        for level in reversed(range(len(ch_mult))):
            up = nn.Module()
            blocks = []
            for _ in range(num_res_blocks + 1):
                blocks.append(ResnetBlock(block_in, ch * ch_mult[level]))
                block_in = ch * ch_mult[level]
            up.block, up.attn = nn.ModuleList(blocks), nn.ModuleList()
            if level != 0:
                up.upsample = Upsample(block_in)
            ups.insert(0, up)
        self.up = nn.ModuleList(ups)
        self.norm_out, self.conv_out = _norm(block_in), nn.Conv2d(block_in, out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        mid: Any = self.mid
        h = mid.block_2(mid.attn_1(mid.block_1(h)))
        for level in reversed(range(len(self.up))):
            up: Any = self.up[level]
            for block in up.block:
                h = block(h)
            if level != 0:
                h = up.upsample(h)
        return self.conv_out(_swish(self.norm_out(h)))


class FluxDecoder(nn.Module):
    """`decoder` plus the latent scaling: `decode(z [B, z_channels, h, w])` -> [B, 3, 8h, 8w] in [-1, 1]-ish."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__()
        self.decoder = Decoder(int(params["ch"]), int(params["out_ch"]), list(params["ch_mult"]),
                               int(params["num_res_blocks"]), int(params["z_channels"]))
        self.scale_factor, self.shift_factor = float(params["scale_factor"]), float(params["shift_factor"])

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z / self.scale_factor + self.shift_factor)


class FluxEncoder(nn.Module):
    """`encoder` plus the Gaussian's sample and the latent scaling: `encode(x [B, 3, H, W] in
    [-1, 1], noise [B, z_channels, H / 8, W / 8] or None: the mean)` -> the scaled latents."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__()
        self.encoder = Encoder(int(params.get("in_channels", 3)), int(params["ch"]), list(params["ch_mult"]),
                               int(params["num_res_blocks"]), int(params["z_channels"]))
        self.scale_factor, self.shift_factor = float(params["scale_factor"]), float(params["shift_factor"])

    def moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Gaussian's (mean, log-variance), each [B, z_channels, H / 8, W / 8]."""
        mean, logvar = torch.chunk(self.encoder(x), 2, dim=1)
        return mean, logvar

    def encode(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        mean, logvar = self.moments(x)
        z = mean if noise is None else mean + torch.exp(0.5 * logvar) * noise.to(mean.dtype)
        return self.scale_factor * (z - self.shift_factor)
