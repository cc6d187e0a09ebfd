"""CSM in process: the spec's prompt and layouts, and the real engine's greedy frames
(backbone + depth decoder on their paged labels, batched) against transformers' `generate`
on a tiny random checkpoint, with the KV debug checks on and the pools back to empty."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.gpu_worker.build import build_engine
from services.gpu_worker.kv_manager import KVManager
from services.gpu_worker.weights import build_model
from shared.frames import NewRequest, SamplingParams, pack_tensors
from shared.model_source import ModelSource
from shared.specs.base import PromptError, PromptRequest
from tests.tts_checkpoints import csm_reference, make_csm_checkpoint

TURNS = [("0", "Hello world."), ("1", "What is the capital of France?"), ("0", "The quick brown fox."),
         ("1", "Numbers like 12345 appear in text."), ("0", "Goodbye, world.")]
FRAMES = 6


@pytest.fixture(scope="module")
def csm(tmp_path_factory):
    return make_csm_checkpoint(tmp_path_factory.mktemp("csm") / "csm", num_codebooks=16)


@pytest.fixture(scope="module")
def reference(csm):
    return csm_reference(csm, TURNS, FRAMES)


def _engine(path, num_pages=64):
    src = ModelSource(str(path))
    spec = src.spec(16)
    pools = spec.paged_pools(num_pages)
    model = build_model(src, spec, torch.float32)
    caches = {n: [torch.zeros(p.num_pages, 2, p.page_size, p.kv_heads, p.head_dim) for _ in range(p.num_layers)]
              for n, p in pools.items()}
    kv = KVManager(pools, spec.kv_labels)
    kv.debug = True
    eng = build_engine(model, spec, kv, caches, eos_ids=[*src.eos_token_ids, *spec.stop_ids], max_num_seqs=8,
                       max_batch_tokens=64, max_seq_len=spec.max_seq_len)
    return src, spec, pools, kv, eng


def _run(path, turns, max_frames):
    """Every turn batched through the engine: (frames, sound) per turn."""
    src, spec, pools, kv, eng = _engine(path)
    tok = src.tokenizer.tokenizer
    caps = spec.clamp_caps(spec.get_loop_caps(max_frames))
    for i, (voice, text) in enumerate(turns):
        ids = tok.encode(spec.prompt_text(text, {"voice": voice})).ids
        ppo = spec.process_prompt(PromptRequest(ids, None, {"voice": voice}))
        refs, _ = pack_tensors(ppo.new_input_tensors)
        eng.add(NewRequest(f"r{i}", "", refs, SamplingParams(temperature=0.0), "", len(ppo.kv_layout["backbone"]
                                                                                          .spans[0].token_ids),
                           max_frames, ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, pools)),
                ppo.new_input_tensors)
    tokens: dict[str, list[int]] = {}
    sound: dict[str, list[bytes]] = {}
    while eng.has_work:
        res = eng.step()
        assert not res.errors, res.errors
        for _, o in res.outputs:
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            sound.setdefault(o.request_id, []).append(o.audio or b"")
    assert kv.used_pages() == 0 and kv.footprint_overruns == 0
    return spec, [(tokens[f"r{i}"], np.frombuffer(b"".join(sound[f"r{i}"]), "<f4")) for i in range(len(turns))]


def test_prompt_is_the_processors_template(csm):
    import transformers

    src = ModelSource(str(csm))
    spec = src.spec(16)
    tok = transformers.AutoTokenizer.from_pretrained(csm)
    for voice, text in TURNS:
        rendered = tok.apply_chat_template([{"role": voice, "content": [{"type": "text", "text": text}]}],
                                           tokenize=False)
        want = tok(rendered, add_special_tokens=False).input_ids
        ids = src.tokenizer.tokenizer.encode(spec.prompt_text(text, {"voice": voice})).ids
        ppo = spec.process_prompt(PromptRequest(ids))
        assert ppo.new_input_tensors["input_ids"].tolist() == want
        assert ppo.kv_layout["depth"].scratch == spec.num_codebooks and not ppo.kv_layout["depth"].spans
        assert ppo.kv_layout["backbone"].growth == {"frame_loop": 1}
    with pytest.raises(PromptError) as exc:
        spec.prompt_text("hi", {"voice": "tara"})
    assert exc.value.param == "voice"
    assert spec.get_loop_caps(25) == {"frame_loop": 24, "codebook_loop": spec.num_codebooks - 1}
    assert spec.frames_for(2.0) == 25 and spec.sample_rate == 24000 and spec.samples_per_frame == 1920


def test_greedy_frames_and_sound_equal_transformers(csm, reference):
    spec, got = _run(csm, TURNS, FRAMES)
    for (tokens, sound), (frames, ref_sound) in zip(got, reference):
        stop = [i for i, f in enumerate(frames) if (f[:-1] == 0).all()]
        want = [spec.eos_frame_token if i in stop else int(f[0]) for i, f in enumerate(frames)]
        assert tokens == want
        assert sound.shape == ref_sound.shape
        np.testing.assert_allclose(sound, ref_sound, atol=1e-4 * max(1.0, float(np.abs(ref_sound).max())))


def test_context_prompt_is_the_processors(csm):
    """Context turns with audio: the ids equal the CSM processor's (one `<|AUDIO|>` per
    frame its encoder makes, `<|audio_eos|>` after), each audio's run a keyed rows span,
    every row counted; refusals name the turn's field."""
    import transformers

    from shared.frames import ContextTurn
    from tests.tts_checkpoints import audio_file, chirp

    src = ModelSource(str(csm))
    spec = src.spec(16)
    tok = transformers.AutoTokenizer.from_pretrained(csm)
    processor = transformers.CsmProcessor(transformers.EncodecFeatureExtractor(feature_size=1, sampling_rate=24000),
                                          tok, chat_template=tok.chat_template)
    a, b = chirp(5000, 220), chirp(9000, 330)
    turns = [ContextTurn("0", "Hello there.", audio_file(a)), ContextTurn("1", "Text alone."),
             ContextTurn("1", "Hi, how are you?", audio_file(b))]
    audios, before = spec.prepare_context(turns)
    assert [x.frames for x in audios] == [3, 5] and audios[0].key != audios[1].key
    ids = src.tokenizer.tokenizer.encode(before + spec.prompt_text("Fine.", {"voice": "0"})).ids
    ppo = spec.process_prompt(PromptRequest(ids, None, {"voice": "0"}, context=audios))
    conv = [{"role": t.speaker, "content": [{"type": "text", "text": t.text}]
             + ([{"type": "audio", "audio": x}] if x is not None else [])} for t, x in zip(turns, (a, None, b))]
    conv.append({"role": "0", "content": [{"type": "text", "text": "Fine."}]})
    want = processor.apply_chat_template(conv, tokenize=True, return_dict=True)
    assert ppo.new_input_tensors["input_ids"].tolist() == want["input_ids"][0].tolist()
    spans = ppo.kv_layout["backbone"].spans
    assert [s.kind for s in spans] == ["ids", "rows", "ids", "rows", "ids"]
    assert [s.key for s in spans if s.key] == [audios[0].key, audios[1].key]
    assert sum(s.length for s in spans) == len(ids)
    assert ppo.new_input_tensors["context_cutoffs"].tolist() == [5000, 14000]
    refusals = [([ContextTurn("9x", "a")], "context[0].speaker"), ([ContextTurn("0", "")], "context[0].text"),
                ([ContextTurn("0", "a"), ContextTurn("0", "b", b"junk")], "context[1].audio")]
    for bad, param in refusals:
        with pytest.raises(PromptError) as exc:
            spec.prepare_context(bad)
        assert exc.value.param == param
