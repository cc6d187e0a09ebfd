"""Qwen3-Omni's thinker (`Qwen3OmniMoeForConditionalGeneration`, text out) through the real
services, on a tiny random checkpoint in the release's layout (thinker, talker, code
predictor and Code2Wav weights in one folder, the processor's preprocessor_config.json):
greedy tokens equal transformers' thinker `generate` (float32, transformers'
Qwen3OmniMoeProcessor making its inputs) for text alone, an image and text, an audio clip
and text, and both; on the chat route (image_url and input_audio parts) one after another
and all four at once, and on `/generate` (`images`, `audios`); prefill in 32-row chunks, so
chunks end inside images and clips; `usage.prompt_tokens` counts the media placeholders;
every KV page back to zero under the layout debug checks. Speech options without `audio` and
audio that is not audio are 400s naming the field."""

from __future__ import annotations

import asyncio
import base64
import io
from functools import cache
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.omni_checkpoints import make_omni_checkpoint, omni_processor, tone, wav_bytes
from tests.omni_video import mp4_bytes, reference_video, shapes_video
from tests.servers import MstarServer, assert_clean

pytest.importorskip("soundfile")
MAX_TOKENS = 8


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


#: 96 x 64 pixels: 6 x 4 patches of 16, 3 x 2 merged rows (not square: height and width differ)
IMAGE = png(96, 64, 1)
#: 2.3 s: three conv windows (13, 13 and 4 rows) and two attention windows (26 and 4 rows)
AUDIO = wav_bytes(tone(2.3, seed=1))
#: name -> the clip's file: the other clip is shorter, so the processor pads it to AUDIO's length
CLIPS = {"audio": AUDIO, "short": wav_bytes(tone(1.2, f0=300.0, seed=2))}
#: case -> (media parts in order, the text)
CASES = {
    "text only": ((), "Hello world! The quick brown fox."),
    "image": (("image",), "What is in this image?"),
    "audio": (("audio",), "What do you hear?"),
    "image and audio": (("image", "audio"), "Describe both."),
}
#: /generate's extra case: two clips of different lengths
TWO_CLIPS = {"two clips": (("audio", "short"), "Which is longer?")}
#: a 1.5 s clip of moving shapes (6 frames at 4 fps: 4 sampled, 2 temporal patches of 11 x 12 rows)
VIDEO = mp4_bytes(shapes_video())
VIDEO_CASES = {"video": (("video",), "What happens in this video?"),
               "video and image": (("video", "image"), "Compare them.")}
ALL = {**CASES, **TWO_CLIPS, **VIDEO_CASES}


def content(media: tuple[str, ...], text: str, ours: bool) -> list[dict] | str:
    """A user message: our parts (image_url / input_audio, base64) or the processor's
    ({"type": "image"} / {"type": "audio"}), the text after them."""
    if not media:
        return text

    def part(kind: str) -> dict:
        if not ours:
            return {"type": kind if kind in ("image", "video") else "audio"}
        if kind == "video":
            return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(VIDEO)}}
        if kind == "image":
            url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
            return {"type": "image_url", "image_url": {"url": url}}
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(CLIPS[kind]).decode(), "format": "wav"}}
    return [*map(part, media), {"type": "text", "text": text}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_omni_checkpoint(tmp_path_factory.mktemp("omni") / "ckpt")


@cache
def _hf(folder: Path):
    import transformers

    model = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).eval()
    return model.thinker, omni_processor(folder)


def rendered(folder: Path, case: str) -> str:
    media, text = ALL[case]
    return _hf(folder)[1].apply_chat_template([{"role": "user", "content": content(media, text, ours=False)}],
                                              add_generation_prompt=True)


