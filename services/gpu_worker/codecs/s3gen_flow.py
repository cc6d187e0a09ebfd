"""S3Gen's token-to-mel half (Chatterbox's `CausalMaskedDiffWithXvec`, from CosyVoice):
speech tokens -> mel [80, 2 per token], for one utterance at a time.

The package's `flow` in plain torch (no diffusers, einops or conformer package), its
parameter names (s3gen.safetensors' `flow.*`), for a batch of one unpadded utterance (every
mask is all ones, so none is applied):
- the voice's prompt tokens then the new tokens, embedded (`input_embedding`); the encoder
  (`UpsampleConformerEncoder`): a linear embedding with LayerNorm scaled by sqrt(d) and
  ESPnet relative positions, a look-ahead conv block, conformer layers (relative-position
  attention with its u / v biases, SiLU feed-forward), a nearest x2 upsampling conv, the
  same again at the doubled rate, a final LayerNorm; projected to 80 (`encoder_proj`);
- flow matching (`CausalConditionalCFM.solve_euler`): noise (drawn from the caller's
  generator, as the package draws `randn_like`), 10 Euler steps on a cosine schedule, each
  the estimator on a batch of two (conditional: the encoder's mu, the speaker's x-vector
  (normalized, projected), the prompt's mel as `cond`; unconditional: zeros), combined
  `(1 + 0.7) * cond - 0.7 * uncond`;
- the estimator (`ConditionalDecoder`): a sinusoidal time embedding and MLP, a causal
  resnet block and transformer blocks (LayerNorm, attention, LayerNorm, GELU MLP) down, in
  the middle and up (with the skip), a final causal block and 1x1 projection.
The mel after the prompt's frames is the result.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

#: S3Token2Mel's constructor arguments
ENCODER = {"input_size": 512, "output_size": 512, "attention_heads": 8, "linear_units": 2048, "num_blocks": 6}
DECODER = {"in_channels": 320, "out_channels": 80, "channels": [256], "attention_head_dim": 64, "n_blocks": 4,
           "num_mid_blocks": 12, "num_heads": 8}
FLOW = {"input_size": 512, "output_size": 80, "spk_embed_dim": 192, "vocab_size": 6561}
CFG_RATE = 0.7
STEPS = 10


# -- the encoder ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def rel_positions(t: int, d: int) -> torch.Tensor:
    """ESPnet's relative position table for `t` rows: [1, 2t - 1, d] (positions t-1 .. -(t-1));
    kept per size (two per utterance, ~10 small ops each, the same for every utterance of
    that length). Read-only; a normal tensor even when first made under inference mode."""
    with torch.inference_mode(False):
        position = torch.arange(0, t, dtype=torch.float32).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * -(math.log(10000.0) / d))
        pos, neg = torch.zeros(t, d), torch.zeros(t, d)
        pos[:, 0::2], pos[:, 1::2] = torch.sin(position * div), torch.cos(position * div)
        neg[:, 0::2], neg[:, 1::2] = torch.sin(-1 * position * div), torch.cos(-1 * position * div)
        return torch.cat([torch.flip(pos, [0]).unsqueeze(0), neg[1:].unsqueeze(0)], dim=1)


class _RelAttention(nn.Module):
    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.h, self.d_k = heads, dim // heads
        self.linear_q, self.linear_k, self.linear_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(heads, self.d_k))

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = self.linear_q(x).view(b, -1, self.h, self.d_k)
        k = self.linear_k(x).view(b, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, -1, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(pos_emb.shape[0], -1, self.h, self.d_k).transpose(1, 2)
        ac = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        bd = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))
        if ac.shape != bd.shape:  # rel_shift
            zero = torch.zeros((*bd.shape[:3], 1), device=bd.device, dtype=bd.dtype)
            padded = torch.cat([zero, bd], dim=-1).view(bd.shape[0], bd.shape[1], bd.shape[3] + 1, bd.shape[2])
            bd = padded[:, :, 1:].view_as(bd)[:, :, :, : bd.shape[-1] // 2 + 1]
        attn = torch.softmax((ac + bd) / math.sqrt(self.d_k), dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k)
        return self.linear_out(out)


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_1, self.w_2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class _ConformerLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.self_attn = _RelAttention(heads, dim)
        self.feed_forward = _FeedForward(dim, hidden)
        self.norm_mha, self.norm_ff = nn.LayerNorm(dim, eps=1e-12), nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), pos_emb)
        return x + self.feed_forward(self.norm_ff(x))


class _LinearEmbed(nn.Module):
    """`LinearNoSubsampling` with ESPnet relative positions: (rows scaled, positions)."""

    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.scale = math.sqrt(odim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.out(x) * self.scale
        return x, rel_positions(x.shape[1], x.shape[2]).to(x)


class _PreLookahead(nn.Module):
    def __init__(self, channels: int, lookahead: int = 3) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, channels, lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.pad(x.transpose(1, 2).contiguous(), (0, self.lookahead))
        out = self.conv2(F.pad(F.leaky_relu(self.conv1(out)), (2, 0)))
        return out.transpose(1, 2).contiguous() + x


class _Upsample(nn.Module):
    def __init__(self, channels: int, stride: int = 2) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, stride * 2 + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(out, (self.stride * 2, 0), value=0.0))


class _Encoder(nn.Module):
    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        d, heads, hidden = int(c["output_size"]), int(c["attention_heads"]), int(c["linear_units"])
        self.embed = _LinearEmbed(int(c["input_size"]), d)
        self.pre_lookahead_layer = _PreLookahead(512)
        self.encoders = nn.ModuleList(_ConformerLayer(d, heads, hidden) for _ in range(int(c["num_blocks"])))
        self.up_layer = _Upsample(512)
        self.up_embed = _LinearEmbed(int(c["input_size"]), d)
        self.up_encoders = nn.ModuleList(_ConformerLayer(d, heads, hidden) for _ in range(4))
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, pos = self.embed(x)
        x = self.pre_lookahead_layer(x)
        for layer in self.encoders:
            x = layer(x, pos)
        x = self.up_layer(x.transpose(1, 2).contiguous()).transpose(1, 2).contiguous()
        x, pos = self.up_embed(x)
        for layer in self.up_encoders:
            x = layer(x, pos)
        return self.after_norm(x)


# -- the estimator ------------------------------------------------------------------------


class _CausalConv(nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class _Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class _CausalBlock(nn.Module):
    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(_CausalConv(dim, dim_out, 3), _Transpose(), nn.LayerNorm(dim_out), _Transpose(),
                                   nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class _Resnet(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1, self.block2 = _CausalBlock(dim, dim_out), _CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """`shift`: `self.mlp` of the time embedding, unsqueezed (`_Estimator.time_shifts`)."""
        h = self.block1(x)
        h += shift
        return self.block2(h) + self.res_conv(x)

    def split_forward(self, x: torch.Tensor, shift: torch.Tensor,
                      const: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`forward` on the input's first channels `x` only, `const` being what its two
        convs give on the others (`_Estimator.constants`): convolution is linear in its
        input channels, so a conv over all = the conv over `x` + the rest's part."""
        conv, n = cast("nn.Conv1d", self.block1.block[0]), x.shape[1]
        h = F.conv1d(F.pad(x, (conv.kernel_size[0] - 1, 0)), conv.weight[:, :n]) + const[0]
        h = self.block1.block[1:](h)
        h += shift
        return self.block2(h) + (F.conv1d(x, self.res_conv.weight[:, :n]) + const[1])


