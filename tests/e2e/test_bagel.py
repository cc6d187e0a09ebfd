"""BAGEL understanding through the real services: a tiny random BAGEL-7B-MoT-shaped folder
(tests/bagel_checkpoints.py) against ByteDance's own `InterleaveInferencer` (bagel2 0.0.6)
on the same folder, greedy, in float32 (its attention's bfloat16 casts kept in float32).

Each case is the inferencer's input list (images and texts in order, `understanding_output`)
sent as one chat turn: the answer's tokens equal the reference's, up to its `<|im_end|>`.
BAGEL's images are big in rows (the inferencer resizes every image to a short edge of 512
and then 518 px for the ViT: 37 x 37 patches and more), so every prompt here is ~1400-3100
rows whose image blocks attend both ways. The server's step budget (1024 rows) is smaller
than every image block here, so each block runs whole as its step's first chunk while the
text around it is chunked; it runs with `MSTAR_KV_DEBUG_ASSERTS=1` and every page comes back.
"""

from __future__ import annotations

import asyncio
import base64
import io
from functools import cache
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.bagel_checkpoints import build_reference, make_bagel_checkpoint, reference_chat
from tests.servers import MstarServer, assert_clean

MAX_TOKENS = 6
PROMPTS = ("What is in the picture?", "Count the things you see, then name their colours.")


def png(width: int, height: int, seed: int, color: tuple[int, int, int]) -> bytes:
    """Noise over a colour: a random tiny model's answer follows an image's colours (its
    1400+ rows average out noise alone), so each image here has its own."""
    from PIL import Image

    noise = np.random.default_rng(seed).integers(0, 256, (height, width, 3)).astype(np.float32)
    pixels = (0.3 * noise + 0.7 * np.asarray(color, dtype=np.float32)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


#: 37 x 43 patches (24 x 20 px -> 608 x 512 -> 602 x 518), 37 x 108 (90 x 30 px)
IMAGES = {"red": png(24, 20, 1, (255, 0, 0)), "wide": png(90, 30, 2, (0, 0, 255)),
          "green": png(20, 24, 3, (0, 255, 0))}
#: case -> the inferencer's input list: image names and texts, in order
CASES = {
    "image then text": ("red", PROMPTS[0]),
    "wide image, long text": ("wide", PROMPTS[1] * 3),
    "text, image, text": (PROMPTS[1], "green", PROMPTS[0]),
    "text only": (PROMPTS[0],),
}
#: the first case's text after another image
OTHER = ("green", PROMPTS[0])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_bagel_checkpoint(tmp_path_factory.mktemp("bagel") / "BAGEL-7B-MoT")


@cache
def _reference(folder: Path) -> dict:
    return build_reference(folder)


@cache
def reference(folder: Path, items: tuple[str, ...]) -> tuple[list[int], list[float]]:
    """The reference's greedy answer for one input list (tokens after its `<|im_start|>`)
    and their log-probabilities."""
    from PIL import Image

    inputs = [Image.open(io.BytesIO(IMAGES[x])) if x in IMAGES else x for x in items]
    return reference_chat(_reference(folder), inputs, MAX_TOKENS)


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    """The server, started while the reference computes every answer the tests compare."""
    srv = MstarServer(str(folder), tmp_path_factory.mktemp("logs") / "bagel.log", "--num-kv-pages", "640",
                      "--page-size", "16", "--max-batch-tokens", "1024", "--enable-prompt-tokens-details",
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).launch()
    try:
        for items in (*CASES.values(), OTHER):
            reference(folder, items)
        yield srv.wait_ready()
    finally:
        srv.stop()


def url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode(IMAGES[name]).decode()


def parts(items: tuple[str, ...]) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url(x)}} if x in IMAGES else {"type": "text", "text": x}
            for x in items]


def prompt(items: tuple[str, ...]) -> str:
    """The turn as BAGEL's chat template renders it (`shared.specs.bagel`): each text its own
    `<|im_start|>`..`<|im_end|>`, each image its tags around one placeholder, then the fed
    `<|im_start|>`."""
    return "".join("<|vision_start|><|image_pad|><|vision_end|>" if x in IMAGES else f"<|im_start|>{x}<|im_end|>"
                   for x in items) + "<|im_start|>"


