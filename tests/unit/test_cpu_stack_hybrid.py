"""A hybrid's (Qwen3.5's) decode step in one C call (modeling/hybrid/cpu_stack.py,
kernels/decode_stack.c) gives bitwise the torch modules' result: the same logits, KV pages
and state slots (conv window and recurrent matrix), on a float32 checkpoint (gemm.c's packed
GEMMs) and on the Q8_0 file llama.cpp's converter writes of it, for decode steps of one and
several requests (a fresh slot beside continued ones), and steps with prompt chunks beside
decode rows; and the hybrid mixtures of experts (Qwen3.5-MoE: every layer sparse; Qwen3-Next:
a dense layer, top-k weights not renormalized), their gated shared expert in the C stack's
mixture block. The decoder families' tests are tests/unit/test_cpu_stack.py's."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from bench.perplexity import load
from services.gpu_worker.attention import BUILDERS, AttnRows, KernelBuilder, build_metadata, cpu_backend
from services.gpu_worker.kv_memory import kv_cache, state_cache
from services.gpu_worker.layers import quant
from services.gpu_worker.layers.delta_rule import StateBatch
from services.gpu_worker.modeling.decoder.cpu_stack import _MoE
from services.gpu_worker.modeling.hybrid.cpu_stack import state_host
from tests.checkpoints import make_checkpoint

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not quant.available(), reason="no quantized GEMM kernel")]

PAGE = 16
SLOTS = 6


def _one_thread_load(path: str, dtype: str):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return load(path, dtype, "float32")[0]
    finally:
        torch.set_num_threads(threads)


def _converted(root):
    """The checkpoint as llama.cpp's converter writes it in Q8_0 (SmolLM2's vocabulary, which
    the converter knows), loaded as the worker loads it."""
    from tokenizers import Tokenizer

    from bench.hybrid import _convert
    from tests.llama_converter import converter, smollm2_vocabulary

    if converter() is None:
        pytest.skip("llama.cpp's converter is not available (scripts/fetch-llama-converter fetches it)")
    vocab = smollm2_vocabulary(root / "bpe")
    size = Tokenizer.from_file(str(vocab / "tokenizer.json")).get_vocab_size()
    ckpt = make_checkpoint(root / "ckpt", "qwen3_5", vocab_size=size, eos_token_id=2, head_dim=64,
                           linear_key_head_dim=32, linear_value_head_dim=32)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / name).unlink(missing_ok=True)
        shutil.copy(vocab / name, ckpt / name)
    return _one_thread_load(str(_convert(ckpt, root / "q8.gguf")), "auto")  # (--no-mtp: the bench file's way)


@pytest.fixture(scope="module", params=["qwen3_5-float32", "qwen3_5-q8_0", "qwen3_5_moe-float32",
                                        "qwen3_next-float32"])
def model(request, tmp_path_factory):
    arch, _, variant = request.param.partition("-")
    root = tmp_path_factory.mktemp(f"hstack-{request.param}")
    if variant == "q8_0":
        m = _converted(root)
        assert any(isinstance(x, quant.QuantLinear) for x in m.model.layers.modules())
        return m
    ckpt = make_checkpoint(root / "ckpt", arch)
    return _one_thread_load(str(ckpt), "float32")


def _caches(m) -> list[torch.Tensor]:
    """Layer i's tensor: KV pages for an attention layer, the state pool's slots for a linear one."""
    cfg, a = m.config, m.config.attention
    linear = [layer.linear for layer in m.model.layers]
    kv = iter(kv_cache(linear.count(False), 64, PAGE, a.num_key_value_heads, a.head_dim, torch.float32,
                       torch.device("cpu")))
    states = iter(state_cache(linear.count(True), SLOTS, cfg.state_floats, torch.device("cpu")))
    return [next(states) if lin else next(kv) for lin in linear]


def _state_rows(rows) -> list[AttnRows]:
    """Each request's state label rows: its slot (request r: slot r) as its one page."""
    return [AttnRows([r], 0, row[2], row[3], row[4]) for r, row in enumerate(rows)]


def _forward(m, caches, ids, positions, rows, sample):
    """The modules' step (`Qwen35LM.forward`), metadata as the runner builds it."""
    meta = build_metadata(rows, PAGE, None, cpu_backend(torch.float32))
    srows = _state_rows(rows)
    bounds = [0]
    for r in srows:
        bounds.append(bounds[-1] + r.new)
    batch = StateBatch.build(bounds, [r.pages[0] for r in srows], [r.cached == 0 for r in srows])
    metas = [batch if layer.linear else meta for layer in m.model.layers]
    with torch.inference_mode():
        return m(torch.tensor(ids), torch.tensor(positions), caches, metas, torch.tensor(sample))


def _decode(m, caches, ids, positions, rows, sample):
    """The runner's path: the whole step in one C call from plain ints."""
    kernel = BUILDERS["kernel"]
    assert isinstance(kernel, KernelBuilder)
    host, state = kernel.host(rows, PAGE, None), state_host(_state_rows(rows))
    metas = [state if layer.linear else host for layer in m.model.layers]
    logits = m.cpu_stack.run_step(ids, positions, sample, metas, caches)
    return None if logits is None else torch.from_numpy(logits.copy())


