"""Speech out through the real services: a tiny random Orpheus checkpoint (a Llama whose
added tokens are SNAC codes) with a tiny random SNAC codec at `<folder>/snac`.

- codes: `/generate`'s token ids equal transformers' greedy tokens under the same per-slot
  code ranges (the worker's constraint, given to `generate` as a logits processor), and
  the audio equals SNAC's own `decode` of those codes;
- `/v1/audio/speech` in pcm, wav, flac, mp3 and opus, streamed (`stream_format` audio and sse) and
  not: the streamed chunks joined equal the whole clip; two voices, each transformers';
- the official `openai` client's `audio.speech.create` and `with_streaming_response`;
- refusals naming the field; debug asserts on, pages back to 0.
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
from tests.tts_checkpoints import make_orpheus_checkpoint, make_snac_folder, openai_speech

TEXTS = ("Hello world!", "The quick brown fox jumps over the lazy dog.")
MAX_TOKENS = 7 * 6  # six frames
#: greedy, and none of Orpheus' default penalties (the reference is plain greedy)
GREEDY = {"temperature": 0, "top_p": 1.0, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = make_orpheus_checkpoint(tmp_path_factory.mktemp("tts") / "orpheus")
    make_snac_folder(path / "snac", noise=False)  # noise-free: SNAC's decode is deterministic
    return path


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    srv = MstarServer(str(folder), tmp_path_factory.mktemp("logs") / "tts.log", "--num-kv-pages", "64",
                      "--page-size", "8", env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    yield srv
    srv.stop()


def reference(folder: Path, text: str, voice: str = "tara") -> tuple[list[int], np.ndarray]:
    """(transformers' greedy tokens under the code constraint, SNAC's decode of them)."""
    import torch
    import transformers
    from snac import SNAC

    from shared.specs.orpheus_codes import CODES_PER_FRAME, OrpheusCodes

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    codes = OrpheusCodes(tok.get_vocab(), 64)
    prompt = codes.prompt_ids(tok(f"{voice}: {text}")["input_ids"])

    class Slots(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            k = input_ids.shape[1] - len(prompt)
            keep = torch.zeros_like(scores, dtype=torch.bool)
            lo, hi = codes.allowed(k)
            keep[:, lo:hi] = True
            if k and k % CODES_PER_FRAME == 0:
                keep[:, codes.end_of_speech] = True
            return scores.masked_fill(~keep, float("-inf"))

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             logits_processor=[Slots()], eos_token_id=codes.end_of_speech, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    audio = [t for t in tokens if t != codes.end_of_speech]
    frames = codes.frames(codes.codes(audio))
    snac = SNAC(**json.loads((folder / "snac" / "config.json").read_text()))
    snac.load_state_dict(torch.load(folder / "snac" / "pytorch_model.bin", weights_only=True))
    with torch.no_grad():
        wave = snac.eval().decode([torch.from_numpy(f)[None] for f in frames])[0, 0].numpy()
    return tokens, wave


def pcm(samples: np.ndarray) -> np.ndarray:
    return np.frombuffer((np.clip(samples, -1, 1) * 32767).round().astype("<i2").tobytes(), "<i2")


async def test_codes_and_audio_equal_transformers_and_snac(folder, server):
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        got = await asyncio.gather(*(client.post("/generate", json={
            "prompt": t, "max_tokens": MAX_TOKENS, "temperature": 0}) for t in TEXTS))
    for text, r in zip(TEXTS, got):
        assert r.status_code == 200, r.text
        body = r.json()
        tokens, wave = reference(folder, text)
        assert body["token_ids"] == tokens
        audio = np.frombuffer(base64.b64decode(body["audio"]), "<f4")
        np.testing.assert_allclose(audio, wave, atol=1e-5, rtol=0)
    assert server.wait_pages_free() == 0
    assert "footprint overrun" not in server.log() and "not tight" not in server.log()


async def speech(client: httpx.AsyncClient, **body) -> httpx.Response:
    body = {"input": TEXTS[1], "max_tokens": MAX_TOKENS, **GREEDY, **body}
    return await client.post("/v1/audio/speech", json=body)


async def test_speech_route_formats_and_streams(folder, server):
    """pcm is the reference's samples; wav and flac hold the same (mp3 and opus its rate and
    length); the streamed pcm (raw and
    SSE) joined equals the whole clip; another voice is its own reference."""
    import soundfile

    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        whole = await speech(client, response_format="pcm")
        wav = await speech(client, response_format="wav")
        flac = await speech(client, response_format="flac")
        raw = await speech(client, response_format="pcm", stream_format="audio")
        sse = await speech(client, response_format="pcm", stream_format="sse")
        leo = await speech(client, response_format="pcm", voice="leo")
        lossy = {fmt: await speech(client, response_format=fmt) for fmt in ("mp3", "opus")}
    assert whole.headers["content-type"] == "audio/pcm" and wav.headers["content-type"] == "audio/wav"
    want = pcm(reference(folder, TEXTS[1])[1])
    got = np.frombuffer(whole.content, "<i2")
    assert len(got) == len(want) and np.abs(got.astype(int) - want).max() <= 1
    assert raw.content == whole.content
    events = [json.loads(line[6:]) for line in sse.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == whole.content
    for encoded in (wav.content, flac.content):
        samples, rate = soundfile.read(io.BytesIO(encoded), dtype="int16")
        assert rate == 24000 and np.array_equal(samples, got)
    for fmt, media in (("mp3", "audio/mpeg"), ("opus", "audio/opus")):  # lossy: the clip's rate and length
        assert lossy[fmt].headers["content-type"] == media
        samples, rate = soundfile.read(io.BytesIO(lossy[fmt].content), dtype="int16")
        assert rate == 24000 and len(samples) == len(got)
    other = np.frombuffer(leo.content, "<i2")
    assert np.abs(other.astype(int) - pcm(reference(folder, TEXTS[1], "leo")[1])).max() <= 1
    assert server.wait_pages_free() == 0
    # the speech histograms beside the token ones: every clip so far counted, its seconds summed
    clips = server.metric("mstar_time_to_first_audio_seconds_count")
    assert clips >= 8 and server.metric("mstar_real_time_factor_count") == clips
    assert server.metric("mstar_audio_seconds_total") >= 6 * len(got) / 24000


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": ""}, "input", None),
    ({"input": "x", "voice": "robot"}, "voice", "voice 'robot' is not one of this model's"),
    ({"input": "x", "response_format": "aac"}, "response_format", "response_format 'aac' is not offered"),
    ({"input": "x", "response_format": "mp3", "stream_format": "audio"}, "stream_format", "mp3 cannot be streamed"),
    ({"input": "x", "speed": 2.0}, "speed", "speed 2.0 is not supported"),
    ({"input": "x", "max_tokens": 100000}, "max_tokens", None),
])
async def test_speech_refusals_name_the_field(server, body, param, message):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        r = await client.post("/v1/audio/speech", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if message:
        assert message in r.json()["error"]["message"]


async def test_another_familys_extension_is_refused_naming_it(server):
    """Orpheus reads neither Chatterbox's fields nor Qwen3-TTS' one: each is a 400 naming it
    and its family (silently ignoring it would speak as if it were honoured)."""
    name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        for field, value, family in (("exaggeration", 0.5, "Chatterbox"), ("cfg_weight", 0.5, "Chatterbox"),
                                     ("non_streaming_mode", False, "Qwen3-TTS")):
            r = await client.post("/v1/audio/speech", json={"input": "x", field: value})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["param"], error["message"]) == (
                field, f"{field} is a {family} extension; the served model ({name}) does not use it")


def test_the_openai_client_speaks(folder, server):
    clip, streamed = openai_speech(server.url, "tara", TEXTS[1], {**GREEDY, "max_tokens": MAX_TOKENS})
    assert clip == streamed and len(clip) > 0
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["output_modalities"] == ["audio"]


async def test_a_greedy_generation_config_is_the_speech_default(folder, tmp_path):
    """A checkpoint whose generation_config.json says greedy, no penalty and 42 new tokens
    speaks exactly that when the body sets no sampling field and no length: the file's
    fields over Orpheus' package defaults (temperature 0.6, top_p 0.8, repetition_penalty
    1.3), which apply only where the file says nothing. It spoke 16x longer, sampled."""
    import shutil

    greedy = tmp_path / "orpheus"
    shutil.copytree(folder, greedy)
    (greedy / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "repetition_penalty": 1.0, "max_new_tokens": MAX_TOKENS}))
    srv = MstarServer(str(greedy), tmp_path / "tts.log", "--num-kv-pages", "64", "--page-size", "8",
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
            r = await client.post("/v1/audio/speech", json={"input": TEXTS[1], "response_format": "pcm"})
        assert r.status_code == 200, r.text
        want = pcm(reference(folder, TEXTS[1])[1])
        got = np.frombuffer(r.content, "<i2")
        assert len(got) == len(want) and np.abs(got.astype(int) - want).max() <= 1
        assert srv.wait_pages_free() == 0
    finally:
        srv.stop()
