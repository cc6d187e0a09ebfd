"""GGUF weights kept quantized and computed on as such (kernels/qgemm.c, llama.cpp's method).

At load each quantized GGUF matrix is repacked into one of the kernel's two forms (see
qgemm.c), every scale a float32 made by the same float32 operations `gguf.quants.dequantize`
does, so `QuantLinear.weight` (the form expanded) equals gguf's dequantization bit for bit
(tests/unit/test_quant.py checks each type):

| GGUF type | form | weight | bytes per weight |
|---|---|---|---|
| Q4_0 | 4 | d * q + (-8 d) | 0.75 |
| Q4_1 | 4 | d * q + m | 0.75 |
| Q4_K | 4 | (d * sc) * q - dmin * mn, per 32-group | 0.75 |
| Q5_0 | 8 | d * (q - 16) | 1.25 |
| Q5_1 | 8 | d * q + m | 1.375 |
| Q5_K | 8 | (d * sc) * q - dmin * mn | 1.375 |
| Q6_K | 8 | (d * sc) * (q - 32), per 16-group | 1.25 |
| Q8_0 | 8 | d * q | 1.25 |

The GEMM rounds the activations per block of 32 to two signed bytes, x ~ d * (q1 + q2 / 256)
with d = amax / 127 (about 15 bits; llama.cpp keeps q1 alone, and with it alone SmolLM2's
greedy answers drift from the float32 path's): that rounding is the one approximation.
Other types (Q2_K, Q3_K, the IQ types) are dequantized to float32 at load, as
`--dtype float32` does for every type. Where the kernel is not built
(no compiler, no AVX-512 VNNI) `available()` is False and the loader dequantizes too.
"""

from __future__ import annotations

import os
import time

import gguf
import numpy as np
import torch
from torch import nn

from services.gpu_worker import cpu_kernels

FORM4 = ("Q4_0", "Q4_1", "Q4_K")
FORM8 = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
KEPT_TYPES = frozenset(FORM4 + FORM8)

_threads = max(1, int(os.environ.get("MSTAR_COMPUTE_THREADS", "1")))


def available() -> bool:
    lib = cpu_kernels.library()
    return lib is not None and bool(lib.mstar_qgemm_available())


def set_threads(n: int) -> None:
    """Threads each quantized GEMM splits its output columns over."""
    global _threads
    _threads = max(1, int(n))


def threads() -> int:
    return _threads


def tune_threads(model: nn.Module, most: int | None = None) -> int:
    """Pick the threads the quantized GEMMs split over by measurement (MSTAR_COMPUTE_THREADS,
    if set, wins): each distinct `QuantLinear` shape under `model` at a decode step's row
    counts (1 and 16), best of three passes, per candidate count 1..`most` (default: every
    core); more threads must be 10% faster to be chosen. Sets and returns the count."""
    if os.environ.get("MSTAR_COMPUTE_THREADS"):
        set_threads(int(os.environ["MSTAR_COMPUTE_THREADS"]))
        return _threads
    shapes: dict[tuple[int, int, int], QuantLinear] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            shapes.setdefault((m.form, m.in_features, m.out_features), m)
    most = most or os.cpu_count() or 1
    if not shapes or most < 2:
        set_threads(1)
        return 1
    xs = {k: torch.randn(16, k) for k in {m.in_features for m in shapes.values()}}
    best, best_s = 1, float("inf")
    with torch.inference_mode():
        for n in range(1, most + 1):
            set_threads(n)
            passes = []
            for _ in range(3):
                t0 = time.perf_counter()
                for layer in shapes.values():
                    layer(xs[layer.in_features][:1])
                    layer(xs[layer.in_features])
                passes.append(time.perf_counter() - t0)
            if min(passes) < 0.9 * best_s:
                best, best_s = n, min(passes)
    set_threads(best)
    return best


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per-32-group scale d * sc and offset -(dmin * mn), [blocks, 8]."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _nibbles(qs: np.ndarray, halves: int) -> np.ndarray:
    """Bytes [blocks, B] in `halves` runs: each run's low nibbles are its first values, its high ones the next."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, qs.shape[1] // halves) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5_0 / Q5_1: bit j of the block's 32-bit word is element j's fifth bit."""
    bits = qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(count, dtype=np.uint32).reshape(1, count)
    return ((bits & 1).astype(np.uint8)) << np.uint8(4)


