"""Prompt-lookup speculative decoding: the proposer's lookups, and the engine's verify
steps giving exactly plain greedy decoding's tokens (and HF's), with every page back and
no row past any footprint."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.build import Speculation, build_engine
from services.gpu_worker.kv_manager import KVManager
from services.gpu_worker.speculative import NgramProposer, accept_greedy
from services.gpu_worker.weights import build_model
from shared.frames import NewRequest, SamplingParams, pack_tensors
from shared.model_source import ModelSource
from shared.specs.base import PromptRequest
from tests.checkpoints import make_checkpoint
from tests.reference import hf_greedy

# -- the proposer ---------------------------------------------------------------------


def test_proposes_what_followed_the_latest_occurrence_of_the_suffix():
    # the later of two
    assert NgramProposer(max_n=3, min_n=1).propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    # near the end the match's continuation repeats with its period: a loop drafts k tokens
    assert NgramProposer(max_n=3, min_n=1).propose([5, 6, 7, 5, 6, 7], 7) == [5, 6, 7, 5, 6, 7, 5]
    assert NgramProposer(max_n=2, min_n=1).propose([1, 4, 4, 4], 3) == [4, 4, 4]


def test_longest_ngram_wins_over_a_later_shorter_match():
    # "4 5" occurs twice; "3 4 5" only first, so the 3-gram's continuation (6) wins over the 2-gram's (9)
    assert NgramProposer(max_n=3, min_n=1).propose([3, 4, 5, 6, 0, 4, 5, 9, 3, 4, 5], 1) == [6]


def test_no_match_below_min_n_and_never_the_suffix_itself():
    assert NgramProposer(max_n=3, min_n=2).propose([1, 2, 3, 4, 9, 4], 3) == []  # only a 1-gram repeats
    assert NgramProposer(max_n=3, min_n=1).propose([1, 2, 3, 4, 9, 4], 3) == [9, 4, 9]
    assert NgramProposer(max_n=3, min_n=1).propose([1, 2, 3], 3) == []
    assert NgramProposer().propose([7], 4) == [] and NgramProposer().propose([1, 1, 1], 0) == []


def test_incremental_index_equals_a_fresh_one():
    """The index grows one position at a time as tokens arrive: same answers as a proposer
    that sees the whole history at once."""
    g = torch.Generator().manual_seed(0)
    hist = torch.randint(0, 6, (300,), generator=g).tolist()
    grown = NgramProposer(max_n=4, min_n=2)
    for end in range(1, len(hist) + 1):
        assert grown.propose(hist[:end], 5) == NgramProposer(max_n=4, min_n=2).propose(hist[:end], 5), end


def test_accept_greedy_counts_the_leading_matches():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accept_greedy([4], [3, 1]) == 0


def test_bad_ngram_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(max_n=2, min_n=3)


# -- the engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "llama")
    src = ModelSource(str(path))
    spec = src.spec(16)
    return path, spec, build_model(src, spec, torch.float32)


def run_engine(spec, model, prompts, max_tokens, k, max_batch_tokens=64, ignore_eos=True, eos_ids=()):
    pools = spec.paged_pools(128)
    caches = {n: [torch.zeros(p.num_pages, 2, p.page_size, p.kv_heads, p.head_dim) for _ in range(p.num_layers)]
              for n, p in pools.items()}
    kv = KVManager(pools, spec.kv_labels)
    kv.debug = True  # MSTAR_KV_DEBUG_ASSERTS=1: every commit checked against the layout
    eng = build_engine(model, spec, kv, caches, eos_ids=list(eos_ids), max_num_seqs=8,
                       max_batch_tokens=max_batch_tokens, max_seq_len=spec.max_seq_len,
                       speculation=Speculation(k, 3, 1))
    for i, ids in enumerate(prompts):
        ppo = spec.process_prompt(PromptRequest(ids))
        caps = spec.clamp_caps(spec.get_loop_caps(max_tokens, prompt_len=len(ids)))
        refs, _ = pack_tensors(ppo.new_input_tensors)
        eng.add(NewRequest(f"r{i}", "", refs, SamplingParams(temperature=0.0, ignore_eos=ignore_eos), "", len(ids),
                           max_tokens, ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, pools)),
                ppo.new_input_tensors)
    toks: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    frames = 0
    while eng.has_work:
        res = eng.step()
        assert not res.errors, res.errors
        for _, o in res.outputs:
            toks.setdefault(o.request_id, []).extend(o.token_ids)
            frames += 1
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
            assert o.completion_tokens == len(toks[o.request_id])
    assert kv.used_pages() == 0 and kv.footprint_overruns == 0
    for pool in kv.pools.values():
        assert pool.reserved == 0
    return toks, finish, eng, frames


REPETITIVE = [10, 11, 12, 13, 14, 15, 16, 17] * 6
PROMPTS = [REPETITIVE, list(range(20, 61)), [7, 8, 9] * 10 + [40, 41], [100, 101]]


@pytest.mark.parametrize("k", [1, 4, 16])
def test_speculation_emits_exactly_the_greedy_tokens(llama, k):
    _, spec, model = llama
    plain, plain_finish, _, plain_frames = run_engine(spec, model, PROMPTS, 40, 0)
    fast, fast_finish, eng, frames = run_engine(spec, model, PROMPTS, 40, k)
    assert fast == plain and fast_finish == plain_finish
    assert all(len(t) == 40 for t in fast.values())
    assert eng.spec_accepted_tokens > 0 and eng.spec_draft_tokens >= eng.spec_accepted_tokens
    assert frames < plain_frames  # accepted drafts arrive several to a frame


def test_speculation_matches_hf_generate(llama):
    path, spec, model = llama
    fast, _, eng, _ = run_engine(spec, model, PROMPTS, 48, 4)
    assert [fast[f"r{i}"] for i in range(len(PROMPTS))] == [hf_greedy(path, p, 48) for p in PROMPTS]
    assert 0 < eng.spec_accepted_tokens < eng.spec_draft_tokens  # some drafts accepted, some not


def test_a_repeating_model_takes_most_drafts(tmp_path):
    """A model whose greedy output loops (small random weights repeat the last token):
    most drafts stand and output arrives several tokens to a frame."""
    path = make_checkpoint(tmp_path / "copy", "llama", initializer_range=0.02)
    src = ModelSource(str(path))
    spec = src.spec(16)
    model = build_model(src, spec, torch.float32)
    plain, _, _, plain_frames = run_engine(spec, model, PROMPTS, 48, 0)
    fast, _, eng, frames = run_engine(spec, model, PROMPTS, 48, 4)
    assert fast == plain
    assert eng.spec_accepted_tokens >= 0.8 * eng.spec_draft_tokens > 0
    assert frames <= plain_frames / 2


def test_speculation_within_a_small_step_budget(llama):
    """Drafts take only the budget decodes leave: a 16-token step with 4 requests."""
    _, spec, model = llama
    plain, _, _, _ = run_engine(spec, model, PROMPTS, 30, 0, max_batch_tokens=16)
    fast, _, eng, _ = run_engine(spec, model, PROMPTS, 30, 8, max_batch_tokens=16)
    assert fast == plain and eng.spec_accepted_tokens > 0


def test_speculation_stops_at_eos_inside_accepted_drafts(llama):
    """An eos among a verify step's tokens ends the request there, as plain decoding does."""
    _, spec, model = llama
    plain, _, _, _ = run_engine(spec, model, [REPETITIVE], 40, 0)
    eos = plain["r0"][12]  # a token the model emits at step 12
    want, want_finish, _, _ = run_engine(spec, model, [REPETITIVE], 40, 0, ignore_eos=False, eos_ids=[eos])
    got, got_finish, _, _ = run_engine(spec, model, [REPETITIVE], 40, 8, ignore_eos=False, eos_ids=[eos])
    assert got == want and got_finish == want_finish == {"r0": "stop"}
    assert got["r0"][-1] == eos and len(got["r0"]) <= 13


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_speculation_never_runs_past_max_tokens(llama, max_tokens):
    _, spec, model = llama
    got, finish, _, _ = run_engine(spec, model, [REPETITIVE], max_tokens, 16)
    want, _, _, _ = run_engine(spec, model, [REPETITIVE], max_tokens, 0)
    assert got == want and len(got["r0"]) == max_tokens and finish == {"r0": "length"}


