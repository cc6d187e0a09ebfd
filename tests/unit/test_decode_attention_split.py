"""The C decode kernel over long contexts (kernels/paged_attention.c): rows of more than one
partition (512 keys) are split into partitions run over the pool's threads and merged in a
fixed order (flash-decoding). Each row against torch's SDPA on its gathered K/V (bfloat16
pages widened), within float32 rounding; the same bits on one thread as on two; bfloat16
pages bitwise the float32 kernel on the pages widened."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.gpu_worker import attention, cpu_kernels
from services.gpu_worker.attention import AttnRows, build_metadata, head_dim_of
from services.gpu_worker.layers import quant

pytestmark = pytest.mark.kernels


@pytest.fixture(autouse=True)
def kernels():
    if cpu_kernels.library() is None or attention._bf16_kernels() is None:
        pytest.skip("no C compiler here: the CPU kernels did not build")


def batch(shapes, heads, dtype, page_size=16, window=None, seed=0):
    """A pool holding each entry's `cached + new` rows (its pages scattered), the queries and
    the kernel's metadata: (cache, q, metadata). shapes: (cached, new) per decode entry."""
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-(c + n) // page_size) for c, n in shapes) + 1
    cache = (torch.randn(n_pages, 2, page_size, hkv, d, generator=g) * 2).to(dtype)
    free = torch.randperm(n_pages, generator=g).tolist()
    rows = [([free.pop() for _ in range(-(-(c + n) // page_size))], 0, c, n, True) for c, n in shapes]
    q = torch.randn(sum(n for _, n in shapes), hq, d, generator=g)
    return cache, q, build_metadata(rows, page_size, window)


def kernel(cache, q, meta, threads):
    """The decode rows through the kernel on `threads` threads of the pool."""
    quant.set_threads(threads)
    out = torch.zeros_like(q)
    attention._decode_kernel(q, cache, meta.decode, q.shape[-1] ** -0.5, out)
    return out


def reference(cache, q, meta):
    """Each decode row by SDPA on its keys [lo, hi) gathered and read as float32 (int8 pages
    dequantized, `attention._read_pages`), [N, Hq, D]."""
    dec = meta.decode
    hkv, d = cache.shape[3], head_dim_of(cache)
    outs = []
    for row, entry, lo, hi in dec.query.t().tolist():
        pages = dec.pages[entry]
        k = attention._read_pages(cache[pages, 0], torch.float32).reshape(-1, hkv, d)[lo:hi].transpose(0, 1)
        v = attention._read_pages(cache[pages, 1], torch.float32).reshape(-1, hkv, d)[lo:hi].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[row].unsqueeze(1), k, v, scale=d**-0.5, enable_gqa=True)
        outs.append(o.squeeze(1))
    return torch.stack(outs)


def check(cache, q, meta):
    """Same bits on one thread and on two; within float32 rounding of SDPA."""
    one, two = kernel(cache, q, meta, 1), kernel(cache, q, meta, 2)
    assert torch.equal(one, two), "the thread count changed the result"
    rows = meta.decode.query[0]
    ref = reference(cache, q, meta)
    torch.testing.assert_close(one[rows], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    return one


LENGTHS = [[1], [100], [2100], [5000], [1, 100, 2100, 5000, 513]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 64)])  # GQA 3 (SmolLM2) and 1
@pytest.mark.parametrize("lengths", LENGTHS)
def test_long_rows_match_sdpa_on_any_thread_count(lengths, heads, dtype, restore_threads):
    cache, q, meta = batch([(n - 1, 1) for n in lengths], heads, dtype)
    check(cache, q, meta)


@pytest.mark.parametrize("heads", [(8, 2, 128), (9, 3, 128), (4, 1, 256), (8, 2, 256), (6, 2, 48), (16, 1, 64),
                                   (40, 8, 64), (20, 4, 40)])
def test_other_head_shapes(heads, restore_threads):
    """Head size 128 (its own AVX-512 copy: blocks of 2 heads), 256 (Gemma 3's: blocks of
    one), 48 (the vector path: 3 or 6 vectors a head) and 40 (the plain loops), G = 16
    (blocks of 4), 40 query heads (passes of 16: one splits a KV head's five)."""
    cache, q, meta = batch([(1299, 1), (600, 1)], heads, torch.bfloat16, seed=3)
    check(cache, q, meta)


def test_speculative_entries_and_a_window(restore_threads):
    """Multi-row decode entries (each row its own hi), and a sliding window (lo > 0, so the
    partitions start off the page grid)."""
    shapes = [(2100, 3), (700, 4), (30, 2)]
    cache, q, meta = batch(shapes, (9, 3, 64), torch.bfloat16, seed=4)
    assert meta.decode.query.shape[1] == 9
    check(cache, q, meta)
    cache, q, meta = batch([(3000, 1), (1400, 2)], (9, 3, 64), torch.float32, page_size=8, window=1000, seed=5)
    assert meta.decode.query[2].min() > 0
    check(cache, q, meta)


def test_bf16_pages_are_the_float32_kernel_widened(restore_threads):
    cache, q, meta = batch([(4999, 1), (511, 1), (512, 1), (1024, 1)], (9, 3, 64), torch.bfloat16, seed=6)
    quant.set_threads(2)
    assert torch.equal(kernel(cache, q, meta, 2), kernel(cache.float(), q, meta, 2))


def test_scratch_sized_by_the_kernel():
    """The scratch the Python side allocates holds the counts and every partition's record."""
    lib = cpu_kernels.library()
    size = attention._decode_scratch(lib)
    assert size(1, 9, 64, 512) == 16 + 1 * 9 * 66 + 16
    assert size(5, 9, 64, 5000) == 16 + 5 * 10 * 9 * 66 + 16


def test_short_rows_split_over_kv_heads_keep_their_bits(restore_threads):
    """A call with fewer partitions than two per thread splits each over groups of KV heads
    where its tasks come out even over the threads (4 KV heads: 1 thread 2 groups, 2 threads
    4, 3 threads none); a head's arithmetic is the same in any group, so every count gives
    the same bits, and SDPA's values."""
    cache, q, meta = batch([(99, 1)], (12, 4, 64), torch.bfloat16, seed=3)
    outs = [kernel(cache, q, meta, threads) for threads in (1, 2, 3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "the KV-head groups changed the result"
    torch.testing.assert_close(outs[0], reference(cache, q, meta), rtol=1e-5, atol=1e-5)


INVARIANT_KEYS = [1, 5, 16, 17, 45, 74, 130, 600]  # one page, page edges, several pages, two partitions


@pytest.mark.parametrize("d", [16, 32, 48, 64, 128, 256])
@pytest.mark.parametrize("hq, hkv", [(4, 2), (8, 2), (4, 4), (4, 1), (8, 1)])
def test_rows_are_batch_invariant(d, hq, hkv, restore_threads):
    """A row's output is the same bits whoever shares its call: alone, in the whole batch, in
    the batch reversed, on one thread or two (the KV-head split and the partitions the call
    picks from the batch's size never change a row's arithmetic). Before the fix the plain
    loops (head sizes 16-48 here, every size on the generic class) summed a score in an order
    GCC picked per loop version, and the version hung on the heads a task had, so rows of
    more than one page changed bits with their batch. Each row alone is SDPA's within float
    rounding."""
    g = torch.Generator().manual_seed(d * 100 + hq * 10 + hkv)
    page_size = 16
    n_pages = sum(-(-n // page_size) for n in INVARIANT_KEYS) + 1
    cache = torch.randn(n_pages, 2, page_size, hkv, d, generator=g)
    free = torch.randperm(n_pages, generator=g).tolist()
    rows = [AttnRows([free.pop() for _ in range(-(-n // page_size))], 0, n - 1, 1, True) for n in INVARIANT_KEYS]
    q = torch.randn(len(rows), hq, d, generator=g)

    def call(order, threads):
        meta = build_metadata([rows[i] for i in order], page_size)
        return kernel(cache, q[order].contiguous(), meta, threads)

    every = list(range(len(rows)))
    for threads in (1, 2):
        whole, backwards = call(every, threads), call(every[::-1], threads).flip(0)
        for i in every:
            alone = call([i], threads)
            assert torch.equal(alone[0], whole[i]), f"row {i} ({INVARIANT_KEYS[i]} keys) changed in the batch"
            assert torch.equal(alone[0], backwards[i]), f"row {i} changed with the batch's order"
            if threads == 1:
                meta = build_metadata([rows[i]], page_size)
                ref = reference(cache, q[i : i + 1], meta)
                torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert torch.equal(whole, call(every, 3 - threads)), "the thread count changed the result"
