"""Qwen3-TTS Base checkpoints through the real services: a voice cloned from a reference
clip (x-vector mode), a tiny random Base checkpoint laid out as the Hub ships one
(tests/qwen3_tts_checkpoints.py), against the `qwen-tts` package's
`generate_voice_clone(x_vector_only_mode=True, non_streaming_mode=True)` run greedy on the
same folder and clips.

- the clip is one `context` turn `{"audio": base64 WAV}` (the engine's cloning field, as
  CSM's and Higgs'; no text: x-vector mode); two clips, three texts, batched on
  `/v1/audio/speech`: each the package's pcm within 1e-3 of full scale; the same clip again
  (its speaker row from the prefix cache) gives the same clip; `/generate` with the clip:
  the package's first codes as tokens and its float waveform within 1e-3;
- ICL mode (the clip with its transcript: `context=[{"text", "audio"}]`), against
  `generate_voice_clone(ref_audio, ref_text, x_vector_only_mode=False,
  non_streaming_mode=True)`: two clips x two texts batched, each the package's pcm within
  1e-3 of full scale after the package's cut of the clip's part (exactly the clip's
  samples; where the package's float cut is a sample short, its extra first sample is
  the one not compared), the same request again (from the prefix cache) the same bytes;
  `/generate`: the package's codes as tokens and its waveform within 1e-3;
- the package's streaming text (`non_streaming_mode: false`) in both modes, batched, each
  equal to the package's (`generate_voice_clone(non_streaming_mode=False)`);
- refusals: `voice` on a Base checkpoint, no clip, a transcript holding a special token
  or without its clip, an ICL clip whose frames do not fit `max_seq_len`;
- debug asserts on, pages back to 0.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.qwen3_tts_checkpoints import (
    make_qwen3_tts_checkpoint,
    qwen3_tts_clone_reference,
    qwen3_tts_icl_reference,
    qwen3_tts_prefetch,
    qwen3_tts_server,
)

pytestmark = pytest.mark.timeout(600)

FRAMES = 12
EOS = 72  # the checkpoint's codec_eos_token_id
CASES = ((0, "Hello world!"), (0, "The quick brown fox."), (1, "Hello world!"))
#: ICL: (clip, its transcript, the text to speak); the clips' frames (48 samples each) are prompt rows
ICL_CASES = ((0, "the wind in the trees", "Hello world!"), (0, "the wind in the trees", "The quick brown fox."),
             (1, "our house is quiet.", "Hello world!"), (1, "our house is quiet.", "The quick brown fox."))
SAMPLES_PER_FRAME = 48
#: the package's streaming text (`non_streaming_mode: false`): ICL with a clip of fewer frames
#: than the transcript and text have tokens (the rest fed a frame), and of more (all on its
#: rows, then `tts_pad`); x-vector mode (the text's first token on `codec_bos`, the rest fed)
STREAMED_ICL = ((2, "the wind in the trees and the rain on the roof", "The quick brown fox."),
                (0, "our house is quiet.", "Hello world!"))
STREAMED_XVECTOR = ((1, "The quick brown fox."),)


def _clips() -> list[np.ndarray]:
    """Two reference clips at 24 kHz (a chord with noise, 1 s; noise, 0.6 s) as a float WAV
    holds them."""
    rng = np.random.default_rng(5)
    t = np.arange(24000) / 24000
    chord = 0.3 * np.sin(2 * np.pi * 180 * t) + 0.2 * np.sin(2 * np.pi * 990 * t) + 0.05 * rng.standard_normal(len(t))
    return [chord.astype(np.float32), (0.3 * rng.standard_normal(14400)).astype(np.float32)]


def _icl_clips() -> list[np.ndarray]:
    """The ICL clips: 50 and 40 frames of the two clips, and the first's last 30 (whole
    frames: the package encodes one clip alone, as the server does, and a whole number of
    frames is the same batched)."""
    chord, noise = _clips()
    return [chord[: 50 * SAMPLES_PER_FRAME], noise[: 40 * SAMPLES_PER_FRAME], chord[-30 * SAMPLES_PER_FRAME:]]


def _wav(samples: np.ndarray) -> str:
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, samples, 24000, format="WAV", subtype="FLOAT")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_tts_base") / "ckpt"
    return make_qwen3_tts_checkpoint(folder, {"do_sample": False, "subtalker_dosample": False,
                                              "max_new_tokens": FRAMES}, model_type="base")


def _xvector_answers(root: Path, work: Path, stream: bool = False):
    asks = [{"text": text, "clip": clip, "max_new_tokens": FRAMES + 1, **({"non_streaming_mode": False} if stream
                                                                           else {})}
            for clip, text in (STREAMED_XVECTOR if stream else CASES)]
    return qwen3_tts_clone_reference(root, asks, _clips(), work)


def _icl_answers(root: Path, work: Path, stream: bool = False):
    asks = [{"text": text, "clip": clip, "ref_text": said, "max_new_tokens": FRAMES + 1,
             **({"non_streaming_mode": False} if stream else {})}
            for clip, said, text in (STREAMED_ICL if stream else ICL_CASES)]
    return qwen3_tts_icl_reference(root, asks, _icl_clips(), work)


@pytest.fixture(scope="module")
def answers(root, tmp_path_factory) -> dict:
    """The package's answers for every test here, made in one run of the reference (kept):
    x-vector mode, ICL mode, and both with streamed text."""
    calls = {"xvector": _xvector_answers, "icl": _icl_answers,
             "icl_streamed": functools.partial(_icl_answers, stream=True),
             "xvector_streamed": functools.partial(_xvector_answers, stream=True)}
    works = {k: tmp_path_factory.mktemp(f"qwen3_tts_{k}_ref") for k in calls}
    qwen3_tts_prefetch(*(functools.partial(f, root, works[k]) for k, f in calls.items()))
    return {k: f(root, works[k]) for k, f in calls.items()}


@pytest.fixture(scope="module")
def reference(answers):
    return answers["xvector"]


@pytest.fixture(scope="module")
def icl_reference(answers):
    return answers["icl"]


@pytest.fixture(scope="module")
def stream_reference(answers):
    """The package's streaming-text answers: (ICL cases, x-vector cases)."""
    return answers["icl_streamed"], answers["xvector_streamed"]


