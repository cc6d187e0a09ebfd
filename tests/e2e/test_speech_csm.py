"""CSM speech out through the real services: a tiny random CsmForConditionalGeneration
(backbone 2 x 64, depth decoder 2 x 32, 16 codebooks, a tiny Mimi with the real rates).

- frames: `/generate`'s tokens (each frame's first code; the ending frame as the spec's
  `eos_frame_token`) equal transformers' greedy `generate` (depth decoder greedy too) for 5
  texts and 2 speakers, batched; the audio equals `MimiModel.decode` of transformers'
  frames within float tolerance, so every codebook of every frame is transformers';
- `/v1/audio/speech` in pcm, wav and flac, streamed (raw and SSE) and not: the chunks
  joined equal the whole clip; speakers as voices;
- the official `openai` client's `audio.speech.create` and `with_streaming_response`;
- refusals naming the field (a length past the frame loop's cap names `frame_loop`); KV
  debug asserts on, both labels within their footprints, pages back to 0;
- context turns (voice continuation, the `context` extension): two conversations whose
  earlier turns carry audio (chirps; one a 48 kHz FLAC, resampled) give transformers'
  greedy frames and sound for the CSM processor's inputs of the same conversation, through
  `/generate`, `/v1/audio/speech` and the openai client's `extra_body`; refusals naming
  `context[i].*`.
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

from tests.servers import MstarServer
from tests.tts_checkpoints import (
    audio_file,
    chirp,
    csm_context_reference,
    csm_reference,
    make_csm_checkpoint,
    openai_speech,
)

TEXTS = ("Hello world!", "The quick brown fox jumps over the lazy dog.", "What is the capital of France?",
         "Numbers like 12345 appear in text.", "Goodbye, world.")
FRAMES = 6
GREEDY = {"temperature": 0}
CODEBOOKS = 16
MAX_SEQ_LEN = 128
PAGE_SIZE = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_csm_checkpoint(tmp_path_factory.mktemp("csm") / "csm", num_codebooks=CODEBOOKS)


@pytest.fixture(scope="module")
def reference(folder):
    turns = [(speaker, text) for text in TEXTS for speaker in ("0", "1")]
    return dict(zip(turns, csm_reference(folder, turns, FRAMES)))


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    srv = MstarServer(str(folder), tmp_path_factory.mktemp("logs") / "csm.log", "--num-kv-pages", "64",
                      "--page-size", str(PAGE_SIZE), "--max-seq-len", str(MAX_SEQ_LEN),
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    yield srv
    srv.stop()


def tokens_of(frames: np.ndarray, eos_token: int) -> list[int]:
    """The tokens mstar sends for transformers' frames: first codes, the ending frame as eos."""
    return [eos_token if (f[:-1] == 0).all() else int(f[0]) for f in frames]


def pcm(samples: np.ndarray) -> np.ndarray:
    return np.frombuffer((np.clip(samples, -1, 1) * 32767).round().astype("<i2").tobytes(), "<i2")


def prompt_ids(folder: Path, speaker: str, text: str) -> list[int]:
    """The CSM processor's ids of a `[speaker]text` turn."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    rendered = tok.apply_chat_template([{"role": speaker, "content": [{"type": "text", "text": text}]}],
                                       tokenize=False)
    return tok(rendered, add_special_tokens=False).input_ids


async def test_frames_and_audio_equal_transformers(folder, server, reference):
    """Speaker 0 as a text prompt (the default voice), both speakers as the processor's ids."""
    turns = list(reference)
    bodies = [{"prompt": text} for text in TEXTS] + [{"input_ids": prompt_ids(folder, s, t)} for s, t in turns]
    turns = [("0", text) for text in TEXTS] + turns
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        got = await asyncio.gather(*(client.post("/generate", json={**body, "max_tokens": FRAMES, **GREEDY})
                                     for body in bodies))
    for turn, r in zip(turns, got):
        assert r.status_code == 200, r.text
        frames, wave = reference[turn]
        body = r.json()
        assert body["token_ids"] == tokens_of(frames, 64)
        audio = np.frombuffer(base64.b64decode(body["audio"]), "<f4")
        assert audio.shape == wave.shape
        np.testing.assert_allclose(audio, wave, atol=1e-4 * max(1.0, float(np.abs(wave).max())), rtol=0)
    server.assert_clean()


