"""The decode step's layer stack in one C call (modeling/decoder/cpu_stack.py, kernels/decode_stack.c)
gives bitwise the torch modules' result: the same logits and the same KV pages, on
quantized Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norms) and Gemma 3 (q/k norms, sandwich
norms, GELU, sliding-window layers with their own RoPE) GGUF models, one whose q/k/v and
gate/up GEMMs run apart (types whose forms do not concatenate), and on float32 checkpoints
(gemm.c's packed GEMMs, the gate/up GEMM with silu * up fused), for decode steps of one and several
rows at different lengths, on float32, bfloat16 and int8 pages; steps it does not take (a
prefill, float16 pages) go through the modules."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from bench.perplexity import load
from services.gpu_worker.attention import BUILDERS, AttnRows, KernelBuilder, build_metadata, cpu_backend
from services.gpu_worker.kv_memory import kv_cache
from services.gpu_worker.layers import quant
from shared.model_config import SLIDING
from tests.checkpoints import make_checkpoint
from tests.gguf_files import gguf_checkpoint_overrides, write_gguf

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not quant.available(), reason="no quantized GEMM kernel")]

#: q/k/v in one form (fused into one GEMM), gate/up too, both forms present
QTYPES = {"token_embd.weight": "Q8_0", "output.weight": "Q8_0", "attn_q.weight": "Q4_1", "attn_k.weight": "Q4_1",
          "attn_v.weight": "Q4_1", "attn_output.weight": "Q4_0", "ffn_gate.weight": "Q4_1",
          "ffn_up.weight": "Q4_1", "ffn_down.weight": "Q8_0"}
#: forms that do not concatenate (Q4_1 q/k beside a Q8_0 v, a Q4_1 gate beside a Q5_0 up): the
#: GEMMs run apart (QuantParts), the stack runs each into its columns
PARTS_QTYPES = {**QTYPES, "attn_v.weight": "Q8_0", "ffn_up.weight": "Q5_0"}
PAGE = 16


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3", "llama-float32", "qwen2-float32",
                                        "gemma3-float32", "llama-parts", "qwen3_moe-float32", "qwen3_moe-q8_0",
                                        "gpt_oss-float32", "gpt_oss-mxfp4"])
def model(request, tmp_path_factory):
    """A quantized GGUF model, or a float32 checkpoint on gemm.c's packed GEMMs (those are
    used with one torch thread, as the worker has on a 2-core machine). Gemma 3: five
    sliding-window layers of six, their own RoPE base (what a GGUF file of it holds)."""
    arch, _, variant = request.param.partition("-")
    root = tmp_path_factory.mktemp(f"stack-{request.param}")
    if variant == "q8_0":  # a mixture of experts in llama.cpp's converter's file: experts in their Q8_0 blocks
        return _converted_moe(root)
    if variant == "mxfp4":  # gpt-oss as released: its experts in MXFP4 blocks, kept so
        from tests.mxfp4 import mxfp4_folders

        folder = mxfp4_folders(make_checkpoint(root / "ckpt", arch), root / "mx", root / "rounded")[0]
        model, spec, _ = load(str(folder), "auto", "float32")
        assert model.model.layers[0].mlp.quant is not None
        return model, spec
    ckpt = make_checkpoint(root / "ckpt", arch, **gguf_checkpoint_overrides(arch))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if variant == "float32":
            model, spec, _ = load(str(ckpt), "float32", "float32")
        else:
            path = write_gguf(ckpt, root / "model.gguf", arch, "qwen2" if arch.startswith("qwen") else "gpt2",
                              qtypes=PARTS_QTYPES if variant == "parts" else QTYPES)
            model, spec, _ = load(str(path), "auto", "float32")
            if variant == "parts":
                layer = model.model.layers[0]
                assert isinstance(layer.self_attn.qkv_proj, quant.QuantParts)
                assert isinstance(layer.mlp.gate_up_proj, quant.QuantParts)
    finally:
        torch.set_num_threads(threads)
    return model, spec


def _converted_moe(root):
    """A Qwen3-MoE checkpoint (SmolLM2's vocabulary, which the converter knows) as llama.cpp's
    converter writes it in Q8_0, loaded as the worker loads it."""
    import shutil

    from tests.llama_converter import convert, converter, smollm2_vocabulary

    if converter() is None:
        pytest.skip("llama.cpp's converter is not available (scripts/fetch-llama-converter fetches it)")
    from tokenizers import Tokenizer

    vocab = smollm2_vocabulary(root / "bpe")
    size = Tokenizer.from_file(str(vocab / "tokenizer.json")).get_vocab_size()
    ckpt = make_checkpoint(root / "ckpt", "qwen3_moe", vocab_size=size, eos_token_id=2,
                           **gguf_checkpoint_overrides("qwen3_moe"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(vocab / name, ckpt / name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, spec, _ = load(str(convert(ckpt, root / "moe.gguf", "q8_0")), "auto", "float32")
    finally:
        torch.set_num_threads(threads)
    assert model.model.layers[0].mlp.quant is not None  # the experts in their blocks
    return model, spec


def _pages_of_other_types_on_dense_models(m, dtype) -> None:
    """bfloat16 and int8 pages change the attention alone, which the dense families hold:
    a mixture of experts' models run on float32 pages (the CI's time, not a gap)."""
    if m.config.has_experts and dtype != torch.float32:
        pytest.skip("pages of other types: the dense families' tests (the attention is the same)")


def _caches(model, spec, dtype=torch.float32):
    """A KV tensor per layer (a Gemma's sliding and full layers in one list, as the runner
    hands them to the model)."""
    pool = next(iter(spec.paged_pools(64).values()))
    return kv_cache(len(model.model.layers), pool.num_pages, PAGE, pool.kv_heads, pool.head_dim, dtype,
                    torch.device("cpu"))


def _forward(model, caches, ids, positions, rows, stack: bool):
    saved = model.cpu_stack
    if not stack:
        model.cpu_stack = None
    try:
        backend = cpu_backend(caches[0].dtype)  # the runner's pick
        meta = build_metadata(rows, PAGE, None, backend)
        window = model.config.sliding_window
        local = build_metadata(rows, PAGE, window, backend) if window else meta  # a sliding label's rows
        metas = [local if kind == SLIDING else meta for kind in model.config.layer_types]
        with torch.inference_mode():
            return model(torch.tensor(ids), torch.tensor(positions), caches, metas, torch.arange(len(ids)))
    finally:
        model.cpu_stack = saved


def _prefilled(model, spec, lens, dtype=torch.float32):
    """Caches holding prompts of `lens` rows (request r on pages 8r..8r+7)."""
    caches = _caches(model, spec, dtype)
    for r, n in enumerate(lens):
        ids = [(7 * r + j) % 90 + 3 for j in range(n)]
        _forward(model, caches, ids, list(range(n)), [(list(range(8 * r, 8 * r + 8)), 0, 0, n, False)], stack=False)
    return caches


@contextmanager
def _runs(m):
    """The stack's answers (True: it ran the layers) while the block runs."""
    calls: list[bool] = []
    real = type(m.cpu_stack).run

    def spy(self, *args):
        calls.append(real(self, *args))
        return calls[-1]

    type(m.cpu_stack).run = spy
    try:
        yield calls
    finally:
        type(m.cpu_stack).run = real


