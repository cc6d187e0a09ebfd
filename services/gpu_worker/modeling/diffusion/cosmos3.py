"""Cosmos 3's transformer (`Cosmos3OmniTransformer`, diffusers), split where the engine
needs it, and its VAE's decoder (wan_vae.py: diffusers' `AutoencoderKLWan.decode`; it holds
no KV and runs once per request, as a codec does).

Every layer is a mixture of two transformers over one sequence: the text rows (the
"understanding" pathway: its own projections, norms and MLP, causal attention over the text
alone) and the latents' rows (the "generation" pathway: its own weights, attending to the
text's keys and values and to its own, bidirectionally). The text pathway never reads the
latents, so its K/V are the same at every denoising step: `text_kv` computes them once per
prompt (the last layer's attention and MLP are skipped: only its K/V are read), and
`velocity` runs only the latents' rows of every request of a step together, each row set
reading its own prompt's K/V. Where the reference recomputes the text pathway in every
step and branch, this computes it once per request.

The parameter names are the diffusers module's (`transformer.layers.0.self_attn.to_q...`,
`vae.decoder...`), so the folder's safetensors load as saved. The math follows the module:
RMSNorm over float32 variances, Qwen3-VL's interleaved 3-axis M-RoPE (rotate-half), the
timestep's sinusoid (flip to cos, 256 channels) through a two-layer SiLU MLP, scaled by
`timestep_scale`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.modeling.base import DiffusionModel
from services.gpu_worker.modeling.diffusion.wan_vae import WanVAEDecoder

#: (cos, sin) [rows, head_dim] of a row set's positions
Rope = tuple[torch.Tensor, torch.Tensor]
#: one layer's text K (rotated, as the latents' rows read it) and V [rows, kv heads, head_dim]
LayerKV = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    """diffusers' `RMSNorm` (elementwise affine, no bias): variance in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """`Cosmos3PackedMoTAttention`: the text pathway's projections (to_q...) and the latents'
    (add_q_proj...), per-head RMSNorms on q and k."""

    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, d = int(c["hidden_size"]), int(c["head_dim"])
        self.heads, self.kv_heads, self.head_dim = int(c["num_attention_heads"]), int(c["num_key_value_heads"]), d
        bias, eps = bool(c.get("attention_bias", False)), float(c.get("rms_norm_eps", 1e-6))
        q, kv = self.heads * d, self.kv_heads * d
        self.to_q, self.to_k = nn.Linear(hidden, q, bias), nn.Linear(hidden, kv, bias)
        self.to_v = nn.Linear(hidden, kv, bias)
        self.to_out = nn.Linear(q, hidden, bias)
        self.add_q_proj, self.add_k_proj = nn.Linear(hidden, q, bias), nn.Linear(hidden, kv, bias)
        self.add_v_proj, self.to_add_out = nn.Linear(hidden, kv, bias), nn.Linear(q, hidden, bias)
        text_norm = bool(c.get("qk_norm_for_text", True))
        self.norm_q: nn.Module = RMSNorm(d, eps) if text_norm else nn.Identity()
        self.norm_k: nn.Module = RMSNorm(d, eps) if text_norm else nn.Identity()
        self.k_norm_und_for_gen = (RMSNorm(d, eps) if c.get("use_und_k_norm_for_gen") and not text_norm else None)
        self.norm_added_q, self.norm_added_k = RMSNorm(d, eps), RMSNorm(d, eps)

    def text(self, x: torch.Tensor, rope: Rope, need_out: bool) -> tuple[torch.Tensor | None, LayerKV]:
        """The text rows' causal attention output (None where not needed) and the K/V the
        latents' rows read (K through `k_norm_und_for_gen` where the model has one)."""
        n = x.shape[0]
        k = self.norm_k(self.to_k(x).view(n, self.kv_heads, self.head_dim))
        v = self.to_v(x).view(n, self.kv_heads, self.head_dim)
        k_gen = self.k_norm_und_for_gen(k) if self.k_norm_und_for_gen is not None else k
        kv = (apply_rope(k_gen, rope), v)
        if not need_out:
            return None, kv
        q = apply_rope(self.norm_q(self.to_q(x).view(n, self.heads, self.head_dim)), rope)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], apply_rope(k, rope).transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        return self.to_out(out[0].transpose(0, 1).flatten(-2)), kv

    def gen(self, x: torch.Tensor, ropes: list[Rope], sets: list[tuple[int, int]], text: list[LayerKV]
            ) -> torch.Tensor:
        """The latents' rows of every row set (`sets`: (first row, rows) in x), each attending
        to its text's K/V and to its own rows."""
        n = x.shape[0]
        q = self.norm_added_q(self.add_q_proj(x).view(n, self.heads, self.head_dim))
        k = self.norm_added_k(self.add_k_proj(x).view(n, self.kv_heads, self.head_dim))
        v = self.add_v_proj(x).view(n, self.kv_heads, self.head_dim)
        outs = []
        for (first, rows), rope, (tk, tv) in zip(sets, ropes, text):
            qs = apply_rope(q[first:first + rows], rope)
            ks = torch.cat([tk, apply_rope(k[first:first + rows], rope)])
            vs = torch.cat([tv, v[first:first + rows]])
            o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                               vs.transpose(0, 1)[None], enable_gqa=True)
            outs.append(o[0].transpose(0, 1).flatten(-2))
        return self.to_add_out(torch.cat(outs))


