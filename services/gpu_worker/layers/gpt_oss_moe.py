"""gpt-oss's mixture-of-experts block: transformers' `GptOssMLP` (router + `GptOssExperts`).

It differs from Qwen3-MoE's block (layers/moe.py `SparseMoE`; both are `ExpertMixture`s,
whose grouping by expert and weighted sum in ascending expert order they share) in three
ways, each as transformers computes it:

- the router is a linear layer with a bias, and the softmax is over the top-k logits only
  (`torch.topk` of the logits, then softmax of those k);
- the experts' two projections have biases, and their weights are stored transposed and
  fused: `gate_up_proj` [E, hidden, 2 x inter] whose columns interleave gate and up
  (gate = [..., ::2], up = [..., 1::2]), `down_proj` [E, inter, hidden];
- the activation is the clamped SwiGLU: gate clamped to at most `limit`, up to [-limit,
  limit], then (up + 1) * gate * sigmoid(alpha * gate).

On torch's path the expert is `x @ W + b` on the checkpoint's layout, bit for bit
transformers' eager experts. On the CPU's C GEMM (`pack`) each expert's weights are packed
once with gate columns first and up columns after (the same values, so the same activation,
read as two contiguous halves), the biases go in the GEMM's epilogue and the activation is a C
kernel's, row by row (kernels/elementwise.c `mstar_clamped_swiglu`): every row's bits are then
the same whatever rows share its step (shared/DESIGN.md's batch invariance).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, cast

import torch
from torch import nn

from services.gpu_worker import cpu_kernels
from services.gpu_worker.layers.linear import kernel_available, kernel_linear, kernel_pack, kernel_packed_size
from services.gpu_worker.layers.moe import TOPK_SOFTMAX, ExpertMixture, kernel_route
from shared.model_config import ModelConfig


class GptOssExperts(nn.Module):
    """The experts' weights and biases under transformers' names and layout."""

    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)


class GptOssExpertBiases(nn.Module):
    """The experts' biases alone, under transformers' names: what stays of `GptOssExperts`
    where a GGUF file's experts are kept in their blocks (`GptOssMoE.keep_quantized`)."""

    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`GptOssExperts._apply_gate` op for op, on gate and up already apart."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@functools.cache
def _swiglu_function(lib: ctypes.CDLL) -> Any | None:
    """`mstar_clamped_swiglu` (kernels/elementwise.c) with its argument types declared; None
    where an older build lacks it."""
    try:
        fn = lib.mstar_clamped_swiglu
    except AttributeError:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.restype = None
    fn.argtypes = [ptr, i64, i64, ctypes.c_float, ctypes.c_float, ptr, i64]
    return fn


def kernel_clamped_swiglu(gate_up: torch.Tensor, inter: int, alpha: float, limit: float) -> torch.Tensor | None:
    """`clamped_swiglu` of a [rows, gate | up] float32 CPU tensor by the C kernel, each row's
    bits its own (torch's sigmoid gives an element other bits in a tensor's vectorized body
    than in its tail, so a row's result would depend on the row count); None without it."""
    lib = cpu_kernels.library()
    fn = None if lib is None else _swiglu_function(lib)
    if fn is None or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.stride(1) != 1:
        return None
    out = torch.empty(gate_up.shape[0], inter)
    fn(gate_up.data_ptr(), gate_up.stride(0), inter, alpha, limit, out.data_ptr(), gate_up.shape[0])
    return out