async def generate(client: httpx.AsyncClient, items: tuple[str, ...]) -> dict:
    r = await client.post("/generate", json={"prompt": prompt(items), "images": [url(x) for x in items if x in IMAGES],
                                             "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


async def chat(client: httpx.AsyncClient, items: tuple[str, ...]) -> dict:
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": parts(items)}], "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": True})
    assert r.status_code == 200, r.text
    return r.json()


async def test_understanding_equals_the_reference(folder, server):
    """Every case at once, on `/generate` and on the chat route: the answer is the
    reference's greedy tokens (generation stops at `<|im_end|>` as the reference's does)
    with its log-probabilities (float32, within 1e-4), the chat route's text their
    decoding and its prompt the same rows. The images matter: each gives another answer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        got = await asyncio.gather(*(generate(client, items) for items in CASES.values()),
                                   *(chat(client, items) for items in CASES.values()))
    raw, chats = got[: len(CASES)], got[len(CASES):]
    for name, body, reply in zip(CASES, raw, chats):
        want, logprobs = reference(folder, CASES[name])
        ids = body["token_ids"]
        assert ids[: len(want)] == want and ids[len(want):] in ([], [end]), name
        assert body["finish_reason"] == ("length" if len(ids) == MAX_TOKENS and ids[-1] != end else "stop"), name
        assert reply["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"], name
        assert reply["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True), name
        got_lp = [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]][: len(want)]
        assert np.allclose(got_lp, logprobs, atol=1e-4, rtol=0), (name, got_lp, logprobs)
    assert len({tuple(reference(folder, items)[0]) for items in CASES.values()}) == len(CASES)
    assert_clean(server)


async def test_an_image_seen_again_comes_from_the_prefix_cache(folder, server):
    """The same image and text again: its block's rows (keyed by the image's bytes) and the
    text's come from the prefix cache, with the same answer; another image with the same
    text shares nothing of the block (the placeholders' ids are all alike)."""
    items = CASES["image then text"]
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        first = await generate(client, items)
        again = await generate(client, items)
        other = await generate(client, OTHER)
    assert again["token_ids"] == first["token_ids"] == reference(folder, items)[0][: len(first["token_ids"])]
    rows = first["usage"]["prompt_tokens"]
    assert again["usage"]["cached_tokens"] == (rows - 1) // 16 * 16  # every full page but the last row's
    assert other["usage"]["cached_tokens"] == 0
    assert other["token_ids"][:MAX_TOKENS] == reference(folder, OTHER)[0][:MAX_TOKENS]
    assert_clean(server)


async def test_image_tokens_without_their_block_are_refused(server):
    """A placeholder outside `<|vision_start|>`..`<|vision_end|>`, or placeholder ids
    with no image: 400 naming the field."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        bare = await client.post("/generate", json={"prompt": "<|image_pad|><|im_start|>hi<|im_end|>",
                                                    "images": [url("red")], "max_tokens": 2})
        ids = await client.post("/generate", json={"input_ids": [1, 2], "images": [url("red")], "max_tokens": 2})
    assert bare.status_code == 400 and bare.json()["error"]["param"] == "prompt", bare.text
    assert "<|vision_start|>" in bare.json()["error"]["message"]
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "input_ids", ids.text
    assert server.wait_pages_free() == 0


@pytest.mark.parametrize(("size", "steps", "text_scale"), [((64, 64), 5, 3.0), ((32, 96), 4, 1.0)])
def test_text_to_image_in_process_equals_the_reference(folder, size, steps, text_scale):
    """BAGEL's text-to-image (`services.gpu_worker.modeling.vision.bagel_gen`, in process,
    not yet on the engine) against the inferencer's `interleave_inference([text])` with the
    same global seed: three-branch guidance on (and off), the decoded uint8 pixels equal."""
    import json

    import torch
    from bagel2.inferencer import InterleaveInferencer
    from safetensors.torch import load_file

    from services.gpu_worker.modeling.vision.bagel_gen import BagelGenerator, text_to_image

    ref = _reference(folder)
    inf = InterleaveInferencer(ref["model"], ref["vae"], ref["tokenizer"], ref["vae_transform"],
                               ref["vit_transform"], ref["ids"])
    text, (height, width) = "A red cat on a mat.", size
    torch.manual_seed(7)
    want = np.asarray(inf.interleave_inference([text], image_shapes=size, num_timesteps=steps,
                                               cfg_text_scale=text_scale)[-1])
    model = BagelGenerator(json.loads((folder / "config.json").read_text())).eval()
    model.load_weights({**load_file(str(folder / "ema.safetensors")), **load_file(str(folder / "ae.safetensors"))})
    ids = ref["ids"]
    prompt = torch.tensor([ids["bos_token_id"], *ref["tokenizer"].encode(text), ids["eos_token_id"]])
    tags = torch.tensor([ids["start_of_image"], ids["end_of_image"]])
    noise = torch.randn(height * width // 256, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = text_to_image(model, prompt, tags, height, width, noise, steps=steps, text_scale=text_scale).numpy()
    assert got.shape == want.shape == (height, width, 3)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    assert want.std() > 10  # an image, not a flat field
