"""Qwen3-Omni's speech out through the real services (`/v1/chat/completions` with
`modalities: ["text", "audio"]`), on the tiny random checkpoint of tests/omni_checkpoints.py:
the thinker's text, then its talker and Code2Wav in the same request. For a text prompt and
two voices, the text equals transformers' greedy text and the waveform transformers'
`generate(..., thinker_do_sample=False, talker_do_sample=False, return_audio=True)` within
1e-3 and of the same length (its talker_max_new_tokens the frame loop's cap + 1: the cap
counts frames after the talker's prompt step); alone and both at once; streamed, the
`delta.content` chunks join to the text and the `delta.audio` chunks (base64 pcm16) to the
unstreamed clip. An image prompt, an audio prompt and a video prompt too. Every KV page back to zero
under the layout debug checks. Bad speech options are 400s naming the field."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from functools import cache
from pathlib import Path

import httpx
import numpy as np
import pytest

from shared.specs.qwen3_omni import FRAMES_PER_TOKEN
from tests.e2e.test_omni import png
from tests.omni_checkpoints import make_omni_checkpoint, omni_processor, tone, wav_bytes
from tests.omni_video import mp4_bytes, reference_video, shapes_video
from tests.servers import MstarServer, assert_clean

pytest.importorskip("soundfile")
MAX_TOKENS = 5
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello to the world"}]
VOICES = ("ethan", "chelsie")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_omni_checkpoint(tmp_path_factory.mktemp("omni") / "ckpt")


@cache
def _hf(folder: Path):
    import torch
    import transformers

    model = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return model, omni_processor(folder)


#: an image, an audio clip and a video (tests/omni_video.py), each before the user's text (their parts as we send them)
IMAGE, AUDIO, VIDEO = png(96, 64, 1), wav_bytes(tone(1.3, seed=1)), mp4_bytes(shapes_video())
MEDIA = {"image": {"type": "image_url",
                   "image_url": {"url": "data:image/png;base64," + base64.b64encode(IMAGE).decode()}},
         "audio": {"type": "input_audio", "input_audio": {"data": base64.b64encode(AUDIO).decode(), "format": "wav"}},
         "video": {"type": "video_url",
                   "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(VIDEO).decode()}}}


def messages(media: str = "", ours: bool = True) -> list[dict]:
    """MESSAGES, the user's text after a `media` part (ours, or the processor's)."""
    if not media:
        return MESSAGES
    part = MEDIA[media] if ours else {"type": media}
    return [MESSAGES[0], {"role": "user", "content": [part, {"type": "text", "text": MESSAGES[1]["content"]}]}]


@cache
def reference(folder: Path, voice: str, media: str = "", stop: tuple[str, ...] = (),
              max_tokens: int = MAX_TOKENS, ignore_eos: bool = False) -> tuple[str, np.ndarray]:
    """(transformers' text, its waveform) for `messages(media)` in `voice`; with `stop`, the
    thinker ends at the token that completes one (`thinker_stop_strings`: the text holds it);
    `ignore_eos`: it writes `max_tokens` (an end id no token has), all of them spoken."""
    import soundfile as sf
    import torch
    from PIL import Image

    model, proc = _hf(folder)
    text = proc.apply_chat_template(messages(media, ours=False), add_generation_prompt=True, tokenize=False)
    kwargs: dict = {}
    if media == "image":
        kwargs["images"] = [Image.open(io.BytesIO(IMAGE)).convert("RGB")]
    if media == "audio":
        kwargs["audio"] = [sf.read(io.BytesIO(AUDIO), dtype="float32")[0]]
    inputs = proc(text=text.replace("<|video_pad|>", "<tts_pad>"), return_tensors="pt", **kwargs)
    if media == "video":  # the processor's expansion of the video processor's grid (as in test_omni.py)
        video = reference_video(VIDEO)
        t, h, w = video["video_grid_thw"][0].tolist()
        ids = inputs["input_ids"][0].tolist()
        at = ids.index(proc.tokenizer.convert_tokens_to_ids("<tts_pad>"))
        ids[at : at + 1] = [proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")] * (t * h * w // 4)
        inputs["input_ids"] = torch.tensor([ids])
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs.update(video)
    eos = -1 if ignore_eos else proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    if stop:
        kwargs.update(thinker_stop_strings=list(stop), thinker_tokenizer=proc.tokenizer)
    with torch.no_grad():
        seq, wav = model.generate(**inputs, speaker=voice, thinker_max_new_tokens=max_tokens, thinker_do_sample=False,
                                  talker_do_sample=False, return_audio=True,
                                  talker_max_new_tokens=FRAMES_PER_TOKEN * max_tokens + 1, thinker_eos_token_id=eos)
    out = seq[0, inputs["input_ids"].shape[1]:].tolist()
    return proc.tokenizer.decode(out, skip_special_tokens=True), wav.reshape(-1).float().numpy()


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    srv = MstarServer(str(folder), tmp_path_factory.mktemp("logs") / "omni_speech.log", "--num-kv-pages", "64",
                      "--page-size", "8", "--max-batch-tokens", "32",
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    try:
        yield srv
    finally:
        srv.stop()


def body(voice: str, fmt: str = "wav", media: str = "", **extra) -> dict:
    return {"messages": messages(media), "modalities": ["text", "audio"], "audio": {"voice": voice, "format": fmt},
            "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


async def chat(client: httpx.AsyncClient, voice: str, fmt: str = "wav", media: str = "") -> tuple[str, bytes, dict]:
    """(the text, the clip's file bytes, message.audio) of an unstreamed reply."""
    r = await client.post("/v1/chat/completions", json=body(voice, fmt, media))
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    return message["content"], base64.b64decode(message["audio"]["data"]), message["audio"]


async def streamed(client: httpx.AsyncClient, voice: str) -> tuple[str, bytes]:
    """(the delta.content chunks joined, the delta.audio chunks' pcm16 joined)."""
    text, pcm = [], []
    async with client.stream("POST", "/v1/chat/completions", json=body(voice, "pcm16", stream=True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                if delta.get("content"):
                    assert not pcm, "text after audio"
                    text.append(delta["content"])
                if delta.get("audio"):
                    pcm.append(base64.b64decode(delta["audio"]["data"]))
    return "".join(text), b"".join(pcm)


def wave_of(wav: bytes) -> np.ndarray:
    import soundfile as sf

    samples, rate = sf.read(io.BytesIO(wav), dtype="float32")
    assert rate == 24_000
    return samples


def assert_speech(folder: Path, voice: str, text: str, wav: bytes, media: str = "") -> None:
    want_text, want_wave = reference(folder, voice, media)
    assert text == want_text
    assert_wave(wav, want_wave)


def assert_wave(wav: bytes, want_wave: np.ndarray) -> None:
    """The clip `wav` (a wav file) is `want_wave` within 1e-3, of its length."""
    wave = wave_of(wav)
    assert wave.shape == want_wave.shape and len(wave) > 0
    np.testing.assert_allclose(wave, want_wave, atol=1e-3)


async def test_speech_equals_transformers(folder, server):
    """Two voices, one after the other and both at once: transformers' text and waveform;
    streamed, the same text and the same clip; each of the 8 clips counted in the
    time-to-first-audio and real-time-factor histograms."""
    clips = server.metric("mstar_time_to_first_audio_seconds_count")
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        alone = [await chat(client, v) for v in VOICES]
        together = await asyncio.gather(*(chat(client, v) for v in VOICES))
        pcm = await asyncio.gather(*(chat(client, v, "pcm16") for v in VOICES))
        streams = await asyncio.gather(*(streamed(client, v) for v in VOICES))
    for voice, one, other, raw, stream in zip(VOICES, alone, together, pcm, streams):
        for text, wav, audio in (one, other):
            assert_speech(folder, voice, text, wav)
            assert audio["transcript"] == text and audio["id"] and audio["expires_at"] > 0
        assert raw[1] == one[1][44:]  # pcm16: the wav file's samples
        assert stream == (one[0], raw[1])
    assert one[1] != alone[0][1]  # the two voices differ
    assert server.metric("mstar_time_to_first_audio_seconds_count") == clips + 8
    assert server.metric("mstar_real_time_factor_count") == clips + 8
    assert_clean(server)


async def test_the_talker_speaks_while_the_thinker_writes(server):
    """The talker starts at the thinker's first token (DESIGN.md §3 "Stages"): streamed,
    the first sound arrives before the text's last token (counted by the chunks' logprobs,
    which the detokenizer does not hold back); the stream joins to the unstreamed reply."""
    request = body("chelsie", "pcm16", max_tokens=16, ignore_eos=True, logprobs=True)
    tokens_before_audio, text, pcm = None, [], []
    tokens = 0
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        async with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice["delta"]
                    tokens += len((choice.get("logprobs") or {}).get("content") or [])
                    text.append(delta.get("content") or "")
                    if delta.get("audio"):
                        tokens_before_audio = tokens if tokens_before_audio is None else tokens_before_audio
                        pcm.append(base64.b64decode(delta["audio"]["data"]))
        whole = (await client.post("/v1/chat/completions", json=request)).json()["choices"][0]["message"]
    assert tokens == 16 and tokens_before_audio is not None and tokens_before_audio < 16, tokens_before_audio
    assert "".join(text) == whole["content"] and b"".join(pcm) == base64.b64decode(whole["audio"]["data"])
    assert_clean(server)


async def test_image_audio_and_video_prompts(folder, server):
    """An image prompt, an audio prompt and a video prompt (the talker reads the thinker's
    hidden states at their rows; a video's talker positions step by its own
    position_id_per_seconds), at once: transformers' text and waveform. (An image and a clip together has
    no reference: transformers' talker cannot place them.)"""
    cases = (("ethan", "image"), ("chelsie", "audio"), ("chelsie", "video"))
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        replies = await asyncio.gather(*(chat(client, voice, media=media) for voice, media in cases))
    for (voice, media), (text, wav, _) in zip(cases, replies):
        assert_speech(folder, voice, text, wav, media)
    assert_clean(server)


async def test_a_client_gone_mid_speech_frees_every_stage(folder, server):
    """A stream closed at its first audio chunk (the talker running): the request ends
    everywhere and every page of both stages returns."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body("ethan", "pcm16", stream=True)) as r:
            async for line in r.aiter_lines():
                if '"audio"' in line:
                    break
        text, _, _ = await chat(client, "chelsie")  # the engine goes on serving
    assert text == reference(folder, "chelsie")[0]
    assert_clean(server)


async def test_bad_speech_options_are_400s(server):
    """A voice the model lacks, audio without text, audio asked without its options, a bad format."""
    cases = [({"audio": {"voice": "nobody", "format": "wav"}}, "audio.voice"),
             ({"modalities": ["audio"]}, "modalities"),
             ({"audio": None}, "audio"),
             ({"audio": {"voice": "ethan", "format": "mp3"}}, "audio.format"),
             ({"modalities": ["text"]}, "audio"),
             ({"audio": {"voice": "ethan", "temperature": -0.5}}, "audio.temperature"),
             ({"audio": {"voice": "ethan", "top_p": 0}}, "audio.top_p"),
             ({"audio": {"voice": "ethan", "top_k": 1.5}}, "audio.top_k"),
             ({"audio": {"voice": "ethan", "seed": 1}}, "audio")]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        for change, param in cases:
            r = await client.post("/v1/chat/completions", json={**body("ethan"), **change})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (change, r.text)
    assert_clean(server)


#: stop strings for the tiny checkpoint's greedy text "\ufffd\ufffd\ufffd\ufffd1n a": "n " ends
#: inside its 7th token (" a"), so the text ends before a token's end and the talker
#: speaks that token too (transformers' `thinker_stop_strings` ends the thinker there)
STOP, STOP_TOKENS = ("zzz", "n "), 8


async def stop_stream(client: httpx.AsyncClient, request: dict) -> tuple[str, bytes, str | None]:
    """(the delta.content chunks joined, the pcm16 chunks joined, the finish_reason)."""
    text, pcm, finish = [], [], None
    async with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                assert finish is None, "a chunk after the finish_reason"
                text.append(choice["delta"].get("content") or "")
                if choice["delta"].get("audio"):
                    pcm.append(base64.b64decode(choice["delta"]["audio"]["data"]))
                finish = choice.get("finish_reason")
    return "".join(text), b"".join(pcm), finish


async def test_stop_strings_end_the_text_and_its_speech(folder, server):
    """With `stop` and speech: the text ends before the first match and the voice is
    transformers' for the thinker ended at the token completing it, twice at once and
    streamed (byte for byte the same clip, no text past the match, finish_reason "stop");
    `modalities: ["text"]` keeps the api's stop (the same text, "stop")."""
    full, want_wave = reference(folder, "ethan", stop=STOP, max_tokens=STOP_TOKENS)
    want = full[: full.find("n ")]
    assert want and full.endswith("n a"), full  # the match ends inside the last token
    request = body("ethan", "pcm16", max_tokens=STOP_TOKENS, stop=list(STOP))
    text_only = {k: v for k, v in request.items() if k != "audio"} | {"modalities": ["text"]}
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=request) for _ in range(2)))
        stream = await stop_stream(client, request)
        wav = await client.post("/v1/chat/completions", json={**request, "audio": {"voice": "ethan", "format": "wav"}})
        plain = await client.post("/v1/chat/completions", json=text_only)
    choices = [r.json()["choices"][0] for r in (*replies, wav, plain)]
    assert [(c["message"]["content"], c["finish_reason"]) for c in choices] == [(want, "stop")] * 4
    assert "audio" not in choices[3]["message"] or not choices[3]["message"]["audio"]
    pcm = base64.b64decode(choices[0]["message"]["audio"]["data"])
    assert base64.b64decode(choices[1]["message"]["audio"]["data"]) == pcm and stream == (want, pcm, "stop")
    assert_wave(base64.b64decode(choices[2]["message"]["audio"]["data"]), want_wave)
    assert pcm == base64.b64decode(choices[2]["message"]["audio"]["data"])[44:]  # the wav file's samples
    assert_clean(server)


async def test_sampled_speech_is_seeded(folder, server):
    """`audio.temperature` samples the talker (and its code predictor): the same seed gives
    the same clip byte for byte (two at once), another seed another clip, the greedy text
    unchanged; a request that sets no temperature at all samples both stages, seeded alike."""
    def request(seed: int, **audio) -> dict:
        return body("ethan", "pcm16", seed=seed, audio={"voice": "ethan", "format": "pcm16", **audio})

    free = {k: v for k, v in request(7).items() if k != "temperature"}
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=r) for r in (
            request(7, temperature=0.9, top_k=20), request(7, temperature=0.9, top_k=20),
            request(8, temperature=0.9, top_k=20), free, free)))
    messages = [r.json()["choices"][0]["message"] for r in replies]
    texts = [m["content"] for m in messages]
    clips = [base64.b64decode(m["audio"]["data"]) for m in messages]
    assert texts[:3] == [reference(folder, "ethan")[0]] * 3 and texts[3] == texts[4]
    assert clips[0] == clips[1] and clips[0] != clips[2] and clips[3] == clips[4] and all(clips)
    assert_clean(server)