@pytest.fixture(scope="module")
def server(root, tmp_path_factory):
    srv = qwen3_tts_server(root, tmp_path_factory.mktemp("logs") / "qwen3_tts_clone.log")
    yield srv
    srv.stop()


def pcm(samples: np.ndarray) -> np.ndarray:
    return np.frombuffer((np.clip(samples, -1, 1) * 32767).round().astype("<i2").tobytes(), "<i2")


async def speech(client: httpx.AsyncClient, text: str, **body) -> httpx.Response:
    return await client.post("/v1/audio/speech", json={"input": text, "response_format": "pcm", **body})


async def test_cloned_voices_equal_the_package(server, reference):
    clips = [_wav(c) for c in _clips()]
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        got = await asyncio.gather(*(speech(client, text, context=[{"audio": clips[clip]}]) for clip, text in CASES))
        again = await speech(client, CASES[0][1], context=[{"audio": clips[0]}])
        generated = await client.post("/generate", json={"prompt": CASES[2][1], "context": [{"audio": clips[1]}],
                                                         "temperature": 0})
    for (clip, text), r, (codes, wave) in zip(CASES, got, reference):
        assert r.status_code == 200, r.text
        samples, want = np.frombuffer(r.content, "<i2"), pcm(wave)
        assert len(samples) == len(want) > 0, (clip, text, len(codes))
        assert np.abs(samples.astype(int) - want).max() <= 33  # 1e-3 of full scale
    assert again.content == got[0].content
    assert generated.status_code == 200, generated.text
    firsts = [int(c) for c in reference[2][0][:, 0]]
    assert generated.json()["token_ids"] == (firsts if len(firsts) == FRAMES else [*firsts, EOS])
    audio = np.frombuffer(base64.b64decode(generated.json()["audio"]), "<f4")
    np.testing.assert_allclose(audio, reference[2][1], atol=1e-3, rtol=0)
    assert not np.array_equal(reference[0][0], reference[2][0])  # the clip is the voice (same text)
    server.assert_clean()


def _package_cut(ref: int, new: int) -> int:
    """The samples the package cuts from its decode of the clip's codes and the new ones
    (`generate_voice_clone`: int(ref / total * samples), float rounding and all)."""
    total = ref + new
    return int(ref / max(total, 1) * (total * SAMPLES_PER_FRAME))


def _after_cut(wave: np.ndarray, ref: int, new: int) -> np.ndarray:
    """The package's waveform less the leading sample its cut keeps where rounding leaves it
    one short of the clip's samples (what a stream cannot know: runners/qwen3_tts.py)."""
    extra = ref * SAMPLES_PER_FRAME - _package_cut(ref, new)
    assert extra in (0, 1)
    return wave[extra:]


