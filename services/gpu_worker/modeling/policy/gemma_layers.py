"""Gemma's decoder layer as the Pi0 family uses it, in plain torch: (1 + w) RMS norms in
float32, rotate-half RoPE, grouped-query attention, a tanh-GELU gated MLP. Module names
follow transformers' (`self_attn.q_proj`, `mlp.gate_proj`, ...), so a checkpoint's layers
load by name. The attention itself is the caller's (paged for the prefix, dense over the
prefix's gathered K/V for the action expert): a layer exposes its steps, not one forward."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class GemmaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(hidden, int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]),
                                        int(cfg["head_dim"]))
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(hidden, int(cfg["intermediate_size"]))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., T, hidden] -> q [..., T, heads, D], k and v [..., T, kv_heads, D], RoPE applied."""
        return project_qkv(self.self_attn, self.input_layernorm(x), cos, sin)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual after attention (`attn`: [..., T, heads * D]), then the MLP's."""
        x = x + self.self_attn.o_proj(attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def project_qkv(a: GemmaAttention, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normed rows [..., T, hidden] -> their q, k (RoPE applied) and v."""
    lead = h.shape[:-1]
    q = a.q_proj(h).view(*lead, a.heads, a.head_dim)
    k = a.k_proj(h).view(*lead, a.kv_heads, a.head_dim)
    v = a.v_proj(h).view(*lead, a.kv_heads, a.head_dim)
    return rope(q, cos, sin), rope(k, cos, sin), v


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., T, 1, D] of `positions` [..., T], in float32 as transformers' default RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[..., None, :], emb.sin()[..., None, :]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


def rope_theta(cfg: Mapping[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