@cache
def reference(folder: Path, case: str, clip: bytes = AUDIO) -> tuple[list[int], int]:
    """(transformers' greedy tokens, EOS ignored; its prompt length) for one chat turn
    (`clip` the audio part's file)."""
    import soundfile as sf
    import torch
    from PIL import Image

    thinker, proc = _hf(folder)
    media = ALL[case][0]
    kwargs: dict = {}
    if "image" in media:
        kwargs["images"] = [Image.open(io.BytesIO(IMAGE)).convert("RGB")]
    files = [clip if kind == "audio" else CLIPS[kind] for kind in media if kind not in ("image", "video")]
    if files:
        kwargs["audio"] = [sf.read(io.BytesIO(f), dtype="float32")[0] for f in files]
    # the video's run stands in as one <tts_pad> through the processor (which needs torchvision
    # for videos), then becomes the processor's expansion of the video processor's grid
    inputs = proc(text=[rendered(folder, case).replace("<|video_pad|>", "<tts_pad>")], return_tensors="pt", **kwargs)
    if "video" in media:
        video = reference_video(VIDEO)
        t, h, w = video["video_grid_thw"][0].tolist()
        ids = inputs["input_ids"][0].tolist()
        at = ids.index(proc.tokenizer.convert_tokens_to_ids("<tts_pad>"))
        ids[at : at + 1] = [proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")] * (t * h * w // 4)
        inputs["input_ids"] = torch.tensor([ids])
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs.update(video)
    with torch.no_grad():
        out = thinker.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    n = inputs["input_ids"].shape[1]
    return out[0, n:].tolist(), n


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    srv = MstarServer(str(folder), tmp_path_factory.mktemp("logs") / "omni.log", "--num-kv-pages", "96",
                      "--page-size", "8", "--max-batch-tokens", "32", "--enable-prompt-tokens-details",
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    try:
        yield srv
    finally:
        srv.stop()


async def test_chat_route_equals_transformers(folder, server):
    """`/v1/chat/completions` with image_url and input_audio parts, the cases one after
    another and then all four at once: the answer and prompt_tokens are transformers'."""
    tok = _hf(folder)[1].tokenizer

    async def chat(client: httpx.AsyncClient, case: str) -> dict:
        media, text = CASES[case]
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": content(media, text, ours=True)}], "modalities": ["text"],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        alone = [await chat(client, case) for case in CASES]
        together = await asyncio.gather(*(chat(client, case) for case in CASES))
    for case, one, other in zip(CASES, alone, together):
        want, prompt_len = reference(folder, case)
        for body in (one, other):
            assert body["usage"]["prompt_tokens"] == prompt_len, case
            assert body["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True), case
    assert_clean(server)


async def test_generate_token_ids_equal_transformers(folder, server):
    """`/generate` with the rendered prompt and the media (two clips of different lengths
    too): greedy token ids and prompt_tokens equal transformers'."""
    def media(case: str) -> dict:
        kinds = ALL[case][0]
        out: dict = {}
        if "image" in kinds:
            out["images"] = ["data:image/png;base64," + base64.b64encode(IMAGE).decode()]
        if any(k not in ("image", "video") for k in kinds):
            out["audios"] = [base64.b64encode(CLIPS[k]).decode() for k in kinds if k not in ("image", "video")]
        if "video" in kinds:
            out["videos"] = ["data:video/mp4;base64," + base64.b64encode(VIDEO).decode()]
        return out

    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        rs = await asyncio.gather(*(client.post("/generate", json={
            "prompt": rendered(folder, case), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **media(case)}) for case in ALL))
    for case, r in zip(ALL, rs):
        assert r.status_code == 200, r.text
        assert (r.json()["token_ids"], r.json()["usage"]["prompt_tokens"]) == reference(folder, case), case
    assert_clean(server)


async def test_the_prefix_cache_keys_clips_by_content(folder, server):
    """The same prompt with another clip of the same length (the same ids) answers as
    transformers does for that clip, not from the first clip's rows; the first clip again
    resumes from the prefix cache past its rows, with the same answer."""
    other = wav_bytes(tone(2.3, f0=500.0, seed=7))

    async def ask(client: httpx.AsyncClient, clip: bytes) -> tuple[list[int], int]:
        r = await client.post("/generate", json={
            "prompt": rendered(folder, "audio"), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "audios": [base64.b64encode(clip).decode()]})
        assert r.status_code == 200, r.text
        return r.json()["token_ids"], r.json()["usage"]["cached_tokens"]

    want, prompt_len = reference(folder, "audio")
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        first = await ask(client, AUDIO)
        second, second_cached = await ask(client, other)
        again, again_cached = await ask(client, AUDIO)
    assert first[0] == want == again and second == reference(folder, "audio", other)[0] != want
    assert second_cached < 8  # the template's rows before the clip at most
    assert again_cached == (prompt_len - 1) // 8 * 8  # every full page but the one with the last prompt row
    assert_clean(server)


async def test_speech_options_and_bad_audio_are_400s(server):
    """`modalities` asking for audio without its `audio` options, and an input_audio part
    that is not audio, are 400s naming the field; the model card lists audio among its
    inputs and outputs (speech out: tests/e2e/test_omni_speech.py)."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        speech = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"], "max_tokens": 2})
        noise = base64.b64encode(b"this is not a sound file at all" * 8).decode()
        bad = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hi"},
                {"type": "input_audio", "input_audio": {"data": noise, "format": "wav"}}]}],
            "max_tokens": 2})
        card = (await client.get("/v1/models")).json()["data"][0]
    assert speech.status_code == 400 and speech.json()["error"]["param"] == "audio", speech.text
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "messages[0].content[1].input_audio.data"
    assert {"text", "image", "audio"} <= set(card["input_modalities"])
    assert card["output_modalities"] == ["text", "audio"]
    assert_clean(server)


async def test_video_chat_equals_transformers(folder, server):
    """`/v1/chat/completions` with a video_url part (alone, and beside an image), both at
    once: the answer and prompt_tokens are transformers' thinker on the same decoded frames
    (tests/omni_video.py), so the video's rows, deepstack and time-stepped positions are
    transformers'; every page back to zero."""
    tok = _hf(folder)[1].tokenizer

    async def chat(client: httpx.AsyncClient, case: str) -> dict:
        media, text = VIDEO_CASES[case]
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": content(media, text, ours=True)}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        bodies = await asyncio.gather(*(chat(client, case) for case in VIDEO_CASES))
        card = (await client.get("/v1/models")).json()["data"][0]
    for case, body in zip(VIDEO_CASES, bodies):
        want, prompt_len = reference(folder, case)
        assert body["usage"]["prompt_tokens"] == prompt_len, case
        assert body["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True), case
    assert "video" in card["input_modalities"] and card["video_placeholder"] == "<|video_pad|>"
    assert_clean(server)


async def test_bad_videos_are_400s(server):
    """A video_url part that is not a video, one whose frames are over the size limit, one
    not a data URL, and (on /generate) a one-frame video, shorter than a temporal patch:
    400s naming the field; /tokenize, which counts no video rows, says so naming the part."""
    from tests.omni_video import shapes_video

    def url(data: bytes) -> str:
        return "data:video/mp4;base64," + base64.b64encode(data).decode()

    huge = mp4_bytes(np.zeros((1, 2176, 3872, 3), dtype=np.uint8), fps=1)  # over 3840 x 2160 pixels
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        chats = [await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hi"}, {"type": "video_url", "video_url": {"url": bad}}]}],
            "max_tokens": 2}) for bad in (url(b"not a video at all" * 16), url(huge), "https://example.com/a.mp4")]
        tokenize = await client.post("/tokenize", json={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "video_url", "video_url": {"url": url(VIDEO)}}]}]})
        short = await client.post("/generate", json={
            "prompt": "<|vision_start|><|video_pad|><|vision_end|>hi", "max_tokens": 2,
            "videos": [url(mp4_bytes(shapes_video(frames=1)))]})
    for r in chats:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[0].content[1].video_url.url", r.text
    assert "pixels" in chats[1].json()["error"]["message"]
    assert short.status_code == 400 and short.json()["error"]["param"] == "videos[0]", short.text
    assert tokenize.status_code == 400, tokenize.text  # /tokenize counts no video rows: it says so
    assert tokenize.json()["error"]["param"] == "messages[0].content[1].video_url.url"
    assert_clean(server)
