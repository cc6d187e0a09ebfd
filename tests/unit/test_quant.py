"""GGUF weights kept quantized (layers/quant.py, kernels/qgemm.c): each type's repack
reproduces `gguf.quants.dequantize` bit for bit, the GEMM equals x rounded to two bytes (or,
for prompt rows under `--prefill-dtype int8`, one) per value and block of 32 times that
weight (the one approximation), and a quantized GGUF
model loads with `--dtype auto` as `QuantLinear`s and with `--dtype float32` as today."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from services.gpu_worker.layers import quant
from services.gpu_worker.layers.quant import QuantEmbedding, QuantLinear

pytestmark = pytest.mark.kernels

needs_kernel = pytest.mark.skipif(not quant.available(), reason="no quantized GEMM kernel (compiler, AVX2)")

#: byte offsets of each type's float16 fields within a block
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": []}
TYPES = sorted(quant.KEPT_TYPES)


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, bytes per row] of valid random blocks: random bits, small finite float16 scales
    (the `gguf` package cannot quantize the k-quants, so every type is tested this way)."""
    rng = np.random.default_rng(seed)
    size, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 1e-2, (n, k // size)) * rng.choice([-1, 1], (n, k // size))
        raw[:, :, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n, k // size, 2)
    if qtype == "MXFP4":  # E8M0 exponents of small scales (2^-18 .. 2^-3, as trained weights have)
        raw[:, :, 0] = rng.integers(110, 126, (n, k // size), dtype=np.uint8)
    return raw.reshape(n, -1)


def dequantized(qtype: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k).copy())


def rounded(x: torch.Tensor, xbytes: int = 2) -> torch.Tensor:
    """x as the kernel reads it: per block of 32, d * (q1 + q2 / 256), q1 = round(x / d) with
    d = amax / 127, q2 = round((x - d q1) * 256 / d) clamped to [-127, 127]; with one byte,
    d * q1 (llama.cpp's Q8_1). q1 in float32 as the kernel makes it (x times the float32
    1 / d, rounded half to even: a float64 quotient rounds some halves the other way, which
    one byte has no q2 to take back), the rest in float64."""
    k = x.shape[1]
    xb = torch.nn.functional.pad(x, (0, -k % 32)).view(x.shape[0], -1, 32)
    d32 = xb.abs().amax(-1, keepdim=True) / 127
    q1 = torch.round(xb * torch.where(d32 > 0, 1 / d32, 0)).double()
    d, xb = d32.double(), xb.double()
    safe = torch.where(d > 0, d, 1)
    q2 = torch.round((xb - d * q1) * 256 / safe).clamp(-127, 127) if xbytes == 2 else 0
    return (d * (q1 + q2 / 256)).view(x.shape[0], -1)[:, :k]


@pytest.mark.parametrize("qtype", TYPES)
def test_repack_reproduces_gguf_dequantization(qtype):
    k = 768 if qtype.endswith("_K") or qtype == "IQ4_XS" else 96  # 96: not a multiple of 64, the kernel's padding
    raw = random_blocks(qtype, 40, k)
    layer = QuantLinear.from_gguf(qtype, raw, (40, k))
    forms = {**dict.fromkeys(quant.FORM4, 4), **dict.fromkeys(quant.FORM5, quant.Q5),
             **dict.fromkeys(quant.FORM6, quant.Q6), **dict.fromkeys(quant.FORM9, quant.Q8S),
             **dict.fromkeys(quant.FORMNL, quant.NL), **dict.fromkeys(quant.FORMMX, quant.MX)}
    assert layer.form & ~quant.FLAGS == forms[qtype]
    # GGUF's own float16 scales stay float16; the k-quants' and IQ4_XS's as the file has them:
    # a float16 per 256 values and an integer factor per group, in one byte blob
    half = qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4")  # (MXFP4's powers of two)
    assert bool(layer.form & quant.HALF_SCALES) == half
    assert bool(layer.form & quant.SUPER_SCALES) == (not half)
    assert layer.d.dtype == (torch.float16 if half else torch.uint8)
    assert torch.equal(layer.weight, dequantized(qtype, raw, 40, k))
    ids = torch.tensor([[3, 0], [39, 3]])
    assert torch.equal(QuantEmbedding(layer)(ids), dequantized(qtype, raw, 40, k)[ids])


#: bytes a weight in memory (layers/quant.py's table; the README's): float16 scales where exact
BYTES_PER_WEIGHT = {"Q4_0": 0.625, "Q4_1": 0.625, "Q4_K": 0.578125, "Q5_0": 0.75, "Q5_1": 0.75, "Q5_K": 0.703125,
                    "Q6_K": 0.8203125, "Q8_0": 1.0625, "IQ4_NL": 0.5625, "IQ4_XS": 0.5390625,
                    "MXFP4": 0.5625}


@pytest.mark.parametrize("qtype", TYPES)
def test_bytes_per_weight_in_memory(qtype):
    layer = QuantLinear.from_gguf(qtype, random_blocks(qtype, 32, 512), (32, 512))
    nbytes = sum(t.nbytes for t in (layer.w, layer.d, layer.m) if t is not None)
    assert nbytes / (32 * 512) == BYTES_PER_WEIGHT[qtype]


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_without_the_kernels_are_the_same_bits(qtype, monkeypatch):
    """An embedding lookup on torch's ops (no C compiler) and on mstar_qrows agree bit for bit;
    the kernel refuses an id past the table (it would read past the weight's last tile)."""
    k = 768 if qtype.endswith("_K") or qtype == "IQ4_XS" else 96
    layer = QuantLinear.from_gguf(qtype, random_blocks(qtype, 40, k), (40, k))
    ids = torch.tensor([5, 39, 0, 16, 5])
    kernel = layer.rows(ids)
    with pytest.raises(IndexError):
        layer.rows(torch.tensor([40]))
    monkeypatch.setattr(quant.cpu_kernels, "library", lambda: None)
    assert torch.equal(layer.rows(ids), kernel)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_gemm_is_rounded_x_times_the_dequantized_weight(qtype):
    k = 768 if qtype.endswith("_K") or qtype == "IQ4_XS" else 96
    n = 45  # not a multiple of the kernel's 4-column tile
    raw = random_blocks(qtype, n, k, seed=1)
    bias = torch.randn(n)
    layer = QuantLinear.from_gguf(qtype, raw, (n, k))
    layer.bias = bias
    w = dequantized(qtype, raw, n, k).double()
    for rows in (1, 3, 4, 6, 17):
        x = torch.randn(rows, k)
        exact = x.double() @ w.T + bias.double()
        for xbytes, error in ((2, 1e-3), (1, 3e-2)):
            y = torch.empty(rows, n)
            layer._qgemm(x, y, xbytes)
            if xbytes == 2:
                assert torch.equal(y, layer(x))  # what the layer computes outside a forward's prompt rows
            ref = (rounded(x, xbytes).double() @ w.T + bias.double()).float()
            assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())), (rows, xbytes)
            # against float32 x, the rounding is a small error: ~2^-15 with two bytes, ~2^-8 with one
            assert float((y - exact).abs().max()) < error * float(exact.abs().max()), (rows, xbytes)


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4"])
def test_float16_scales_give_the_float32_scales_bits(qtype):
    """A layer whose scales are kept float16 computes what it would with them widened to
    float32 (the kernel widens them exactly): GEMM rows of either width, and lookups."""
    raw = random_blocks(qtype, 45, 96, seed=3)
    half = QuantLinear.from_gguf(qtype, raw, (45, 96))
    assert half.form & quant.HALF_SCALES and half.d.dtype == torch.float16
    wide = half.float32_scales()
    assert not wide.form & quant.HALF_SCALES and wide.d.dtype == torch.float32
    assert half.d.nbytes * 2 == wide.d.nbytes  # what a step reads less
    assert_same_bits(half, wide)


def assert_same_bits(narrow: QuantLinear, wide: QuantLinear) -> None:
    """Lookups and GEMM rows (a decode row, a prompt's row groups; x in one or two bytes) of
    a layer and of its copy with float32 scales are the same bits."""
    ids = torch.tensor([0, 44, 17])
    assert torch.equal(narrow.rows(ids), wide.rows(ids))
    n, k = narrow.out_features, narrow.in_features
    for rows in (1, 17):
        x = torch.randn(rows, k)
        for xbytes in (1, 2):
            a, b = torch.empty(rows, n), torch.empty(rows, n)
            narrow._qgemm(x, a, xbytes)
            wide._qgemm(x, b, xbytes)
            assert torch.equal(a, b), (rows, xbytes)


@needs_kernel
@pytest.mark.parametrize("qtype", quant.SUPER_TYPES)
def test_super_block_scales_give_the_float32_scales_bits(qtype):
    """The k-quants' and IQ4_XS's scales kept as the file has them (a float16 per 256 values
    per column, an int8 factor per group): the kernel's d * factor is the float32 product
    gguf makes, so GEMM rows of either width and lookups are the float32 scales' bits."""
    raw = random_blocks(qtype, 45, 512, seed=4)
    small = QuantLinear.from_gguf(qtype, raw, (45, 512))
    assert small.form & quant.SUPER_SCALES and small.d.dtype == torch.uint8
    wide = small.float32_scales()
    assert not wide.form & quant.FLAGS and wide.d.dtype == torch.float32
    groups = 16 if qtype == "Q6_K" else 8  # Q6_K: a scale per 16 values
    # per tile of 16 columns and super-block: 32 bytes of d and a byte per group and column,
    # against 4 bytes per group and column
    assert small.d.nbytes == 3 * 2 * (32 + 16 * groups) and wide.d.nbytes == 3 * 2 * groups * 16 * 4
    assert torch.equal(small.weight, dequantized(qtype, raw, 45, 512))
    assert_same_bits(small, wide)


@needs_kernel
def test_threads_split_columns_without_changing_a_bit():
    raw = random_blocks("Q4_1", 100, 256, seed=2)
    layer = QuantLinear.from_gguf("Q4_1", raw, (100, 256))
    x = torch.randn(7, 256)
    before = quant.threads()
    try:
        quant.set_threads(1)
        one = layer(x)
        quant.set_threads(2)
        two = layer(x)
    finally:
        quant.set_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_an_lm_heads_prefetch_changes_no_bit():
    """A byte-form GEMV as wide as an LM head (65,536 columns and more: Gemma 3's tied Q8_0
    head) prefetches its weights ahead (qgemm.c's HEAD_TILES); the same bits without, and
    the rounded-x GEMM's values."""
    from services.gpu_worker import cpu_kernels

    n, k = 65536 + 40, 64  # a ragged last tile
    raw = random_blocks("Q8_0", n, k, seed=4)
    layer = QuantLinear.from_gguf("Q8_0", raw, (n, k))
    x, lib = torch.randn(1, k), cpu_kernels.library()
    try:
        lib.mstar_qgemm_set_head_prefetch(0)
        off = layer(x)
    finally:
        lib.mstar_qgemm_set_head_prefetch(1)
    on = layer(x)
    assert torch.equal(on, off)
    ref = (rounded(x).double() @ dequantized("Q8_0", raw, n, k).double().T).float()
    assert torch.allclose(on, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_K", "Q6_K"])
def test_a_row_is_the_same_bits_alone_and_among_a_prompts(qtype):
    """Forms 5 and 6 under a prompt's rows compute on each tile expanded once (weights to
    bytes, scales multiplied out) rather than per row group: the same values, so a row's
    output is the same bits as when it runs alone (a decode row), on one thread or two."""
    layer = QuantLinear.from_gguf(qtype, random_blocks(qtype, 100, 512, seed=6), (100, 512))
    x = torch.randn(70, 512)
    before = quant.threads()
    try:
        for threads in (1, 2):
            quant.set_threads(threads)
            batch = layer(x)
            for i in (0, 5, 69):
                assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1]), (threads, i)
    finally:
        quant.set_threads(before)