def test_the_stack_applies_to_a_llama_shape_on_the_c_gemms(model):
    m = model[0]
    assert m.cpu_stack is not None and m.cpu_stack._ends is not None  # whole steps too, embedding to head
    if m.config.sandwich_norm:  # Gemma 3: both kinds of layer, each with its RoPE tables
        assert set(m.config.layer_types) == {"sliding_attention", "full_attention"} and len(m.rotaries) == 2


@pytest.mark.parametrize("lens", [[5], [17, 40, 3], [16, 33]])
def test_decode_steps_are_bitwise_the_modules(model, lens):
    m, spec = model
    a, b = _prefilled(m, spec, lens), _prefilled(m, spec, lens)
    for step in range(20):  # crosses page boundaries (16 rows a page)
        rows = [(list(range(8 * r, 8 * r + 8)), 0, n + step, 1, True) for r, n in enumerate(lens)]
        ids = [(11 * r + step) % 90 + 3 for r in range(len(lens))]
        pos = [n + step for n in lens]
        with _runs(m) as ran:
            got = _forward(m, a, ids, pos, rows, stack=True)
        want = _forward(m, b, ids, pos, rows, stack=False)
        assert ran == [True] and torch.equal(got, want), step
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _decode(model, caches, ids, positions, rows, sample_rows):
    """A decode step through `CpuDecodeStack.run_step` (the runner's path: the whole step
    in one call, from `KernelBuilder.host`'s plain ints), as a tensor."""
    kernel = BUILDERS["kernel"]
    assert isinstance(kernel, KernelBuilder)
    full = kernel.host(rows, PAGE, None)
    window = model.config.sliding_window
    local = kernel.host(rows, PAGE, window) if window else full
    metas = [local if kind == SLIDING else full for kind in model.config.layer_types]
    logits = model.cpu_stack.run_step(ids, positions, sample_rows, metas, caches)
    return None if logits is None else torch.from_numpy(logits.copy())


