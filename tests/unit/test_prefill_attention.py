"""The C prefill kernel (kernels/prefill_attention.c, `attention._prefill_kernel`) against
torch's SDPA on the gathered pages: float32 and bfloat16 pages, GQA, chunks of 1, 17 and 300
rows over a prefix already in the pages, pages in random order, sliding windows (with the
pages behind the window released), an encoder's bidirectional chunks (every row sees every
key), the same bits on 1 and 2 threads, and the chunks it must leave to torch (bidirectional
blocks, soft-capping, the torch backend)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.gpu_worker import attention, cpu_kernels
from services.gpu_worker.attention import AttnRows, build_metadata, paged_attention
from services.gpu_worker.layers import quant

pytestmark = pytest.mark.kernels

PAGE = 16
D = 64


@pytest.fixture(autouse=True)
def kernel():
    lib = cpu_kernels.library()
    if lib is None or attention._prefill_function(lib) is None:
        pytest.skip("no C compiler here: the CPU kernels did not build")
    return lib


@pytest.fixture
def taken(monkeypatch):
    """The chunks the kernel took (True) or refused (False), in call order."""
    calls: list[bool] = []
    real = attention._prefill_kernel

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(attention, "_prefill_kernel", spy)
    return calls


def setup(q_len, cached, hq, hkv, dtype, window=None, seed=0):
    """A pool holding one request's first cached + q_len rows (the last q_len the chunk's),
    its live pages in random order (those wholly behind the window released), the chunk's
    metadata for the kernel backend, and q as the model makes it (rows strided: column
    slices of a fused qkv row). Returns (q, cache, meta, k, v) with k/v every row [n, hkv, D]."""
    g = torch.Generator().manual_seed(seed)
    n = cached + q_len
    k = torch.randn(n, hkv, D, generator=g) * 2
    v = torch.randn(n, hkv, D, generator=g)
    first_page = 0 if window is None else max(0, cached - window) // PAGE
    n_pages = -(-n // PAGE) - first_page
    pool = n_pages + 7
    pages = torch.randperm(pool, generator=g)[:n_pages].tolist()
    cache = torch.zeros(pool, 2, PAGE, hkv, D, dtype=dtype)
    for r in range(first_page * PAGE, n):
        cache[pages[r // PAGE - first_page], 0, r % PAGE] = k[r].to(dtype)
        cache[pages[r // PAGE - first_page], 1, r % PAGE] = v[r].to(dtype)
    meta = build_metadata([AttnRows(pages, first_page, cached, q_len, False)], PAGE, window, backend="kernel")
    qkv = torch.randn(q_len, (hq + 2 * hkv) * D, generator=g) * 2
    q = qkv[:, : hq * D].view(q_len, hq, D)
    return q, cache, meta, k.to(dtype).float(), v.to(dtype).float()


def reference(q, k, v, window):
    """SDPA over every row (the pages' values as float32) under the bottom-right causal
    mask and the window."""
    n, q_len = k.shape[0], q.shape[0]
    mask = attention.window_mask(torch.arange(n - q_len, n), torch.arange(n), window)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                       scale=D**-0.5, enable_gqa=True)
    return o.transpose(0, 1)


def on_threads(n: int, fn):
    """fn() with the kernels' pool on n threads (the default count restored after)."""
    cpu_kernels.library().mstar_pool_set_threads(n)
    try:
        return fn()
    finally:
        quant.set_threads(quant.threads())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize(("q_len", "cached"), [(1, 40), (17, 30), (300, 333), (300, 0)])
def test_matches_sdpa_and_thread_count(dtype, group, q_len, cached, taken):
    hkv = 3
    q, cache, meta, k, v = setup(q_len, cached, hkv * group, hkv, dtype)
    one = on_threads(1, lambda: paged_attention(q, cache, meta, D**-0.5))
    two = on_threads(2, lambda: paged_attention(q, cache, meta, D**-0.5))
    assert taken == [True, True]
    assert meta.prefills[0].mask is None  # the kernel needs no mask: none was built
    assert torch.equal(one, two)  # the same bits whichever threads run the tasks
    torch.testing.assert_close(one, reference(q, k, v, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_len", "cached", "window"), [(1, 100, 37), (17, 80, 37), (300, 333, 64), (300, 0, 100)])
def test_sliding_window(dtype, q_len, cached, window, taken):
    """Keys more than window - 1 rows before a query's own are not seen (pages wholly
    behind the window are released: the first live page is not the request's first)."""
    q, cache, meta, k, v = setup(q_len, cached, 9, 3, dtype, window, seed=1)
    out = paged_attention(q, cache, meta, D**-0.5)
    assert taken == [True]
    torch.testing.assert_close(out, reference(q, k, v, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "lens"), [(12, 12, [1, 9, 40]), (6, 2, [130, 17])])
def test_bidirectional_chunks(dtype, hq, hkv, lens, taken):
    """An encoder's step (`causal=False`: BERT's, the pooling runner's): several requests'
    whole prompts, each row seeing every row of its own request, through the kernel (no
    mask built), within float32 rounding of SDPA without a mask, the same bits on 1 and 2
    threads."""
    g = torch.Generator().manual_seed(2)
    pool = sum(-(-n // PAGE) for n in lens) + 3
    order = torch.randperm(pool, generator=g).tolist()
    cache = torch.zeros(pool, 2, PAGE, hkv, D, dtype=dtype)
    rows, kvs = [], []
    for n in lens:
        pages, order = order[: -(-n // PAGE)], order[-(-n // PAGE):]
        k, v = torch.randn(n, hkv, D, generator=g) * 2, torch.randn(n, hkv, D, generator=g)
        for r in range(n):
            cache[pages[r // PAGE], 0, r % PAGE], cache[pages[r // PAGE], 1, r % PAGE] = k[r].to(dtype), v[r].to(dtype)
        rows.append(AttnRows(pages, 0, 0, n, False))
        kvs.append((k.to(dtype).float(), v.to(dtype).float()))
    meta = attention.BUILDERS["kernel"].build(rows, PAGE, None, causal=False)
    q = torch.randn(sum(lens), hq, D, generator=g) * 2
    one = on_threads(1, lambda: paged_attention(q, cache, meta, D**-0.5))
    two = on_threads(2, lambda: paged_attention(q, cache, meta, D**-0.5))
    assert taken == [True] * (2 * len(lens)) and all(c.mask is None for c in meta.prefills)
    assert torch.equal(one, two)
    at = 0
    for n, (k, v) in zip(lens, kvs):
        ref = F.scaled_dot_product_attention(q[at : at + n].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             scale=D**-0.5, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(one[at : at + n], ref, rtol=1e-5, atol=1e-5)
        at += n


def test_chunks_with_decode_rows(taken):
    """A step with a decode entry (the decode kernel) before two prefill chunks: each chunk's
    rows go to their own rows of the output."""
    g = torch.Generator().manual_seed(2)
    hq, hkv = 9, 3
    shapes = [(25, 1, True), (40, 17, False), (0, 33, False)]
    cache = torch.zeros(40, 2, PAGE, hkv, D)
    free = torch.randperm(40, generator=g).tolist()
    rows, kvs = [], []
    for cached, new, dec in shapes:
        k, v = torch.randn(cached + new, hkv, D, generator=g), torch.randn(cached + new, hkv, D, generator=g)
        pages = [free.pop() for _ in range(-(-(cached + new) // PAGE))]
        for r in range(cached + new):
            cache[pages[r // PAGE], 0, r % PAGE], cache[pages[r // PAGE], 1, r % PAGE] = k[r], v[r]
        rows.append(AttnRows(pages, 0, cached, new, dec))
        kvs.append((k, v))
    meta = build_metadata(rows, PAGE, backend="kernel")
    q = torch.randn(sum(s[1] for s in shapes), hq, D, generator=g)
    out = paged_attention(q, cache, meta, D**-0.5)
    assert taken == [True, True]
    t = 0
    for (_, new, _), (k, v) in zip(shapes, kvs):
        torch.testing.assert_close(out[t : t + new], reference(q[t : t + new], k, v, None), rtol=1e-5, atol=1e-5)
        t += new


def test_left_to_torch(taken):
    """Bidirectional blocks, soft-capping and the torch backend's metadata keep torch's path."""
    q, cache, meta, k, v = setup(17, 30, 9, 3, torch.float32)
    blocks = build_metadata([AttnRows(list(meta.prefills[0].pages.tolist()), 0, 30, 17, False, ((35, 40),))],
                            PAGE, backend="kernel")
    torch_meta = build_metadata([AttnRows(list(meta.prefills[0].pages.tolist()), 0, 30, 17, False)], PAGE,
                                backend="torch")
    assert not blocks.prefills[0].plain and not torch_meta.prefills[0].plain
    paged_attention(q, cache, blocks, D**-0.5)
    assert meta.prefills[0].mask is None
    paged_attention(q, cache, meta, D**-0.5, softcap=30.0)
    # the torch path built the plain chunk's mask when it ran it: bottom-right causal over the cached rows
    assert torch.equal(meta.prefills[0].mask, attention.window_mask(torch.arange(30, 47), torch.arange(47), None))
    torch.testing.assert_close(paged_attention(q, cache, torch_meta, D**-0.5), reference(q, k, v, None))
    assert taken == []


def test_refused_shapes_fall_back(taken):
    """A head_dim the kernel does not take (not a multiple of 8): torch's path, same answer."""
    g = torch.Generator().manual_seed(3)
    d = 12
    cache = torch.randn(4, 2, PAGE, 1, d, generator=g)
    meta = build_metadata([AttnRows([2, 0], 0, 10, 9, False)], PAGE, backend="kernel")
    q = torch.randn(9, 2, d, generator=g)
    out = paged_attention(q, cache, meta, d**-0.5)
    assert taken == [False]
    k = cache[[2, 0], 0].reshape(-1, 1, d)[:19]
    v = cache[[2, 0], 1].reshape(-1, 1, d)[:19]
    mask = attention.window_mask(torch.arange(10, 19), torch.arange(19), None)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=d**-0.5, enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(0, 1))