@needs_kernel
def test_concat_is_the_parts_side_by_side():
    a = QuantLinear.from_gguf("Q4_0", random_blocks("Q4_0", 16, 64, 3), (16, 64))
    c = QuantLinear.from_gguf("Q4_1", random_blocks("Q4_1", 40, 64, 5), (40, 64))
    both = QuantLinear.concat([a, c])
    x = torch.randn(3, 64)
    assert torch.equal(both(x), torch.cat([a(x), c(x)], dim=1))
    assert torch.equal(both.weight, torch.cat([a.weight, c.weight]))
    assert QuantLinear.concat([a, QuantLinear.from_gguf("Q8_0", random_blocks("Q8_0", 16, 64), (16, 64))]) is None
    assert QuantLinear.concat([c, a]) is None  # 40 columns do not fill their tiles: kept apart


@needs_kernel
def test_a_q8_byte_of_minus_128_is_taken():
    """ggml's quantizers never write -128, but the Q8 form (q + 128 unsigned) takes it."""
    raw = random_blocks("Q8_0", 4, 64)
    raw[0, 5] = 128  # -128 as int8
    layer = QuantLinear.from_gguf("Q8_0", raw, (4, 64))
    w = dequantized("Q8_0", raw, 4, 64)
    assert torch.equal(layer.weight, w)
    x = torch.randn(2, 64)
    assert torch.allclose(layer(x), (rounded(x).double() @ w.double().T).float(), rtol=1e-4, atol=1e-5)