class _Attention(nn.Module):
    """diffusers' `Attention` (AttnProcessor2_0) without bias on q / k / v; the package's mask is
    all zeros (one unpadded utterance), so none is passed (no mask tensor per call)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner, bias=False) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, -1, self.heads, t.shape[-1] // self.heads).transpose(1, 2)

        h = F.scaled_dot_product_attention(split(self.to_q(x)), split(self.to_k(x)), split(self.to_v(x)),
                                           attn_mask=None)
        return self.to_out[0](h.transpose(1, 2).reshape(b, -1, h.shape[1] * h.shape[3]))


class _GeluProj(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class _FF(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([_GeluProj(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.net:
            x = m(x)
        return x


class _TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn1 = _Attention(dim, heads, head_dim)
        self.ff = _FF(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn1(self.norm1(x)) + x
        return self.ff(self.norm3(x)) + x


class _TimeMLP(nn.Module):
    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(dim, out), nn.Linear(out, out)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(t)))


def _stage(c: Mapping[str, Any], dim: int, dim_out: int, time_dim: int, tail: bool) -> nn.ModuleList:
    blocks = nn.ModuleList(_TransformerBlock(dim_out, int(c["num_heads"]), int(c["attention_head_dim"]))
                           for _ in range(int(c["n_blocks"])))
    parts: list[nn.Module] = [_Resnet(dim, dim_out, time_dim), blocks]
    if tail:
        parts.append(_CausalConv(dim_out, dim_out, 3))
    return nn.ModuleList(parts)


class _Estimator(nn.Module):
    """`ConditionalDecoder` (causal, one channel width, as S3Gen builds it)."""

    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        channels = list(c["channels"])
        if len(channels) != 1:
            raise ValueError(f"S3Gen's estimator here takes one channel width; the config says {channels}")
        ch, self.in_channels = int(channels[0]), int(c["in_channels"])
        time_dim = ch * 4
        self.time_mlp = _TimeMLP(self.in_channels, time_dim)
        self.down_blocks = nn.ModuleList([_stage(c, self.in_channels, ch, time_dim, True)])
        self.mid_blocks = nn.ModuleList(_stage(c, ch, ch, time_dim, False) for _ in range(int(c["num_mid_blocks"])))
        self.up_blocks = nn.ModuleList([_stage(c, ch * 2, ch, time_dim, True)])
        self.final_block = _CausalBlock(ch, ch)
        self.final_proj = nn.Conv1d(ch, int(c["out_channels"]), 1)
        #: time values -> every resnet's time shift (`time_shifts`)
        self.shifts: dict[tuple[object, ...], list[torch.Tensor]] = {}

    def time_embedding(self, t: torch.Tensor) -> torch.Tensor:
        half = self.in_channels // 2
        emb = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
        emb = 1000 * t.unsqueeze(1) * emb.unsqueeze(0)
        return self.time_mlp(torch.cat((emb.sin(), emb.cos()), dim=-1).to(t.dtype))

    def time_shifts(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Each resnet's `mlp(time_embedding(t))` (down, middle, up), [B, C, 1]. The Euler
        steps' times are the same for every utterance (a fixed cosine schedule), so under
        inference mode they are computed once per time and kept: the same ops on the same
        values, so the same shifts, without ~2 small linears per resnet per step."""
        key = (*t.tolist(), str(t.dtype), str(t.device))
        cached = self.shifts.get(key) if torch.is_inference_mode_enabled() else None
        if cached is not None:
            return cached
        emb = self.time_embedding(t)
        stages = [*self.down_blocks, *self.mid_blocks, *self.up_blocks]
        shifts = [cast("Sequence[Any]", stage)[0].mlp(emb).unsqueeze(-1) for stage in stages]
        if torch.is_inference_mode_enabled():
            self.shifts[key] = shifts
        return shifts

    @staticmethod
    def _blocks(x: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
        x = x.transpose(1, 2).contiguous()
        for block in blocks:
            x = block(x)
        return x.transpose(1, 2).contiguous()

    def constants(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first resnet's two convs on the input channels that are the same at every
        Euler step (mu, the speaker, the prompt's mel: 3/4 of them), with their biases,
        computed once per utterance instead of once per step (`_Resnet.split_forward`)."""
        rest = torch.cat([mu, spks.unsqueeze(-1).expand(-1, -1, mu.shape[-1]), cond], dim=1)
        first = cast("_Resnet", cast("Sequence[Any]", self.down_blocks[0])[0])
        conv, res = cast("nn.Conv1d", first.block1.block[0]), first.res_conv
        n = conv.in_channels - rest.shape[1]
        return (F.conv1d(F.pad(rest, (conv.kernel_size[0] - 1, 0)), conv.weight[:, n:], conv.bias),
                F.conv1d(rest, res.weight[:, n:], res.bias))

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor) -> torch.Tensor:
        return self.step(x, t, self.constants(mu, spks, cond))

    def step(self, x: torch.Tensor, t: torch.Tensor, const: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The estimator on the noisy mel `x` at time `t`, the rest of its input being
        `const` (`constants`)."""
        shifts = self.time_shifts(t)
        down = cast("Sequence[Any]", self.down_blocks[0])
        skip = self._blocks(down[0].split_forward(x, shifts[0], const), down[1])
        x = down[2](skip)
        for mid, shift in zip(cast("Iterable[Sequence[Any]]", self.mid_blocks), shifts[1:-1]):
            x = self._blocks(mid[0](x, shift), mid[1])
        up = cast("Sequence[Any]", self.up_blocks[0])
        x = torch.cat([x[:, :, : skip.shape[-1]], skip], dim=1)
        x = up[2](self._blocks(up[0](x, shifts[-1]), up[1]))
        return self.final_proj(self.final_block(x))


class _Decoder(nn.Module):
    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        self.estimator = _Estimator(c)


class S3GenFlow(nn.Module):
    """`flow`: (tokens, the voice's prompt tokens / mel / x-vector) -> the new tokens' mel."""

    def __init__(self, sections: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        sections = sections or {}
        enc = {**ENCODER, **(sections.get("UpsampleConformerEncoder") or {})}
        flow = {**FLOW, **(sections.get("CausalMaskedDiffWithXvec") or {})}
        self.input_embedding = nn.Embedding(int(flow["vocab_size"]), int(flow["input_size"]))
        self.spk_embed_affine_layer = nn.Linear(int(flow["spk_embed_dim"]), int(flow["output_size"]))
        self.encoder = _Encoder(enc)
        self.encoder_proj = nn.Linear(int(enc["output_size"]), int(flow["output_size"]))
        self.decoder = _Decoder({**DECODER, **(sections.get("ConditionalDecoder") or {})})

    def forward(self, tokens: torch.Tensor, prompt_tokens: torch.Tensor, prompt_feat: torch.Tensor,
                xvector: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """tokens [1, n], prompt_tokens [1, p], prompt_feat [1, 2p, 80], xvector [1, 192]
        -> mel [1, 80, 2n]."""
        spks = self.spk_embed_affine_layer(F.normalize(xvector, dim=1))
        h = self.encoder(self.input_embedding(torch.cat([prompt_tokens, tokens], dim=1).long()))
        p = prompt_feat.shape[1]
        mu = self.encoder_proj(h).transpose(1, 2).contiguous()
        cond = torch.zeros_like(mu)
        cond[:, :, :p] = prompt_feat.transpose(1, 2)
        z = torch.randn(mu.shape, generator=gen, dtype=mu.dtype).to(mu.device)
        return self._euler(z, mu, spks, cond)[:, :, p:]

    def _euler(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """`solve_euler`: conditional and unconditional rows as one batch, combined each step."""
        t_span = torch.linspace(0, 1, STEPS + 1, device=mu.device, dtype=mu.dtype)
        t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        zeros = torch.zeros_like(mu)
        mu_in, spks_in = torch.cat([mu, zeros]), torch.cat([spks, torch.zeros_like(spks)])
        estimator = self.decoder.estimator
        const = estimator.constants(mu_in, spks_in, torch.cat([cond, zeros]))
        for t, r in itertools.pairwise(t_span):
            x_in, t_in = torch.cat([x, x]), t.unsqueeze(0).expand(2)
            dxdt = estimator.step(x_in, t_in, const)
            dxdt, uncond = torch.split(dxdt, [1, 1], dim=0)
            x = x + (r - t) * ((1.0 + CFG_RATE) * dxdt - CFG_RATE * uncond)
        return x