async def speech(client: httpx.AsyncClient, **body) -> httpx.Response:
    body = {"input": TEXTS[1], "max_tokens": FRAMES, **GREEDY, **body}
    return await client.post("/v1/audio/speech", json=body)


async def test_speech_route_formats_and_streams(server, reference):
    import soundfile

    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        whole = await speech(client, response_format="pcm")
        wav = await speech(client, response_format="wav")
        flac = await speech(client, response_format="flac")
        raw = await speech(client, response_format="pcm", stream_format="audio")
        sse = await speech(client, response_format="pcm", stream_format="sse")
        other = await speech(client, response_format="pcm", voice="1")
        # 0.42 s is 5.25 frames of 80 ms: rounded up to the 6 max_tokens asks for; 0.3 s: 4 frames
        seconds = await speech(client, response_format="pcm", max_tokens=None, max_audio_seconds=0.42)
        shorter = await speech(client, response_format="pcm", max_audio_seconds=0.3)
    assert whole.headers["content-type"] == "audio/pcm" and wav.headers["content-type"] == "audio/wav"
    got = np.frombuffer(whole.content, "<i2")
    want = pcm(reference[("0", TEXTS[1])][1])
    assert len(got) == len(want) == FRAMES * 1920 and np.abs(got.astype(int) - want).max() <= 1
    assert np.abs(got).max() < 32767  # not clipped: the samples themselves are compared
    assert raw.content == whole.content
    assert seconds.content == whole.content and shorter.content == whole.content[: 4 * 1920 * 2]
    events = [json.loads(line[6:]) for line in sse.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] == FRAMES
    assert len(events) > 2  # the first frame leaves alone, then chunks of frames
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == whole.content
    for encoded in (wav.content, flac.content):
        samples, rate = soundfile.read(io.BytesIO(encoded), dtype="int16")
        assert rate == 24000 and np.array_equal(samples, got)
    second = np.frombuffer(other.content, "<i2")
    assert np.abs(second.astype(int) - pcm(reference[("1", TEXTS[1])][1])).max() <= 1
    server.assert_clean()
    clips = server.metric("mstar_time_to_first_audio_seconds_count")
    assert clips >= 6 and server.metric("mstar_real_time_factor_count") == clips
    assert server.metric("mstar_audio_seconds_total") >= 6 * FRAMES * 1920 / 24000


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": ""}, "input", None),
    ({"input": "x" * 5000}, "input", None),
    ({"input": "x", "voice": "tara"}, "voice", "voice 'tara' is not one of this model's speakers"),
    ({"input": "x", "response_format": "aac"}, "response_format", "response_format 'aac' is not offered"),
    ({"input": "x", "response_format": "mp3", "stream_format": "audio"}, "stream_format", "mp3 cannot be streamed"),
    ({"input": "x", "max_tokens": 100000}, "max_tokens",
     f"max_tokens - 1 = 99999 exceeds the decode loop's max_iters {MAX_SEQ_LEN - 1} (frame_loop)"),
    ({"input": "x", "max_audio_seconds": 1000}, "max_tokens",  # 12,500 frames
     f"max_tokens - 1 = 12499 exceeds the decode loop's max_iters {MAX_SEQ_LEN - 1} (frame_loop)"),
    ({"input": "x", "max_audio_seconds": 0}, "max_audio_seconds", None),
])
async def test_speech_refusals_name_the_field(server, body, param, message):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        r = await client.post("/v1/audio/speech", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if message:
        assert message in r.json()["error"]["message"]


async def test_frames_to_the_cap_and_aborts_free_both_labels(server):
    """Requests that run the frame loop to its cap (their footprints' peak, both labels:
    the debug checks log any label held below it) and a stream dropped mid-way."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        long = MAX_SEQ_LEN - 20
        runs = await asyncio.gather(*(client.post("/generate", json={
            "prompt": TEXTS[0], "max_tokens": long, "ignore_eos": True, **GREEDY}) for _ in range(3)))
        assert all(r.status_code == 200 and len(r.json()["token_ids"]) == long for r in runs)
        async with client.stream("POST", "/v1/audio/speech", json={"input": TEXTS[2], "max_tokens": long,
                                                                   "stream_format": "audio", **GREEDY}) as r:
            async for _ in r.aiter_bytes():
                break  # the first chunk, then the client goes away
    server.assert_clean()


def test_the_openai_client_speaks(server):
    clip, streamed = openai_speech(server.url, "1", TEXTS[1], {**GREEDY, "max_tokens": FRAMES})
    assert clip == streamed and len(clip) == 2 * FRAMES * 1920
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["output_modalities"] == ["audio"]


# -- context turns (voice continuation) --------------------------------------------------


@pytest.fixture(scope="module")
def conversations():
    """Two conversations as (context turns for the api, turns for transformers, the text
    to speak and its speaker): a 24 kHz float WAV and a 48 kHz FLAC (which mstar resamples;
    transformers gets the same 24 kHz samples)."""
    from shared.audio import decode_audio

    a, b = chirp(5000, 220), chirp(9000, 330)
    flac = audio_file(chirp(15000, 500, 48000), 48000, "FLAC", "PCM_16")
    first = [("0", "Hello there.", audio_file(a), a), ("1", "Hi, how are you?", audio_file(b), b)]
    second = [("1", "Numbers like 12345.", flac, decode_audio(flac, 24000)), ("0", "A text-only turn.", None, None)]
    out = []
    for turns, speaker, text in ((first, "0", TEXTS[4]), (second, "1", TEXTS[2])):
        body = [{"speaker": s, "text": t, **({"audio": base64.b64encode(f).decode()} if f else {})}
                for s, t, f, _ in turns]
        out.append((body, [(s, t, x) for s, t, _, x in turns] + [(speaker, text, None)], speaker, text))
    return out


@pytest.fixture(scope="module")
def context_reference(folder, conversations):
    return csm_context_reference(folder, [ref for _, ref, _, _ in conversations], FRAMES)


def _check_context(body: dict, frames: np.ndarray, wave: np.ndarray) -> None:
    assert body["token_ids"] == tokens_of(frames, 64)
    audio = np.frombuffer(base64.b64decode(body["audio"]), "<f4")
    assert audio.shape == wave.shape
    np.testing.assert_allclose(audio, wave, atol=1e-4 * max(1.0, float(np.abs(wave).max())), rtol=0)


async def test_context_turns_equal_transformers(server, reference, conversations, context_reference):
    """Both conversations batched (by /generate and the speech route), then the first again
    alone: its prompt, clips' frames included, now comes from the prefix cache (all but
    the page of its last row; the clips are not encoded again), with the same frames."""
    first = {"prompt": conversations[0][3], "context": conversations[0][0], "max_tokens": FRAMES, **GREEDY}
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        together = await asyncio.gather(client.post("/generate", json=first),
                                        speech(client, input=conversations[1][3], voice=conversations[1][2],
                                               context=conversations[1][0], response_format="pcm"))
        await asyncio.sleep(0.5)  # metrics trail the worker
        hits = server.metric("mstar_prefix_cache_hit_tokens_total")
        again = await client.post("/generate", json=first)
    prompt_len = again.json()["usage"]["prompt_tokens"]
    assert prompt_len > 2 * PAGE_SIZE
    want = hits + (prompt_len - 1) // PAGE_SIZE * PAGE_SIZE
    assert server.wait_metric("mstar_prefix_cache_hit_tokens_total", want) == want
    frames, wave = context_reference[0]
    for r in (together[0], again):
        assert r.status_code == 200, r.text
        _check_context(r.json(), frames, wave)
    assert together[1].status_code == 200, together[1].text
    got = np.frombuffer(together[1].content, "<i2")
    want = pcm(context_reference[1][1])
    assert len(got) == len(want) > 0 and np.abs(got.astype(int) - want).max() <= 1
    alone = reference[("0", conversations[0][3])][0]  # the same turn without its context
    assert not np.array_equal(frames[: len(alone)], alone[: len(frames)])
    server.assert_clean()


def test_the_openai_client_takes_context(server, conversations, context_reference):
    body, _, speaker, text = conversations[1]
    clip, streamed = openai_speech(server.url, speaker, text, {**GREEDY, "max_tokens": FRAMES, "context": body})
    assert clip == streamed
    got = np.frombuffer(clip, "<i2")
    assert np.abs(got.astype(int) - pcm(context_reference[1][1])).max() <= 1
    server.assert_clean()


def silence(frames: int) -> str:
    """A base64 FLAC of `frames` frames of silence (small: FLAC packs it)."""
    return base64.b64encode(audio_file(np.zeros(frames * 1920, np.float32), fmt="FLAC", subtype="PCM_16")).decode()


def _turn(**fields) -> dict:
    return {"speaker": "0", "text": "Hello.", "audio": base64.b64encode(audio_file(chirp(3000, 200))).decode(),
            **fields}


@pytest.mark.parametrize(("context", "param", "message"), [
    ([_turn(), _turn(audio="not base64!")], "context[1].audio", "is not base64"),
    ([_turn(audio=base64.b64encode(b"RIFF not a wav file").decode())], "context[0].audio", "could not be decoded"),
    ([_turn(audio=silence(MAX_SEQ_LEN))], "context[0].audio", "no frame fits in the model's 128 (max_seq_len)"),
    ([_turn(), _turn(audio=silence(MAX_SEQ_LEN))], "context[1].audio", "holds at most"),  # refused before decoding
    ([_turn(), _turn(speaker="7x")], "context[1].speaker", "speaker '7x' is not one of this model's speakers"),
    ([_turn(text="")], "context[0].text", None),
    ([{"speaker": "0"}], "context[0].text", None),
])
async def test_context_refusals_name_the_field(server, context, param, message):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        r = await speech(client, context=context)
        ids = await client.post("/generate", json={"input_ids": [1, 2], "context": [_turn()]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if message:
        assert message in r.json()["error"]["message"]
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "input_ids"
    server.assert_clean()


async def test_small_special_ids_and_a_greedy_generation_config(tmp_path):
    """A checkpoint whose audio placeholder is id 5 (CSM's specials trained in at ids 3-6)
    starts (the warm-up's made-up ids skip the placeholders: they were 1..16 and the spec
    refused its own warm-up), and its generation_config.json (greedy, FRAMES new tokens) is
    the speech route's default: a body with no sampling field and no max_tokens speaks
    transformers' greedy frames."""
    folder = make_csm_checkpoint(tmp_path / "csm", num_codebooks=CODEBOOKS, small_ids=True)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_new_tokens": FRAMES}))
    frames, wave = csm_reference(folder, [("0", TEXTS[0])], FRAMES)[0]
    srv = MstarServer(str(folder), tmp_path / "csm.log", "--num-kv-pages", "64", "--page-size", str(PAGE_SIZE),
                      "--max-seq-len", str(MAX_SEQ_LEN), env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
            r = await client.post("/v1/audio/speech", json={"input": TEXTS[0], "response_format": "pcm"})
            gen = await client.post("/generate", json={"prompt": TEXTS[0], "max_tokens": FRAMES, **GREEDY})
        assert r.status_code == 200 and gen.status_code == 200, (r.text, gen.text)
        assert gen.json()["token_ids"] == tokens_of(frames, 64)
        got, want = np.frombuffer(r.content, "<i2"), pcm(wave)
        assert len(got) == len(want) and np.abs(got.astype(int) - want).max() <= 1
        srv.assert_clean()
    finally:
        srv.stop()
