"""GGUF weights kept quantized and computed on as such (kernels/qgemm.c, llama.cpp's method).

At load each quantized GGUF matrix is repacked into one of the kernel's forms (see
qgemm.c), every scale made by the same float32 operations `gguf.quants.dequantize` does, so
`QuantLinear.weight` (the form expanded) equals gguf's dequantization bit for bit
(tests/unit/test_quant.py checks each type):

| GGUF type | form | weight | bytes per weight |
|---|---|---|---|
| Q4_0 | 4 | d * q + (-8 d) | 0.625 (float16 scales) |
| Q4_1 | 4 | d * q + m | 0.625 (float16) |
| Q4_K | 4 | (d * sc) * q - dmin * mn, per 32-group | 0.578 (super-block scales) |
| Q5_0 | 5 | d * q + (-16 d) | 0.75 (float16) |
| Q5_1 | 5 | d * q + m | 0.75 (float16) |
| Q5_K | 5 | (d * sc) * q - dmin * mn | 0.703 (super-block) |
| Q6_K | 6 | (d * sc) * (q - 32), per 16-group | 0.820 (super-block) |
| Q8_0 | 9 | d * q | 1.0625 (float16) |
| IQ4_NL | 16 | d * kvalues[q] | 0.5625 (float16) |
| IQ4_XS | 16 | (d * (sc - 32)) * kvalues[q], per 32-group | 0.539 (super-block) |
| MXFP4 | 17 | d * kvalues_mxfp4[q], d = 2^(e - 128) | 0.5625 (float16) |

(form 5: 5-bit values, the nibbles of form 4 and a plane of fifth bits; form 6: 6-bit values,
the nibbles and two planes, a scale per 16; form 9: signed bytes with Q8_0's one scale per
32; form 8, signed bytes with a scale per 16, is what a layer fused from parts of forms 5,
6, 8 and 9 is kept in; form 16: 4-bit
indices into IQ4_NL's 16-value table `kvalues`, a signed byte each; form 17: the same on
MXFP4's table, E2M1's values doubled, gpt-oss's experts as its files keep them. Q5_0 and Q5_1 were
signed bytes at 1.125-1.1875 bytes a weight, Q6_K too at 1.25, and Q8_0's scale was
written twice, until Gemma 3's files, whose layers are mostly Q5_0 and whose head is Q8_0,
showed it: a decode step of the 270M Q4_K_M file read 294 MB where the file holds 247.)

The GEMM rounds the activations per block of 32 to two signed bytes, x ~ d * (q1 + q2 / 256)
with d = amax / 127 (about 15 bits; llama.cpp keeps q1 alone, and with it alone SmolLM2's
greedy answers drift from the float32 path's): that rounding is the one approximation.
Prompt rows may keep q1 alone (`prompt_bytes` = 1, `--prefill-dtype int8`: llama.cpp's
rounding, half the kernel's dot products); decode rows always keep two bytes.
Scales and offsets are kept as float16 where every one is a float16 exactly (`HALF_SCALES`:
GGUF's own float16s in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), and for the k-quants and IQ4_XS,
whose scales are products d * sc (a float16 per 256 values times a 6-bit integer per group),
as the file has them (`SUPER_SCALES`: d per column and super-block, and an int8 factor per
group, multiplied in the kernel: the same float32 product). The kernel widens both
exactly, so the results are the same bits as with float32 scales, and a decode step, which
reads every weight once, reads about GGUF's bytes (0.625 a weight for Q4_1, 0.578 for Q4_K)
rather than 0.75.
Other types (Q2_K, Q3_K, the other IQ types, ...) are dequantized to float32 at load, as
`--dtype float32` does for every type. Where the kernel is not built
(no compiler, no AVX-512 VNNI) `available()` is False and the loader dequantizes too.

The layout is the kernel's: output columns in tiles of 16, one per 32-bit lane, so that a
block of 32 values is eight 64-byte vectors multiplied by x broadcast, never shuffled
(qgemm.c). The kernel's scratch (x rounded) is one buffer per process, reused: calls come
from one thread at a time (the worker's step loop), each call splitting its columns and rows
over `threads()` threads of a persistent pool (kernels/pool.c: a busy core's thread takes
fewer tasks, the calling thread the rest).
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import torch
from torch import nn

from services.gpu_worker import cpu_kernels
from services.gpu_worker.layers import prompt_rows, wide_gemm
from shared.cgroup import available_cpus

FORM4 = ("Q4_0", "Q4_1", "Q4_K")
#: 5-bit values: form 4's nibbles and a plane of their fifth bits (form 5 of qgemm.c)
FORM5 = ("Q5_0", "Q5_1", "Q5_K")
#: 6-bit values: form 4's nibbles and two planes of high bits, a scale per 16 (form 6)
FORM6 = ("Q6_K",)
#: signed bytes with a scale per 32 (form 9; form 8, a scale per 16, is what other forms
#: expand to where a layer concatenates several: `QuantLinear.in_byte_form`)
FORM9 = ("Q8_0",)
#: 4-bit indices into a 16-value table (form 16 of qgemm.c)
FORMNL = ("IQ4_NL", "IQ4_XS")
#: 4-bit indices into MXFP4's table (form 17: form 16's layout)
FORMMX = ("MXFP4",)
KEPT_TYPES = frozenset(FORM4 + FORM5 + FORM6 + FORM9 + FORMNL + FORMMX)
#: qgemm.c's codes of the 5-bit, 6-bit, one-scale byte, NL and MX forms
Q5, Q6, Q8S, NL, MX = 5, 6, 9, 16, 17
#: qgemm.c's flag on a form code: d and m are float16
HALF_SCALES = 256
#: qgemm.c's flag on a form code: d and m as the k-quants store them, a float16 per column
#: and super-block of 256 and a small integer per group (`super_scales`)
SUPER_SCALES = 512
#: the types whose scales are a float16 per 256 times a small integer per group
SUPER_TYPES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
#: the flags on a form code (how its scales are stored); `form & ~FLAGS` is the form
FLAGS = HALF_SCALES | SUPER_SCALES
#: IQ4_NL's (and IQ4_XS's) values of the 16 indices (ggml's kvalues_iq4nl)
KVALUES = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.int8)
_KVALUES_F32 = torch.from_numpy(KVALUES.astype(np.float32))
#: MXFP4's values of the 16 indices (ggml's kvalues_mxfp4: E2M1's doubled)
_MX_KVALUES_F32 = torch.tensor(gguf.quants.MXFP4.kvalues, dtype=torch.float32)

def default_threads() -> int:
    """`MSTAR_COMPUTE_THREADS` if set, else every CPU the process may use (affinity mask and
    cgroup quota, shared/cgroup.py): the pool (kernels/pool.c) degrades to the calling thread
    alone when the other cores are busy, so more threads than are free cost about nothing."""
    env = os.environ.get("MSTAR_COMPUTE_THREADS")
    return max(1, int(env)) if env else available_cpus()


_threads = default_threads()


def available() -> bool:
    lib = cpu_kernels.library()
    return lib is not None and bool(lib.mstar_qgemm_available())


def set_threads(n: int) -> None:
    """Threads each quantized GEMM splits its work over (the caller and n - 1 pool workers;
    1: the calling thread alone); starts or stops the pool's workers."""
    global _threads
    _threads = max(1, int(n))
    lib = cpu_kernels.library()
    if lib is not None:
        lib.mstar_pool_set_threads(_threads)


