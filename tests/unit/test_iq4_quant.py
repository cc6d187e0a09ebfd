"""IQ4_NL and IQ4_XS kept at 4 bits (layers/quant.py's form 16, kernels/qgemm.c): the repack
reproduces `gguf.quants.dequantize` bit for bit (edge float16 scales included), the GEMM is
the float32 GEMM of x rounded as the kernel rounds it and that weight, a `QuantLinear` of
each type stands in for its dequantized `nn.Linear`, and GGUF files mixing the kept types as
llama.cpp's `_K_M` and `IQ4_*` files do load with every matrix kept and compute as the
float32 path does. gguf-py cannot quantize these types: blocks are random valid ones."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from services.gpu_worker import cpu_kernels
from services.gpu_worker.layers import quant
from services.gpu_worker.layers.quant import QuantEmbedding, QuantLinear
from tests.gguf_files import random_blocks, write_gguf_mix
from tests.unit.test_quant import dequantized, rounded

pytestmark = pytest.mark.kernels

needs_kernel = pytest.mark.skipif(not quant.available(), reason="no quantized GEMM kernel (compiler, AVX2)")

IQ4 = ("IQ4_NL", "IQ4_XS")

#: float16 scales at the edges: zeros of both signs, subnormals, the smallest normal, one,
#: the largest finite, and their negatives
EDGE_SCALES = np.array([0.0, -0.0, 2.0 ** -24, -(2.0 ** -24), 6.097555e-05, 6.1035156e-05, -6.1035156e-05, 1.0,
                        -1.0, 65504.0, -65504.0, 0.33325195], dtype=np.float16)


def blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    return random_blocks(qtype, n, k, np.random.default_rng(seed))


def xs_scale_bytes(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_XS's scales_h (2 bytes) and scales_l (4 bytes) holding the 6-bit group scales sc [..., 8]."""
    lo, hi = sc & 15, sc >> 4
    scales_l = (lo[..., 0::2] | (lo[..., 1::2] << 4)).astype(np.uint8)
    scales_h = sum(hi[..., g].astype(np.uint16) << (2 * g) for g in range(8)).astype(np.uint16)
    return scales_h[..., None].view(np.uint8), scales_l