def test_sampled_requests_do_not_speculate(llama):
    _, spec, model = llama
    pools = spec.paged_pools(64)
    caches = {n: [torch.zeros(p.num_pages, 2, p.page_size, p.kv_heads, p.head_dim) for _ in range(p.num_layers)]
              for n, p in pools.items()}
    eng = build_engine(model, spec, KVManager(pools, spec.kv_labels), caches, eos_ids=[], max_num_seqs=8,
                       max_batch_tokens=64, max_seq_len=spec.max_seq_len, speculation=Speculation(4))
    ppo = spec.process_prompt(PromptRequest(REPETITIVE))
    caps = spec.clamp_caps(spec.get_loop_caps(20, prompt_len=len(REPETITIVE)))
    refs, _ = pack_tensors(ppo.new_input_tensors)
    eng.add(NewRequest("s", "", refs, SamplingParams(temperature=0.8, seed=1, ignore_eos=True), "", len(REPETITIVE), 20,
                       ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, pools)), ppo.new_input_tensors)
    while eng.has_work:
        eng.step()
    assert eng.spec_draft_tokens == 0


def test_speculation_stops_at_the_sequence_limit(llama):
    """A request that runs into max_seq_len: drafts never reach past it, the tokens and the
    finish are plain decoding's, and no page is taken past any footprint."""
    _, spec, model = llama
    prompt = (REPETITIVE * 11)[: spec.max_seq_len - 20]
    want, want_finish, _, _ = run_engine(spec, model, [prompt], 100, 0)
    got, got_finish, eng, _ = run_engine(spec, model, [prompt], 100, 16)
    assert got == want and got_finish == want_finish == {"r0": "length"}
    assert len(prompt) + len(got["r0"]) == spec.max_seq_len
    assert eng.spec_draft_tokens > 0  # it did speculate up to the limit


def test_sliding_window_models_do_not_speculate(tmp_path):
    path = make_checkpoint(tmp_path / "sw", "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    src = ModelSource(str(path))
    spec = src.spec(16)
    assert any(lab.window for lab in spec.kv_labels)
    model = build_model(src, spec, torch.float32)
    plain, _, _, _ = run_engine(spec, model, [REPETITIVE], 20, 0)
    got, _, eng, _ = run_engine(spec, model, [REPETITIVE], 20, 4)
    assert got == plain and eng.scheduler.speculative_k == 0 and eng.spec_draft_tokens == 0
