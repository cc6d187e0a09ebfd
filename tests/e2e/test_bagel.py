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

Edits: `POST /v1/images/edits` on the image server against `interleave_inference([image,
text])` (float32, the PNG within 1), one alone and two at once; its refusals.

Text to image: a second server (`--task image`) behind `POST /v1/images/generations`, against
the inferencer's `interleave_inference([text])` with the same global seed: guidance on and
off, two sizes, n = 2, all at once; the PNG within 1, the npy float image truncated within 1.
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
def servers(folder, tmp_path_factory):
    """(the understanding server, the `--task image` one, the reference images): both start
    while the reference computes every answer and image the tests compare."""
    logs = tmp_path_factory.mktemp("logs")
    und = MstarServer(str(folder), logs / "bagel.log", "--num-kv-pages", "640", "--page-size", "16",
                      "--max-batch-tokens", "1024", "--enable-prompt-tokens-details",
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).launch()
    gen = MstarServer(str(folder), logs / "bagel-image.log", "--task", "image", "--num-kv-pages", "512",
                      "--page-size", "16", env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).launch()
    try:
        for items in (*CASES.values(), OTHER):
            reference(folder, items)
        refs = {name: reference_images(folder, body, n) for name, (body, n) in GEN.items()}
        refs.update({name: [reference_edit(folder, body)] for name, body in EDITS.items()})
        yield und.wait_ready(), gen.wait_ready(), refs
    finally:
        und.stop()
        gen.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def image_server(servers):
    return servers[1], servers[2]


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


# -- text to image on the engine, through POST /v1/images/generations ------------------------

#: name -> (the route's body, n): guidance on, off (a wide size), and two samples of a seed
GEN = {"cfg": ({"prompt": "A red cat on a mat.", "size": "64x64", "num_inference_steps": 5, "guidance_scale": 3.0,
                "seed": 7}, 1),
       "no cfg, wide": ({"prompt": "A blue boat.", "size": "96x32", "num_inference_steps": 4,
                         "guidance_scale": 1.0, "seed": 11}, 1),
       "two samples": ({"prompt": "Two green apples.", "size": "32x48", "num_inference_steps": 3,
                        "guidance_scale": 4.0, "seed": 5}, 2)}