@needs_kernel
def test_concat_puts_five_bit_and_one_scale_parts_in_the_byte_form():
    """Gemma 3's Q4_K_M files fuse Q5_0 q and k with a Q8_0 v: one layer in form 8 (Q8_0's
    scale per 16, a zero offset where a part has none), the parts' weights bit for bit."""
    parts = [QuantLinear.from_gguf(t, random_blocks(t, n, 64, seed), (n, 64))
             for t, n, seed in (("Q5_0", 32, 1), ("Q5_1", 16, 2), ("Q8_0", 16, 3))]
    assert [p.form & ~quant.FLAGS for p in parts] == [quant.Q5, quant.Q5, quant.Q8S]
    fused = QuantLinear.concat(parts)
    assert fused is not None and fused.form & ~quant.FLAGS == 8
    w = torch.cat([p.weight for p in parts])
    assert torch.equal(fused.weight, w)
    x = torch.randn(3, 64)
    ref = (rounded(x).double() @ w.double().T).float()
    assert torch.allclose(fused(x), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    assert torch.allclose(fused(x), torch.cat([p(x) for p in parts], dim=1), rtol=1e-5, atol=1e-6)
    # Q6_K's 6 bits (q - 32 a scale per 16) beside Q8_0: bytes q + 96, the same GEMM bits
    q6, q8 = (QuantLinear.from_gguf(t, random_blocks(t, 16, 256, 5), (16, 256)) for t in ("Q6_K", "Q8_0"))
    assert q6.form & ~quant.FLAGS == quant.Q6
    fused = QuantLinear.concat([q6, q8])
    assert fused is not None and fused.form & ~quant.FLAGS == 8
    assert torch.equal(fused.weight, torch.cat([q6.weight, q8.weight]))
    x = torch.randn(3, 256)
    assert torch.equal(fused(x), torch.cat([q6(x), q8(x)], dim=1))