def threads() -> int:
    return _threads


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


def _iq4_xs_factors(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS: per-32-group factor sc - 32 of d, [blocks, 8] int8: sc's low 4 bits from
    scales_l (bytes 4-7, a nibble per group), its high 2 from scales_h (bytes 2-3, a
    little-endian u16, 2 bits per group)."""
    lo = (blocks[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(-1, 8)
    hi = blocks[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16)).reshape(1, 8)
    return ((lo & np.uint8(0x0F)) | ((hi.astype(np.uint8) & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)


def _iq4_xs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS: per-32-group scale d * (sc - 32), [blocks, 8], as gguf's dequantization makes it."""
    return _f16(blocks[:, 0:2]) * _iq4_xs_factors(blocks).astype(np.float32)


def split_blocks(qtype: str, raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks -> (q [rows, K] integers (form 16: table indices; forms 4 and 5 unsigned,
    their offset in m; form 6 unsigned, q - 32 the value), scale per 32 (forms 4, 5, 9 and
    16) or per 16 (form 6), offset per 32 or None), each scale and offset as gguf's
    dequantization computes it."""
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    b = np.ascontiguousarray(raw).reshape(-1, size)
    if qtype in ("Q4_0", "Q4_1"):
        d = _f16(b[:, 0:2])
        m = -8 * d if qtype == "Q4_0" else _f16(b[:, 2:4])
        q = _nibbles(b[:, 2 if qtype == "Q4_0" else 4:], 1)
    elif qtype == "Q4_K":
        d, m = _k_scales(b)
        q = _nibbles(b[:, 16:], 4)
    elif qtype == "IQ4_NL":
        d, m = _f16(b[:, 0:2]), None
        q = _nibbles(b[:, 2:], 1)
    elif qtype == "MXFP4":  # a byte e (the scale 2^(e - 128), as gguf halves it), 16 bytes of nibbles
        d, m = gguf.quants.MXFP4.e8m0_to_fp32_half(b[:, 0:1]), None
        q = _nibbles(b[:, 1:], 1)
    elif qtype == "IQ4_XS":
        d, m = _iq4_xs_scales(b), None
        q = _nibbles(b[:, 8:], 8)  # per 32-group: 16 bytes, low nibbles first
    elif qtype == "Q8_0":
        d, m = _f16(b[:, 0:2]), None
        q = b[:, 2:].copy().view(np.int8)
    elif qtype in ("Q5_0", "Q5_1"):
        off = 2 if qtype == "Q5_0" else 4
        q = _nibbles(b[:, off + 4:], 1) | _high_bits(b[:, off:off + 4], 32)
        d = _f16(b[:, 0:2])
        m = -16 * d if qtype == "Q5_0" else _f16(b[:, 2:4])  # d (q - 16) = d q + (-16 d), exactly
    elif qtype == "Q5_K":
        d, m = _k_scales(b)
        qh = b[:, 16:48].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = _nibbles(b[:, 48:], 4) | ((qh & 1).reshape(b.shape[0], -1) << np.uint8(4))
    elif qtype == "Q6_K":
        d, m = _f16(b[:, 208:210]) * b[:, 192:208].copy().view(np.int8).astype(np.float32), None
        ql = _nibbles(b[:, :128], 2)  # per 128 values: bytes 0-63 low nibbles, then their high ones
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = ql.reshape(-1, 8, 32) | ((qh & 3).reshape(-1, 8, 32) << np.uint8(4))  # 0..63: q - 32 the value
    else:
        raise NotImplementedError(f"GGUF type {qtype} is not kept quantized")
    return q.reshape(rows, -1), d.reshape(rows, -1).astype(np.float32), None if m is None else m.reshape(rows, -1)


def _super_parts(qtype: str, raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                                   np.ndarray | None]:
    """The k-quants' and IQ4_XS's scales as the file has them: (d [rows, super-blocks]
    float16, its integer factor per group [rows, groups] int8, and for Q4_K / Q5_K dmin and
    its factor), so that d * factor in float32 is `split_blocks`' scale (and -(dmin * factor)
    its offset), bit for bit."""
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    b = np.ascontiguousarray(raw).reshape(-1, size)
    f16 = (lambda c: np.ascontiguousarray(c).view(np.float16).reshape(rows, -1))  # noqa: E731
    i8 = (lambda a: a.astype(np.int8).reshape(rows, -1))  # noqa: E731
    if qtype in ("Q4_K", "Q5_K"):
        sc, mn = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
        return f16(b[:, 0:2]), i8(sc), f16(b[:, 2:4]), i8(mn)
    if qtype == "Q6_K":
        return f16(b[:, 208:210]), i8(b[:, 192:208].view(np.int8)), None, None
    if qtype == "IQ4_XS":
        return f16(b[:, 0:2]), i8(_iq4_xs_factors(b)), None, None
    raise NotImplementedError(f"GGUF type {qtype} has no super-block scales")


def _super_blob(base: np.ndarray, factor: np.ndarray, tiles: int) -> np.ndarray:
    """[tiles, super-blocks, 32 + groups * 16] bytes: per tile and super-block, the 16
    columns' float16 d, then each group's 16 factors (int8), the kernel's one load each."""
    nsb = base.shape[1]
    groups = factor.shape[1] // nsb
    base = _padded(base.view(np.uint16), tiles * TILE, nsb).reshape(tiles, TILE, nsb).transpose(0, 2, 1)
    fac = _padded(factor, tiles * TILE, nsb * groups).reshape(tiles, TILE, nsb, groups).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(np.concatenate(
        [np.ascontiguousarray(base).view(np.uint8).reshape(tiles, nsb, 2 * TILE),
         np.ascontiguousarray(fac).view(np.uint8).reshape(tiles, nsb, groups * TILE)], axis=2))


def _padded(a: np.ndarray, rows: int, width: int, value: int = 0) -> np.ndarray:
    if a.shape == (rows, width):
        return a
    return np.pad(a, ((0, rows - a.shape[0]), (0, width - a.shape[1])), constant_values=value)


#: output columns per tile of the kernel's layout (one 32-bit lane each, qgemm.c)
TILE = 16


def _narrowed(d: np.ndarray, m: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(d, m) as float16 when every value is one exactly (so widened back, the same bits),
    else None."""
    parts = [d] if m is None else [d, m]
    half = [p.astype(np.float16) for p in parts]
    if not all(np.array_equal(h.astype(np.float32), p) for h, p in zip(half, parts, strict=True)):
        return None
    return half[0], None if m is None else half[1]


def repack(qtype: str, raw: np.ndarray,
           shape: tuple[int, int]) -> tuple[int, np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks -> (form, w, d, m) in qgemm.c's layout (`_tiled`), d and m float16 with the
    form's HALF_SCALES flag where that is exact, or for the k-quants and IQ4_XS as the file
    keeps them (SUPER_SCALES: `_super_blob`; Q4_K's d and m in 0.078 bytes a weight where
    float32 products per 32 took 0.25, Q6_K's d in 0.070 where per 16 it took 0.25)."""
    form, w, d, m = _tiled(qtype, raw, shape)
    if qtype in SUPER_TYPES:
        tiles = -(-shape[0] // TILE)
        base, factor, mbase, mfactor = _super_parts(qtype, raw, shape[0])
        return (form | SUPER_SCALES, w, _super_blob(base, factor, tiles),
                None if mbase is None or mfactor is None else _super_blob(mbase, mfactor, tiles))
    narrow = _narrowed(d, m)
    if narrow is None:
        return form, w, d, m
    return form | HALF_SCALES, w, narrow[0], narrow[1]


def _tiled(qtype: str, raw: np.ndarray,
           shape: tuple[int, int]) -> tuple[int, np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks -> (form, w, d, m) in qgemm.c's tiled layout (n padded to tiles of 16
    columns, k to blocks of 32, with zero weights): forms 4 and 16: w [tiles, kb, 4, 16, 4]
    bytes (q[k] | q[k + 16] << 4 at k = 4 g + i), d [tiles, kb, 16], m (form 4) the same
    shape or None (form 16); form 5: w [tiles, kb, 5, 16, 4], form 4's then a group of the
    fifth bits (bit 4 j + i of 64-bit word G: value 4 G + i of column j); form 6: w [tiles,
    kb, 6, 16, 4], the sixth bits' group after, d [tiles, kb, 2, 16]; forms 8 and 9: w
    [tiles, kb, 8, 16, 4] bytes (q + 128), d [tiles, kb, 2, 16] (form 8) or [tiles, kb, 16]
    (form 9), m [tiles, kb, 16] or None."""
    n, k = shape
    q, d, m = split_blocks(qtype, raw, n)
    tiles, kb = -(-n // TILE), -(-k // 32)
    np_, kp = tiles * TILE, kb * 32
    if m is not None:
        m = np.ascontiguousarray(_padded(m, np_, kb).reshape(tiles, TILE, kb).transpose(0, 2, 1))
    if qtype in FORM4 or qtype in FORM5 or qtype in FORM6 or qtype in FORMNL or qtype in FORMMX:
        q = _padded(q.astype(np.uint8), np_, kp, 32 if qtype in FORM6 else 0)  # (32: Q6_K's zero)
        q4 = (q & np.uint8(15)).reshape(tiles, TILE, kb, 2, 4, 4)  # [t, j, b, half, g, i]
        w = (q4[:, :, :, 0] | (q4[:, :, :, 1] << np.uint8(4))).transpose(0, 2, 3, 1, 4)  # [t, b, g, j, i]
        for plane in range(4, 6 if qtype in FORM6 else 5 if qtype in FORM5 else 4):
            # a group of the bits `plane`: bit 4 j + i of word G = value 4 G + i of column j
            high = ((q >> np.uint8(plane)) & np.uint8(1)).reshape(tiles, TILE, kb, 8, 4).transpose(0, 2, 3, 1, 4)
            bits = np.packbits(high.reshape(tiles, kb, 8, 64), axis=-1, bitorder="little")  # 8 bytes per G
            w = np.concatenate([w, bits.reshape(tiles, kb, 1, TILE, 4)], axis=2)
        if qtype in FORM6:  # a scale per 16, as form 8's
            d = _padded(d, np_, 2 * kb).reshape(tiles, TILE, kb, 2).transpose(0, 2, 3, 1)
            return Q6, np.ascontiguousarray(w), np.ascontiguousarray(d), m
        d = _padded(d, np_, kb).reshape(tiles, TILE, kb).transpose(0, 2, 1)
        form = 4 if qtype in FORM4 else Q5 if qtype in FORM5 else MX if qtype in FORMMX else NL
        return form, np.ascontiguousarray(w), np.ascontiguousarray(d), m
    u = _padded((q.astype(np.int16) + 128).astype(np.uint8), np_, kp, 128)  # 128: a zero weight
    w = u.reshape(tiles, TILE, kb, 8, 4).transpose(0, 2, 3, 1, 4)
    if qtype in FORM9:
        d = _padded(d, np_, kb).reshape(tiles, TILE, kb).transpose(0, 2, 1)
        return Q8S, np.ascontiguousarray(w), np.ascontiguousarray(d), m
    d = _padded(d, np_, 2 * kb).reshape(tiles, TILE, kb, 2).transpose(0, 2, 3, 1)
    return 8, np.ascontiguousarray(w), np.ascontiguousarray(d), m


class QuantLinear(nn.Module):
    """A linear layer on a repacked GGUF weight (no bias unless given). `weight` expands a
    float32 copy (for tests and inspection), equal to gguf's dequantization."""

    #: what a decode step streams (huge_pages.place puts them on 2 MB pages)
    hot_tensors = ("w", "d", "m", "bias")

    def __init__(self, form: int, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 in_features: int, out_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.form, self.in_features, self.out_features = form, in_features, out_features
        self.w, self.d, self.m, self.bias = w, d, m, bias
        self.kp = -(-in_features // 32) * 32

    @classmethod
    def from_gguf(cls, qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantLinear:
        form, w, d, m = repack(qtype, raw, shape)
        t = torch.from_numpy
        return cls(form, t(w), t(d), None if m is None else t(m), shape[1], shape[0])

    @staticmethod
    def concat(parts: list[QuantLinear]) -> QuantLinear | None:
        """One layer whose outputs are the parts' side by side, or None (different forms, or
        a part before the last whose columns do not fill their tiles)."""
        forms = {p.form & ~FLAGS for p in parts}
        if len(forms) > 1:  # Q5_0 q and k beside a Q8_0 v (Gemma 3's files): all in the byte form
            if not forms <= {Q5, Q6, 8, Q8S}:
                return None
            parts = [p.in_byte_form() for p in parts]
            if any(p.m is not None for p in parts):  # a zero offset where a part has none
                parts = [p.with_offsets() for p in parts]
        first = parts[0]
        if any((p.m is None) != (first.m is None) for p in parts):
            return None
        if len({p.form for p in parts}) > 1:  # float16 scales beside float32 ones: all widened (exact)
            parts = [p.float32_scales() for p in parts]
            first = parts[0]
        if any(p.out_features % TILE for p in parts[:-1]) or any(p.bias is not None for p in parts[:-1]) != (
                first.bias is not None):
            return None
        cat = (lambda ts: torch.cat(ts, dim=0))  # noqa: E731
        bias = None if first.bias is None else cat([p.bias for p in parts])
        return QuantLinear(first.form, cat([p.w for p in parts]), cat([p.d for p in parts]),
                           None if first.m is None else cat([p.m for p in parts]), first.in_features,
                           sum(p.out_features for p in parts), bias)

    def float32_scales(self) -> QuantLinear:
        """This layer with float32 scales and offsets (itself where they are): the float16
        ones widened, super-block ones multiplied out (each d * factor, and -(dmin * factor),
        as gguf computes them), exactly, so it computes the same bits."""
        if self.form & SUPER_SCALES:
            d, m = _super_products(self.d, self.form & ~SUPER_SCALES in (8, Q6)), None
            if self.m is not None:
                m = -_super_products(self.m, False)
            return QuantLinear(self.form & ~SUPER_SCALES, self.w, d, m, self.in_features, self.out_features, self.bias)
        if not self.form & HALF_SCALES:
            return self
        return QuantLinear(self.form & ~HALF_SCALES, self.w, self.d.float(), None if self.m is None else self.m.float(),
                           self.in_features, self.out_features, self.bias)

    def in_byte_form(self) -> QuantLinear:
        """This layer in form 8 (a signed byte a weight, a scale per 16; itself where it is):
        how a form 5 or 9 part is concatenated with another form's. The same weight, bit for
        bit; a form 5 layer's GEMM sums its two halves apart there (float rounding only)."""
        if self.form & SUPER_SCALES:
            return self.float32_scales().in_byte_form()
        form = self.form & ~HALF_SCALES
        if form == 8:
            return self
        if form not in (Q5, Q6, Q8S):
            raise ValueError(f"form {form} has no byte form")
        w, d = self.w, self.d
        if form in (Q5, Q6):
            q = torch.cat((w[:, :, :4] & 15, w[:, :, :4] >> 4), dim=2)  # [t, b, G, j, i]: value 4 G + i
            for plane in range(4, form):  # the high bits' groups
                bits = np.unpackbits(w[:, :, plane].reshape(*w.shape[:2], 8, 8).numpy(), axis=-1, bitorder="little")
                q = q | (torch.from_numpy(bits).reshape(q.shape) << plane)
            w = q + (96 if form == Q6 else 128)  # form 8's bytes: q + 128, Q6_K's q being q - 32
        if form != Q6:  # a scale per 32, written twice
            d = self.d.unsqueeze(2).expand(-1, -1, 2, -1).contiguous()  # [t, b, 2, 16]
        return QuantLinear(8 | (self.form & HALF_SCALES), w.contiguous(), d, self.m, self.in_features,
                           self.out_features, self.bias)

    def with_offsets(self) -> QuantLinear:
        """This layer with offsets: zeros where it has none (form 8; itself where it has)."""
        if self.m is not None:
            return self
        m = torch.zeros(self.d.shape[0], self.d.shape[1], TILE, dtype=self.d.dtype)
        return QuantLinear(self.form, self.w, self.d, m, self.in_features, self.out_features, self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in float32 (an embedding lookup), as gguf dequantizes them:
        on the CPU by qgemm.c's mstar_qrows (one call; the same bits as the expression below,
        which is ~10 torch ops a decode step)."""
        lib = cpu_kernels.library() if self.w.device.type == "cpu" else None
        if lib is not None:
            flat = ids.reshape(-1).to(torch.int64).contiguous()
            out = torch.empty(*ids.shape, self.in_features)
            rc = lib.mstar_qrows(self.form, self.w.data_ptr(), self.d.data_ptr(),
                                 None if self.m is None else self.m.data_ptr(), self.out_features, self.in_features,
                                 flat.data_ptr(), flat.numel(), out.data_ptr(), self.in_features)
            if rc == 0:
                return out
            if rc == -2:  # as torch's indexing refuses it
                raise IndexError(f"a row id outside [0, {self.out_features})")
        if self.form & SUPER_SCALES:
            return self.float32_scales().rows(ids)
        if self.form & ~FLAGS in (Q5, Q6):  # the same weights as bytes (form 8): the same values
            return self.in_byte_form().rows(ids)
        t, j = ids // TILE, ids % TILE
        w = self.w[t, :, :, j]  # [*ids, kb, groups, 4]
        lead, kb = ids.shape, self.w.shape[1]
        d, m = self.d.float(), None if self.m is None else self.m.float()  # (float16 ones widen exactly)
        form = self.form & ~HALF_SCALES
        if form == 4:
            assert m is not None  # form 4 always has offsets
            q = torch.cat(((w & 15).reshape(*lead, kb, 16), (w >> 4).reshape(*lead, kb, 16)), dim=-1).float()
            out = d[t, :, j].unsqueeze(-1) * q + m[t, :, j].unsqueeze(-1)
        elif form in (NL, MX):
            idx = torch.cat(((w & 15).reshape(*lead, kb, 16), (w >> 4).reshape(*lead, kb, 16)), dim=-1).long()
            out = d[t, :, j].unsqueeze(-1) * (_MX_KVALUES_F32 if form == MX else _KVALUES_F32)[idx]
            if m is not None:
                out = out + m[t, :, j].unsqueeze(-1)
        else:
            q = (w.reshape(*lead, kb, 2, 16).to(torch.int16) - 128).float()
            out = (d[t, :, j].unsqueeze(-1).unsqueeze(-1) if form == Q8S else d[t, :, :, j].unsqueeze(-1)) * q
            if m is not None:
                out = out.reshape(*lead, kb, 32) + m[t, :, j].unsqueeze(-1)
        return out.reshape(*lead, self.kp)[..., : self.in_features]

    @property
    def weight(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    def widen(self) -> int:
        """Keep a bfloat16 copy of the weight (gguf's dequantization rounded to nearest
        even) for prompt rows: oneDNN's bfloat16 GEMM (AMX tiles, or AVX512-BF16's dot
        products) runs a long prefill ~1.4x (AVX512-BF16) to several times (AMX) faster than
        the VNNI kernel, whose activations are two bytes. Returns the copy's bytes."""
        self.wide = self.weight.to(torch.bfloat16).contiguous()
        return self.wide.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows = x2.shape[0]
        out = torch.empty(rows, n)
        own_way = self.wide is not None or self.prompt_bytes != 2  # prompt rows computed another way
        first = min(prompt_rows.start(), rows) if own_way else rows
        if first:
            self._qgemm(x2[:first], out)
        if first < rows:  # prompt rows (layers/prompt_rows.py)
            if self.wide is not None:  # oneDNN on the bfloat16 copy
                wide_gemm.linear(x2[first:], self.wide, self.bias, out[first:], _threads)
            else:  # the VNNI kernel with x rounded to prompt_bytes
                self._qgemm(x2[first:], out[first:], self.prompt_bytes)
        return out.view(*x.shape[:-1], n).to(x.dtype)

    def _qgemm(self, x2: torch.Tensor, out: torch.Tensor, xbytes: int = 2) -> None:
        """out [rows, n] (contiguous) = x2 [rows, k] (rows strided) @ weight.T (+ bias), on
        the VNNI kernel, x rounded to `xbytes` bytes a value (qgemm.c)."""
        rows, k, n = x2.shape[0], self.in_features, self.out_features
        ptrs = self._ptrs
        if ptrs is None:  # the weight's pointers, once (its tensors never move)
            ptrs = self._ptrs = (self.w.data_ptr(), self.d.data_ptr(), None if self.m is None else self.m.data_ptr(),
                                 None if self.bias is None else self.bias.data_ptr())
        lib = cpu_kernels.library()
        assert lib is not None  # quantized weights are kept only where quant.available()
        rc = lib.mstar_qlinear(self.form, xbytes, x2.data_ptr(), rows, k, x2.stride(0), ptrs[0], ptrs[1], ptrs[2], n,
                               ptrs[3], out.data_ptr(), n, _threads, _scratch(lib, rows, k))
        if rc:
            raise RuntimeError(f"mstar_qlinear refused form {self.form}, {rows} x {k} x {n}")

    #: (w, d, m, bias) data pointers, set at the first call
    _ptrs: tuple | None = None
    #: the weight in bfloat16 for prompt rows (`widen`), or None: every row on the VNNI kernel
    wide: torch.Tensor | None = None
    #: bytes the VNNI kernel rounds a prompt row's values to (2 as decode rows; 1: llama.cpp's)
    prompt_bytes: int = 2


def _super_products(blob: torch.Tensor, per16: bool) -> torch.Tensor:
    """A `_super_blob` [tiles, super-blocks, 32 + groups * 16] multiplied out: float32 d *
    factor per group, [tiles, kb, 16] (per 32) or [tiles, kb, 2, 16] (per 16, form 8)."""
    tiles, nsb = blob.shape[:2]
    base = blob[:, :, : 2 * TILE].contiguous().view(torch.float16).float()  # [tiles, nsb, 16]
    factor = blob[:, :, 2 * TILE :].contiguous().view(torch.int8).reshape(tiles, nsb, -1, TILE).float()
    prod = base.unsqueeze(2) * factor  # [tiles, nsb, groups, 16]
    return prod.reshape(tiles, -1, 2, TILE) if per16 else prod.reshape(tiles, -1, TILE)


_scratch_buf = torch.empty(0, dtype=torch.uint8)


def _scratch(lib, rows: int, k: int) -> int:
    """A buffer for x's rounded copy (qgemm.c), grown as needed and reused by every call."""
    global _scratch_buf
    need = int(lib.mstar_qlinear_scratch(rows, k))
    if _scratch_buf.numel() < need:
        _scratch_buf = torch.empty(max(need, 2 * _scratch_buf.numel()), dtype=torch.uint8)
    return _scratch_buf.data_ptr()


class QuantParts(nn.Module):
    """GEMMs on one input whose outputs sit side by side but whose weights cannot be one
    `QuantLinear` (`concat` refuses their forms: Q4_K q and k beside a Q6_K v, as llama.cpp's
    Q4_K_M recipe writes every few layers): each runs apart and their outputs are
    concatenated, so the layer computes as with one fused GEMM, and the C decode stack
    (modeling/decoder/cpu_stack.py) runs the parts into one buffer's column ranges: the same values."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def layers(self) -> list[QuantLinear]:
        return list(self.parts)  # type: ignore[arg-type]  # ModuleList of QuantLinear

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([p.weight for p in self.layers])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.layers], dim=-1)


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
