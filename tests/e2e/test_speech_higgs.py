"""Higgs Audio v2 through the real services: a tiny random checkpoint laid out as the Hub
ships it (tests/higgs_checkpoints.py), its codec found by processor_config.json's Hub id in
a Hugging Face cache folder (HF_HUB_CACHE), not in the checkpoint's folder.

- frames: `/generate`'s tokens are transformers' greedy frames' codebook-0 codes (the
  all-EOS frame as the eos token), 4 inputs x 2 voices batched, greedy both from
  generation_config.json (no sampling field sent) and with temperature 0 sent; the audio
  equals `HiggsAudioV2Processor.decode` of the frames within 1e-3; a step's token budget
  of 64 chunks the ~100-row prompts, so steps mix prompt rows (text) and frame rows (audio);
- `/v1/audio/speech` in pcm and wav, streamed (raw and SSE) and not: the chunks joined
  equal the whole clip, each voice's its reference; TTFA / RTF in /metrics;
- voice cloning: a reference clip (24 kHz WAV, 48 kHz FLAC resampled) and its text as a
  context turn equal transformers' processor + generate, batched, then again from the
  prefix cache;
- a sampled request (RAS on, as generation_config.json sets it) and refusals;
- debug asserts on, pages back to 0.

Greedy and RAS: transformers applies RAS even under greedy (it then draws from a softmax,
so its greedy output is random wherever a code repeats); a greedy request here is argmax,
so the reference runs with RAS off (`ras_win_len=None`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.higgs_checkpoints import (
    higgs_clone_reference,
    higgs_prompt_ids,
    higgs_reference,
    hub_cache_folder,
    make_higgs_checkpoint,
    make_higgs_codec,
)
from tests.servers import MstarServer
from tests.tts_checkpoints import audio_file, chirp

TEXTS = ("Hello world!", "The quick brown fox jumps over the lazy dog.", "Numbers like 12345.",
         "What is the capital of France?")
VOICES = ("default", "a warm, low female voice")
FRAMES = 40
#: a request cut by max_tokens before its EOS frame (its delayed codebooks never close)
CUT, CUT_FRAMES = (VOICES[1], TEXTS[3]), 12
EOS_TOKEN = 1026  # one past the last code (1024 BOS, 1025 EOS)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("higgs")
    make_higgs_codec(hub_cache_folder(root / "hub"))
    make_higgs_checkpoint(root / "higgs", generation={"do_sample": False, "max_new_tokens": FRAMES})
    return root


@pytest.fixture(scope="module")
def reference(root):
    turns = [(voice, text) for voice in VOICES for text in TEXTS]
    codec = hub_cache_folder(root / "hub")
    out = dict(zip(turns, higgs_reference(root / "higgs", codec, turns, FRAMES)))
    out["cut"] = higgs_reference(root / "higgs", codec, [CUT], CUT_FRAMES)[0]
    return out


@pytest.fixture(scope="module")
def server(root, tmp_path_factory):
    srv = MstarServer(str(root / "higgs"), tmp_path_factory.mktemp("logs") / "higgs.log", "--num-kv-pages", "96",
                      "--page-size", "16", "--max-seq-len", "256", "--max-batch-tokens", "64",
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1", "HF_HUB_CACHE": str(root / "hub")}).start()
    yield srv
    srv.stop()


def tokens_of(frames: np.ndarray) -> list[int]:
    """The tokens mstar sends for transformers' frames: codebook 0's codes, the all-EOS frame as eos."""
    return [EOS_TOKEN if (f == 1025).all() else int(f[0]) for f in frames]


def pcm(samples: np.ndarray) -> np.ndarray:
    return np.frombuffer((np.clip(samples, -1, 1) * 32767).round().astype("<i2").tobytes(), "<i2")


async def test_frames_and_audio_equal_transformers(root, server, reference):
    """The default voice as text prompts with temperature 0 sent; the other voice as the
    template's ids with no sampling field (generation_config.json's greedy); and one cut by
