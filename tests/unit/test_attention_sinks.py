"""gpt-oss's attention sinks (one learned logit per query head in every row's softmax
denominator) on each attention path against transformers' `eager_attention_forward` of
gpt_oss: torch's decode (one row an entry, and entries of several rows), torch's prefill
chunks (plain causal, after cached rows, under a sliding window), the C decode kernel (rows
of one partition and of several, merged), on float32, bfloat16 and int8 pages, and the C
prefill kernel (whose rows do not depend on the pages released behind a window); without sinks
the C kernels give what they gave before."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss as hf_oss

from services.gpu_worker import attention, cpu_kernels
from services.gpu_worker.attention import AttnRows, build_metadata, paged_attention, window_mask

HQ, HKV, D, PAGE = 8, 2, 64, 16


class _Module(torch.nn.Module):
    """What transformers' eager op reads of its attention module."""

    def __init__(self, sinks: torch.Tensor) -> None:
        super().__init__()
        self.num_key_value_groups = HQ // HKV
        self.sinks = torch.nn.Parameter(sinks, requires_grad=False)
        self.eval()


def _pool(shapes: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """A pool holding each request's `cached + new` rows on scattered pages, and its rows."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-(c + n) // PAGE) for c, n in shapes) + 1
    cache = (torch.randn(n_pages, 2, PAGE, HKV, D, generator=g) * 2)
    cache = attention.quantize_kv(cache) if dtype == torch.int8 else cache.to(dtype)
    free = torch.randperm(n_pages, generator=g).tolist()
    return cache, [[free.pop() for _ in range(-(-(c + n) // PAGE))] for c, n in shapes]


def _reference(cache, pages, cached, new, q, sinks, window):
    """transformers' eager attention with sinks for one request's new rows [new, HQ, D]."""
    n = cached + new
    k = attention._read_pages(cache[pages, 0], torch.float32).reshape(-1, HKV, D)[:n]
    v = attention._read_pages(cache[pages, 1], torch.float32).reshape(-1, HKV, D)[:n]
    visible = window_mask(torch.arange(cached, n), torch.arange(n), window)
    mask = torch.zeros(new, n).masked_fill(~visible, torch.finfo(torch.float32).min)
    out, _ = hf_oss.eager_attention_forward(_Module(sinks), q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                            v.transpose(0, 1)[None], mask[None, None], scaling=D**-0.5)
    return out[0]


def _check(shapes, decode, backend, dtype=torch.float32, window=None, seed=0):
    cache, pages = _pool(shapes, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    sinks = torch.randn(HQ, generator=g) * 2
    q = torch.randn(sum(n for _, n in shapes), HQ, D, generator=g)
    rows = [AttnRows(p, 0, c, n, decode) for p, (c, n) in zip(pages, shapes, strict=True)]
    meta = build_metadata(rows, PAGE, window, backend)
    got = paged_attention(q, cache, meta, D**-0.5, None, sinks)
    t = 0
    for p, (c, n) in zip(pages, shapes, strict=True):
        want = _reference(cache, p, c, n, q[t : t + n], sinks, window)
        torch.testing.assert_close(got[t : t + n], want, rtol=2e-5, atol=2e-5)
        t += n
    return cache, q, meta, got


def _kernels() -> None:
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler here: the CPU kernels did not build")


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("decode_shapes", [[(5, 1), (40, 1), (17, 1)], [(9, 3), (30, 1), (20, 2)]])
def test_torch_decode_with_sinks_is_transformers(decode_shapes, window):
    _check(decode_shapes, True, "torch", window=window)


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("prefill_shapes", [[(0, 21)], [(0, 7), (13, 9)], [(32, 16)]])
def test_torch_prefill_with_sinks_is_transformers(prefill_shapes, window):
    _check(prefill_shapes, False, "torch", window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("window", [None, 8])
def test_kernel_decode_with_sinks_is_transformers(dtype, window):
    """Rows of one partition (<= 512 keys) and of several (their records merged)."""
    _kernels()
    _check([(5, 1), (40, 1), (700, 1), (1300, 1)], True, "kernel", dtype, window)
    _check([(9, 3), (600, 2)], True, "kernel", dtype, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 8, 128])
def test_kernel_prefill_with_sinks_is_transformers(dtype, window):
    _kernels()
    _, _, meta, _ = _check([(0, 45), (19, 33), (200, 70)], False, "kernel", dtype, window)
    assert all(c.plain for c in meta.prefills)  # the C prefill kernel took every chunk


def test_kernels_without_sinks_are_unchanged():
    """The kernels' no-sink calls give what torch's SDPA gives (the sink argument is NULL)."""
    _kernels()
    shapes = [(0, 30), (40, 1), (700, 1)]
    cache, pages = _pool(shapes, torch.float32)
    q = torch.randn(sum(n for _, n in shapes), HQ, D)
    rows = [AttnRows(p, 0, c, n, n == 1) for p, (c, n) in zip(pages, shapes, strict=True)]
    got = paged_attention(q, cache, build_metadata(rows, PAGE, None, "kernel"), D**-0.5)
    want = paged_attention(q, cache, build_metadata(rows, PAGE, None, "torch"), D**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_decode_with_sinks_is_batch_invariant():
    """A decode row's bits with sinks do not depend on the rows beside it."""
    _kernels()
    shapes = [(5, 1), (40, 1), (700, 1)]
    cache, pages = _pool(shapes, torch.float32)
    sinks, q = torch.randn(HQ), torch.randn(3, HQ, D)
    rows = [AttnRows(p, 0, c, n, True) for p, (c, n) in zip(pages, shapes, strict=True)]
    together = paged_attention(q, cache, build_metadata(rows, PAGE, None, "kernel"), D**-0.5, None, sinks)
    for i, row in enumerate(rows):
        alone = paged_attention(q[i : i + 1], cache, build_metadata([row], PAGE, None, "kernel"), D**-0.5, None,
                                sinks)
        assert torch.equal(alone, together[i : i + 1])


@pytest.mark.parametrize("released", [1, 3, 4])
def test_kernel_prefill_with_sinks_does_not_depend_on_released_pages(released):
    """A chunk's rows under a window of 8 give the same bits whether the pages behind the
    window were released before it or not (the key blocks fall at absolute rows)."""
    _kernels()
    cache, (pages,) = _pool([(100, 20)], torch.float32)
    sinks, q = torch.randn(HQ), torch.randn(20, HQ, D)
    held = paged_attention(q, cache, build_metadata([AttnRows(pages, 0, 100, 20, False)], PAGE, 8, "kernel"),
                           D**-0.5, None, sinks)
    rows = AttnRows(pages[released:], released, 100, 20, False)
    assert torch.equal(paged_attention(q, cache, build_metadata([rows], PAGE, 8, "kernel"), D**-0.5, None, sinks),
                       held)