class GptOssMoE(ExpertMixture):
    """`forward(x [T, hidden])` -> [T, hidden]: ExpertMixture's grouping by expert, with gpt-oss's
    router, biases and activation."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, norm_topk_prob=False)  # (its softmax is over the k logits: nothing to renormalize)
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        #: the router (HF `mlp.router.{weight,bias}`); `pack_linears` may swap it for the C GEMM
        self.router = nn.Linear(self.hidden, self.num_experts, bias=True)
        self.experts = GptOssExperts(self.num_experts, self.hidden, self.inter)
        #: the biases in the packed weights' column order (gate half, then up half), set by `pack`
        self.gate_up_bias: torch.Tensor | None = None
        self.down_bias: torch.Tensor | None = None

    def keep_quantized(self, parts: dict) -> bool:
        """ExpertMixture's (each expert's gate and up joined, gate columns first, and down, in the
        file's blocks: MXFP4 in gpt-oss's files), keeping a module for the biases, which
        `pack` then puts in the GEMMs' epilogues."""
        if not super().keep_quantized(parts):
            return False
        self.experts = GptOssExpertBiases(self.num_experts, self.hidden, self.inter)
        return True

    def pack(self) -> bool:
        """Each expert's two weights in the C GEMM's panels ([2 x inter, hidden] with the gate
        columns first, [hidden, inter]), where that kernel runs (float32 on the CPU, one torch
        thread); the checkpoint's tensors are then dropped. Returns whether it packed. Experts
        kept quantized get their biases (gate half, then up half) in their GEMMs instead."""
        if self.quant is not None:
            biases = cast("GptOssExpertBiases", self.experts)
            b = biases.gate_up_proj_bias.detach().float()
            for e in range(self.num_experts):
                self.quant.gate_up[e].bias = torch.cat((b[e, 0::2], b[e, 1::2])).contiguous()
                self.quant.down[e].bias = biases.down_proj_bias[e].detach().float().contiguous()
            return False
        ex = cast("GptOssExperts", self.experts)
        w = ex.gate_up_proj
        if w.device.type != "cpu" or w.dtype != torch.float32 or not kernel_available():
            return False
        inter, hidden = self.inter, self.hidden
        self.gate_up_packed = torch.empty(self.num_experts, kernel_packed_size(2 * inter, hidden))
        self.down_packed = torch.empty(self.num_experts, kernel_packed_size(hidden, inter))
        for e in range(self.num_experts):
            wt = w[e].t()  # [2 x inter, hidden], rows interleaved gate / up
            kernel_pack(torch.cat((wt[0::2], wt[1::2])), self.gate_up_packed[e])
            kernel_pack(ex.down_proj[e].t(), self.down_packed[e])
        b = ex.gate_up_proj_bias.detach()
        self.gate_up_bias = torch.cat((b[:, 0::2], b[:, 1::2]), dim=1).contiguous()
        self.down_bias = ex.down_proj_bias.detach().contiguous()
        del self.experts
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) as `GptOssTopKRouter`: the k largest logits
        (torch.topk's order among ties), softmax over those k in their dtype; on the C
        kernels' path (experts packed or quantized) the C routing, as the C decode stack."""
        logits = self.router(x)
        if self.gate_up_packed is not None or self.quant is not None:  # the C decode stack's routing, bit for bit
            got = kernel_route(logits, self.top_k, TOPK_SOFTMAX)
            if got is not None:
                return got[0].to(x.dtype), got[1]
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), ids

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Expert `e` on its rows `h` [n, hidden]."""
        if self.quant is not None:
            gate_up = self.quant.gate_up[e](h)
            act = kernel_clamped_swiglu(gate_up, self.inter, self.alpha, self.limit)
            if act is None:
                act = clamped_swiglu(gate_up[:, : self.inter], gate_up[:, self.inter :], self.alpha, self.limit)
            return self.quant.down[e](act)
        if self.gate_up_packed is not None and self.down_packed is not None:
            assert self.gate_up_bias is not None and self.down_bias is not None
            gate_up = kernel_linear(h, self.gate_up_packed[e], 2 * self.inter, self.gate_up_bias[e])
            act = kernel_clamped_swiglu(gate_up, self.inter, self.alpha, self.limit)
            if act is None:
                act = clamped_swiglu(gate_up[:, : self.inter], gate_up[:, self.inter :], self.alpha, self.limit)
            return kernel_linear(act, self.down_packed[e], self.hidden, self.down_bias[e])
        ex = cast("GptOssExperts", self.experts)
        gate_up = h @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
        act = clamped_swiglu(gate_up[..., ::2], gate_up[..., 1::2], self.alpha, self.limit)
        return act @ ex.down_proj[e] + ex.down_proj_bias[e]
