"""The C elementwise kernels against torch's ops (the decoder's reference path): RMSNorm (of
rows, and of each head in place on the q/k/v output), RoPE in place on strided q/k heads,
silu(gate) * up, gelu_tanh(gate) * up; and the torch fallback where they do not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.gpu_worker import cpu_kernels
from services.gpu_worker.layers import fused
from services.gpu_worker.modeling.decoder.lm import Rotary, _apply_rope
from shared.model_config import RopeConfig

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: the CPU kernels did not build")]


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_rms_norm_matches_torch(rows):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 96) * 3, torch.randn(96)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rope_in_place_matches_torch(head_dim):
    torch.manual_seed(head_dim)
    heads, kv_heads, t = 4, 2, 5
    rot = Rotary(RopeConfig(), head_dim, 64)
    cos, sin_signed = rot.tables(torch.tensor([0, 3, 7, 8, 63]), torch.float32)
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim)
    before = qkv.clone()
    qk = qkv[:, : heads + kv_heads]  # strided rows: the v heads follow in each row
    ref = _apply_rope(qk.clone(), cos, sin_signed)
    assert fused.rope_(qk, cos, sin_signed) is qk
    torch.testing.assert_close(qk, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, heads + kv_heads :], before[:, heads + kv_heads :])  # v untouched


def test_silu_mul_matches_torch():
    torch.manual_seed(0)
    gate_up = torch.randn(7, 2 * 200) * 6  # large |gate| too: exp's clamps
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])
    ref = F.silu(gate_up[:, :200]) * gate_up[:, 200:]
    torch.testing.assert_close(fused.silu_mul(gate_up), ref, rtol=1e-5, atol=1e-6)


def test_gelu_mul_matches_the_tanh_gelu():
    """Against torch's tanh GELU in float64; torch's float32 agrees but where 1 + tanh cancels
    (gate ~ -5: it returns 0 where the value is ~-1e-6, which the kernel's form keeps)."""
    torch.manual_seed(1)
    gate_up = torch.randn(7, 2 * 200) * 6
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -30.0, 1e-4, -1e-4])  # clamps, and tiny gates
    g, u = gate_up[:, :200].double(), gate_up[:, 200:].double()
    out = fused.gelu_mul(gate_up)
    torch.testing.assert_close(out.double(), F.gelu(g, approximate="tanh") * u, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(out, F.gelu(gate_up[:, :200], approximate="tanh") * gate_up[:, 200:], rtol=1e-5,
                               atol=2e-6)


def test_head_norm_normalises_each_head_in_place():
    torch.manual_seed(2)
    heads, kv_heads, t, d = 4, 2, 5, 16
    qkv = torch.randn(t, heads + 2 * kv_heads, d) * 3
    before = qkv.clone()
    w = torch.randn(d)
    k = qkv[:, heads : heads + kv_heads]  # strided rows, between q and v
    assert fused.head_norm_(k, w, 1e-6) is k
    want = before[:, heads : heads + kv_heads]
    want = want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(k, want, rtol=1e-5, atol=1e-6)
    rest = torch.cat([qkv[:, :heads], qkv[:, heads + kv_heads :]], dim=1)
    assert torch.equal(rest, torch.cat([before[:, :heads], before[:, heads + kv_heads :]], dim=1))  # untouched
    assert fused.head_norm_(k, torch.randn(d + 1), 1e-6) is None  # a weight of another size


def test_layouts_the_kernels_do_not_take_fall_back():
    x = torch.randn(4, 8, dtype=torch.float64)
    assert fused.rms_norm(x, torch.ones(8, dtype=torch.float64), 1e-6) is None
    assert fused.silu_mul(torch.randn(4, 16).t()) is None  # not contiguous
    assert fused.gelu_mul(torch.randn(4, 16).t()) is None
    q = torch.randn(4, 16, 2).transpose(1, 2)  # head_dim not contiguous
    assert fused.rope_(q, torch.ones(4, 1, 16), torch.zeros(4, 1, 16)) is None
