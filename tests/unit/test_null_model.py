"""The null model (`--model null`) in process: its source, spec, tokenizer and torch module,
driven through the real engine and KV manager (real layouts, real pages, no compute)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.gpu_worker.attention import build_metadata
from services.gpu_worker.build import build_engine
from services.gpu_worker.kv_manager import KVManager
from services.gpu_worker.weights import build_model
from shared.frames import NewRequest, SamplingParams, pack_tensors
from shared.model_source import ModelSource
from shared.specs.base import PromptRequest
from shared.specs.decoder_lm import DecoderLMSpec
from shared.specs.null_lm import EOS_ID, VOCAB_SIZE, NullLMSpec, next_token

PAGE = 4


@pytest.fixture(scope="module")
def source():
    return ModelSource("null")


def make_engine(source, num_pages=64, max_num_seqs=8, max_batch_tokens=64):
    spec = source.spec(PAGE)
    spec.validate()
    pools = spec.paged_pools(num_pages)
    model = build_model(source, spec, torch.float32)
    caches = {n: [torch.zeros(p.num_pages, 2, p.page_size, p.kv_heads, p.head_dim) for _ in range(p.num_layers)]
              for n, p in pools.items()}
    kv = KVManager(pools, spec.kv_labels)
    engine = build_engine(model, spec, kv, caches, eos_ids=source.tokenizer.eos_token_ids, max_num_seqs=max_num_seqs,
                          max_batch_tokens=max_batch_tokens, max_seq_len=spec.max_seq_len)
    return spec, pools, kv, caches, engine


def new_request(spec, pools, rid, prompt, max_tokens, ignore_eos=True):
    ppo = spec.process_prompt(PromptRequest(prompt))
    caps = spec.clamp_caps(spec.get_loop_caps(max_tokens))
    refs, _ = pack_tensors(ppo.new_input_tensors)
    req = NewRequest(rid, "null", refs, SamplingParams(temperature=0.0, ignore_eos=ignore_eos), "api", len(prompt),
                     max_tokens, ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, pools))
    return req, ppo.new_input_tensors


def expected(prompt, n):
    out, last = [], prompt[-1]
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


def test_source_is_synthetic(source):
    assert (source.kind, source.name) == ("null", "null")
    assert source.config["architectures"] == ["NullLM"]
    assert source.tokenizer.eos_token_ids == [EOS_ID]
    tok = source.tokenizer.tokenizer
    assert tok.get_vocab_size() == VOCAB_SIZE
    text = "Hello, wörld <|im_end|>"
    ids = tok.encode(text).ids
    assert ids[:5] == list(b"Hello") and ids[-1] == EOS_ID
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_spec_is_a_decoder_lm_spec(source):
    spec = source.spec(PAGE)
    assert isinstance(spec, NullLMSpec) and isinstance(spec, DecoderLMSpec)
    assert [lab.name for lab in spec.kv_labels] == ["text"]
    pools = spec.paged_pools(8)
    assert list(pools) == ["kv"]
    p = pools["kv"]
    assert (p.num_layers, p.kv_heads, p.head_dim, p.page_size, p.num_pages) == (1, 1, 8, PAGE, 8)
    # The same layouts and caps as the real decoder LM would declare.
    ref = DecoderLMSpec(source.config, page_size=PAGE)
    prompt = [5, 6, 7, 8, 9]
    a, b = spec.process_prompt(PromptRequest(prompt)), ref.process_prompt(PromptRequest(prompt))
    assert a.kv_layout == b.kv_layout
    assert np.array_equal(a.new_input_tensors["input_ids"], b.new_input_tensors["input_ids"])
    assert spec.get_loop_caps(10) == ref.get_loop_caps(10) == {"decode_loop": 9}


def test_next_token_is_printable_and_never_eos():
    for t in range(VOCAB_SIZE):
        n = next_token(t)
        assert 0x20 <= n <= 0x7E and n != EOS_ID
    assert next_token(ord("a")) == ord("b") and next_token(0x7E) == 0x20


def test_forward_shape_and_argmax(source):
    _, _, _, caches, engine = make_engine(source)
    model = engine.runner.model

    meta = build_metadata([([3, 5], 0, 0, 6, False)], PAGE)
    cache = caches["kv"][0]
    cache.fill_(7.0)
    ids = torch.tensor([1, 2, 3, 4, 5, 0x7E])
    logits = model(ids, torch.arange(6), [cache], [meta], torch.tensor([2, 5]))
    assert logits.shape == (2, VOCAB_SIZE)
    assert logits.argmax(-1).tolist() == [next_token(3), next_token(0x7E)]
    # The six rows were written (zeros) into pages 3 and 5, nothing else touched.
    assert cache[3].abs().sum() == 0 and cache[5, :, :2].abs().sum() == 0
    assert (cache[5, :, 2:] == 7.0).all() and (cache[0] == 7.0).all()


def test_engine_runs_batches_deterministically_and_frees_pages(source):
    spec, pools, kv, _, engine = make_engine(source, num_pages=64, max_batch_tokens=16)
    prompts = {f"r{i}": list(range(10 + i, 10 + i + 3 + 5 * i)) for i in range(5)}
    lens = {f"r{i}": 1 + 4 * i for i in range(5)}
    for rid, prompt in prompts.items():
        req, tensors = new_request(spec, pools, rid, prompt, lens[rid])
        engine.add(req, tensors)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    finish: dict[str, str] = {}
    steps = 0
    while engine.has_work:
        res = engine.step()
        steps += 1
        assert not res.errors
        for _, out in res.outputs:
            got[out.request_id].extend(out.token_ids)
            if out.finish_reason:
                finish[out.request_id] = out.finish_reason
        assert steps < 1000
    for rid, prompt in prompts.items():
        assert got[rid] == expected(prompt, lens[rid])
        assert finish[rid] == "length"
    assert kv.used_pages() == 0
    assert kv.footprint_overruns == 0


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_engine_stops_at_eos_only_when_asked(source, ignore_eos):
    """The null model never samples its tokenizer's EOS, so the engine is given one it does
    produce (the 3rd token it will emit): without ignore_eos the request ends there with
    "stop"; with it, it runs to max_tokens with "length"."""
    spec, pools, kv, caches, _ = make_engine(source)
    stop_tok = expected([2], 3)[-1]
    engine = build_engine(build_model(source, spec, torch.float32), spec, kv, caches, eos_ids=[stop_tok],
                          max_num_seqs=8, max_batch_tokens=64, max_seq_len=spec.max_seq_len)
    req, tensors = new_request(spec, pools, "a", [EOS_ID, 1, 2], 6, ignore_eos=ignore_eos)
    engine.add(req, tensors)
    toks, finish = [], None
    while engine.has_work:
        for _, out in engine.step().outputs:
            toks.extend(out.token_ids)
            finish = out.finish_reason or finish
    assert (toks, finish) == ((expected([2], 6), "length") if ignore_eos else (expected([2], 3), "stop"))
    assert kv.used_pages() == 0


@pytest.mark.parametrize("scratch", [0, 2 * PAGE])
def test_debug_asserts_see_a_footprint_that_is_not_tight(source, caplog, scratch):
    """Under debug asserts, a request that ran to its caps but never reached its footprint
    (3 prompt + 5 decode rows: 2 pages of 4, against 4 with 8 declared scratch rows) is
    logged per label; a truthful one is not."""
    import logging

    import msgspec

    spec, pools, kv, _, engine = make_engine(source)
    kv.debug = True
    req, tensors = new_request(spec, pools, "r", [70, 71, 72], 6)
    if scratch:
        layout = {n: msgspec.structs.replace(lay, scratch=scratch) for n, lay in req.kv_layout.items()}
        req = msgspec.structs.replace(req, kv_layout=layout, kv_configs=spec.kv_configs(layout, req.loop_caps, pools))
    engine.add(req, tensors)
    with caplog.at_level(logging.ERROR, logger="mstar.kv"):
        while engine.has_work:
            assert not engine.step().errors
    loose = [r.getMessage() for r in caplog.records if "footprint not tight" in r.getMessage()]
    if scratch:
        assert loose == ["request r label 'text' ran to its caps but held at most 2 of its 4 footprint pages "
                         "(footprint not tight)"]
    else:
        assert loose == []
    assert kv.used_pages() == 0