def reference_images(folder: Path, body: dict, n: int) -> list[np.ndarray]:
    """The inferencer's images for the body: sample j after j draws of the same shape on the
    global generator seeded with `seed` (its noise is `torch.randn` there)."""
    import torch
    from bagel2.inferencer import InterleaveInferencer

    ref = _reference(folder)
    inf = InterleaveInferencer(ref["model"], ref["vae"], ref["tokenizer"], ref["vae_transform"],
                               ref["vit_transform"], ref["ids"])
    width, height = (int(s) for s in body["size"].split("x"))
    out = []
    for j in range(n):
        torch.manual_seed(body["seed"])
        for _ in range(j):
            torch.randn(height * width // 256, 64)
        out.append(np.asarray(inf.interleave_inference(
            [body["prompt"]], image_shapes=(height, width), num_timesteps=body["num_inference_steps"],
            cfg_text_scale=body["guidance_scale"])[-1]))
    return out


def _pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


async def test_images_equal_the_reference(image_server):
    """Every body at once (four engine requests): each PNG within 1 of the inferencer's
    image (it truncates x * 255, the route's PNG rounds it; the engine's forward runs every
    request's branches together), the `npy` float image truncated within 1 too; n = 2 as the
    seed's first two draws; the loop's iterations in /metrics; pages back to zero."""
    srv, refs = image_server
    before = srv.metric("mstar_denoise_steps_total")
    async with httpx.AsyncClient(base_url=srv.url, timeout=600) as client:
        replies = await asyncio.gather(*(client.post("/v1/images/generations", json={**body, "n": n})
                                         for body, n in GEN.values()),
                                       client.post("/v1/images/generations",
                                                   json={**GEN["cfg"][0], "output_format": "npy"}))
    for name, r in zip([*GEN, "npy"], replies):
        assert r.status_code == 200, (name, r.text)
    for name, r in zip(GEN, replies):
        got = [_pixels(d["b64_json"]) for d in r.json()["data"]]
        assert len(got) == len(refs[name]), name
        for mine, want in zip(got, refs[name]):
            assert mine.shape == want.shape and np.abs(mine.astype(int) - want.astype(int)).max() <= 1, name
    assert not np.array_equal(*refs["two samples"])
    image = np.load(io.BytesIO(base64.b64decode(replies[-1].json()["data"][0]["b64_json"])))
    truncated = (image * np.float32(255)).astype(np.uint8)  # as the reference's PIL image
    assert np.abs(truncated.astype(int) - refs["cfg"][0].astype(int)).max() <= 1
    # each image's loop iterations (steps - 1: its timesteps hold both ends), in /metrics
    want = sum((body["num_inference_steps"] - 1) * n for body, n in GEN.values()) + 4
    assert srv.wait_metric("mstar_denoise_steps_total", before + want) == before + want
    assert_clean(srv)


async def test_image_refusals_name_the_field(image_server):
    srv, _ = image_server
    cases = [({"prompt": "x", "size": "40x40"}, "size"), ({"prompt": "x", "size": "2048x32"}, "size"),
             ({"prompt": "x", "size": "32x32", "num_inference_steps": 1}, "num_inference_steps"),
             ({"prompt": "x", "size": "32x32", "negative_prompt": "blurry"}, "negative_prompt")]
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
        for body, param in cases:
            r = await client.post("/v1/images/generations", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert srv.wait_pages_free() == 0


# -- POST /v1/images/edits -------------------------------------------------------------------


async def _edit(client: httpx.AsyncClient, fields: dict, files: list[tuple[str, bytes]]) -> httpx.Response:
    """The route's multipart form as OpenAI's client sends it (files as `image` parts)."""
    parts = [(name, (f"{i}.png", data, "image/png")) for i, (name, data) in enumerate(files)]
    return await client.post("/v1/images/edits", data={k: str(v) for k, v in fields.items()}, files=parts or None)


#: name -> the edit route's fields and the image it edits (each 512 x 512 or so after
#: BAGEL's resize: ~1000 latent rows and ~1400 ViT rows in the context)
EDITS = {"edit": {"prompt": "Make it blue.", "num_inference_steps": 3, "guidance_scale": 3.0,
                  "image_guidance_scale": 2.0, "seed": 7, "image": "square"},
         "other": {"prompt": "Paint a green boat on it.", "num_inference_steps": 2, "guidance_scale": 2.0,
                   "seed": 3, "image": "square2"}}
IMAGES.update(square=png(20, 20, 4, (255, 0, 0)), square2=png(16, 16, 5, (0, 0, 255)))


def reference_edit(folder: Path, body: dict) -> np.ndarray:
    """The inferencer's edit of the body's image (`interleave_inference([image, prompt])`)
    with the global generator seeded with `seed` (its encoder's noise, then the latents')."""
    import torch
    from bagel2.inferencer import InterleaveInferencer
    from PIL import Image

    ref = _reference(folder)
    inf = InterleaveInferencer(ref["model"], ref["vae"], ref["tokenizer"], ref["vae_transform"],
                               ref["vit_transform"], ref["ids"])
    torch.manual_seed(body["seed"])
    return np.asarray(inf.interleave_inference(
        [Image.open(io.BytesIO(IMAGES[body["image"]])), body["prompt"]], num_timesteps=body["num_inference_steps"],
        cfg_text_scale=body["guidance_scale"], cfg_img_scale=body.get("image_guidance_scale", 1.5))[-1])


async def _edit(client: httpx.AsyncClient, fields: dict, files: list[tuple[str, bytes]]) -> httpx.Response:
    """The route's multipart form as OpenAI's client sends it (files as `image` parts)."""
    parts = [(name, (f"{i}.png", data, "image/png")) for i, (name, data) in enumerate(files)]
    return await client.post("/v1/images/edits", data={k: str(v) for k, v in fields.items()}, files=parts or None)


async def _edit_of(client: httpx.AsyncClient, name: str, part: str = "image") -> np.ndarray:
    body = {k: v for k, v in EDITS[name].items() if k != "image"}
    r = await _edit(client, body, [(part, IMAGES[EDITS[name]["image"]])])
    assert r.status_code == 200, (name, r.text)
    data = r.json()["data"]
    assert len(data) == 1
    return _pixels(data[0]["b64_json"])


async def test_edits_equal_the_reference(image_server):
    """An edit alone, then two at once (their iterations in one forward): each PNG within 1
    of the inferencer's edit (float32; it truncates x * 255, the route's PNG rounds), the
    input's size after BAGEL's resize; pages back to zero."""
    srv, refs = image_server
    async with httpx.AsyncClient(base_url=srv.url, timeout=600) as client:
        alone = await _edit_of(client, "edit")
        both = await asyncio.gather(_edit_of(client, "edit", "image[]"), _edit_of(client, "other"))
    for name, mine in (("edit", alone), ("edit", both[0]), ("other", both[1])):
        want = refs[name][0]
        assert mine.shape == want.shape and np.abs(mine.astype(int) - want.astype(int)).max() <= 1, name
    assert not np.array_equal(refs["edit"][0], refs["other"][0])
    assert_clean(srv)


async def test_edit_refusals_name_the_field(servers):
    """A model that does not edit (the understanding server: text out) is a 400 naming the
    model and the route; on the image server a body that is not a form, no image, bytes that
    are not an image, two images, a mask, a size other than the edit's: 400 naming the field."""
    und, gen, _ = servers
    body = {"prompt": "Make it blue.", "num_inference_steps": 2}
    image = IMAGES["red"]
    async with httpx.AsyncClient(base_url=und.url, timeout=60) as client:
        name = (await client.get("/v1/models")).json()["data"][0]["id"]
        r = await _edit(client, body, [("image", image)])
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "model", r.text
    assert name in err["message"] and "/v1/images/edits" in err["message"]
    cases = [(body, [], "image"), (body, [("image", b"not an image")], "image"),
             (body, [("image", image), ("image[]", image)], "image"),
             (body, [("image", image), ("mask", image)], "mask"),
             ({**body, "size": "512x512"}, [("image", image)], "size"), ({**body, "n": 9}, [("image", image)], "n"),
             ({**body, "image_guidance_scale": -1}, [("image[]", image)], "image_guidance_scale")]
    async with httpx.AsyncClient(base_url=gen.url, timeout=60) as client:
        as_json = await client.post("/v1/images/edits", json=body)
        got = [await _edit(client, fields, files) for fields, files, _ in cases]
    assert as_json.status_code == 400 and as_json.json()["error"]["param"] == "image", as_json.text
    for (fields, files, param), r in zip(cases, got):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, [n for n, _ in files], r.text)
    assert "608x512" in got[4].json()["error"]["message"]
    assert gen.wait_pages_free() == 0 and und.wait_pages_free() == 0