max_tokens before it ends; all 9 at once."""
    bodies = [{"prompt": text, "temperature": 0} for text in TEXTS]
    bodies += [{"input_ids": higgs_prompt_ids(root / "higgs", text, VOICES[1])} for text in TEXTS]
    turns: list = [(voice, text) for voice in VOICES for text in TEXTS]
    caps = [FRAMES] * len(bodies) + [CUT_FRAMES]
    bodies.append({"input_ids": higgs_prompt_ids(root / "higgs", CUT[1], CUT[0]), "temperature": 0})
    turns.append("cut")
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        got = await asyncio.gather(*(client.post("/generate", json={**body, "max_tokens": cap})
                                     for body, cap in zip(bodies, caps)))
    ends = 0
    for turn, r in zip(turns, got):
        assert r.status_code == 200, r.text
        frames, wave = reference[turn]
        body = r.json()
        assert body["token_ids"] == tokens_of(frames), turn
        ends += body["token_ids"][-1] == EOS_TOKEN
        audio = np.frombuffer(base64.b64decode(body["audio"]), "<f4")
        assert audio.shape == wave.shape and len(wave) > 0
        np.testing.assert_allclose(audio, wave, atol=1e-3, rtol=0)
    # both ways a request ends: the delay's all-EOS frame, and max_tokens
    assert ends > 0 and got[-1].json()["token_ids"][-1] != EOS_TOKEN
    server.assert_clean()


async def speech(client: httpx.AsyncClient, **body) -> httpx.Response:
    return await client.post("/v1/audio/speech", json={"input": TEXTS[1], "max_tokens": FRAMES, **body})


async def test_speech_route_streams_and_voices(server, reference):
    """The default voice's longest reference (streamed in several chunks), the other voice."""
    import soundfile

    text = max(TEXTS, key=lambda t: len(reference[(VOICES[0], t)][0]))
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        whole = await speech(client, input=text, response_format="pcm")
        wav = await speech(client, input=text, response_format="wav", temperature=0)
        raw = await speech(client, input=text, response_format="pcm", stream_format="audio")
        sse = await speech(client, input=text, response_format="pcm", stream_format="sse", temperature=0)
        other = await speech(client, response_format="pcm", voice=VOICES[1], temperature=0)
        # 0.4 s: 10 codec frames, 18 delayed ones (the BOS frame and the delay's 7 added)
        seconds = await speech(client, input=text, response_format="pcm", max_tokens=None, max_audio_seconds=0.4)
    assert len(reference[(VOICES[0], text)][0]) > 18 and len(seconds.content) == 2 * 10 * 960
    assert whole.headers["content-type"] == "audio/pcm"
    got = np.frombuffer(whole.content, "<i2")
    want = pcm(reference[(VOICES[0], text)][1])
    assert len(got) == len(want) > 0 and np.abs(got.astype(int) - want).max() <= 33  # 1e-3 of full scale
    assert raw.content == whole.content
    events = [json.loads(line[6:]) for line in sse.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    assert len(events) > 3  # the first final frames leave alone, then chunks
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == whole.content
    samples, rate = soundfile.read(io.BytesIO(wav.content), dtype="int16")
    assert rate == 24000 and np.array_equal(samples, got)
    second = np.frombuffer(other.content, "<i2")
    assert np.abs(second.astype(int) - pcm(reference[(VOICES[1], TEXTS[1])][1])).max() <= 33
    server.assert_clean()
    clips = server.metric("mstar_time_to_first_audio_seconds_count")
    assert clips >= 5 and server.metric("mstar_real_time_factor_count") == clips
    assert server.metric("mstar_audio_seconds_total") > 0


async def test_sampling_with_ras_and_refusals(server):
    """A sampled request (temperature 1, RAS from generation_config.json) speaks and frees
    its pages; voices that are not a speaker description are refused by name."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        sampled = await asyncio.gather(*(speech(client, response_format="pcm", temperature=1.0, seed=s)
                                         for s in (1, 2)))
        bad = [await speech(client, voice=v) for v in ("<|audio_out_bos|>", "x" * 501)]
    for r in sampled:
        assert r.status_code == 200, r.text
        assert len(r.content) % (2 * 960) == 0
    for r in bad:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "voice"
    server.assert_clean()


# -- voice cloning: a reference clip and its text as a context turn -------------------------


@pytest.fixture(scope="module")
def clips():
    """(context turn for the api, reference samples for transformers, text to speak): a
    24 kHz float WAV, and a 48 kHz FLAC that mstar resamples (transformers gets the same
    24 kHz samples)."""
    from shared.audio import decode_audio

    wav = chirp(12000, 220)
    flac = audio_file(chirp(20000, 500, 48000), 48000, "FLAC", "PCM_16")
    return [({"speaker": "0", "text": "Hello there.", "audio": base64.b64encode(audio_file(wav)).decode()}, wav,
             TEXTS[2]),
            ({"speaker": "x", "text": "Numbers like 12345.", "audio": base64.b64encode(flac).decode()},
             decode_audio(flac, 24000), TEXTS[0])]


@pytest.fixture(scope="module")
def clone_reference(root, clips):
    items = [(turn["text"], samples, text) for turn, samples, text in clips]
    return higgs_clone_reference(root / "higgs", hub_cache_folder(root / "hub"), items, FRAMES)


async def test_voice_cloning_equals_transformers(server, reference, clips, clone_reference):
    """Both clips batched (/generate and the speech route), then the first again: its clip's
    rows now come from the prefix cache (not encoded again), with the same frames."""
    first = {"prompt": clips[0][2], "context": [clips[0][0]], "max_tokens": FRAMES, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        together = await asyncio.gather(client.post("/generate", json=first),
                                        speech(client, input=clips[1][2], context=[clips[1][0]],
                                               response_format="pcm", temperature=0))
        await asyncio.sleep(0.5)  # metrics trail the worker
        hits = server.metric("mstar_prefix_cache_hit_tokens_total")
        again = await client.post("/generate", json=first)
    frames, wave, ids = clone_reference[0]
    for r in (together[0], again):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        assert body["token_ids"] == tokens_of(frames)
        audio = np.frombuffer(base64.b64decode(body["audio"]), "<f4")
        assert audio.shape == wave.shape and len(wave) > 0
        np.testing.assert_allclose(audio, wave, atol=1e-3, rtol=0)
    assert server.wait_metric("mstar_prefix_cache_hit_tokens_total", hits + 1) > hits
    assert together[1].status_code == 200, together[1].text
    got, want = np.frombuffer(together[1].content, "<i2"), pcm(clone_reference[1][1])
    assert len(got) == len(want) > 0 and np.abs(got.astype(int) - want).max() <= 33
    alone = reference[(VOICES[0], clips[0][2])][0]  # the same text without the clip
    assert not np.array_equal(frames[: len(alone)], alone[: len(frames)])
    server.assert_clean()


@pytest.mark.parametrize(("turn", "param"), [
    ({"speaker": "0", "text": "Hi."}, "context[0].audio"),
    ({"speaker": "0", "text": "", "audio": base64.b64encode(b"RIFF").decode()}, "context[0].text"),
    ({"speaker": "0", "text": "Hi.", "audio": base64.b64encode(b"RIFF not a wav").decode()}, "context[0].audio"),
])
async def test_clone_refusals_name_the_field(server, turn, param):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        r = await speech(client, context=[turn])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    server.assert_clean()
