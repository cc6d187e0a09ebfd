"""The decoder's elementwise chains through the C kernels (kernels/elementwise.c) on the CPU.

Each function returns None where the kernel does not apply (no kernel built, not float32
on the CPU, a layout it does not take) and the caller runs its torch ops instead, so
results never depend on whether a compiler was there beyond float rounding.
"""

from __future__ import annotations

import torch

from services.gpu_worker import cpu_kernels


def available() -> bool:
    """The C kernels are built (CPU float32 tensors then take them)."""
    return cpu_kernels.library() is not None


def _lib(*tensors: torch.Tensor):
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    return cpu_kernels.library()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, into a fresh tensor."""
    lib = _lib(x, weight)
    if lib is None or not x.is_contiguous() or not weight.is_contiguous():
        return None
    dim = x.shape[-1]
    out = torch.empty_like(x)
    lib.mstar_rms_norm(x.data_ptr(), dim, weight.data_ptr(), eps, out.data_ptr(), x.numel() // dim, dim)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor | None:
    """Rotate x [T, heads, D] in place (rows may be strided, each row's heads contiguous)
    with per-row tables [T, 1, D] and return it; None (x untouched) where the kernel does not apply."""
    lib = _lib(x, cos, sin_signed)
    d = x.shape[-1]
    if (lib is None or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != d or d % 2
            or not cos.is_contiguous() or not sin_signed.is_contiguous() or cos.shape[0] != x.shape[0]):
        return None
    lib.mstar_rope(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], d, cos.data_ptr(), sin_signed.data_ptr(), d)
    return x


def head_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of each head of x [T, heads, D] in place (rows may be strided, each row's heads
    contiguous: the q/k/v GEMM's output), with weight [D]; None (x untouched) where the kernel
    does not apply."""
    lib = _lib(x, weight)
    d = x.shape[-1]
    if (lib is None or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != d or not weight.is_contiguous()
            or weight.numel() != d):
        return None
    lib.mstar_head_norm(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], d, weight.data_ptr(), eps)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up = [gate | up] along the last dim, into a fresh tensor."""
    return _act_mul(gate_up, "mstar_silu_mul")


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gelu_tanh(gate) * up (Gemma's MLP) for gate_up = [gate | up], into a fresh tensor."""
    return _act_mul(gate_up, "mstar_gelu_mul")


def _act_mul(gate_up: torch.Tensor, kernel: str) -> torch.Tensor | None:
    lib = _lib(gate_up)
    if lib is None or gate_up.dim() != 2 or not gate_up.is_contiguous():
        return None
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter)
    getattr(lib, kernel)(gate_up.data_ptr(), gate_up.shape[1], inter, out.data_ptr(), gate_up.shape[0])
    return out
