"""Prompt rows of a quantized GGUF layer computed their own way (`--prefill-dtype`,
layers/prompt_rows.py): on a bfloat16 copy (layers/quant.py `QuantLinear.widen`,
layers/wide_gemm.py) they are oneDNN's bfloat16 GEMM of x and the weight rounded to
bfloat16; under int8 (`QuantLinear.prompt_bytes`) the VNNI kernel's with x rounded to one
byte. Decode rows stay the two-byte kernel's bit for bit, and a row's result depends on its
kind only: not on the chunk it is in, the rows beside it, the thread count, or the MLP's
slicing of a long prefill."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.gpu_worker.layers import quant, wide_gemm
from services.gpu_worker.layers.prompt_rows import prompt_rows_from, shifted, start
from services.gpu_worker.layers.quant import QuantLinear
from services.gpu_worker.runners import base as runner
from services.gpu_worker.step_types import PlanEntry, StepPlan
from shared.config import Deployment
from tests.unit.test_quant import dequantized, random_blocks, rounded

pytestmark = pytest.mark.kernels

needs_kernel = pytest.mark.skipif(not quant.available(), reason="no quantized GEMM kernel (compiler, AVX2)")


def layer(n: int = 200, k: int = 96, qtype: str = "Q4_1", bias: bool = False) -> QuantLinear:
    q = QuantLinear.from_gguf(qtype, random_blocks(qtype, n, k, seed=n + k), (n, k))
    if bias:
        q.bias = torch.randn(n)
    return q


def test_prompt_rows_context_and_shift():
    assert start() >= 1 << 40  # outside a forward: no prompt rows
    with prompt_rows_from(5):
        assert start() == 5
        with shifted(256):
            assert start() == 0  # a slice past the first prompt row: all of it is prompt rows
        with shifted(3):
            assert start() == 2
    with prompt_rows_from(None), shifted(100):
        assert start() >= 1 << 40


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "IQ4_NL"])
@pytest.mark.parametrize("bias", [False, True])
def test_prompt_rows_are_the_bf16_gemm_and_decode_rows_the_kernel(qtype, bias):
    k = 256 if qtype.endswith("_K") else 96
    q = layer(200, k, qtype, bias)
    x = torch.randn(300, k)
    decode = q(x[:7])  # no context: every row on the VNNI kernel
    assert q.widen() == 200 * k * 2
    assert torch.equal(q.wide, q.weight.to(torch.bfloat16))
    assert torch.equal(q(x[:7]), decode)  # a widened layer outside a forward's prompt rows: unchanged
    with prompt_rows_from(7):
        y = q(x)
    assert torch.equal(y[:7], decode)
    want = F.linear(x[7:].to(torch.bfloat16), q.wide).float()
    if bias:
        want = want + q.bias
    assert torch.equal(y[7:], want)


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "IQ4_NL"])
def test_int8_prompt_rows_are_x_in_one_byte_and_decode_rows_the_two_byte_kernel(qtype):
    k = 256 if qtype.endswith("_K") else 96
    raw = random_blocks(qtype, 200, k, seed=200 + k)
    q = QuantLinear.from_gguf(qtype, raw, (200, k))
    x = torch.randn(300, k)
    decode = q(x[:7])
    q.prompt_bytes = 1
    assert torch.equal(q(x[:7]), decode)  # outside a forward's prompt rows: unchanged
    with prompt_rows_from(7):
        y = q(x)
    assert torch.equal(y[:7], decode)
    w = dequantized(qtype, raw, 200, k).double()
    want = (rounded(x[7:], 1) @ w.T).float()
    assert torch.allclose(y[7:], want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    two = (rounded(x[7:], 2) @ w.T).float()
    assert not torch.allclose(y[7:], two, rtol=1e-4, atol=1e-4 * float(two.abs().max()))  # not the two-byte rows


@needs_kernel
@pytest.mark.parametrize("path", ["bfloat16", "int8"])
def test_a_prompt_row_is_the_same_in_any_chunk_and_thread_count(path):
    q = layer(1536, 576)
    if path == "bfloat16":
        q.widen()
    else:
        q.prompt_bytes = 1
    x = torch.randn(700, 576)
    saved = quant.threads()
    try:
        quant.set_threads(2)
        with prompt_rows_from(0):
            whole = q(x)
        for lo, hi, threads in ((0, 1, 2), (5, 6, 1), (3, 20, 2), (100, 357, 2), (0, 700, 1), (129, 700, 2)):
            quant.set_threads(threads)
            with prompt_rows_from(0):
                assert torch.equal(q(x[lo:hi]), whole[lo:hi]), (lo, hi, threads)
            with prompt_rows_from(2):  # two decode rows first: the prompt rows keep their bits
                part = q(torch.cat([x[:2], x[lo:hi]]))
            assert torch.equal(part[2:], whole[lo:hi]), (lo, hi, threads)
    finally:
        quant.set_threads(saved)


@needs_kernel
def test_blocks_split_over_threads_cover_every_row():
    q = layer(64, 96)
    q.widen()
    x = torch.randn(wide_gemm.ROWS * 3 + 5, 96)
    out = torch.full((x.shape[0], 64), float("nan"))
    wide_gemm.linear(x, q.wide, None, out, threads=3)
    assert torch.equal(out, F.linear(x.to(torch.bfloat16), q.wide).float())


def test_first_prompt_row_follows_the_plan():
    plan = StepPlan()
    assert runner._first_prompt_row(plan) is None
    plan.entries = [PlanEntry(None, 1, True), PlanEntry(None, 3, True, [5, 6]), PlanEntry(None, 40, False),
                    PlanEntry(None, 9, False)]
    assert runner._first_prompt_row(plan) == 4
    plan.entries = [PlanEntry(None, 40, False)]
    assert runner._first_prompt_row(plan) == 0
    plan.entries = [PlanEntry(None, 40, False), PlanEntry(None, 1, True)]
    with pytest.raises(RuntimeError, match="prompt rows must come last"):
        runner._first_prompt_row(plan)


def test_prefill_dtype_is_validated():
    assert Deployment().prefill_dtype == "auto"
    with pytest.raises(ValueError, match="prefill_dtype must be one of"):
        Deployment(prefill_dtype="float16")


@needs_kernel  # (without it no weight stays quantized, so nothing is copied)
@pytest.mark.parametrize(("prefill_dtype", "amx", "copied", "prompt_bytes"), [
    ("auto", True, True, 2), ("auto", False, False, 2),  # AVX512-BF16 alone: the VNNI kernel (docs/benchmarks.md)
    ("bfloat16", False, True, 2), ("quantized", True, False, 2), ("int8", True, False, 1)])
def test_which_cpus_keep_a_bfloat16_copy_for_prompt_rows(monkeypatch, prefill_dtype, amx, copied, prompt_bytes):
    from torch import nn

    from services.gpu_worker import weights

    monkeypatch.setattr(weights, "cpu_has_amx_bf16", lambda: amx)
    model = nn.Module()
    model.layers = nn.ModuleList([layer(32, 64)])
    model.head = layer(48, 64)  # outside the decoder layers: sampled rows only, never copied
    assert weights.prompt_path(model, prefill_dtype) == (32 * 64 * 2 if copied else 0)
    assert (model.layers[0].wide is not None) == copied and model.head.wide is None
    assert model.layers[0].prompt_bytes == prompt_bytes and model.head.prompt_bytes == 2  # int8: decoder layers only


@needs_kernel
def test_experts_kept_quantized_get_no_bfloat16_copy(monkeypatch):
    """A mixture's experts stay in their blocks for prompt rows too: a bfloat16 copy of every
    expert would double a MoE model's memory, and an expert sees only its share of the rows."""
    from torch import nn

    from services.gpu_worker import weights
    from services.gpu_worker.layers.moe import ExpertMixture

    monkeypatch.setattr(weights, "cpu_has_amx_bf16", lambda: True)
    mix = ExpertMixture.__new__(ExpertMixture)
    nn.Module.__init__(mix)
    mix.quant = nn.ModuleList([layer(32, 64), layer(32, 64)])  # type: ignore[assignment]
    block = nn.Module()
    block.attn, block.mlp = layer(32, 64), mix
    model = nn.Module()
    model.layers = nn.ModuleList([block])
    assert weights.prompt_path(model, "auto") == 32 * 64 * 2  # the attention's GEMM alone
    assert block.attn.wide is not None and all(q.wide is None for q in mix.quant)