def test_xs_scale_bytes_are_gguf_layout():
    """The helper above, read back by gguf: d = 1, every index 8 (value 1): each group is sc - 32."""
    sc = np.arange(64).reshape(8, 8)
    b = np.full((8, 136), 0x88, dtype=np.uint8)
    b[:, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    b[:, 2:4], b[:, 4:8] = xs_scale_bytes(sc)
    got = gguf.quants.dequantize(b, gguf.GGMLQuantizationType.IQ4_XS).reshape(8, 8, 32)
    assert (got == (sc - 32)[:, :, None]).all()


def _f16_of(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Every block's float16 d."""
    nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    return raw.reshape(-1, nbytes)[:, 0:2].copy().view(np.float16).astype(np.float32).ravel()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_iq4_types_are_kept_at_four_bits():
    assert set(IQ4) <= quant.KEPT_TYPES
    for qtype, k in (("IQ4_NL", 96), ("IQ4_XS", 512)):
        layer = QuantLinear.from_gguf(qtype, blocks(qtype, 64, k), (64, k))
        assert layer.form & ~quant.FLAGS == quant.NL and layer.m is None
        # 4-bit indices and one scale per 32: IQ4_NL's float16 (GGUF's own: 0.5625 bytes a
        # weight), IQ4_XS's d per 256 and its factor sc - 32 per 32 (0.5390625; GGUF's 0.53125)
        nbytes = layer.w.numel() * layer.w.element_size() + layer.d.numel() * layer.d.element_size()
        assert nbytes / (64 * k) == (0.5625 if qtype == "IQ4_NL" else 0.5390625)


@pytest.mark.parametrize("qtype", IQ4)
def test_repack_is_gguf_dequantization_bit_for_bit_at_edge_scales(qtype):
    k = 512 if qtype == "IQ4_XS" else 128
    n = 37
    raw = blocks(qtype, n, k, seed=3)
    b = raw.reshape(n, -1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1])  # a view: [row, block, byte]
    rows = np.arange(n) % 3 == 0  # every third row's blocks: the edge scales in turn, each several times
    edges = np.resize(EDGE_SCALES, (int(rows.sum()), b.shape[1]))
    b[rows, :, 0:2] = edges.view(np.uint8).reshape(*edges.shape, 2)
    assert set(_f16_of(raw, qtype).tolist()) >= set(EDGE_SCALES.astype(np.float32).tolist())
    if qtype == "IQ4_XS":  # every 6-bit group scale, 0 (-32) .. 63 (+31), in several blocks
        sc = np.resize(np.arange(64), (*b.shape[:2], 8))
        b[:, :, 2:4], b[:, :, 4:8] = xs_scale_bytes(sc)
    layer = QuantLinear.from_gguf(qtype, raw, (n, k))
    want = dequantized(qtype, raw, n, k)
    assert torch.equal(bits(layer.weight), bits(want))
    ids = torch.tensor([[0, 36], [5, 0], [17, 3]])
    assert torch.equal(bits(QuantEmbedding(layer)(ids)), bits(want[ids]))


@needs_kernel
@pytest.mark.parametrize("qtype", IQ4)
def test_gemm_is_the_float32_gemm_of_the_dequantized_weight(qtype):
    k = 512 if qtype == "IQ4_XS" else 160  # 160: five blocks, not a multiple of 64
    n = 45  # the last tile of 16 columns not full
    raw = blocks(qtype, n, k, seed=1)
    bias = torch.randn(n)
    layer = QuantLinear.from_gguf(qtype, raw, (n, k))
    layer.bias = bias
    w = dequantized(qtype, raw, n, k).double()
    for rows in (1, 3, 4, 6, 17, 33, 64):
        x = torch.randn(rows, k)
        y = layer(x)
        ref = (rounded(x).double() @ w.T + bias.double()).float()
        assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())), (rows, (y - ref).abs().max())
        exact = x.double() @ w.T + bias.double()  # against float32 x: x's rounding, a small error
        assert float((y - exact).abs().max()) < 1e-3 * float(exact.abs().max())


@needs_kernel
@pytest.mark.parametrize("qtype", IQ4)
def test_quant_linear_stands_in_for_its_dequantized_linear(qtype):
    n, k = 96, 768
    raw = blocks(qtype, n, k, seed=4)
    linear = torch.nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.copy_(dequantized(qtype, raw, n, k))
    layer = QuantLinear.from_gguf(qtype, raw, (n, k))
    layer.bias = linear.bias.detach().clone()
    x = torch.randn(2, 5, k)
    with torch.inference_mode():
        y, ref = layer(x), linear(x)
    assert y.shape == ref.shape == (2, 5, n)
    assert float((y - ref).abs().max()) < 1e-3 * float(ref.abs().max())
    assert torch.equal(layer.weight, linear.weight.detach())