class Layer(nn.Module):
    """`Cosmos3VLTextMoTDecoderLayer`: pre-norm attention and MLP, a copy of each per pathway."""

    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, inter, eps = int(c["hidden_size"]), int(c["intermediate_size"]), float(c.get("rms_norm_eps", 1e-6))
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Cosmos 3 transformer: hidden_act {c.get('hidden_act')!r} is not served (silu is)")
        self.self_attn = Attention(c)
        self.mlp, self.mlp_moe_gen = MLP(hidden, inter), MLP(hidden, inter)
        self.input_layernorm, self.input_layernorm_moe_gen = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm_moe_gen = RMSNorm(hidden, eps)

    def text(self, x: torch.Tensor, rope: Rope, last: bool) -> tuple[torch.Tensor, LayerKV]:
        out, kv = self.self_attn.text(self.input_layernorm(x), rope, not last)
        if out is None:
            return x, kv
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), kv

    def gen(self, x: torch.Tensor, ropes: list[Rope], sets: list[tuple[int, int]], text: list[LayerKV]
            ) -> torch.Tensor:
        x = x + self.self_attn.gen(self.input_layernorm_moe_gen(x), ropes, sets, text)
        return x + self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(x))


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(256, dim), nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """`Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)` then the MLP."""
        half = 128
        exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half
        emb = t[:, None].float() * torch.exp(exponent)[None, :]
        emb = torch.cat([torch.cos(emb), torch.sin(emb)], dim=-1)
        return self.linear_2(F.silu(self.linear_1(emb.to(self.linear_1.weight.dtype))))


