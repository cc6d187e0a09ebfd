"""Paged attention against a dense reference, on both decode paths (the C kernel reading
pages in place, and torch's gather + SDPA): mixed decode rows and prefill chunks (with
cached rows, so the bottom-right causal mask matters), GQA, pages scattered through the
pool, sliding windows, speculative multi-row entries."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker import attention, cpu_kernels
from services.gpu_worker.attention import bottom_right_causal_mask, build_metadata, paged_attention, write_kv

pytestmark = pytest.mark.kernels


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    """Run the test on one decode path; on "kernel", fail if the kernel did not take the
    decode rows (it builds wherever a C compiler is, as on CI)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "library", lambda: None)  # both kernels off: write_kv too
        yield request.param
        return
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler here: the CPU kernels did not build")
    used = []
    real = attention._decode_kernel

    def spy(*args):
        used.append(real(*args))
        return used[-1]

    monkeypatch.setattr(attention, "_decode_kernel", spy)
    yield request.param
    assert used and all(u is not None for u in used), "the decode rows did not go through the kernel"


def dense_attention(q, k, v, scale, window=None):
    """q [q, Hq, D] at the end of k/v [kv, Hkv, D]: plain softmax attention, GQA by repeat."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = bottom_right_causal_mask(q.shape[0], k.shape[0])
    if window is not None:
        qpos = torch.arange(k.shape[0] - q.shape[0], k.shape[0]).unsqueeze(1)
        mask &= torch.arange(k.shape[0]).unsqueeze(0) > qpos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_bottom_right_mask():
    m = bottom_right_causal_mask(2, 5)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def check_paged_against_dense(shapes, window=None, seed=0, page_size=4, heads=(4, 2, 8)):
    """Requests of (cached rows, new rows, decode?) on pages scattered through a pool, the
    cached rows written as an earlier step would have: every new row's paged attention
    equals dense attention over its prefix. Returns the step's metadata."""
    torch.manual_seed(seed)
    hq, hkv, d = heads
    cache = torch.zeros(64, 2, page_size, hkv, d)
    perm = torch.randperm(64).tolist()
    full_k, full_v, pages_of = [], [], []
    for cached, new, _ in shapes:
        n = cached + new
        full_k.append(torch.randn(n, hkv, d))
        full_v.append(torch.randn(n, hkv, d))
        pages_of.append([perm.pop() for _ in range(-(-n // page_size))])
    for (cached, _, _), k, v, pages in zip(shapes, full_k, full_v, pages_of):
        for r in range(cached):
            cache[pages[r // page_size], 0, r % page_size] = k[r]
            cache[pages[r // page_size], 1, r % page_size] = v[r]
    meta = build_metadata([(pages, 0, c, n, dec) for (c, n, dec), pages in zip(shapes, pages_of)], page_size, window)
    new_k = torch.cat([k[c:] for (c, _, _), k in zip(shapes, full_k)])
    new_v = torch.cat([v[c:] for (c, _, _), v in zip(shapes, full_v)])
    q = torch.randn(new_k.shape[0], hq, d)
    write_kv(cache, new_k, new_v, meta)
    out = paged_attention(q, cache, meta, d**-0.5)
    t = 0
    for (_, new, _), k, v in zip(shapes, full_k, full_v):
        torch.testing.assert_close(out[t : t + new], dense_attention(q[t : t + new], k, v, d**-0.5, window),
                                   rtol=1e-5, atol=1e-5)
        t += new
    return meta


def test_paged_matches_dense(decode_path):
    # (cached rows, new rows, decode?) per request; decodes first.
    shapes = [(9, 1, True), (3, 1, True), (0, 7, False), (5, 6, False), (12, 3, False)]
    check_paged_against_dense(shapes)
    page_size = 4
    # FlashInfer's view of the same batch: lengths = (pages - 1) * page_size + last_page_len.
    rows = [(list(range(-(-(c + n) // page_size))), 0, c, n, d) for c, n, d in shapes]
    fi = build_metadata(rows, page_size, None, "flashinfer").flashinfer
    lens = [(fi.kv_indptr[i + 1] - fi.kv_indptr[i] - 1) * page_size + fi.kv_last_page_len[i]
            for i in range(len(shapes))]
    assert [int(x) for x in lens] == [c + n for c, n, _ in shapes]
    assert fi.kv_indices.dtype == torch.int32


def test_windowed_paged_matches_dense_after_release(decode_path):
    """Sliding window: pages wholly behind the window are gone (first_page > 0), the
    rest still attend exactly as dense attention with the window mask."""
    torch.manual_seed(1)
    page_size, hq, hkv, d, window = 4, 2, 1, 8, 6
    cache = torch.zeros(32, 2, page_size, hkv, d)
    shapes = [(17, 1, True), (10, 5, False)]
    rows, full, t_new = [], [], []
    free = list(range(32))
    for cached, new, dec in shapes:
        n = cached + new
        k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
        full.append((k, v))
        first_page = max(0, cached - window) // page_size
        pages = [free.pop() for _ in range(-(-n // page_size) - first_page)]
        for r in range(first_page * page_size, cached):
            cache[pages[r // page_size - first_page], 0, r % page_size] = k[r]
            cache[pages[r // page_size - first_page], 1, r % page_size] = v[r]
        rows.append((pages, first_page, cached, new, dec))
        t_new.append((k[cached:], v[cached:]))
    meta = build_metadata(rows, page_size, window)
    q = torch.randn(sum(n for _, n, _ in shapes), hq, d)
    write_kv(cache, torch.cat([k for k, _ in t_new]), torch.cat([v for _, v in t_new]), meta)
    out = paged_attention(q, cache, meta, d**-0.5)
    t = 0
    for (_, new, _), (k, v) in zip(shapes, full):
        torch.testing.assert_close(out[t : t + new], dense_attention(q[t : t + new], k, v, d**-0.5, window),
                                   rtol=1e-5, atol=1e-5)
        t += new


@pytest.mark.parametrize("window", [None, 5])
def test_multi_row_decode_entries_match_dense(window, decode_path):
    """Decode entries carrying speculative drafts (several rows each, batched with the
    one-row decodes and padded), beside prefill chunks: each row sees exactly its prefix."""
    shapes = [(9, 1, True), (3, 4, True), (20, 5, True), (6, 2, True), (0, 7, False), (5, 6, False)]
    meta = check_paged_against_dense(shapes, window, seed=1)
    if decode_path == "kernel":
        assert meta.decode.query.shape == (4, 1 + 4 + 5 + 2)  # every real decode row, for the kernel
    else:
        assert meta.decode.rows.shape == (4, 5)  # the torch path pads entries to 5 rows


@pytest.mark.parametrize("heads", [(8, 2, 64), (6, 6, 32), (16, 1, 128)])
def test_head_shapes_match_dense(heads, decode_path):
    """Head counts and sizes of real models (the kernel specialises head_dim 64), longer
    prefixes over 16-row pages, a decode-only step."""
    shapes = [(150, 1, True), (37, 1, True), (16, 1, True), (15, 1, True), (0, 1, True)]
    check_paged_against_dense(shapes, seed=2, page_size=16, heads=heads)


def test_each_backend_builds_only_its_own_view():
    """One builder per backend: the kernel's metadata has no torch fields, torch's none of
    the kernel's, FlashInfer's only its page table; the runner's pick follows what the
    kernel takes."""
    rows = [([3, 5], 0, 6, 1, True), ([7], 0, 0, 4, False)]
    kern, tor, fi = (build_metadata(rows, 4, None, b) for b in ("kernel", "torch", "flashinfer"))
    assert isinstance(kern.decode, attention.KernelDecode) and kern.decode.query.tolist() == [[0], [0], [0], [7]]
    assert isinstance(tor.decode, attention.TorchDecode) and tor.decode.rows.tolist() == [0]
    assert fi.decode is None and not fi.prefills and fi.flashinfer.kv_indptr.tolist() == [0, 2, 3]
    assert fi.flashinfer.qo_indptr.tolist() == [0, 1, 5] and fi.flashinfer.kv_last_page_len.tolist() == [3, 4]
    assert len(kern.prefills) == len(tor.prefills) == 1 and kern.flashinfer is tor.flashinfer is None
    if cpu_kernels.library() is not None:
        assert attention.cpu_backend(torch.float32, torch.float32, None, 8, 2) == "kernel"
        with pytest.raises(ValueError, match="no soft-capping"):
            paged_attention(torch.zeros(5, 2, 8), torch.zeros(8, 2, 4, 1, 8), kern, 1.0, softcap=30.0)
    assert attention.cpu_backend(torch.float32, torch.float32, 30.0, 8, 2) == "torch"  # Gemma 2's soft-cap
    assert attention.cpu_backend(torch.float16, torch.float32, None, 8, 2) == "torch"  # no float16 kernel
    assert attention.cpu_backend(torch.float32, torch.bfloat16, None, 8, 2) == "torch"  # bf16 queries


@pytest.mark.parametrize("window", [None, 3, 8])
def test_block_mask_is_transformers_gemma3_rule(window):
    """`window_mask` with blocks against transformers' own mask functions, as Gemma 3
    composes them (`create_masks_for_vision_model`): OR(causal, same block) on full layers,
    AND(window, OR(causal, same block)) on sliding ones; a chunk with cached rows before it."""
    from transformers.masking_utils import (
        and_masks,
        blockwise_overlay,
        causal_mask_function,
        or_masks,
        sliding_window_overlay,
    )

    blocks = ((3, 7), (9, 10), (12, 17))
    n, cached = 20, 5
    ids = torch.full((1, n), -1)
    for i, (s, e) in enumerate(blocks):
        ids[0, s:e] = i
    rule = or_masks(causal_mask_function, blockwise_overlay(ids))
    if window is not None:
        rule = and_masks(sliding_window_overlay(window), rule)
    want = torch.tensor([[bool(rule(0, 0, torch.tensor(q), torch.tensor(k))) for k in range(n)]
                         for q in range(cached, n)])
    got = attention.window_mask(torch.arange(cached, n), torch.arange(n), window, blocks)
    assert torch.equal(got, want)
    assert torch.equal(attention.window_mask(torch.arange(cached, n), torch.arange(n), window),
                       attention.window_mask(torch.arange(cached, n), torch.arange(n), window, ()))


def test_prefill_chunks_with_blocks_see_their_block_whole(decode_path):
    """A prefill chunk's rows with blocks (a decode entry beside it) attend as the dense
    reference under the block mask; the same chunk without blocks is plain causal."""
    torch.manual_seed(0)
    ps, h, d, cached, new = 4, 2, 8, 3, 9
    cache = torch.zeros(16, 2, ps, h, d)
    pages, dec_pages = [5, 2, 9], [7]
    k, v = torch.randn(cached + new, h, d), torch.randn(cached + new, h, d)
    rows = [attention.AttnRows(dec_pages, 0, 2, 1, True),
            attention.AttnRows(pages, 0, cached, new, False, ((4, 8),))]
    meta = build_metadata(rows, ps, backend=decode_path)
    old = build_metadata([attention.AttnRows(pages, 0, 0, cached, False)], ps, backend="torch")
    write_kv(cache, k[:cached], v[:cached], old)
    dk, dv = torch.randn(3, h, d), torch.randn(3, h, d)
    before = build_metadata([attention.AttnRows(dec_pages, 0, 0, 2, False)], ps, backend="torch")
    write_kv(cache, dk[:2], dv[:2], before)
    write_kv(cache, torch.cat([dk[2:], k[cached:]]), torch.cat([dv[2:], v[cached:]]), meta)
    q = torch.randn(1 + new, h, d)
    out = paged_attention(q, cache, meta, d**-0.5)
    mask = attention.window_mask(torch.arange(cached, cached + new), torch.arange(cached + new), None, ((4, 8),))
    ref = torch.nn.functional.scaled_dot_product_attention(q[1:].transpose(0, 1), k.transpose(0, 1),
                                                           v.transpose(0, 1), attn_mask=mask, scale=d**-0.5)
    torch.testing.assert_close(out[1:], ref.transpose(0, 1))
    assert not torch.equal(mask, attention.window_mask(torch.arange(cached, cached + new), torch.arange(cached + new),
                                                       None))