@needs_kernel
def test_extreme_weights_do_not_overflow():
    """Every index 0 (-127) or 15 (+113) against x at +-amax: the int32 sums' largest."""
    n, k = 16, 256
    raw = blocks("IQ4_NL", n, k, seed=5).reshape(n, -1, 18)
    raw[: n // 2, :, 2:] = 0x00
    raw[n // 2:, :, 2:] = 0xFF
    raw = raw.reshape(n, -1)
    layer = QuantLinear.from_gguf("IQ4_NL", raw, (n, k))
    w = dequantized("IQ4_NL", raw, n, k).double()
    x = torch.full((2, k), 3.0)
    x[1] = -3.0
    y = layer(x)
    ref = (rounded(x).double() @ w.T).float()
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_kernel
def test_same_bits_whatever_the_threads():
    n, k = 1000, 512
    layers = [QuantLinear.from_gguf(t, blocks(t, n, k, seed=6), (n, k)) for t in IQ4]
    before = quant.threads()
    try:
        for layer in layers:
            for rows in (1, 5, 64, 200):
                x = torch.randn(rows, k)
                quant.set_threads(1)
                one = layer(x)
                for threads in (2, 3):
                    quant.set_threads(threads)
                    assert torch.equal(layer(x), one), (rows, threads)
    finally:
        quant.set_threads(before)


@needs_kernel
def test_concat_of_iq4_layers():
    a = QuantLinear.from_gguf("IQ4_XS", blocks("IQ4_XS", 32, 256, 7), (32, 256))
    c = QuantLinear.from_gguf("IQ4_NL", blocks("IQ4_NL", 40, 256, 8), (40, 256))
    assert c.form == quant.NL | quant.HALF_SCALES and a.form == quant.NL | quant.SUPER_SCALES
    both = QuantLinear.concat([a, c])
    assert both is not None and both.form == quant.NL and both.d.dtype == torch.float32  # both widened
    x = torch.randn(3, 256)
    assert torch.equal(both(x), torch.cat([a(x), c(x)], dim=1))
    assert torch.equal(both.weight, torch.cat([a.weight, c.weight]))
    q4k = QuantLinear.from_gguf("Q4_K", blocks("Q4_K", 16, 256, 9), (16, 256))
    assert QuantLinear.concat([a, q4k]) is None  # another form: kept apart


@needs_kernel
def test_kernel_refuses_an_unknown_form_or_x_width():
    lib = cpu_kernels.library()
    layer = QuantLinear.from_gguf("IQ4_NL", blocks("IQ4_NL", 16, 64), (16, 64))
    x, out = torch.randn(1, 64), torch.empty(1, 16)
    for form, xbytes in ((5, 2), (15, 2), (18, 2), (16, 0), (16, 3)):  # x in 1 or 2 bytes only (17: MXFP4)
        assert lib.mstar_qlinear(form, xbytes, x.data_ptr(), 1, 64, 64, layer.w.data_ptr(), layer.d.data_ptr(), None,
                                 16, None, out.data_ptr(), 16, 1, quant._scratch(lib, 1, 64)) == -1


# --- GGUF files mixing the kept types --------------------------------------------------

#: as a Q4_K_M / Q5_K_M file: Q4_K most matrices, Q6_K attn_v and one layer's ffn_down,
#: Q5_K others, Q8_0 the embedding (q, k, v in two forms: not fused). The tiny checkpoint
#: ties its head to the embedding (no output.weight): the head computes on the Q8_0 table.
K_MIX = {"token_embd.weight": "Q8_0", "attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K",
         "attn_output.weight": "Q5_K", "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q4_K",
         "blk.0.ffn_down.weight": "Q6_K", "ffn_down.weight": "Q5_K"}
#: as IQ4_XS / IQ4_NL files: q, k, v fused in the NL form (the C decode stack runs it), the
#: head on the IQ4_NL embedding
IQ4_MIX = {"token_embd.weight": "IQ4_NL", "attn_q.weight": "IQ4_XS", "attn_k.weight": "IQ4_XS",
           "attn_v.weight": "IQ4_XS", "attn_output.weight": "IQ4_NL", "ffn_gate.weight": "IQ4_NL",
           "ffn_up.weight": "IQ4_NL", "blk.1.ffn_down.weight": "Q8_0", "ffn_down.weight": "IQ4_XS"}
MIXES = {"k_mix": (K_MIX, {"Q4_K", "Q5_K", "Q6_K", "Q8_0"}), "iq4_mix": (IQ4_MIX, {"IQ4_NL", "IQ4_XS", "Q8_0"})}


@pytest.fixture(scope="module", params=sorted(MIXES))
def mixed_gguf(request, tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp(request.param)
    # k = 256: the K-quants' and IQ4_XS's super-block
    ckpt = make_checkpoint(root / "ckpt", "llama", hidden_size=256, intermediate_size=256)
    return write_gguf_mix(ckpt, root / "model.gguf", "llama", "gpt2", MIXES[request.param][0]), request.param


def test_mixed_file_keeps_every_matrix_bit_exact(mixed_gguf):
    from services.gpu_worker.gguf_weights import QuantTensor, load_gguf_weights

    path, mix = mixed_gguf
    _, kept = load_gguf_weights(path, progress=False, keep_quantized=quant.KEPT_TYPES)
    _, plain = load_gguf_weights(path, progress=False)
    quantized = {name: t for name, t in kept.items() if isinstance(t, QuantTensor)}
    assert {t.qtype for t in quantized.values()} == MIXES[mix][1]
    assert all(np.asarray(a).ndim == 1 for name, a in kept.items() if name not in quantized)  # norms alone
    for name, t in quantized.items():
        layer = QuantLinear.from_gguf(t.qtype, t.data, t.shape)
        assert torch.equal(layer.weight, torch.from_numpy(np.asarray(plain[name]))), name


@needs_kernel
def test_mixed_file_computes_as_the_float32_path(mixed_gguf, monkeypatch):
    from bench.perplexity import load
    from services.gpu_worker.attention import build_metadata
    from services.gpu_worker.kv_memory import kv_cache

    path, mix = mixed_gguf
    model, spec, _ = load(str(path), "auto", "float32")
    plain, _, _ = load(str(path), "float32", "float32")
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.head, QuantLinear)
    forms = {m.form & ~quant.FLAGS for m in [*model.modules(), model.head] if isinstance(m, QuantLinear)}
    assert forms == ({4, quant.Q5, quant.Q6, quant.Q8S} if mix == "k_mix" else {quant.NL, quant.Q8S})
    stack_runs: list[bool] = []
    # iq4_mix: q/k/v and gate/up fused in the NL form; k_mix: Q4_K q and k beside a Q6_K v run
    # apart (QuantParts) into one output: either way a decode step is one C call
    qkv = model.model.layers[0].self_attn.qkv_proj
    if mix == "iq4_mix":
        assert qkv.form & ~quant.FLAGS == quant.NL
    else:
        assert isinstance(qkv, quant.QuantParts) and [p.form & ~quant.FLAGS for p in qkv.layers] == [4, 4, quant.Q6]
    stack = model.cpu_stack
    assert stack is not None
    real_run = stack.run
    monkeypatch.setattr(stack, "run", lambda *a: stack_runs.append(real_run(*a)) or stack_runs[-1])

    ids = [int(i) for i in np.random.default_rng(2).integers(0, 200, 40)]
    pool = next(iter(spec.paged_pools(4).values()))

    def run(m) -> torch.Tensor:
        """A prefill of ids[:-1], then the last id as a one-row decode step: every row's logits."""
        caches = kv_cache(pool.num_layers, pool.num_pages, 16, pool.kv_heads, pool.head_dim, torch.float32,
                          torch.device("cpu"))
        pages, n = list(range(pool.num_pages)), len(ids) - 1
        with torch.inference_mode():
            meta = build_metadata([(pages, 0, 0, n, False)], 16)
            a = m(torch.tensor(ids[:n]), torch.arange(n), caches, [meta] * len(caches), torch.arange(n))
            meta = build_metadata([(pages, 0, n, 1, True)], 16)
            b = m(torch.tensor(ids[n:]), torch.tensor([n]), caches, [meta] * len(caches), torch.arange(1))
        return torch.cat([a, b])

    ours, ref = run(model), run(plain)
    assert stack_runs == [False, True]  # the prefill on the modules, the decode step in C
    assert torch.isfinite(ours).all()
    err = float((ours - ref).abs().max()) / float(ref.abs().max())
    assert err < 2e-3, err
