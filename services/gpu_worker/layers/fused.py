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


def rope_partial_(xs: tuple[torch.Tensor, ...], cos: torch.Tensor, sin_signed: torch.Tensor, rot: int) -> bool:
    """Rotate the first `rot` values of each head of every x [T, heads, D] in xs in place
    (Qwen3.5's partial RoPE; rows may be strided, each row's heads contiguous) with per-row
    tables [T, 1, rot]; False (nothing touched) where the kernel does not take them all. The
    decode stack (kernels/decode_stack.c) calls the same kernel, so the two agree bitwise."""
    lib = _lib(*xs, cos, sin_signed)
    if (lib is None or rot % 2 or not cos.is_contiguous() or not sin_signed.is_contiguous()
            or cos.shape[-1] != rot or any(x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]
                                           or x.shape[2] < rot or cos.shape[0] != x.shape[0] for x in xs)):
        return False
    for x in xs:
        lib.mstar_rope_partial(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2], rot, cos.data_ptr(),
                               sin_signed.data_ptr(), rot)
    return True


def sigmoid_gate_(o: torch.Tensor, qg: torch.Tensor, heads: int, d: int) -> torch.Tensor | None:
    """o [T, heads * d] (contiguous) times sigmoid(gate) in place, the gate of head h the
    second half of qg's [T, heads, 2 d] (q_proj's output: q and gate per head, rows may be
    strided); None (o untouched) where the kernel does not apply."""
    lib = _lib(o, qg)
    if (lib is None or not o.is_contiguous() or o.shape != (qg.shape[0], heads * d) or qg.dim() != 2
            or qg.stride(1) != 1 or qg.shape[1] < 2 * heads * d):
        return None
    lib.mstar_sigmoid_gate(o.data_ptr(), o.shape[0], heads, d, qg.data_ptr() + 4 * d, qg.stride(0), 2 * d)
    return o


def gdn_gates(b: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
              neg_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Gated DeltaNet's (beta, g) [T, heads] from b and a [T, heads] (rows may be strided
    alike): sigmoid(b) and neg_a * softplus(a + dt_bias), by the kernel the decode stack
    calls; None where it does not apply."""
    lib = _lib(b, a, dt_bias, neg_a)
    t, heads = b.shape
    if (lib is None or a.shape != b.shape or b.stride(1) != 1 or a.stride(1) != 1 or a.stride(0) != b.stride(0)
            or not dt_bias.is_contiguous() or not neg_a.is_contiguous() or dt_bias.numel() != heads
            or neg_a.numel() != heads):
        return None
    beta, g = torch.empty(t, heads), torch.empty(t, heads)
    lib.mstar_gdn_gates(b.data_ptr(), a.data_ptr(), b.stride(0), t, heads, dt_bias.data_ptr(), neg_a.data_ptr(),
                        beta.data_ptr(), g.data_ptr())
    return beta, g
