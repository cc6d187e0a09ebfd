"""bfloat16 KV pages on the CPU's C path (kernels/paged_attention.c `mstar_write_kv_bf16`,
`mstar_paged_decode_bf16`) against torch's path on the same pages: writes bit for bit
(rounded to nearest even as `.to(torch.bfloat16)`), decode attention within float32
rounding of torch's, and bitwise the float32 kernel's on the pages widened."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker import attention, cpu_kernels
from services.gpu_worker.attention import build_metadata, paged_attention, write_kv

pytestmark = pytest.mark.kernels


@pytest.fixture(autouse=True)
def kernels():
    if cpu_kernels.library() is None or attention._bf16_kernels() is None:
        pytest.skip("no C compiler here: the CPU kernels did not build")


def torch_path(monkeypatch):
    """Both kernels off for the rest of the test's `with` block (the decode_path fixture's way)."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def strided_rows(t: int, hkv: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as the model makes them: column slices of one fused qkv row (rows strided)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (4 + 2) * hkv * d, generator=g) * 3
    k = qkv[:, 4 * hkv * d : 5 * hkv * d].view(t, hkv, d)
    v = qkv[:, 5 * hkv * d :].view(t, hkv, d)
    return k, v


def test_write_kv_rounds_as_torch(monkeypatch):
    hkv, d, ps, t = 3, 64, 16, 37
    k, v = strided_rows(t, hkv, d, 0)
    # the edge cases of rounding: ties both ways, overflow to inf, denormals, signed zeros, NaN
    edge = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.3961e38, 3.4e38, -3.4e38, 1e-39, -1e-39,
                         1e-45, 0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1.00390625])
    k[0, 0, : edge.numel()] = edge
    v[1, 2, -edge.numel() :] = edge
    pages = torch.randperm(12)[:-(-t // ps)].tolist()
    meta = build_metadata([(pages, 0, 0, t, False)], ps)
    ours = torch.zeros(12, 2, ps, hkv, d, dtype=torch.bfloat16)
    write_kv(ours, k, v, meta)
    torch_path(monkeypatch)
    ref = torch.zeros_like(ours)
    write_kv(ref, k, v, meta)
    assert torch.equal(bits(ours), bits(ref))
    assert bits(ours).ne(0).any()


def test_write_kv_bf16_calls_the_kernel(monkeypatch):
    """The float32 rows into bfloat16 pages go through the C kernel, not torch's indexing."""
    calls = []
    write, decode = attention._bf16_kernels()
    monkeypatch.setattr(attention, "_bf16_kernels", lambda: (lambda *a: calls.append(a) or write(*a), decode))
    k, v = strided_rows(3, 2, 8, 1)
    cache = torch.zeros(4, 2, 4, 2, 8, dtype=torch.bfloat16)
    write_kv(cache, k, v, build_metadata([([2], 0, 0, 3, False)], 4))
    assert len(calls) == 1
    assert torch.equal(cache[2, 0, :3], k.to(torch.bfloat16)) and torch.equal(cache[2, 1, :3], v.to(torch.bfloat16))


def step(shapes, hq, hkv, d, ps, window=None, seed=0):
    """A step over a bfloat16 pool with earlier rows in place: (cache, q, k, v, metadata)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(64, 2, ps, hkv, d, dtype=torch.bfloat16)
    perm = torch.randperm(64, generator=g).tolist()
    rows, new_k, new_v = [], [], []
    for cached, new, decode in shapes:
        pages = [perm.pop() for _ in range(-(-(cached + new) // ps))]
        k = torch.randn(cached + new, hkv, d, generator=g)
        v = torch.randn(cached + new, hkv, d, generator=g)
        for r in range(cached):
            cache[pages[r // ps], 0, r % ps] = k[r].to(torch.bfloat16)
            cache[pages[r // ps], 1, r % ps] = v[r].to(torch.bfloat16)
        rows.append((pages, 0, cached, new, decode))
        new_k.append(k[cached:])
        new_v.append(v[cached:])
    k, v = torch.cat(new_k), torch.cat(new_v)
    q = torch.randn(k.shape[0], hq, d, generator=g)
    return cache, q, k, v, build_metadata(rows, ps, window)


def run(cache, q, k, v, meta, scale):
    cache = cache.clone()
    write_kv(cache, k, v, meta)
    return paged_attention(q, cache, meta, scale), cache


CASES = [
    # (cached rows, new rows, decode?) per request, decodes first; heads (hq, hkv, d); page size; window
    ([(9, 1, True), (3, 1, True), (40, 1, True), (0, 7, False), (5, 6, False)], (9, 3, 64), 16, None),
    ([(130, 1, True), (17, 1, True), (1, 1, True)], (4, 2, 32), 8, None),
    ([(20, 3, True), (7, 2, True), (0, 5, False)], (8, 2, 64), 4, None),  # speculative entries of 3 and 2 rows
    ([(50, 1, True), (12, 1, True)], (6, 6, 48), 16, 9),  # sliding window, no GQA, head size not 64
]


@pytest.mark.parametrize("shapes, heads, ps, window", CASES)
def test_decode_matches_torch_path(monkeypatch, shapes, heads, ps, window):
    hq, hkv, d = heads
    cache, q, k, v, meta = step(shapes, hq, hkv, d, ps, window)
    used = []
    real = attention._decode_kernel
    monkeypatch.setattr(attention, "_decode_kernel", lambda *a: used.append(real(*a)) or used[-1])
    ours, ours_cache = run(cache, q, k, v, meta, d**-0.5)
    assert used and all(u is not None for u in used), "the decode rows did not go through the bf16 kernel"
    torch_path(monkeypatch)
    _, _, _, _, meta_t = step(shapes, hq, hkv, d, ps, window)  # the torch path's own metadata
    ref, ref_cache = run(cache, q, k, v, meta_t, d**-0.5)
    assert torch.equal(bits(ours_cache), bits(ref_cache))
    torch.testing.assert_close(ours, ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("shapes, heads, ps, window", CASES)
def test_decode_is_the_float32_kernel_on_widened_pages(shapes, heads, ps, window):
    """bf16 -> f32 is exact, so the bf16 kernel is the f32 kernel run on the widened pool, bit for bit."""
    hq, hkv, d = heads
    cache, q, k, v, meta = step(shapes, hq, hkv, d, ps, window)
    ours, filled = run(cache, q, k, v, meta, d**-0.5)
    wide = filled.float()
    rows = meta.decode.query[0]
    out_f32 = torch.zeros_like(q)
    assert attention._decode_kernel(q, wide, meta.decode, d**-0.5, out_f32) is not None
    out_bf16 = torch.zeros_like(q)
    assert attention._decode_kernel(q, filled, meta.decode, d**-0.5, out_bf16) is not None
    assert torch.equal(out_bf16[rows], out_f32[rows])
    assert torch.equal(ours[rows], out_bf16[rows])


def test_float16_pages_keep_the_torch_path():
    """No kernel reads float16 pages: the runner's pick is torch's builder, which reads them
    into the queries' dtype (and the kernel's metadata on them is refused, not misread)."""
    assert attention.cpu_backend(torch.float16) == "torch"
    cache, q, _, _, meta = step([(5, 1, True)], 4, 2, 16, 4)
    half = cache.to(torch.float16)
    rows = [([0, 1], 0, 5, 1, True)]
    with pytest.raises(RuntimeError, match=r"cannot take torch\.float32 queries of 4 heads on torch\.float16 pages"):
        attention._decode_kernel(q, half, meta.decode, 0.25, torch.empty_like(q))
    out = paged_attention(q, half, build_metadata(rows, 4, None, "torch"), 0.25)
    ref = paged_attention(q, half.float(), build_metadata(rows, 4, None, "torch"), 0.25)
    torch.testing.assert_close(out, ref)