class Cosmos3Transformer(nn.Module):
    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        hidden = int(c["hidden_size"])
        self.config = dict(c)
        self.embed_tokens = nn.Embedding(int(c["vocab_size"]), hidden)
        self.layers = nn.ModuleList([Layer(c) for _ in range(int(c["num_hidden_layers"]))])
        self.norm_moe_gen = RMSNorm(hidden, float(c.get("rms_norm_eps", 1e-6)))
        self.proj_in = nn.Linear(int(c["patch_latent_dim"]), hidden)
        self.proj_out = nn.Linear(hidden, int(c["patch_latent_dim"]))
        self.time_embedder = TimestepEmbedding(hidden)
        axes = c.get("rope_axes_dim") or ((c.get("rope_scaling") or {}).get("mrope_section") or [24, 20, 20])
        self.rope_axes = [int(a) for a in axes]
        d = int(c["head_dim"])
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", torch.empty(d // 2), persistent=False)
        self.theta = float(c.get("rope_theta", 5000000.0))

    def reset_inv_freq(self) -> None:
        d = self.inv_freq.shape[0] * 2
        self.inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """`Cosmos3VLTextRotaryEmbedding` of positions [3, rows] (t, h, w): float32 angles,
        the h and w axes interleaved into the t axis's frequencies."""
        freqs = positions.float()[:, :, None] * self.inv_freq.float().to(positions.device)[None, None, :]
        out = freqs[0].clone()
        for axis, offset in ((1, 1), (2, 2)):
            idx = slice(offset, self.rope_axes[axis] * 3, 3)
            out[..., idx] = freqs[axis, ..., idx]
        emb = torch.cat((out, out), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def text_kv(self, ids: torch.Tensor, rope: Rope) -> list[LayerKV]:
        """Every layer's K/V of one prompt's rows (causal among themselves)."""
        x = self.embed_tokens(ids)
        out = []
        for i, layer in enumerate(cast(list[Layer], self.layers)):
            x, kv = layer.text(x, rope, i == len(self.layers) - 1)
            out.append(kv)
        return out

    def velocity(self, tokens: torch.Tensor, t: torch.Tensor, ropes: list[Rope], sets: list[tuple[int, int]],
                 text: list[list[LayerKV]]) -> torch.Tensor:
        """The predicted velocity [rows, patch dim] of the latents' patch rows `tokens` of every
        row set, `t` each row's timestep (the scheduler's, before `timestep_scale`); `text[s]`
        row set s's K/V per layer."""
        x = self.proj_in(tokens)
        x = x + self.time_embedder(t * float(self.config.get("timestep_scale", 0.001))).to(x.dtype)
        for i, layer in enumerate(cast(list[Layer], self.layers)):
            x = layer.gen(x, ropes, sets, [kv[i] for kv in text])
        return self.proj_out(self.norm_moe_gen(x))


class Cosmos3(DiffusionModel):
    """The pipeline's transformer and VAE under their folders' names."""

    components: ClassVar[tuple[str, ...]] = ("transformer", "vae")
    #: the text pathway's final norm and LM head (text out), the sound and action heads: never read here
    skip_prefixes: ClassVar[tuple[str, ...]] = ("transformer.lm_head.", "transformer.norm.", "transformer.audio_",
                                                "transformer.action_", "vae.encoder.", "vae.quant_conv.")

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.transformer = Cosmos3Transformer(config["transformer"])
        vae_cfg = config["vae"]
        self.vae = WanVAEDecoder(vae_cfg)
        self.latents_mean = [float(m) for m in vae_cfg.get("latents_mean", [])]
        self.latents_std = [float(s) for s in vae_cfg.get("latents_std", [])]

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = {k: v for k, v in state.items() if not k.startswith(self.skip_prefixes)}
        missing, unexpected = self.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"Cosmos 3 checkpoint: missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")

    def reset_buffers(self) -> None:
        self.transformer.reset_inv_freq()

    def text_kv(self, ids: torch.Tensor, positions: torch.Tensor) -> list[LayerKV]:
        return self.transformer.text_kv(ids, self.transformer.rope(positions, self.dtype_()))

    def rope(self, positions: torch.Tensor) -> Rope:
        return self.transformer.rope(positions, self.dtype_())

    def velocity(self, tokens: torch.Tensor, t: torch.Tensor, ropes: list[Rope], sets: list[tuple[int, int]],
                 text: list[list[LayerKV]]) -> torch.Tensor:
        return self.transformer.velocity(tokens.to(self.dtype_()), t, ropes, sets, text)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents [1, C, T, h, w] -> frames [F, H, W, 3] in [0, 1] (float32), as
        the pipeline's step 8 and `VideoProcessor.postprocess_video(output_type="np")`."""
        dtype = next(self.vae.parameters()).dtype
        mean = torch.tensor(self.latents_mean, dtype=dtype, device=latents.device).view(1, -1, 1, 1, 1)
        inv_std = (1.0 / torch.tensor(self.latents_std, dtype=dtype)).to(latents.device).view(1, -1, 1, 1, 1)
        z = latents.to(dtype) / inv_std + mean
        video = self.vae(z).to(latents.dtype)
        return (video[0].permute(1, 0, 2, 3) * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float()

    def dtype_(self) -> torch.dtype:
        return self.transformer.proj_in.weight.dtype