@pytest.mark.parametrize(("lens", "dtype"), [([5], torch.float32), ([17, 40, 3], torch.float32),
                                             ([9, 20], torch.bfloat16), ([9, 20], torch.int8)])
def test_whole_decode_steps_are_bitwise_the_modules(model, lens, dtype):
    """Embedding, layers, final norm and head in one call (RoPE read from the whole tables
    at each row's position, Gemma's embedding scale) give the modules' logits and pages."""
    m, spec = model
    _pages_of_other_types_on_dense_models(m, dtype)
    a, b = _prefilled(m, spec, lens, dtype), _prefilled(m, spec, lens, dtype)
    for step in range(18):  # crosses page boundaries (16 rows a page)
        rows = [(list(range(8 * r, 8 * r + 8)), 0, n + step, 1, True) for r, n in enumerate(lens)]
        ids = [(11 * r + step) % 90 + 3 for r in range(len(lens))]
        pos = [n + step for n in lens]
        got = _decode(m, a, ids, pos, rows, list(range(len(lens))))
        want = _forward(m, b, ids, pos, rows, stack=False)
        assert got is not None and torch.equal(got, want), step
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_whole_decode_step_samples_the_rows_asked_in_their_order_and_refuses_bad_ids(model):
    m, spec = model
    a, b = _prefilled(m, spec, [6, 21]), _prefilled(m, spec, [6, 21])
    rows = [(list(range(8)), 0, 6, 1, True), (list(range(8, 16)), 0, 21, 1, True)]
    got = _decode(m, a, [9, 4], [6, 21], rows, [1])
    want = _forward(m, b, [9, 4], [6, 21], rows, stack=False)
    assert got is not None and torch.equal(got, want[1:])
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(IndexError, match=r"a token id outside \[0, "):
        _decode(m, a, [9, 10**6], [7, 22], rows, [0, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_whole_steps_with_prompt_chunks_beside_decode_rows_are_bitwise_the_modules(model, dtype):
    """Decode rows, a new prompt's first chunk and another prompt's later chunk (its first
    rows already held) in one call: the chunks through the prefill kernel as the modules
    call it, the same logits and pages (a Gemma's sliding layers under their window)."""
    m, spec = model
    _pages_of_other_types_on_dense_models(m, dtype)
    a, b = _prefilled(m, spec, [5, 17, 10], dtype), _prefilled(m, spec, [5, 17, 10], dtype)
    fresh = [(31 * j) % 90 + 3 for j in range(12)]
    later = [(13 * j) % 90 + 3 for j in range(9)]
    rows = [(list(range(8)), 0, 5, 1, True), (list(range(8, 16)), 0, 17, 1, True),
            (list(range(16, 24)), 0, 10, 9, False), (list(range(24, 32)), 0, 0, 12, False)]
    ids, pos = [7, 8, *later, *fresh], [5, 17, *range(10, 19), *range(12)]
    sample = [0, 1, 10, 22]  # the decode rows, the last row of each chunk
    got = _decode(m, a, ids, pos, rows, sample)
    full = _forward(m, b, ids, pos, rows, stack=False)
    assert got is not None and torch.equal(got, full[sample])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_whole_step_declines_float16_pages_and_a_chunk_the_kernel_does_not_take(model):
    m, spec = model
    kernel = BUILDERS["kernel"]
    assert isinstance(kernel, KernelBuilder)
    image = AttnRows(list(range(8, 16)), 0, 0, 6, False, ((1, 4),))  # bidirectional block: not plain
    assert kernel.host([(list(range(8)), 0, 4, 1, True), image], PAGE, None) is None
    caches = _prefilled(m, spec, [4], torch.float16)
    assert _decode(m, caches, [5], [4], [(list(range(8)), 0, 4, 1, True)], [0]) is None


def test_a_prefill_step_goes_through_the_modules(model):
    m, spec = model
    caches = _prefilled(m, spec, [4])
    rows = [(list(range(8)), 0, 4, 1, True), (list(range(8, 16)), 0, 0, 6, False)]
    with _runs(m) as ran:
        _forward(m, caches, [5, *range(10, 16)], [4, *range(6)], rows, stack=True)
    assert ran == [False]


def test_bfloat16_and_int8_pages_are_bitwise_the_modules_and_float16_goes_through_them(model):
    m, spec = model
    _pages_of_other_types_on_dense_models(m, torch.bfloat16)
    for dtype, runs in ((torch.bfloat16, True), (torch.int8, True), (torch.float16, False)):
        a, b = _prefilled(m, spec, [9, 20], dtype), _prefilled(m, spec, [9, 20], dtype)
        for step in range(3):
            rows = [(list(range(8)), 0, 9 + step, 1, True), (list(range(8, 16)), 0, 20 + step, 1, True)]
            with _runs(m) as ran:
                got = _forward(m, a, [4, 7], [9 + step, 20 + step], rows, stack=True)
            assert ran == [runs], dtype
            assert torch.equal(got, _forward(m, b, [4, 7], [9 + step, 20 + step], rows, stack=False)), dtype
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_long_prefill_runs_the_mlp_in_slices_with_the_same_bits(model, monkeypatch):
    """Past MLP_ROWS rows the MLP runs slice by slice (its intermediate is most of a long
    step's memory); on the C kernels rows are independent, so the logits are the same."""
    from services.gpu_worker.modeling.decoder import lm as decoder_lm

    m, spec = model
    if m.config.has_experts:
        pytest.skip("a mixture of experts has no dense MLP to slice (each expert takes its rows)")
    ids = [(5 * j) % 90 + 3 for j in range(300)]
    rows = [(list(range(64)), 0, 0, 300, False)]
    sliced = _forward(m, _caches(m, spec), ids, list(range(300)), rows, stack=False)
    monkeypatch.setattr(decoder_lm, "MLP_ROWS", 10**6)
    whole = _forward(m, _caches(m, spec), ids, list(range(300)), rows, stack=False)
    monkeypatch.setattr(decoder_lm, "MLP_ROWS", 64)
    assert torch.equal(sliced, whole)
    assert torch.equal(_forward(m, _caches(m, spec), ids, list(range(300)), rows, stack=False), whole)
    assert m.model.layers[0].mlp._rows_independent()


def _in_pieces(m, caches, ids, positions, rows, sample_rows, monkeypatch):
    """The runner's long-step path (`host_pieces`): the step in pieces of at most 8 rows,
    one `run_step` each, their sampled rows' logits in order."""
    import numpy as np

    from services.gpu_worker.runners import base

    monkeypatch.setattr(base, "MAX_CHUNK_ROWS", 8)
    pieces = base.host_pieces({"kv": [AttnRows(*r) for r in rows]}, len(ids), sample_rows)
    assert pieces is not None and len(pieces) > 2
    out = []
    for part, lo, hi, sampled in pieces:
        got = _decode(m, caches, ids[lo:hi], positions[lo:hi], part["kv"], sampled)
        assert got is not None
        out.append(got.numpy())
    return torch.from_numpy(np.concatenate(out))


def test_a_step_longer_than_a_call_runs_in_pieces_with_the_same_bits(model, monkeypatch):
    """Decode rows and two prompt chunks, cut into pieces (each chunk across two): the
    same logits and pages as the modules' one forward of the whole step."""
    m, spec = model
    a, b = _prefilled(m, spec, [5, 17, 10]), _prefilled(m, spec, [5, 17, 10])
    fresh = [(31 * j) % 90 + 3 for j in range(12)]
    later = [(13 * j) % 90 + 3 for j in range(9)]
    rows = [(list(range(8)), 0, 5, 1, True), (list(range(8, 16)), 0, 17, 1, True),
            (list(range(16, 24)), 0, 10, 9, False), (list(range(24, 32)), 0, 0, 12, False)]
    ids, pos = [7, 8, *later, *fresh], [5, 17, *range(10, 19), *range(12)]
    sample = [0, 1, 10, 22]
    got = _in_pieces(m, a, ids, pos, rows, sample, monkeypatch)
    full = _forward(m, b, ids, pos, rows, stack=False)
    assert torch.equal(got, full[sample])
    assert all(torch.equal(x, y) for x, y in zip(a, b))
