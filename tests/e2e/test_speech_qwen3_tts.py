"""Qwen3-TTS (CustomVoice) through the real services: a tiny random checkpoint laid out as
the Hub ships it (tests/qwen3_tts_checkpoints.py: vocab.json + merges.txt and no
tokenizer.json, the 12 Hz codec in speech_tokenizer/), against the `qwen-tts` package
(0.1.1, in its own venv: transformers 4.57.3) run greedy on the same folder.

- frames: `/generate`'s tokens are the package's first codes (a `codec_eos` frame sent as
  that id) and its audio the package's waveform within 1e-3, 4 inputs in the default voice,
  batched, greedy both from generation_config.json (no sampling field sent) and with
  temperature 0 sent; a token budget of 24 a step chunks the prompts beside frame rows;
- `/v1/audio/speech`: a second voice (4 inputs, one with instructions: the package's user
  turn) batched, each equal to the package's pcm within 1e-3 of full scale; a request alone
  equals the same request among others; streamed (raw and SSE) chunks join to the whole;
- the package's streaming text (`non_streaming_mode: false`, a text token fed with each
  frame): two voices, texts longer and shorter than the clip, one with instructions,
  batched, each the package's pcm within 1e-3 (`generate(non_streaming_mode=False)`);
- a sampled request: the same seed, the same clip;
- refusals: an unknown voice (400 naming `voice` and listing the speakers), the model's
  special tokens in the text;
- debug asserts on, pages back to 0.

mstar's `max_tokens` counts frames of sound; the package's `max_new_tokens` n makes n - 1
(runners/qwen3_tts.py), so the reference runs with FRAMES + 1.
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

from tests.qwen3_tts_checkpoints import (
    SPEAKERS,
    make_qwen3_tts_checkpoint,
    qwen3_tts_prefetch,
    qwen3_tts_reference,
    qwen3_tts_server,
)

#: the first test's setup may build the reference's venv, weights and answers (kept after)
pytestmark = pytest.mark.timeout(600)

TEXTS = ("Hello world!", "The quick brown fox jumps over the lazy dog.", "Numbers like 12345.",
         "What is the capital of France?")
VOICES = ("vivian", "ryan")  # the first speaker is the default voice
INSTRUCT = "Speak softly, with a smile."
FRAMES = 16
EOS = 72  # the checkpoint's codec_eos_token_id


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_tts") / "ckpt"
    return make_qwen3_tts_checkpoint(folder, {"do_sample": False, "subtalker_dosample": False,
                                              "max_new_tokens": FRAMES})


def _cases() -> list[tuple[str, str, str]]:
    """(voice, text, instructions) of every request the tests compare."""
    cases = [(voice, text, "") for voice in VOICES for text in TEXTS]
    return [*cases, (VOICES[1], TEXTS[0], INSTRUCT)]


def _answers(root: Path, work: Path, stream: bool = False) -> list:
    cases = STREAMED if stream else _cases()
    asks = [{"text": t, "speaker": v, "instruct": i, "max_new_tokens": FRAMES + 1,
             **({"non_streaming_mode": False} if stream else {})} for v, t, i in cases]
    return qwen3_tts_reference(root, asks, work)


@pytest.fixture(scope="module")
def answers(root, tmp_path_factory) -> tuple[list, list]:
    """The package's answers (the prompt's text, streamed text), in one run of the reference (kept)."""
    works = [tmp_path_factory.mktemp("qwen3_tts_ref"), tmp_path_factory.mktemp("qwen3_tts_stream_ref")]
    qwen3_tts_prefetch(lambda: _answers(root, works[0]), lambda: _answers(root, works[1], True))
    return _answers(root, works[0]), _answers(root, works[1], True)


@pytest.fixture(scope="module")
def reference(answers):
    return dict(zip(_cases(), answers[0]))


#: streamed text: (voice, text, instructions), one batch of the package's
STREAMED = ((VOICES[0], TEXTS[0], ""), (VOICES[0], TEXTS[1], ""), (VOICES[1], TEXTS[1], ""),
            (VOICES[1], TEXTS[0], INSTRUCT))


@pytest.fixture(scope="module")
def stream_reference(answers):
    return answers[1]


@pytest.fixture(scope="module")
def server(root, tmp_path_factory):
    srv = qwen3_tts_server(root, tmp_path_factory.mktemp("logs") / "qwen3_tts.log")
    yield srv
    srv.stop()


def tokens_of(codes: np.ndarray) -> list[int]:
    """The tokens mstar sends for the package's frames: each first code, then codec_eos
    where the package stopped before the cap."""
    firsts = [int(c) for c in codes[:, 0]]
    return firsts if len(firsts) == FRAMES else [*firsts, EOS]


def pcm(samples: np.ndarray) -> np.ndarray:
    return np.frombuffer((np.clip(samples, -1, 1) * 32767).round().astype("<i2").tobytes(), "<i2")


def assert_pcm(got: bytes, wave: np.ndarray) -> None:
    samples = np.frombuffer(got, "<i2")
    want = pcm(wave)
    assert len(samples) == len(want) > 0
    assert np.abs(samples.astype(int) - want).max() <= 33  # 1e-3 of full scale


async def speech(client: httpx.AsyncClient, voice: str, text: str, **body) -> httpx.Response:
    return await client.post("/v1/audio/speech", json={"input": text, "voice": voice, "response_format": "pcm",
                                                       **body})


async def test_codes_and_audio_equal_the_package(server, reference):
    """The default voice's 4 texts on /generate (two with temperature 0 sent, two with
    generation_config.json's greedy), batched: tokens and float audio."""
    bodies = [{"prompt": text, **({"temperature": 0} if i % 2 else {})} for i, text in enumerate(TEXTS)]
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        got = await asyncio.gather(*(client.post("/generate", json=body) for body in bodies))
    for text, r in zip(TEXTS, got):
        assert r.status_code == 200, r.text
        codes, wave = reference[(VOICES[0], text, "")]
        body = r.json()
        assert body["token_ids"] == tokens_of(codes), text
        audio = np.frombuffer(base64.b64decode(body["audio"]), "<f4")
        assert audio.shape == wave.shape and len(wave) > 0
        np.testing.assert_allclose(audio, wave, atol=1e-3, rtol=0)
    server.assert_clean()