def split_blocks(qtype: str, raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks -> (q [rows, K] integers, scale per 32 (form 4) or per 16 (form 8),
    offset per 32 or None), each scale and offset as gguf's dequantization computes it."""
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    b = np.ascontiguousarray(raw).reshape(-1, size)
    if qtype in ("Q4_0", "Q4_1"):
        d = _f16(b[:, 0:2])
        m = -8 * d if qtype == "Q4_0" else _f16(b[:, 2:4])
        q = _nibbles(b[:, 2 if qtype == "Q4_0" else 4:], 1)
    elif qtype == "Q4_K":
        d, m = _k_scales(b)
        q = _nibbles(b[:, 16:], 4)
    elif qtype == "Q8_0":
        d, m = np.repeat(_f16(b[:, 0:2]), 2, axis=1), None
        q = b[:, 2:].copy().view(np.int8)
    elif qtype in ("Q5_0", "Q5_1"):
        off = 2 if qtype == "Q5_0" else 4
        q = _nibbles(b[:, off + 4:], 1) | _high_bits(b[:, off:off + 4], 32)
        d = np.repeat(_f16(b[:, 0:2]), 2, axis=1)
        m = None if qtype == "Q5_0" else _f16(b[:, 2:4])
        q = (q.astype(np.int8) - np.int8(16)) if qtype == "Q5_0" else q.astype(np.int8)
    elif qtype == "Q5_K":
        d32, m = _k_scales(b)
        d = np.repeat(d32, 2, axis=1)
        qh = b[:, 16:48].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = (_nibbles(b[:, 48:], 4) | ((qh & 1).reshape(b.shape[0], -1) << np.uint8(4))).astype(np.int8)
    elif qtype == "Q6_K":
        d, m = _f16(b[:, 208:210]) * b[:, 192:208].copy().view(np.int8).astype(np.float32), None
        ql = _nibbles(b[:, :128], 2)  # per 128 values: bytes 0-63 low nibbles, then their high ones
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = ((ql.reshape(-1, 8, 32) | ((qh & 3).reshape(-1, 8, 32) << np.uint8(4))).astype(np.int8) - np.int8(32))
    else:
        raise NotImplementedError(f"GGUF type {qtype} is not kept quantized")
    return q.reshape(rows, -1), d.reshape(rows, -1).astype(np.float32), None if m is None else m.reshape(rows, -1)


def _padded(a: np.ndarray, width: int) -> np.ndarray:
    return a if a.shape[1] == width else np.pad(a, ((0, 0), (0, width - a.shape[1])))


def repack(qtype: str, raw: np.ndarray,
           shape: tuple[int, int]) -> tuple[int, np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks -> (form, w, d, m) in qgemm.c's layout: k padded to a multiple of 64
    with zero blocks; form 4: w [N, kb * 16] bytes (byte j of a block = q[j] | q[j + 16] << 4),
    d and m [N, kb]; form 8: w [N, kp] and d [N, 2 kb] in block-pair order, m [N, kb] or None."""
    n, k = shape
    q, d, m = split_blocks(qtype, raw, n)
    kp = -(-k // 64) * 64
    kb = kp // 32
    q = _padded(q, kp)
    if m is not None:
        m = _padded(m, kb)
    if qtype in FORM4:
        blocks = q.astype(np.uint8).reshape(n, kb, 2, 16)
        return 4, (blocks[:, :, 0] | (blocks[:, :, 1] << np.uint8(4))).reshape(n, -1), _padded(d, kb), m
    if (q == -128).any():  # the kernel cannot take it (qgemm.c); ggml's quantizers never write it
        raise ValueError(f"{qtype} tensor holds -128")
    # [pair, block, half, 16] -> [pair, half, block, 16]; scales [pair, block, half] -> [pair, half, block]
    w = q.reshape(n, kb // 2, 2, 2, 16).transpose(0, 1, 3, 2, 4).reshape(n, kp)
    d = _padded(d, 2 * kb).reshape(n, kb // 2, 2, 2).transpose(0, 1, 3, 2).reshape(n, 2 * kb)
    return 8, w, d, m


class QuantLinear(nn.Module):
    """A linear layer on a repacked GGUF weight (no bias unless given). `weight` expands a
    float32 copy (for tests and inspection), equal to gguf's dequantization."""

    def __init__(self, form: int, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 in_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.form, self.in_features, self.out_features = form, in_features, w.shape[0]
        self.w, self.d, self.m, self.bias = w, d, m, bias
        self.kp = -(-in_features // 64) * 64

    @classmethod
    def from_gguf(cls, qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantLinear:
        form, w, d, m = repack(qtype, raw, shape)
        t = (lambda a: torch.from_numpy(np.ascontiguousarray(a)))  # noqa: E731
        return cls(form, t(w), t(d.astype(np.float32)), None if m is None else t(m.astype(np.float32)), shape[1])

    @staticmethod
    def concat(parts: list[QuantLinear]) -> QuantLinear | None:
        """One layer whose outputs are the parts' side by side, or None (different forms)."""
        first = parts[0]
        if any(p.form != first.form or (p.m is None) != (first.m is None) for p in parts):
            return None
        cat = (lambda ts: torch.cat(ts, dim=0))  # noqa: E731
        bias = None if first.bias is None else cat([p.bias for p in parts])
        return QuantLinear(first.form, cat([p.w for p in parts]), cat([p.d for p in parts]),
                           None if first.m is None else cat([p.m for p in parts]), first.in_features, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in float32 (an embedding lookup), as gguf dequantizes them."""
        w, d = self.w[ids], self.d[ids]
        lead, pairs = w.shape[:-1], self.kp // 64
        if self.form == 4:
            w = w.view(*lead, 2 * pairs, 16)
            q = torch.stack((w & 15, w >> 4), dim=-2).view(*lead, 2 * pairs, 32).float()
            out = d.unsqueeze(-1) * q + self.m[ids].unsqueeze(-1)
        else:  # undo the pair order: [pair, half, block, 16] -> [pair, block, half, 16]
            q = w.view(*lead, pairs, 2, 2, 16).transpose(-3, -2).reshape(*lead, 4 * pairs, 16).float()
            d = d.view(*lead, pairs, 2, 2).transpose(-2, -1).reshape(*lead, 4 * pairs, 1)
            out = d * q
            if self.m is not None:
                out = out.view(*lead, 2 * pairs, 32) + self.m[ids].unsqueeze(-1)
        return out.reshape(*lead, self.kp)[..., : self.in_features]

    @property
    def weight(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows = x2.shape[0]
        out = torch.empty(rows, n)
        if rows:
            ptrs = self._ptrs
            if ptrs is None:  # the weight's pointers, once (its tensors never move)
                ptrs = self._ptrs = (self.w.data_ptr(), self.d.data_ptr(),
                                     None if self.m is None else self.m.data_ptr(),
                                     None if self.bias is None else self.bias.data_ptr())
            lib = cpu_kernels.library()
            rc = lib.mstar_qlinear(self.form, x2.data_ptr(), rows, k, x2.stride(0), ptrs[0], ptrs[1], ptrs[2], n,
                                   ptrs[3], out.data_ptr(), n, _threads, _scratch(lib, rows, k))
            if rc:
                raise RuntimeError(f"mstar_qlinear refused form {self.form}, {rows} x {k} x {n}")
        return out.view(*x.shape[:-1], n).to(x.dtype)

    #: (w, d, m, bias) data pointers, set at the first call
    _ptrs: tuple | None = None


_scratch_buf = torch.empty(0, dtype=torch.uint8)


def _scratch(lib, rows: int, k: int) -> int:
    """A buffer for x's rounded copy (qgemm.c), grown as needed and reused by every call."""
    global _scratch_buf
    need = int(lib.mstar_qlinear_scratch(rows, k))
    if _scratch_buf.numel() < need:
        _scratch_buf = torch.empty(max(need, 2 * _scratch_buf.numel()), dtype=torch.uint8)
    return _scratch_buf.data_ptr()


class QuantEmbedding(nn.Module):
    """An embedding whose table stays quantized (a tied model's LM head computes on it)."""

    def __init__(self, table: QuantLinear) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)
