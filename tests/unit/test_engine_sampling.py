"""Logprobs and logits processors through the engine: prompt logprobs over chunked
prefills equal transformers' log-softmax, and speculation (each verify row sees the drafts
before it) changes neither the tokens nor the logprobs of a penalised greedy request."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.build import Speculation, build_engine
from services.gpu_worker.kv_manager import KVManager
from services.gpu_worker.weights import build_model
from shared.frames import NewRequest, SamplingParams, pack_tensors
from shared.model_source import ModelSource
from shared.specs.base import PromptRequest
from tests.checkpoints import make_checkpoint
from tests.reference import hf_model

REPETITIVE = [10, 11, 12, 13, 14, 15, 16, 17] * 5
OTHER = list(range(20, 61))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("sampling") / "llama", "llama")
    src = ModelSource(str(path))
    spec = src.spec(16)
    return path, spec, build_model(src, spec, torch.float32)


def run(spec, model, reqs: list[tuple[list[int], SamplingParams]], max_tokens: int, k: int = 0,
        max_batch_tokens: int = 64):
    """Every request to the end: its outputs, joined per request."""
    pools = spec.paged_pools(128)
    caches = {n: [torch.zeros(p.num_pages, 2, p.page_size, p.kv_heads, p.head_dim) for _ in range(p.num_layers)]
              for n, p in pools.items()}
    kv = KVManager(pools, spec.kv_labels)
    kv.debug = True
    eng = build_engine(model, spec, kv, caches, eos_ids=[], max_num_seqs=8, max_batch_tokens=max_batch_tokens,
                       max_seq_len=spec.max_seq_len, speculation=Speculation(k, 3, 1))
    for i, (ids, sp) in enumerate(reqs):
        ppo = spec.process_prompt(PromptRequest(ids))
        caps = spec.clamp_caps(spec.get_loop_caps(max_tokens, prompt_len=len(ids)))
        refs, _ = pack_tensors(ppo.new_input_tensors)
        eng.add(NewRequest(f"r{i}", "", refs, sp, "", len(ids), max_tokens, ppo.kv_layout, caps,
                           spec.kv_configs(ppo.kv_layout, caps, pools)), ppo.new_input_tensors)
    out: dict[str, dict] = {}
    while eng.has_work:
        res = eng.step()
        assert not res.errors, res.errors
        for _, o in res.outputs:
            got = out.setdefault(o.request_id, {"ids": [], "lps": [], "prompt": None, "finish": None})
            got["ids"] += o.token_ids
            got["lps"] += o.logprobs
            assert not o.logprobs or len(o.logprobs) == len(o.token_ids)
            if o.prompt_token_ids:
                got["prompt"] = (o.prompt_token_ids, o.prompt_logprobs)
            got["finish"] = o.finish_reason or got["finish"]
    assert kv.used_pages() == 0 and kv.footprint_overruns == 0
    return [out[f"r{i}"] for i in range(len(reqs))], eng


def hf_lp(path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(str(path))(torch.tensor([ids])).logits[0].float(), -1)


def test_prompt_logprobs_over_chunked_prefills_are_transformers(llama):
    path, spec, model = llama
    asks = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    plain = SamplingParams(temperature=0.0, ignore_eos=True)
    got, _ = run(spec, model, [(OTHER, asks), (REPETITIVE, plain), (REPETITIVE, asks)], 4, max_batch_tokens=16)
    for ids, r in ((OTHER, got[0]), (REPETITIVE, got[2])):
        lp = hf_lp(path, ids + r["ids"])
        prompt_ids, prompt_lps = r["prompt"]
        assert prompt_ids == ids and len(prompt_lps) == len(ids) - 1
        want = [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert [e.logprob for e in prompt_lps] == pytest.approx(want, abs=1e-4)
        assert all(len(e.top_ids) == 3 and e.top_ids == lp[i].topk(3).indices.tolist()
                   for i, e in enumerate(prompt_lps))
        assert [e.logprob for e in r["lps"]] == pytest.approx(
            [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(r["ids"])], abs=1e-4)
        assert all(e.rank == 1 for e in r["lps"])  # greedy: its token is the most likely
    assert got[1]["prompt"] is None and got[1]["lps"] == [] and got[1]["ids"] == got[2]["ids"]


def test_speculation_keeps_penalised_tokens_and_logprobs(llama):
    _, spec, model = llama
    sp = SamplingParams(temperature=0.0, ignore_eos=True, repetition_penalty=0.5, frequency_penalty=-0.5,
                        logprobs=1)
    reqs = [(REPETITIVE, sp), (OTHER, sp)]
    want, _ = run(spec, model, reqs, 24)
    got, eng = run(spec, model, reqs, 24, k=4)
    assert eng.spec_accepted_tokens > 0
    assert [r["ids"] for r in got] == [r["ids"] for r in want]
    for g, w in zip(got, want):
        assert [e.logprob for e in g["lps"]] == pytest.approx([e.logprob for e in w["lps"]], abs=1e-5)


def test_min_tokens_and_stop_token_ids_in_the_engine(llama):
    _, spec, model = llama
    plain, _ = run(spec, model, [(OTHER, SamplingParams(temperature=0.0, ignore_eos=True))], 16)
    stop = plain[0]["ids"][1]
    got, _ = run(spec, model, [(OTHER, SamplingParams(temperature=0.0, ignore_eos=True, stop_token_ids=[stop]))], 16)
    assert got[0]["ids"] == plain[0]["ids"][: plain[0]["ids"].index(stop) + 1] and got[0]["finish"] == "stop"
    held, _ = run(spec, model, [(OTHER, SamplingParams(temperature=0.0, ignore_eos=True, stop_token_ids=[stop],
                                                       min_tokens=5))], 16, k=4)
    assert stop not in held[0]["ids"][:5] and (held[0]["finish"] == "length" or held[0]["ids"][-1] == stop)


def test_samples_sent_after_the_first_token_share_its_prompt_pages(llama):
    """What `n` > 1 relies on: once sample 0 has its first token, its full prompt pages are
    in the prefix cache, and samples 1 and 2 are admitted holding them (counted once), on a
    pool too small for three separate footprints."""
    _, spec, model = llama
    pools = spec.paged_pools(5)  # 40 prompt rows + 7 written = 3 pages of 16 each; 2 of them shareable
    caches = {n: [torch.zeros(p.num_pages, 2, p.page_size, p.kv_heads, p.head_dim) for _ in range(p.num_layers)]
              for n, p in pools.items()}
    kv = KVManager(pools, spec.kv_labels)
    kv.debug = True
    eng = build_engine(model, spec, kv, caches, eos_ids=[], max_num_seqs=8, max_batch_tokens=64,
                       max_seq_len=spec.max_seq_len, speculation=Speculation(0, 3, 1))

    def add(i: int) -> None:
        ppo = spec.process_prompt(PromptRequest(OTHER[:40]))
        caps = spec.clamp_caps(spec.get_loop_caps(8, prompt_len=40))
        refs, _ = pack_tensors(ppo.new_input_tensors)
        sp = SamplingParams(temperature=1.0, seed=5 + i, ignore_eos=True)
        eng.add(NewRequest(f"s{i}", "", refs, sp, "", 40, 8, ppo.kv_layout, caps,
                           spec.kv_configs(ppo.kv_layout, caps, pools)), ppo.new_input_tensors)

    add(0)
    assert eng.step().outputs  # prefill: sample 0's first token, its prompt pages indexed
    add(1)
    add(2)
    eng.step()
    assert len(eng.running) == 3 and kv.used_pages() == 5 and kv.prefix_hit_tokens == 2 * 32
    toks: dict[str, list[int]] = {}
    while eng.has_work:
        for _, o in eng.step().outputs:
            toks.setdefault(o.request_id, []).extend(o.token_ids)
    assert kv.used_pages() == 0 and kv.footprint_overruns == 0 and len(toks) == 3