def _prefilled(m, lens):
    """Caches holding prompts of `lens` rows (request r on pages 8r..8r+7 and slot r)."""
    caches = _caches(m)
    for r, n in enumerate(lens):
        _prefill_one(m, caches, r, [(7 * r + j) % 90 + 3 for j in range(n)])
    return caches


def _prefill_one(m, caches, r, ids):
    """Request r's prompt alone (its pages 8r.., its slot r)."""
    meta = build_metadata([(list(range(8 * r, 8 * r + 8)), 0, 0, len(ids), False)], PAGE, None,
                          cpu_backend(torch.float32))
    batch = StateBatch.build([0, len(ids)], [r], [True])
    metas = [batch if layer.linear else meta for layer in m.model.layers]
    with torch.inference_mode():
        m(torch.tensor(ids), torch.tensor(list(range(len(ids)))), caches, metas, torch.tensor([len(ids) - 1]))


def test_the_stack_applies_to_qwen3_5_on_the_c_gemms(model):
    assert model.cpu_stack is not None and model.cpu_stack._ends is not None
    assert {"linear_attention", "full_attention"} == set(model.cpu_stack.kinds)
    if model.config.attention.has_experts:  # the mixtures with their shared expert, in the C block
        moes = [lay.moe for lay in model.cpu_stack.layers if lay.moe]
        assert moes and all(ctypes.cast(p, ctypes.POINTER(_MoE)).contents.shared_inter > 0 for p in moes)


@pytest.mark.parametrize("lens", [[5], [17, 40, 3]])
def test_whole_decode_steps_are_bitwise_the_modules(model, lens):
    """Logits, KV pages and state slots after each step, over page boundaries."""
    a, b = _prefilled(model, lens), _prefilled(model, lens)
    for step in range(18):
        rows = [(list(range(8 * r, 8 * r + 8)), 0, n + step, 1, True) for r, n in enumerate(lens)]
        ids = [(11 * r + step) % 90 + 3 for r in range(len(lens))]
        pos = [n + step for n in lens]
        got = _decode(model, a, ids, pos, rows, list(range(len(lens))))
        want = _forward(model, b, ids, pos, rows, list(range(len(lens))))
        assert got is not None and torch.equal(got, want), step
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_whole_steps_with_prompt_chunks_and_a_fresh_slot_are_bitwise_the_modules(model):
    """Decode rows, a new prompt's first chunk (its slot fresh: the slot's old state never
    read) and another prompt's later chunk in one call."""
    a, b = _prefilled(model, [5, 17, 10, 7]), _prefilled(model, [5, 17, 10, 7])
    fresh = [(31 * j) % 90 + 3 for j in range(12)]
    later = [(13 * j) % 90 + 3 for j in range(9)]
    rows = [(list(range(8)), 0, 5, 1, True), (list(range(8, 16)), 0, 17, 1, True),
            (list(range(16, 24)), 0, 10, 9, False), (list(range(24, 32)), 0, 0, 12, False)]
    ids, pos = [7, 8, *later, *fresh], [5, 17, *range(10, 19), *range(12)]
    sample = [0, 1, 10, 22]
    got = _decode(model, a, ids, pos, rows, sample)
    want = _forward(model, b, ids, pos, rows, sample)
    assert got is not None and torch.equal(got, want)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_step_longer_than_a_call_runs_in_pieces_with_the_same_bits(model, monkeypatch):
    """The runner's long-step path (`host_pieces`, pieces of at most 8 rows here): a later
    piece of a prompt continues the state its earlier piece left in the slot (a fresh
    slot's first piece starts it at zero), the same logits, pages and states as the
    modules' one forward of the whole step."""
    import numpy as np

    from services.gpu_worker.runners import base

    monkeypatch.setattr(base, "MAX_CHUNK_ROWS", 8)
    a, b = _prefilled(model, [5, 17, 10, 7]), _prefilled(model, [5, 17, 10, 7])
    fresh = [(31 * j) % 90 + 3 for j in range(12)]
    later = [(13 * j) % 90 + 3 for j in range(9)]
    rows = [(list(range(8)), 0, 5, 1, True), (list(range(8, 16)), 0, 17, 1, True),
            (list(range(16, 24)), 0, 10, 9, False), (list(range(24, 32)), 0, 0, 12, False)]
    ids, pos = [7, 8, *later, *fresh], [5, 17, *range(10, 19), *range(12)]
    sample = [0, 1, 10, 22]
    pieces = base.host_pieces({"kv": [AttnRows(*r) for r in rows], "state": _state_rows(rows)}, len(ids), sample)
    assert pieces is not None and len(pieces) == 3
    kernel = BUILDERS["kernel"]
    assert isinstance(kernel, KernelBuilder)
    out = []
    for part, lo, hi, sampled in pieces:
        host, state = kernel.host(part["kv"], PAGE, None), state_host(part["state"])
        metas = [state if layer.linear else host for layer in model.model.layers]
        logits = model.cpu_stack.run_step(ids[lo:hi], pos[lo:hi], sampled, metas, a)
        assert logits is not None
        out.append(logits.copy())
    want = _forward(model, b, ids, pos, rows, sample)
    assert torch.equal(torch.from_numpy(np.concatenate(out)), want)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