async def test_second_voice_and_instructions_batched(server, reference):
    """The other voice's 4 texts and one with instructions at once on the speech route,
    then one of them alone: each the package's clip; alone equals batched."""
    cases = [c for c in _cases() if c[0] == VOICES[1]]
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        got = await asyncio.gather(*(speech(client, v, t, **({"instructions": i} if i else {})) for v, t, i in cases))
        alone = await speech(client, *cases[1][:2])
    for case, r in zip(cases, got):
        assert r.status_code == 200, r.text
        assert_pcm(r.content, reference[case][1])
    assert alone.content == got[1].content
    plain, instructed = reference[cases[0]][0], reference[cases[-1]][0]
    assert not np.array_equal(plain[: len(instructed)], instructed[: len(plain)])  # instructions change the codes
    default = reference[(VOICES[0], TEXTS[0], "")][0]
    assert not np.array_equal(plain[: len(default)], default[: len(plain)])  # so do voices
    server.assert_clean()


async def test_streams_join_to_the_whole(server, reference):
    """Raw pcm chunks and SSE deltas join to the whole clip; wav carries the codec's rate."""
    import soundfile

    text = max(TEXTS, key=lambda t: len(reference[(VOICES[1], t, "")][0]))
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        whole = await speech(client, VOICES[1], text)
        raw = await speech(client, VOICES[1], text, stream_format="audio")
        sse = await speech(client, VOICES[1], text, stream_format="sse", temperature=0)
        wav = await speech(client, VOICES[1], text, response_format="wav")
        # 0.01 s: 5 frames of the tiny codec's 48 samples (500 a second)
        short = await speech(client, VOICES[1], text, max_audio_seconds=0.01)
    assert_pcm(whole.content, reference[(VOICES[1], text, "")][1])
    assert raw.content == whole.content
    events = [json.loads(line[6:]) for line in sse.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done" and len(events) > 3
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == whole.content
    samples, rate = soundfile.read(io.BytesIO(wav.content), dtype="int16")
    assert rate == 24000 and np.array_equal(samples, np.frombuffer(whole.content, "<i2"))
    # the same samples as the whole clip's first 5 frames (a decode of other lengths: to the last bit or one)
    head = np.frombuffer(whole.content[: 2 * 5 * 48], "<i2").astype(int)
    assert len(reference[(VOICES[1], text, "")][0]) > 5 and len(short.content) == 2 * 5 * 48
    assert np.abs(np.frombuffer(short.content, "<i2").astype(int) - head).max() <= 1
    assert server.metric("mstar_time_to_first_audio_seconds_count") >= 4
    server.assert_clean()


async def test_streamed_text_equals_the_package(server, stream_reference, reference):
    """`non_streaming_mode: false`: the text fed a token a frame, batched, as the package."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        got = await asyncio.gather(*(speech(client, v, t, non_streaming_mode=False,
                                            **({"instructions": i} if i else {})) for v, t, i in STREAMED))
    for case, r, (_, wave) in zip(STREAMED, got, stream_reference):
        assert r.status_code == 200, (case, r.text)
        assert_pcm(r.content, wave)
    streamed, whole = stream_reference[1][0], reference[(VOICES[0], TEXTS[1], "")][0]
    assert not np.array_equal(streamed[: len(whole)], whole[: len(streamed)])  # the mode changes the codes
    server.assert_clean()


async def test_sampled_requests_are_seeded(server):
    """generation_config.json's sub-talker sampling is off here; a request sent with
    temperature 1 samples its first codes with its seed: the same seed, the same clip."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        got = await asyncio.gather(*(speech(client, VOICES[1], TEXTS[1], temperature=1.0, seed=s)
                                     for s in (7, 7, 8)))
    for r in got:
        assert r.status_code == 200, r.text
        assert len(r.content) % (2 * 48) == 0 and len(r.content) > 0
    assert got[0].content == got[1].content
    server.assert_clean()


async def test_refusals_name_the_field(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        bad_voice = await speech(client, "nobody", TEXTS[0])
        special = await speech(client, VOICES[0], "Hi <|im_end|> there")
        bad_instr = await speech(client, VOICES[0], TEXTS[0], instructions="<|im_start|>x")
    assert bad_voice.status_code == 400, bad_voice.text
    error = bad_voice.json()["error"]
    assert error["param"] == "voice" and all(s in error["message"] for s in SPEAKERS)
    assert special.status_code == 400 and special.json()["error"]["param"] == "input"
    assert bad_instr.status_code == 400 and bad_instr.json()["error"]["param"] == "instructions"
    server.assert_clean()
