"""The CPU GEMM path: oneDNN-packed weights, row counts rounded to a bounded set of
buckets (padding must never change a result), every bucket's kernel built up front."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.models.linear import (
    PLAIN_MAX_ROWS,
    PackedHead,
    PackedLinear,
    onednn_available,
    pack_linears,
    row_bucket,
    row_buckets,
    warm_packed,
)

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