PACED_TOKENS = 12  # past the talker's FREE_FRAMES + its lead: its last frames are paced to the text


async def test_the_text_is_not_paced_by_the_talker(folder, server):
    """A 12-token text (EOS ignored) with speech, the talker paced to one frame per
    `TEXT_PACE` text tokens past its first frames (runners/omni_speech.py): transformers'
    text and waveform (its talker reads each text row at the same frame, whenever mstar
    runs it); streamed, the text is whole before the sound's last chunk (`Output.text_end`)
    and the stream joins to the reply."""
    want_text, want_wave = reference(folder, "ethan", max_tokens=PACED_TOKENS, ignore_eos=True)
    request = body("ethan", "pcm16", max_tokens=PACED_TOKENS, ignore_eos=True)
    events: list[tuple[str, bytes]] = []

    async def stream(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        delta = choice["delta"]
                        audio = delta.get("audio") or {}
                        events.append((delta.get("content") or "", base64.b64decode(audio.get("data") or "")))

    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        wav, _ = await asyncio.gather(
            client.post("/v1/chat/completions", json={**request, "audio": {"voice": "ethan", "format": "wav"}}),
            stream(client))
    assert wav.status_code == 200, wav.text
    message = wav.json()["choices"][0]["message"]
    assert message["content"] == want_text
    assert_wave(base64.b64decode(message["audio"]["data"]), want_wave)
    last_text = max(i for i, (text, _) in enumerate(events) if text)
    assert any(sound for _, sound in events[last_text + 1:]), "the text's end waited for the sound's"
    assert "".join(t for t, _ in events) == want_text
    assert b"".join(s for _, s in events) == base64.b64decode(message["audio"]["data"])[44:]
    assert_clean(server)
