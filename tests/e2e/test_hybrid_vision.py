"""Qwen3.5 with images (`Qwen3_5ForConditionalGeneration`: Gated DeltaNet layers beside gated
full attention, a vision tower with learned position embeddings, interleaved M-RoPE) through
the real services, on a tiny random checkpoint carrying a Qwen3.5 release's
preprocessor_config.json: greedy tokens equal transformers' `generate` (float32, its
processor making the inputs) for one image, for two images of different sizes around text,
and for text alone, on the chat route (data-URI image parts) and on `/generate`; prefill in
32-row chunks (`--max-batch-tokens 32`), so chunks end inside images and the recurrent
state carries across them; every KV page and state slot back to zero under the layout
debug checks."""

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

from tests.hybrid_vlm_checkpoints import make_qwen35_vl_checkpoint, qwen35_vl_processor
from tests.servers import MstarServer, assert_clean

MAX_TOKENS = 8


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


#: resized to at least 256 x 256 pixels by the release's settings: 16 x 18 and 12 x 26 patches
#: (72 and 78 rows), neither square, so height and width positions differ
IMAGES = {"small": png(24, 20, 1), "wide": png(70, 30, 2), "other": png(24, 20, 4)}
#: case -> (images in order, the text, where the text goes)
CASES = {
    "one image": (("small",), "What is in this image?", "after"),
    "two images": (("small", "wide"), "Compare the two pictures.", "between"),
    "text only": ((), "Hello world! The quick brown fox.", "after"),
    # the prefix cache test's: the same size as "small" (the same ids), other pixels
    "other image": (("other",), "What is in this image?", "after"),
}
#: the cases the parity tests send
PARITY = ("one image", "two images", "text only")


def content(images: tuple[str, ...], text: str, where: str, url: bool) -> list[dict] | str:
    """A user message: image_url parts with data URIs (ours) or {"type": "image"} parts (the
    processor's), the text after them or between the first and the rest."""
    if not images:
        return text

    def image(name: str) -> dict:
        if not url:
            return {"type": "image"}
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                   base64.b64encode(IMAGES[name]).decode()}}
    if where == "between":
        return [image(images[0]), {"type": "text", "text": text}, *map(image, images[1:])]
    return [*map(image, images), {"type": "text", "text": text}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_qwen35_vl_checkpoint(tmp_path_factory.mktemp("qwen35vl") / "ckpt")


@cache
def _hf(folder: Path):
    import transformers

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]  # Qwen3.5's, or Qwen3.5-MoE's
    return getattr(transformers, arch).from_pretrained(folder).eval(), qwen35_vl_processor(folder)


def rendered(folder: Path, case: str) -> str:
    images, text, where = CASES[case]
    return _hf(folder)[1].apply_chat_template([{"role": "user", "content": content(images, text, where, url=False)}],
                                              add_generation_prompt=True)


@cache
def reference(folder: Path, case: str) -> tuple[list[int], int]:
    """(transformers' greedy tokens, EOS ignored; its prompt length) for one chat turn, the
    inputs made by transformers' processor."""
    import torch
    from PIL import Image

    model, proc = _hf(folder)
    images = CASES[case][0]
    pil = [Image.open(io.BytesIO(IMAGES[n])).convert("RGB") for n in images]
    inputs = proc(text=[rendered(folder, case)], images=[pil] if pil else None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    n = inputs["input_ids"].shape[1]
    return out[0, n:].tolist(), n


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    srv = MstarServer(str(folder), tmp_path_factory.mktemp("logs") / "qwen35vl.log", "--num-kv-pages", "96",
                      "--page-size", "8", "--max-batch-tokens", "32", "--enable-prompt-tokens-details",
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    try:
        yield srv
    finally:
        srv.stop()


async def test_chat_route_equals_transformers(folder, server):
    """`/v1/chat/completions` with data-URI image parts, the cases one after another and then
    all at once (their chunks sharing steps): the answer and prompt_tokens are transformers'."""
    tok = _hf(folder)[1].tokenizer

    async def chat(client: httpx.AsyncClient, case: str) -> dict:
        images, text, where = CASES[case]
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": content(images, text, where, url=True)}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        alone = [await chat(client, case) for case in PARITY]
        together = await asyncio.gather(*(chat(client, case) for case in PARITY))
    for case, one, other in zip(PARITY, alone, together):
        want, prompt_len = reference(folder, case)
        for body in (one, other):
            assert body["usage"]["prompt_tokens"] == prompt_len, case
            assert body["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True), case
    assert_clean(server)


async def test_generate_token_ids_equal_transformers(folder, server):
    """`/generate` with the rendered prompt and the images: greedy token ids and
    prompt_tokens equal transformers'."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        rs = await asyncio.gather(*(client.post("/generate", json={
            "prompt": rendered(folder, case), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **({"images": ["data:image/png;base64," + base64.b64encode(IMAGES[n]).decode()
                           for n in CASES[case][0]]} if CASES[case][0] else {})}) for case in PARITY))
    for case, r in zip(PARITY, rs):
        assert r.status_code == 200, r.text
        assert (r.json()["token_ids"], r.json()["usage"]["prompt_tokens"]) == reference(folder, case), case
    assert_clean(server)


async def test_the_prefix_cache_keys_images_by_content(folder, server):
    """The same text after another image of the same size (the same ids) answers as
    transformers does for that image, not from the first image's rows; the same image again
    resumes from the prefix cache (KV pages and the recurrent state snapshotted at its last
    page boundary: its usage's cached_tokens are those rows) with the same answer."""
    want = {case: reference(folder, case)[0] for case in ("one image", "other image")}
    assert want["one image"] != want["other image"]  # the image matters to this model

    async def tokens(client: httpx.AsyncClient, case: str) -> tuple[list[int], int]:
        r = await client.post("/generate", json={
            "prompt": rendered(folder, case), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "images": ["data:image/png;base64," + base64.b64encode(IMAGES[n]).decode() for n in CASES[case][0]]})
        assert r.status_code == 200, r.text
        return r.json()["token_ids"], r.json()["usage"]["cached_tokens"]

    hit = (reference(folder, "one image")[1] - 1) // 8 * 8  # every full page but the one with the last prompt row
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        first = await tokens(client, "one image")
        other, other_cached = await tokens(client, "other image")
        again = await tokens(client, "one image")
    assert first[0] == want["one image"] and other == want["other image"]
    assert other_cached < 16  # the template's rows before the image at most: not the first image's rows
    assert again == (want["one image"], hit)
    assert_clean(server)
