"""RMSNorm as Hugging Face's Llama-family models compute it, on the C kernel where built.

Its own module so the C decode stack (modeling/cpu_stack.py) can tell a model's norm is
this one, whose C kernel it calls itself, without importing the model that imports it."""

from __future__ import annotations

import torch
from torch import nn

from services.gpu_worker.layers import fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fused.rms_norm(x, self.weight, self.eps)  # the C kernel on the CPU, where built
        if out is not None:
            return out
        # HF's Qwen2RMSNorm op for op (bitwise), with the temporaries updated in place
        # (fewer allocations); `.float()` is no copy for float32 input.
        h = x.float()
        var = h.pow(2).mean(-1, keepdim=True)
        y = (h * var.add_(self.eps).rsqrt_()).to(x.dtype)  # fresh either way
        return y.mul_(self.weight) if y.dtype == self.weight.dtype else y * self.weight
