"""int8 KV pages (`--kv-cache-dtype int8`): each (row, KV head) vector stored as head_dim int8
values then its float32 scale (absmax / 127). The C write stores torch's `quantize_kv` bytes;
a value reads back within half a step of its scale; the C decode kernel (one partition and
the split path, GQA, head sizes 32 / 64 / 128, 1 and 2 threads, alone or in a batch) and the
C prefill kernel (causal over cached rows, sliding windows) match SDPA on the dequantized
pages, and the torch fallback path (gathered pages, dequantized) matches the kernels; the
pool's bytes per page count the scales; the deployment refuses int8 where it is not served."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.gpu_worker import attention, cpu_kernels
from services.gpu_worker.attention import (
    AttnRows,
    build_metadata,
    dequantize_kv,
    paged_attention,
    quantize_kv,
    write_kv,
)
from services.gpu_worker.kv_memory import kv_cache
from services.gpu_worker.layers import quant
from shared.config import Deployment, kv_dtype
from shared.layout import PagedKVConfig, kv_head_bytes
from shared.model_source import ModelSource
from shared.specs.base import DeploymentError
from shared.specs.decoder_lm import DecoderLMSpec
from tests.checkpoints import make_checkpoint
from tests.unit.test_decode_attention_split import kernel, reference

pytestmark = pytest.mark.kernels

PAGE = 16


@pytest.fixture
def kernels():
    if cpu_kernels.library() is None or attention._i8_kernels() is None:
        pytest.skip("no C compiler here: the CPU kernels did not build")


def filled(shapes, heads, page_size=PAGE, seed=0, window=None):
    """An int8 pool holding each entry's cached + new rows (pages scattered), written through the
    C write, the queries, the kernel's decode metadata and the rows' (k, v) as written."""
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    per = [-(-(c + n) // page_size) for c, n in shapes]
    n_pages = sum(per) + 1
    cache = kv_cache(1, n_pages, page_size, hkv, d, torch.int8, torch.device("cpu"))[0]
    free = torch.randperm(n_pages, generator=g).tolist()
    rows = [([free.pop() for _ in range(p)], 0, c, n, True) for p, (c, n) in zip(per, shapes)]
    whole = [AttnRows(pages, 0, 0, c + n, False) for pages, _, c, n, _ in rows]
    t = sum(c + n for c, n in shapes)
    k, v = torch.randn(t, hkv, d, generator=g) * 2, torch.randn(t, hkv, d, generator=g)
    write_kv(cache, k, v, build_metadata(whole, page_size, backend="kernel"))
    q = torch.randn(sum(n for _, n in shapes), hq, d, generator=g)
    return cache, q, build_metadata(rows, page_size, window, backend="kernel")


def test_c_write_stores_torchs_quantization_and_reads_back_within_half_a_step(kernels):
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(50, 3, 64, generator=g) * 3, torch.randn(50, 3, 64, generator=g)
    k[7, 1] = 0.0  # an all-zero head: scale 0, zeros
    rows = [AttnRows(list(range(4)), 0, 0, 50, False)]
    a = kv_cache(1, 4, PAGE, 3, 64, torch.int8, torch.device("cpu"))[0]
    b = torch.zeros_like(a)
    write_kv(a, k, v, build_metadata(rows, PAGE, backend="kernel"))
    write_kv(b, k, v, build_metadata(rows, PAGE, backend="torch"))  # torch's indexing + quantize_kv
    assert torch.equal(a, b)
    assert torch.equal(a[:, 0].reshape(-1, 3, 68)[:50], quantize_kv(k))
    back = dequantize_kv(a[:, 0]).reshape(-1, 3, 64)[:50]
    step = k.abs().amax(-1, keepdim=True) / 127
    assert ((back - k).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
    assert torch.equal(back[7, 1], torch.zeros(64))
    assert quantize_kv(k).abs().max() <= 127


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 64), (8, 2, 128), (4, 1, 256), (6, 2, 32)])
@pytest.mark.parametrize("lengths", [[1], [100], [2100], [1, 100, 2100, 5000, 513]])
def test_decode_matches_sdpa_on_dequantized_pages_on_any_thread_count(kernels, restore_threads, heads, lengths):
    cache, q, meta = filled([(n - 1, 1) for n in lengths], heads)
    one, two = kernel(cache, q, meta, 1), kernel(cache, q, meta, 2)
    assert torch.equal(one, two), "the thread count changed the result"
    ref = reference(cache, q, meta)
    torch.testing.assert_close(one, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_decode_is_the_float32_kernel_on_the_dequantized_pages(kernels, restore_threads):
    cache, q, meta = filled([(4999, 1), (511, 1), (512, 1), (1024, 1)], (9, 3, 64), seed=6)
    widened = dequantize_kv(cache).contiguous()
    assert torch.equal(kernel(cache, q, meta, 2), kernel(widened, q, meta, 2))


def test_a_row_is_the_same_bits_alone_and_in_a_batch(kernels, restore_threads):
    shapes = [(2999, 1), (40, 1), (700, 1)]
    cache, q, meta = filled(shapes, (9, 3, 64), seed=3)
    both = kernel(cache, q, meta, 2)
    dec = meta.decode
    for i in range(len(shapes)):
        alone = attention.KernelDecode(dec.pages[i : i + 1].contiguous(),
                                       torch.tensor([[0], [0], *dec.query[2:, i : i + 1].tolist()]))
        out = torch.zeros(1, 9, 64)
        attention._decode_kernel(q[i : i + 1], cache, alone, 64**-0.5, out)
        assert torch.equal(out[0], both[i]), i


def test_speculative_rows_and_a_window(kernels, restore_threads):
    cache, q, meta = filled([(1200, 3), (600, 2)], (9, 3, 64), page_size=8, window=500, seed=5)
    assert meta.decode.query[2].min() > 0
    one = kernel(cache, q, meta, 1)
    assert torch.equal(one, kernel(cache, q, meta, 2))
    torch.testing.assert_close(one, reference(cache, q, meta), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_len,cached,window", [(300, 0, None), (17, 200, None), (1, 530, None), (64, 300, 100)])
def test_prefill_kernel_and_torch_path_match_sdpa_on_dequantized_pages(kernels, restore_threads, q_len, cached,
                                                                       window):
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, n = 9, 3, 64, cached + q_len
    first_page = 0 if window is None else max(0, cached - window) // PAGE
    pages = torch.randperm(-(-n // PAGE) + 5, generator=g)[: -(-n // PAGE)].tolist()
    cache = kv_cache(1, len(pages) + 5, PAGE, hkv, d, torch.int8, torch.device("cpu"))[0]
    k, v = torch.randn(n, hkv, d, generator=g) * 2, torch.randn(n, hkv, d, generator=g)
    write_kv(cache, k, v, build_metadata([AttnRows(pages, 0, 0, n, False)], PAGE, backend="kernel"))
    live = pages[first_page:]
    q = torch.randn(q_len, hq, d, generator=g)
    kd = dequantize_kv(cache[pages, 0]).reshape(-1, hkv, d)[:n]
    vd = dequantize_kv(cache[pages, 1]).reshape(-1, hkv, d)[:n]
    mask = attention.window_mask(torch.arange(cached, n), torch.arange(n), window)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), kd.transpose(0, 1), vd.transpose(0, 1), attn_mask=mask,
                                         scale=d**-0.5, enable_gqa=True).transpose(0, 1)
    outs = []
    for backend, threads in (("kernel", 1), ("kernel", 2), ("torch", 1)):
        quant.set_threads(threads)
        meta = build_metadata([AttnRows(live, first_page, cached, q_len, q_len == 1)], PAGE, window, backend=backend)
        outs.append(paged_attention(q, cache, meta, d**-0.5))
        torch.testing.assert_close(outs[-1], ref, rtol=1e-5, atol=2e-5)
    assert torch.equal(outs[0], outs[1]), "the thread count changed the result"


def test_pool_bytes_per_page_count_the_scales():
    assert kv_head_bytes("int8", 64) == 68 and kv_head_bytes("bfloat16", 64) == 128
    pool = PagedKVConfig("kv", 30, 3, 64, "int8", 16, 10, 2048)
    assert pool.bytes_per_page == 30 * 2 * 16 * 3 * 68
    spec = DecoderLMSpec({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 576,
                          "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                          "intermediate_size": 1536, "max_position_embeddings": 2048}, page_size=16, dtype="int8")
    assert spec.bytes_per_page(16) == pool.bytes_per_page == next(iter(spec.paged_pools(10).values())).bytes_per_page
    t = kv_cache(2, 10, 16, 3, 64, torch.int8, torch.device("cpu"))
    assert len(t) == 2 and t[0].shape == (10, 2, 16, 3, 68) and t[0].nbytes * 30 == pool.bytes_per_page * 10


def test_int8_is_opt_in_and_refused_where_it_is_not_served(monkeypatch, tmp_path):
    monkeypatch.delenv("MSTAR_DEVICE", raising=False)
    assert kv_dtype(Deployment(kv_cache_dtype="int8")) == "int8"
    assert kv_dtype(Deployment(dtype="float32")) == "float32"  # auto never picks int8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Deployment(kv_cache_dtype="int4")
    monkeypatch.setenv("MSTAR_DEVICE", "cuda")
    with pytest.raises(ValueError, match="kv_cache_dtype int8 is the CPU path's"):
        Deployment(kv_cache_dtype="int8")
    monkeypatch.delenv("MSTAR_DEVICE")
    source = ModelSource(str(make_checkpoint(tmp_path / "llama", "llama")))
    assert source.spec(16, 0, "int8").int8_kv
    with pytest.raises(DeploymentError, match=r"kv_cache_dtype int8: LlamaForCausalLM models .*pooling"):
        source.spec(16, 0, "int8", task="embed")
