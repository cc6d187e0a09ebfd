"""The CPU GEMM path: the C kernel (kernels/gemm.c) on one thread, else oneDNN-packed
weights with row counts rounded to a bounded set of buckets (padding must never change a
result) and every bucket's kernel built up front."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker import cpu_kernels
from services.gpu_worker.layers.linear import (
    PLAIN_MAX_ROWS,
    KernelGateUpSilu,
    KernelHead,
    KernelLinear,
    PackedHead,
    PackedLinear,
    kernel_pack,
    kernel_unpack,
    make_head,
    onednn_available,
    pack_linears,
    row_bucket,
    row_buckets,
    warm_packed,
)

pytestmark = pytest.mark.kernels

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


def test_row_bucket_rounds_up_to_a_bounded_set():
    assert [row_bucket(m) for m in (1, 2, 16, 17, 24, 25, 64, 65, 96, 97, 512, 513, 640, 641)] == \
        [1, 2, 16, 24, 24, 32, 64, 96, 96, 128, 512, 640, 640, 768]
    for m in range(1, 3000):
        assert m <= row_bucket(m) <= max(m + 127, 1) and row_bucket(row_bucket(m)) == row_bucket(m)
    # A 512-token step budget: 16 exact + 6 of 8 + 14 of 32 = 36 kernels per weight shape.
    assert len(row_buckets(512)) == 36
    assert row_buckets(20) == [*range(1, 17), 24]


@needs_onednn
@pytest.mark.parametrize("keep_plain", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 61, 100, 513])
def test_packed_linear_matches_f_linear_at_any_row_count(rows, keep_plain):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 80)
    ref = F.linear(x := torch.randn(rows, 96), lin.weight, lin.bias)
    out = PackedLinear(lin, keep_plain)(x)
    assert out.shape == (rows, 80) and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # Leading dimensions are kept.
    assert PackedLinear(lin, keep_plain)(x.view(1, rows, 96)).shape == (1, rows, 80)


@needs_onednn
def test_packed_head_matches_f_linear():
    w = torch.randn(300, 64)
    head = PackedHead(w)
    for rows in (1, PLAIN_MAX_ROWS, PLAIN_MAX_ROWS + 1, 33):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(head(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_warm_packed_runs_each_bucket_of_each_shape_once():
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 32), nn.Linear(32, 48), nn.Linear(32, 48, bias=False))
    assert pack_linears(model, keep_plain=True) == 4
    head = PackedHead(torch.randn(100, 32))
    # Two weight shapes (32 -> 48 three times, 48 -> 32 once); one- and two-row calls take
    # the plain weight and need no oneDNN kernel.
    per_shape = len([b for b in row_buckets(20) if b > PLAIN_MAX_ROWS])
    assert per_shape == 15
    assert warm_packed(model, 20, head, 8) == 2 * per_shape + 6
    assert warm_packed(model, 20) == 2 * per_shape


def test_pack_linears_leaves_non_float32_alone():
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16))
    assert pack_linears(model) == 0 and isinstance(model[0], nn.Linear)


needs_kernel = pytest.mark.skipif(cpu_kernels.gemm_panel() == 0,
                                  reason="no C GEMM kernel here (no compiler or no AVX-512)")


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@needs_kernel
@pytest.mark.parametrize("out_features", [1, 47, 48, 49, 96, 300])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 16, 255, 256, 257, 600])
def test_kernel_linear_matches_a_float64_reference(rows, out_features):
    # Row counts around the 8-row micro-kernel and the 256-row block, column counts around
    # the 48-column panel (a partial last panel is stored masked, never past the end).
    torch.manual_seed(rows * 1000 + out_features)
    lin = nn.Linear(72, out_features)
    x = torch.randn(rows, 72)
    layer = KernelLinear(lin)
    out = layer(x)
    assert out.shape == (rows, out_features) and out.is_contiguous()
    torch.testing.assert_close(out, _ref(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x.view(1, rows, 72)), out.view(1, rows, out_features), rtol=0, atol=0)
    # the bias is optional
    lin.bias = None
    torch.testing.assert_close(KernelLinear(lin)(x), _ref(x, lin.weight, None), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_linear_takes_strided_rows_and_zero_rows():
    lin = nn.Linear(64, 50)
    layer = KernelLinear(lin)
    wide = torch.randn(10, 128)
    x = wide[:, 32:96]  # rows 128 floats apart
    torch.testing.assert_close(layer(x), _ref(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert layer(torch.empty(0, 64)).shape == (0, 50)


@needs_kernel
def test_kernel_results_do_not_depend_on_the_batch():
    # Each output is one FMA chain over k: a row gives the same bits alone or among others,
    # at any position (oneDNN's blocking changes with the row count, this does not).
    torch.manual_seed(0)
    lin = nn.Linear(512, 200)
    layer = KernelLinear(lin)
    x = torch.randn(37, 512)
    batch = layer(x)
    for i in (0, 5, 36):
        assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1])
        assert torch.equal(layer(x[i : i + 9])[0], batch[i])


@needs_kernel
def test_kernel_pack_round_trips_and_head_matches():
    w = torch.randn(1000, 64)
    assert torch.equal(kernel_unpack(kernel_pack(w), 1000, 64), w)
    lin = nn.Linear(64, 1000, bias=False)
    lin.weight.data.copy_(w)
    assert torch.equal(KernelLinear(lin).weight, w)
    head = KernelHead(w)
    for rows in (1, 3, 16):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(head(x), _ref(x, w, None), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_pack_linears_takes_the_kernel_on_one_thread_and_onednn_on_more():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 32))
        assert pack_linears(model) == 2 and all(isinstance(m, KernelLinear) for m in model)
        assert isinstance(make_head(torch.randn(100, 32)), KernelHead)
        # nothing for warm_packed to build on the kernel's path
        assert warm_packed(model, 20, make_head(torch.randn(100, 32)), 8) == 0
        if onednn_available():
            torch.set_num_threads(2)
            model = nn.Sequential(nn.Linear(32, 48))
            assert pack_linears(model) == 1 and isinstance(model[0], PackedLinear)
            assert isinstance(make_head(torch.randn(100, 32)), PackedHead)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_kernel_linear_refuses_other_dtypes_instead_of_reading_them_as_float32():
    layer = KernelLinear(nn.Linear(16, 8))
    with pytest.raises(TypeError, match=r"float32 CPU input, got torch\.float64 on cpu"):
        layer(torch.randn(2, 16, dtype=torch.float64))


@needs_kernel
@pytest.mark.parametrize("inter", [24, 40, 1408])
@pytest.mark.parametrize("rows", [1, 9, 300])
def test_gate_up_silu_is_the_gemm_then_silu_mul_bit_for_bit(rows, inter):
    # the epilogue's outputs are the unfused path's: same FMA chains, same silu formula
    from services.gpu_worker.layers import fused

    torch.manual_seed(rows + inter)
    gate_up = nn.Linear(64, 2 * inter, bias=False)
    x = torch.randn(rows, 64)
    out = KernelGateUpSilu(gate_up)(x)
    unfused = fused.silu_mul(KernelLinear(gate_up)(x))
    assert out.shape == (rows, inter) and torch.equal(out, unfused)
    ref = _ref(x, gate_up.weight, None).double()
    torch.testing.assert_close(out.double(), F.silu(ref[:, :inter]) * ref[:, inter:], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_kernel_results_do_not_depend_on_the_pool_threads(rows):
    # gemm.c splits panels (and blocks of rows) over the pool's threads: each output is the
    # same FMA chain whichever thread computes it, with bias, and through the silu epilogue
    lib = cpu_kernels.library()
    if not hasattr(lib, "mstar_pool_set_threads"):
        pytest.skip("kernels built without the pool")
    torch.manual_seed(rows)
    lin, gate_up = nn.Linear(96, 1000), nn.Linear(96, 2 * 700, bias=False)
    layer, silu, head = KernelLinear(lin), KernelGateUpSilu(gate_up), KernelHead(torch.randn(5000, 96))
    x = torch.randn(rows, 96)
    before = lib.mstar_pool_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            lib.mstar_pool_set_threads(n)
            outs.append((layer(x), silu(x), head(x)))
    finally:
        lib.mstar_pool_set_threads(before)
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))
    torch.testing.assert_close(outs[0][0], F.linear(x, lin.weight, lin.bias), rtol=1e-4, atol=1e-4)
