"""The engine with the encoder-decoder runner + WhisperModel in process: tokens equal transformers' Whisper for the same
audio, two labels per request keep to their footprints (debug asserts on) and give every
page back, and concurrent requests decode as they do alone."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest
import torch

from services.gpu_worker.attention import build_metadata, cross_metadata
from services.gpu_worker.build import Assembled, build_engine, warm_up
from services.gpu_worker.kv_manager import KVManager
from services.gpu_worker.weights import build_model
from shared.audio import audio_features
from shared.config import Deployment
from shared.errors import ErrorKind
from shared.frames import NewRequest, SamplingParams, pack_tensors
from shared.layout import LabelLayout, Span
from shared.model_source import ModelSource
from shared.specs.base import PromptRequest
from shared.specs.whisper import WhisperSpec
from tests.whisper_checkpoints import sine_sweep, wav_bytes, whisper_ckpt  # noqa: F401  (fixture)

transformers = pytest.importorskip("transformers")
pytest.importorskip("soundfile")

PAGE = 8
#: (seconds, file sampling rate, container): clips of different lengths, one resampled
CLIPS = [(0.5, 16000, "WAV"), (3.0, 16000, "FLAC"), (11.0, 44100, "WAV"), (29.5, 16000, "WAV")]


@pytest.fixture(scope="module")
def audio() -> list[bytes]:
    """The CLIPS as files, as a client sends them."""
    return [wav_bytes(sine_sweep(secs, sr=sr, f0=150.0 + 100 * i, seed=i), sr, fmt)
            for i, (secs, sr, fmt) in enumerate(CLIPS)]


@pytest.fixture(scope="module")
def world(whisper_ckpt, audio):  # noqa: F811
    torch.manual_seed(0)
    source = ModelSource(str(whisper_ckpt))
    spec = WhisperSpec.from_folder(whisper_ckpt, page_size=PAGE)
    spec.validate()
    model = build_model(source, spec, torch.float32)
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(whisper_ckpt).eval()
    feats = [audio_features(data, spec.features) for data in audio]
    return spec, model, hf, feats


def make_engine(spec, model, num_pages=64, max_num_seqs=8, max_batch_tokens=64, eos_ids=None, debug=True):
    pools = spec.paged_pools(num_pages)
    caches = {n: [torch.zeros(p.num_pages, 2, p.page_size, p.kv_heads, p.head_dim) for _ in range(p.num_layers)]
              for n, p in pools.items()}
    kv = KVManager(pools, spec.kv_labels)
    kv.debug = debug  # MSTAR_KV_DEBUG_ASSERTS=1
    eos = spec.eos_token_ids if eos_ids is None else eos_ids
    engine = build_engine(model, spec, kv, caches, eos_ids=eos, max_num_seqs=max_num_seqs,
                          max_batch_tokens=max_batch_tokens, max_seq_len=spec.max_seq_len)
    return engine, kv, pools


def new_request(spec, pools, rid, feats, max_tokens, forced=None, layout=None, **sampling):
    """A request with the decoder prompt `forced` (the model's default when None) over the
    features `feats` (computed once per clip, not per request)."""
    forced = spec.forced_ids() if forced is None else forced
    ppo = spec.process_prompt(PromptRequest(forced))  # silence, replaced by the clip's features
    ppo.new_input_tensors["input_features"] = np.asarray(feats, dtype=np.float32).reshape(1, 80, 3000)
    return _new_request(spec, pools, rid, ppo, max_tokens, layout, **sampling)


def audio_request(spec, pools, rid, audio, max_tokens, options=None, **sampling):
    """A request as the data worker makes it: the file and the options through process_prompt."""
    ppo = spec.process_prompt(PromptRequest([], audio, options or {}))
    return _new_request(spec, pools, rid, ppo, max_tokens, **sampling)


def _new_request(spec, pools, rid, ppo, max_tokens, layout=None, **sampling):
    kv_layout = layout or ppo.kv_layout
    prompt_len = ppo.metadata["prompt_len"]
    caps = spec.clamp_caps(spec.get_loop_caps(max_tokens, prompt_len))
    refs, _ = pack_tensors(ppo.new_input_tensors)
    params = SamplingParams(**{"temperature": 0.0, **sampling})
    req = NewRequest(rid, "whisper", refs, params, "api", prompt_len, max_tokens, kv_layout, caps,
                     spec.kv_configs(kv_layout, caps, pools), metadata=ppo.metadata)
    return req, ppo.new_input_tensors


def drain(engine, later=(), at_step=2, max_steps=2000):
    """Step until idle (adding `later` requests at step `at_step`); tokens, finish reasons, errors."""
    toks, finish, errors = {}, {}, []
    steps = 0
    while engine.has_work or later:
        if steps == at_step:
            for req, tensors in later:
                engine.add(req, tensors)
            later = ()
        res = engine.step()
        errors.extend(err for _, err in res.errors)
        for _, out in res.outputs:
            toks.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finish_reason:
                finish[out.request_id] = out.finish_reason
        steps += 1
        assert steps < max_steps
    return toks, finish, errors


def assert_pools_empty(kv):
    assert kv.used_pages() == 0
    for name, pool in kv.pools.items():
        assert pool.used == 0 and pool.reserved == 0, name
    assert not kv.requests
    assert kv.footprint_overruns == 0


_REFS: dict[tuple, list[int]] = {}


def hf_greedy(hf, spec, feats, n, forced=None, eos=None, ignore_eos=False):
    """Greedy decoding by hand with transformers (its own KV cache; the generation config's
    suppress lists applied): the definition the engine must meet. Memoized: a shorter run
    is a prefix of a longer one."""
    forced = spec.forced_ids() if forced is None else forced
    eos = set(spec.eos_token_ids if eos is None else eos)
    key = (id(hf), id(feats), tuple(forced))
    out = _REFS.get(key, [])
    if len(out) < n:
        out = []
        with torch.no_grad():
            enc = hf.model.encoder(torch.from_numpy(feats)).last_hidden_state
            step_ids, cache = list(forced), None
            for i in range(n):
                res = hf(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([step_ids]), cache=cache,
                         use_cache=True)
                cache = res.past_key_values
                logits = res.logits[0, -1]
                logits[list(spec.suppress_tokens)] = float("-inf")
                if i == 0:
                    logits[list(spec.begin_suppress_tokens)] = float("-inf")
                tok = int(logits.argmax())
                out.append(tok)
                step_ids = [tok]
        _REFS[key] = out
    out = out[:n]
    if not ignore_eos:
        stop = next((i for i, t in enumerate(out) if t in eos), None)
        if stop is not None:
            out = out[: stop + 1]
    return out


def test_encoder_and_decoder_logits_match_transformers(world):
    spec, model, hf, feats = world
    f = torch.from_numpy(feats[1])
    forced = spec.forced_ids()
    ids = [*forced, 17, 42, 99, 5, 230]
    with torch.no_grad():
        ref_enc = hf.model.encoder(f).last_hidden_state
        ref = hf(encoder_outputs=(ref_enc,), decoder_input_ids=torch.tensor([ids])).logits[0]
        enc = model.encode(f)
        torch.testing.assert_close(enc, ref_enc, rtol=0, atol=1e-4)
        engine, _kv, _pools = make_engine(spec, model, num_pages=16)
        cross_pages = list(range(3, 3 + math.ceil(1500 / PAGE)))  # any pages, not the first ones
        model.write_cross(enc[0], engine.runner.cross_caches, build_metadata([(cross_pages, 0, 0, 1500, False)], PAGE))
        # prefill 6 rows, then the rest one row at a time (the decode path)
        self_pages = [5, 2]
        got = []
        for start, n in [(0, 6), (6, 1), (7, 1), (8, 1)]:
            self_meta = build_metadata([(self_pages, 0, start, n, n == 1)], PAGE)
            cmeta = cross_metadata([(cross_pages, 1500, n)], PAGE)
            got.append(model(torch.tensor(ids[start : start + n]), torch.arange(start, start + n),
                             engine.runner.self_caches, self_meta, engine.runner.cross_caches, cmeta, torch.arange(n)))
    torch.testing.assert_close(torch.cat(got), ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("clip", range(len(CLIPS)))
def test_greedy_tokens_equal_transformers_generate(world, clip):
    spec, model, hf, feats = world
    n = 24
    forced = spec.forced_ids()
    with torch.no_grad():
        gen = hf.generate(torch.from_numpy(feats[clip]), decoder_input_ids=torch.tensor([forced]), do_sample=False,
                          max_new_tokens=n)[0].tolist()
    if gen[: len(forced)] == forced:  # transformers' Whisper returns only the new tokens; be robust
        gen = gen[len(forced) :]
    ref = hf_greedy(hf, spec, feats[clip], n)
    assert gen == ref
    engine, kv, pools = make_engine(spec, model)
    engine.add(*new_request(spec, pools, "r", feats[clip], n))
    toks, finish, errors = drain(engine)
    assert not errors
    assert toks["r"] == ref
    assert finish["r"] == ("stop" if ref[-1] in spec.eos_token_ids else "length")
    assert_pools_empty(kv)


def test_clips_give_different_transcripts(world):
    """The decoder really reads the cross rows: different audio, different tokens."""
    spec, _model, hf, feats = world
    outs = {tuple(hf_greedy(hf, spec, f, 12, ignore_eos=True)) for f in feats}
    assert len(outs) == len(feats)


def test_concurrent_requests_batch_like_alone(world, caplog):
    spec, model, hf, feats = world
    lens = [30, 7, 18, 1]
    langs = [None, "de", None, "fr"]
    refs = {f"r{i}": hf_greedy(hf, spec, feats[i], lens[i], forced=spec.forced_ids(langs[i]), ignore_eos=True)
            for i in range(4)}
    engine, kv, pools = make_engine(spec, model, max_batch_tokens=8)
    reqs = [new_request(spec, pools, f"r{i}", feats[i], lens[i], forced=spec.forced_ids(langs[i]), ignore_eos=True)
            for i in range(4)]
    for req in reqs[:2]:
        engine.add(*req)
    with caplog.at_level(logging.ERROR, logger="mstar.kv"):
        toks, finish, errors = drain(engine, later=reqs[2:], at_step=3)
    assert not errors
    assert toks == refs
    assert all(f == "length" for f in finish.values())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert_pools_empty(kv)
    # and alone, through the engine, the same again
    for i in (0, 2):
        engine, kv, pools = make_engine(spec, model)
        engine.add(*new_request(spec, pools, "x", feats[i], lens[i], forced=spec.forced_ids(langs[i]), ignore_eos=True))
        assert drain(engine)[0]["x"] == refs[f"r{i}"]


def test_run_to_the_window_holds_exactly_the_footprint(world, caplog):
    """max_tokens = the decoder's window: the loop runs to its cap, each label peaks at its
    footprint (the manager's debug check logs a label that does not), nothing overruns."""
    spec, model, hf, feats = world
    window = spec.max_seq_len - len(spec.forced_ids())
    engine, kv, pools = make_engine(spec, model, num_pages=2 * math.ceil(64 / PAGE))
    req, tensors = new_request(spec, pools, "w", feats[0], window, ignore_eos=True)
    engine.add(req, tensors)
    fps = {name: cfg.footprints for name, cfg in req.kv_configs.items()}
    assert fps == {"kv_self": {"self": math.ceil((4 + window - 1) / PAGE)},
                   "kv_cross": {"cross": math.ceil(1500 / PAGE)}}
    with caplog.at_level(logging.ERROR, logger="mstar.kv"):
        toks, finish, errors = drain(engine)
    assert not errors and finish["w"] == "length" and len(toks["w"]) == window
    assert toks["w"] == hf_greedy(hf, spec, feats[0], window, ignore_eos=True)
    assert not caplog.records
    assert kv.pools["kv_self"].peak_used == fps["kv_self"]["self"]
    assert kv.pools["kv_cross"].peak_used == fps["kv_cross"]["cross"]
    assert_pools_empty(kv)


def test_eos_stops_unless_ignored(world):
    spec, model, hf, feats = world
    ref = hf_greedy(hf, spec, feats[2], 20, ignore_eos=True)
    stop_tok = next(t for t in ref[3:] if t not in spec.begin_suppress_tokens)
    k = ref.index(stop_tok)
    for ignore in (False, True):
        engine, kv, pools = make_engine(spec, model, eos_ids=[stop_tok])
        engine.add(*new_request(spec, pools, "e", feats[2], 20, ignore_eos=ignore))
        toks, finish, _ = drain(engine)
        assert toks["e"] == (ref if ignore else ref[: k + 1])
        assert finish["e"] == ("length" if ignore else "stop")
        assert_pools_empty(kv)


def test_seeded_sampling_does_not_depend_on_the_batch(world):
    spec, model, _hf, feats = world
    sampling = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 1234, "ignore_eos": True}
    engine, kv, pools = make_engine(spec, model)
    engine.add(*new_request(spec, pools, "s", feats[1], 16, **sampling))
    alone = drain(engine)[0]["s"]
    engine, kv, pools = make_engine(spec, model)
    engine.add(*new_request(spec, pools, "g", feats[0], 10, ignore_eos=True))
    engine.add(*new_request(spec, pools, "s", feats[1], 16, **sampling))
    engine.add(*new_request(spec, pools, "t", feats[3], 12, **{**sampling, "seed": 99}))
    toks, _, errors = drain(engine)
    assert not errors and toks["s"] == alone
    assert toks["s"] != toks["t"]
    assert not set(toks["s"]) & set(spec.suppress_tokens)
    assert_pools_empty(kv)


def test_admission_waits_for_cross_pages(world):
    """A pool with room for one request's cross rows runs two requests one after the other."""
    spec, model, hf, feats = world
    engine, kv, pools = make_engine(spec, model, num_pages=math.ceil(64 / PAGE))
    assert pools["kv_cross"].num_pages == math.ceil(1500 / PAGE)
    engine.add(*new_request(spec, pools, "a", feats[0], 6, ignore_eos=True))
    engine.add(*new_request(spec, pools, "b", feats[1], 6, ignore_eos=True))
    engine.step()
    assert [s.request_id for s in engine.running] == ["a"] and len(engine.waiting) == 1
    toks, _, errors = drain(engine)
    assert not errors
    assert toks["b"] == hf_greedy(hf, spec, feats[1], 6, ignore_eos=True)
    assert_pools_empty(kv)


def test_abort_and_fail_all_return_every_page(world):
    spec, model, _hf, feats = world
    engine, kv, pools = make_engine(spec, model, num_pages=2 * math.ceil(64 / PAGE))
    for i in range(3):
        engine.add(*new_request(spec, pools, f"r{i}", feats[i], 20, ignore_eos=True))
    engine.step()
    engine.step()
    assert len(engine.running) == 2 and len(engine.waiting) == 1
    reply_to, pages = engine.abort("r0")
    assert reply_to == "api" and pages == math.ceil(1500 / PAGE) + math.ceil((4 + 1) / PAGE)
    assert engine.abort("r0") is None
    res = engine.fail_all(ErrorKind.WORKER_FAILED, "the worker is shutting down")
    assert sorted(rid for rid, _, _ in res.finished) == ["r1", "r2"]
    assert all(err.kind is ErrorKind.WORKER_FAILED for _, err in res.errors)
    assert not engine.has_work
    assert_pools_empty(kv)


def test_a_lying_cross_layout_fails_under_debug_asserts(world, caplog):
    spec, model, hf, feats = world
    engine, kv, pools = make_engine(spec, model)
    good = spec.process_prompt(PromptRequest(spec.forced_ids())).kv_layout
    lying = {**good, "cross": LabelLayout(spans=(Span.rows(1000),))}
    engine.add(*new_request(spec, pools, "bad", feats[0], 5, layout=lying))
    engine.add(*new_request(spec, pools, "ok", feats[1], 5, ignore_eos=True))
    with caplog.at_level(logging.ERROR):
        toks, _, errors = drain(engine)
    assert [(e.request_id, e.kind) for e in errors] == [("bad", ErrorKind.INTERNAL)]
    assert "layout was violated" in errors[0].message and errors[0].error_id
    assert toks["ok"] == hf_greedy(hf, spec, feats[1], 5, ignore_eos=True)
    assert any("commits 1500 span rows past its declared spans (1000 left)" in r.getMessage() for r in caplog.records)
    assert kv.used_pages() == 0 and all(p.reserved == 0 for p in kv.pools.values())


def test_understated_growth_is_an_overrun_not_a_corruption(world, caplog):
    """Without debug asserts, a layout that declares no decode growth gets its pages anyway,
    the overrun is logged once and counted, and the tokens are still right."""
    spec, model, hf, feats = world
    engine, kv, pools = make_engine(spec, model, debug=False)
    good = spec.process_prompt(PromptRequest(spec.forced_ids())).kv_layout
    lying = {**good, "self": LabelLayout(spans=good["self"].spans, growth={"decode_loop": 0})}
    engine.add(*new_request(spec, pools, "u", feats[3], 12, layout=lying, ignore_eos=True))
    with caplog.at_level(logging.ERROR, logger="mstar.kv"):
        toks, _, errors = drain(engine)
    assert not errors
    assert toks["u"] == hf_greedy(hf, spec, feats[3], 12, ignore_eos=True)
    assert kv.footprint_overruns == 1
    assert sum("footprint overrun" in r.getMessage() for r in caplog.records) == 1
    assert kv.used_pages() == 0 and all(p.reserved == 0 for p in kv.pools.values())


def test_warm_up_style_request_runs(world):
    """A decoder prompt sent as ids (silent audio) with max_tokens 2."""
    spec, model, _hf, _feats = world
    engine, kv, pools = make_engine(spec, model)
    ids = list(range(1, 17))
    ppo = spec.process_prompt(PromptRequest(ids))
    caps = spec.clamp_caps(spec.get_loop_caps(2))
    refs, _ = pack_tensors(ppo.new_input_tensors)
    req = NewRequest("warmup", "", refs, SamplingParams(temperature=0.0), "", len(ids), 2, ppo.kv_layout, caps,
                     spec.kv_configs(ppo.kv_layout, caps, pools))
    engine.add(req, ppo.new_input_tensors)
    toks, _, errors = drain(engine)
    assert not errors and 1 <= len(toks["warmup"]) <= 2
    assert_pools_empty(kv)


def test_the_workers_warm_up_runs_the_language_probe(world, whisper_ckpt):  # noqa: F811
    """The worker's warm-up takes a real request's path for a speech model (no ids, silent
    audio): here that includes the language probe, and it leaves every page free."""
    spec, model, _hf, _feats = world
    engine, kv, pools = make_engine(spec, model)
    calls = spy_scratch(engine)
    warm_up(Assembled(ModelSource(str(whisper_ckpt)), spec, pools, model, kv, engine), Deployment())
    assert [c[:2] for c in calls] == [("warmup", "self")]
    assert_pools_empty(kv)


def test_add_refuses_malformed_requests(world):
    spec, model, _hf, feats = world
    small, _, small_pools = make_engine(spec, model, num_pages=1)
    with pytest.raises(ValueError, match="footprint exceeds the pool"):
        small.add(*new_request(spec, small_pools, "a", feats[0], 4))
    engine, kv, pools = make_engine(spec, model)
    req, tensors = new_request(spec, pools, "a", feats[0], 4)
    with pytest.raises(ValueError, match="needs tensors"):
        engine.add(req, {"input_features": tensors["input_features"]})
    with pytest.raises(ValueError, match=r"input_features must be \[1, 80, 3000\]"):
        engine.add(req, {**tensors, "input_features": np.zeros((1, 80, 100), np.float32)})
    only_self = NewRequest("b", "whisper", req.input_tensors, req.sampling, "api", 4, 4,
                           {"self": req.kv_layout["self"]}, req.loop_caps, req.kv_configs)
    with pytest.raises(ValueError, match="needs layouts for labels"):
        engine.add(only_self, tensors)
    engine.add(req, tensors)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add(req, tensors)
    engine.abort("a")
    assert_pools_empty(kv)


def test_encodes_per_step_are_bounded(world):
    """A burst of arrivals is encoded a few per step, so running decodes keep stepping."""
    spec, model, _hf, feats = world
    engine, kv, pools = make_engine(spec, model)
    engine.scheduler.limits = dataclasses.replace(engine.scheduler.limits, max_admissions=2)
    for i in range(5):
        engine.add(*new_request(spec, pools, f"r{i}", feats[i % len(feats)], 3, ignore_eos=True))
    engine.step()
    assert len(engine.running) == 2 and len(engine.waiting) == 3
    engine.step()
    assert len(engine.running) == 4
    _, finish, errors = drain(engine)
    assert not errors and len(finish) == 5
    assert_pools_empty(kv)


def test_a_448_position_decoder(tmp_path_factory, world):
    """Whisper's real decoder length (448): window, caps and tokens still line up."""
    from tests.whisper_checkpoints import make_whisper_checkpoint

    path = make_whisper_checkpoint(tmp_path_factory.mktemp("w448") / "tiny-whisper-448", seed=1,
                                   max_target_positions=448)
    spec = WhisperSpec.from_folder(path, page_size=PAGE)
    assert spec.graph_loops() == {"decode_loop": 447}
    assert spec.get_loop_caps(10_000) == {"decode_loop": 443}
    model = build_model(ModelSource(str(path)), spec, torch.float32)
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(path).eval()
    feats = world[3]
    engine, kv, pools = make_engine(spec, model, num_pages=128)
    engine.add(*new_request(spec, pools, "a", feats[2], 40, ignore_eos=True))
    engine.add(*new_request(spec, pools, "b", feats[0], 25, forced=spec.forced_ids("ja"), ignore_eos=True))
    toks, _, errors = drain(engine)
    assert not errors
    assert toks["a"] == hf_greedy(hf, spec, feats[2], 40, ignore_eos=True)
    assert toks["b"] == hf_greedy(hf, spec, feats[0], 25, forced=spec.forced_ids("ja"), ignore_eos=True)
    assert_pools_empty(kv)


def test_prefix_cache_never_holds_an_audio_requests_rows(world, whisper_ckpt):  # noqa: F811
    """With 4-row pages the forced prompt fills whole "self" pages; but their KV depends on
    the audio (the cross attention feeds every decoder row), so the prompt is a rows span
    and its label is never keyed: the prefix index never holds one of its pages, and no
    later request with the same prompt and other audio can reuse them."""
    _, model, hf, feats = world
    spec = WhisperSpec.from_folder(whisper_ckpt, page_size=4)
    assert len(spec.forced_ids()) >= 4  # at least one full self page of prompt
    engine, kv, pools = make_engine(spec, model)
    assert kv.prefix_cache
    for i, clip in enumerate((0, 1, 0)):
        engine.add(*new_request(spec, pools, f"r{i}", feats[clip], 8, ignore_eos=True))
        toks, _, errors = drain(engine)
        assert not errors
        assert toks[f"r{i}"] == hf_greedy(hf, spec, feats[clip], 8, ignore_eos=True)
        assert all(len(pool.index) == 0 for pool in kv.pools.values())
    assert kv.prefix_hit_tokens == 0
    assert_pools_empty(kv)


# ---- language detection: the probe step and its scratch ----------------------------------


def hf_detect(hf, spec, feats, n):
    """transformers with no language: `detect_language`, then `generate` (which detects
    again itself); the language token and the greedy tokens after the prompt."""
    f = torch.from_numpy(feats)
    with torch.no_grad():
        (lang,) = hf.detect_language(f).tolist()
        gen = hf.generate(f, do_sample=False, max_new_tokens=n)[0].tolist()
    forced = [spec.decoder_start_token_id, lang, *spec.forced_ids()[2:]]
    if gen[: len(forced)] == forced:  # transformers' Whisper returns only the new tokens; be robust
        gen = gen[len(forced):]
    return lang, gen


def spy_scratch(engine):
    """Record each `drop_scratch` with the pages the label held before and after it."""
    kv, calls = engine.kv, []
    drop = kv.drop_scratch

    def recorded(request_id, label):
        st = kv.requests[request_id].labels[label]
        before = len(st.pages)
        drop(request_id, label)
        calls.append((request_id, label, st.rows, before, len(st.pages)))

    kv.drop_scratch = recorded
    engine.runner.kv.drop_scratch = recorded
    return calls


def test_no_language_detects_it_as_transformers_does(world, audio, caplog):
    """A request without a language (this checkpoint names none) runs the probe: the
    language transformers' `detect_language` picks for the same audio, reported with the
    first output, then the tokens `generate(language=None)` gives. Clips detect different
    languages, the probes of concurrent requests share one step, the probe's row is the
    "self" label's scratch, given back after its step, and every page comes back."""
    spec, model, hf, feats = world
    n = 12
    refs = {f"r{i}": hf_detect(hf, spec, feats[i], n) for i in range(len(CLIPS))}
    assert len({lang for lang, _ in refs.values()}) > 1  # detection, not a default
    engine, kv, pools = make_engine(spec, model)
    calls = spy_scratch(engine)
    reports = {}
    for i in range(len(CLIPS)):
        req, tensors = audio_request(spec, pools, f"r{i}", audio[i], n)
        assert req.metadata["detect_language"] and req.kv_layout["self"].scratch == 1
        engine.add(req, tensors)
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        toks, _, errors = drain(engine)
    assert not errors and not [r for r in caplog.records if r.levelno >= logging.ERROR]
    for rid, (_lang, want) in refs.items():
        assert toks[rid] == want, rid
        assert engine.kv.requests.get(rid) is None
    # each probe wrote one row into a page of its own, released right after (no rows committed)
    assert sorted(c[0] for c in calls) == sorted(refs) and all(c[1:] == ("self", 0, 1, 0) for c in calls)
    assert_pools_empty(kv)
    # the language goes out once, on the first output
    engine, kv, pools = make_engine(spec, model)
    engine.add(*audio_request(spec, pools, "x", audio[1], 3))
    while engine.has_work:
        for _, out in engine.step().outputs:
            if out.metadata:
                reports.setdefault(out.request_id, []).append((out.metadata, out.completion_tokens))
    assert reports == {"x": [({"language": spec.language_code(refs["r1"][0])}, 1)]}
    assert_pools_empty(kv)


def test_a_sent_language_is_reported_and_never_probed(world, audio):
    spec, model, hf, feats = world
    engine, kv, pools = make_engine(spec, model)
    calls = spy_scratch(engine)
    req, tensors = audio_request(spec, pools, "de", audio[0], 6, {"language": "de"})
    assert not req.metadata["detect_language"] and req.kv_layout["self"].scratch == 0
    engine.add(req, tensors)
    outs = []
    while engine.has_work:
        outs += [out for _, out in engine.step().outputs]
    assert outs[0].metadata == {"language": "de"} and not any(o.metadata for o in outs[1:])
    assert [t for o in outs for t in o.token_ids] == hf_greedy(hf, spec, feats[0], 6, forced=spec.forced_ids("de"))
    assert not calls
    assert_pools_empty(kv)


@pytest.mark.parametrize("max_tokens", [5, 13, 20, 60])
def test_detecting_requests_keep_exactly_to_their_footprint(world, audio, caplog, max_tokens):
    """Run to the caps under debug asserts: the probe's scratch never takes a page past
    the footprint, and the label peaks at the footprint, except where the scratch row
    (which the footprint lets follow any commit, the last one too) would open a page of
    its own: there the walk peaks one page below it, and the manager's tightness check
    knows the probe ran before any commit (5 and 13 tokens: 4 + 4 and 4 + 12 rows)."""
    spec, model, hf, feats = world
    engine, kv, pools = make_engine(spec, model, num_pages=16)
    req, tensors = audio_request(spec, pools, "p", audio[2], max_tokens, ignore_eos=True)
    cap = req.loop_caps["decode_loop"]
    footprint = req.kv_configs["kv_self"].footprints["self"]
    assert footprint == math.ceil((4 + 1 + cap) / PAGE)
    engine.add(req, tensors)
    with caplog.at_level(logging.ERROR, logger="mstar.kv"):
        toks, finish, errors = drain(engine)
    assert not errors and not caplog.records, caplog.text
    assert finish["p"] == "length"
    lang, _ = hf_detect(hf, spec, feats[2], 1)
    forced = [spec.decoder_start_token_id, lang, *spec.forced_ids()[2:]]
    assert toks["p"] == hf_greedy(hf, spec, feats[2], max_tokens, forced=forced, ignore_eos=True)
    peak = kv.pools["kv_self"].peak_used
    assert peak == math.ceil((4 + cap) / PAGE)
    assert peak == (footprint - 1 if (4 + cap) % PAGE == 0 else footprint)
    assert kv.footprint_overruns == 0
    assert_pools_empty(kv)