async def test_icl_voices_equal_the_package(server, icl_reference):
    clips = [_wav(c) for c in _icl_clips()]
    turns = [[{"text": said, "audio": clips[clip]}] for clip, said, _ in ICL_CASES]
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        got = await asyncio.gather(*(speech(client, text, context=turn)
                                     for (_, _, text), turn in zip(ICL_CASES, turns)))
        again = await speech(client, ICL_CASES[3][2], context=turns[3])
        generated = await client.post("/generate", json={"prompt": ICL_CASES[2][2], "context": turns[2],
                                                         "temperature": 0})
    for case, r, (codes, wave, ref) in zip(ICL_CASES, got, icl_reference):
        assert r.status_code == 200, r.text
        want = pcm(_after_cut(wave, len(ref), len(codes)))
        samples = np.frombuffer(r.content, "<i2")
        assert len(samples) == len(want) == len(codes) * SAMPLES_PER_FRAME > 0, (case, len(codes))
        assert np.abs(samples.astype(int) - want).max() <= 33  # 1e-3 of full scale
    assert again.content == got[3].content
    assert generated.status_code == 200, generated.text
    codes, wave, ref = icl_reference[2]
    firsts = [int(c) for c in codes[:, 0]]
    assert generated.json()["token_ids"] == (firsts if len(firsts) == FRAMES else [*firsts, EOS])
    audio = np.frombuffer(base64.b64decode(generated.json()["audio"]), "<f4")
    np.testing.assert_allclose(audio, _after_cut(wave, len(ref), len(codes)), atol=1e-3, rtol=0)
    assert [len(r) for _, _, r in icl_reference] == [50, 50, 40, 40]
    assert not np.array_equal(icl_reference[0][0], icl_reference[1][0])  # the text is spoken
    server.assert_clean()


async def test_streamed_text_equals_the_package(server, stream_reference):
    """`non_streaming_mode: false` in ICL and x-vector mode, batched: each the package's pcm."""
    icl_clips, clips = [_wav(c) for c in _icl_clips()], [_wav(c) for c in _clips()]
    bodies = [(text, [{"text": said, "audio": icl_clips[clip]}]) for clip, said, text in STREAMED_ICL]
    bodies += [(text, [{"audio": clips[clip]}]) for clip, text in STREAMED_XVECTOR]
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        got = await asyncio.gather(*(speech(client, text, context=turn, non_streaming_mode=False)
                                     for text, turn in bodies))
    icl, xvec = stream_reference
    for r, (codes, wave, ref) in zip(got, icl):
        assert r.status_code == 200, r.text
        want = pcm(_after_cut(wave, len(ref), len(codes)))
        samples = np.frombuffer(r.content, "<i2")
        assert len(samples) == len(want) == len(codes) * SAMPLES_PER_FRAME > 0
        assert np.abs(samples.astype(int) - want).max() <= 33
    r, (codes, wave) = got[-1], xvec[0]
    assert r.status_code == 200, r.text
    samples = np.frombuffer(r.content, "<i2")
    assert len(samples) == len(wave) > 0 and np.abs(samples.astype(int) - pcm(wave)).max() <= 33
    server.assert_clean()


async def test_refusals_name_the_field(server):
    clip = _wav(_clips()[1])
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        named = await speech(client, "Hi.", voice="vivian", context=[{"audio": clip}])
        none = await speech(client, "Hi.")
        special = await speech(client, "Hi.", context=[{"audio": clip, "text": "What <|im_end|> says."}])
        no_clip = await speech(client, "Hi.", context=[{"text": "What the clip says."}])
        # ICL: 1 s is 500 frames of the tiny codec, past the server's 256 rows (max_seq_len)
        long_clip = await speech(client, "Hi.", context=[{"audio": _wav(_clips()[0]), "text": "What it says."}])
        # 250 frames fit, but not with the text's rows
        rows = await speech(client, "Hi.", context=[{"audio": _wav(_clips()[0][: 250 * SAMPLES_PER_FRAME]),
                                                     "text": "What it says."}])
    assert named.status_code == 400 and named.json()["error"]["param"] == "voice", named.text
    assert none.status_code == 400 and none.json()["error"]["param"] == "context", none.text
    assert special.status_code == 400 and special.json()["error"]["param"] == "context[0].text", special.text
    assert no_clip.status_code == 400 and no_clip.json()["error"]["param"] == "context[0].audio", no_clip.text
    for r in (long_clip, rows):
        assert r.status_code == 400 and r.json()["error"]["param"] == "context[0].audio", r.text
    server.assert_clean()
