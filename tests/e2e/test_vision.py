"""Images in, through the real services: tiny random Idefics3, SmolVLM, Gemma 3 and
Qwen2.5-VL checkpoints (their processors saved with them) against transformers' `generate` on the same folder, chat
requests with data-URL image parts, greedy tokens and `usage.prompt_tokens` equal.

Also the prefix-cache trap (the same text with another image must not reuse the first
image's rows: every image token has the same placeholder id), the cache hit the same image
earns, and the layout checks under `MSTAR_KV_DEBUG_ASSERTS=1` (both servers run with them,
chunked prefill on: `--max-batch-tokens 32` splits every prompt here, mid-image too).
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

from tests.servers import MstarServer
from tests.vlm_checkpoints import (
    load_processor,
    make_gemma3_vlm_checkpoint,
    make_idefics3_checkpoint,
    make_qwen25_vl_checkpoint,
)

FAMILIES = ("idefics3", "smolvlm", "gemma3", "qwen2_5_vl")
MAX_TOKENS = 8
LONG = ("Describe every part of the picture in order, the colours first, then the shapes, then where each "
        "thing sits relative to the others, and say what is missing. ") * 3
PROMPTS = ("What is in this image?", "Count the things you see.", "Hello world! The quick brown fox.")


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


#: small (one tile), wide (2 x 1 tiles + the global image), big (2 x 2 tiles + global)
IMAGES = {"small": png(24, 20, 1), "wide": png(70, 30, 2), "big": png(64, 60, 3), "other": png(24, 20, 4)}
#: case -> (the images, in order; where the text goes: "after" the images or "between" them)
CASES = {
    "one image": (("small",), "after"),
    "two images": (("small", "wide"), "between"),
    "image then long text": (("small",), "long"),
    "tiles": (("big",), "after"),
}


def data_url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode(IMAGES[name]).decode()


def content(images: tuple[str, ...], text: str, where: str, url: bool) -> list[dict]:
    """A user message's parts: ours (image_url parts) or the processor's ({"type": "image"})."""
    def image(name: str) -> dict:
        return {"type": "image_url", "image_url": {"url": data_url(name)}} if url else {"type": "image"}
    if where == "between":
        return [image(images[0]), {"type": "text", "text": text}, *map(image, images[1:])]
    body = text + (LONG if where == "long" else "")
    return [*map(image, images), {"type": "text", "text": body}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {"idefics3": make_idefics3_checkpoint(root / "idefics3", "idefics3", seed=0),
            "smolvlm": make_idefics3_checkpoint(root / "smolvlm", "smolvlm", seed=1),
            "gemma3": make_gemma3_vlm_checkpoint(root / "gemma3"),
            "qwen2_5_vl": make_qwen25_vl_checkpoint(root / "qwen2_5_vl")}


@cache
def _hf(folder: Path):
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(folder).eval(), load_processor(folder)


def reference(folder: Path, images: tuple[str, ...], text: str, where: str,
              specials: bool = True) -> tuple[list[int], int]:
    """(transformers' greedy tokens, its prompt length) for one chat turn: the processor's
    rendering tokenized with the tokenizer's specials (as `/generate` tokenizes a prompt),
    or (`specials` False) without, as a chat route sends its rendered prompt (Gemma 3's
    template writes its BOS itself)."""
    import torch
    from PIL import Image

    model, proc = _hf(folder)
    chat = [{"role": "user", "content": content(images, text, where, url=False)}]
    prompt = proc.apply_chat_template(chat, add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(IMAGES[n])).convert("RGB") for n in images]
    inputs = proc(text=[prompt], images=[pil], return_tensors="pt", add_special_tokens=specials)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS,
                             eos_token_id=None, pad_token_id=0)  # EOS ignored, not suppressed: ignore_eos
    n = inputs["input_ids"].shape[1]
    return out[0, n:].tolist(), n


@pytest.fixture(scope="module")
def servers(folders, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    started = {}
    try:
        for family, folder in folders.items():
            started[family] = MstarServer(str(folder), logs / f"{family}.log", "--num-kv-pages", "96",
                                          "--page-size", "8", "--max-batch-tokens", "32",
                                          "--enable-prompt-tokens-details",  # each reply's cached rows
                                          env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
        yield started
    finally:
        for srv in started.values():
            srv.stop()


async def chat(client: httpx.AsyncClient, images: tuple[str, ...], text: str, where: str) -> dict:
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": content(images, text, where, url=True)}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def rendered(folder: Path, images: tuple[str, ...], text: str, where: str) -> str:
    """The chat turn as the processor's template renders it (image parts as placeholders)."""
    chat_turn = [{"role": "user", "content": content(images, text, where, url=False)}]
    return _hf(folder)[1].apply_chat_template(chat_turn, add_generation_prompt=True)


async def generate(client: httpx.AsyncClient, prompt: str, images: tuple[str, ...]) -> dict:
    r = await client.post("/generate", json={"prompt": prompt, "images": [data_url(n) for n in images],
                                             "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def assert_clean(srv: MstarServer) -> None:
    """Pages back to 0; nothing overran, nothing loose, no request failed."""
    assert srv.wait_pages_free() == 0
    assert srv.metric("mstar_kv_footprint_overruns_total") == 0
    log = srv.log()
    assert "footprint overrun" not in log and "not tight" not in log and "failed (error_id=" not in log


@pytest.mark.parametrize("family", FAMILIES)
async def test_parity_matrix(family, folders, servers):
    """Each family x {one image, two images, image then long text, tiles} x 3 prompts, sent
    at once to `/generate` (the prompt as the processor's template renders the turn):
    greedy tokens and prompt_tokens equal to transformers'."""
    srv, folder = servers[family], folders[family]
    cases = [(CASES[c][0], t, CASES[c][1]) for c in CASES for t in PROMPTS]
    async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
        got = await asyncio.gather(*(generate(client, rendered(folder, *c), c[0]) for c in cases))
    for case, body in zip(cases, got):
        want, prompt_len = reference(folder, *case)
        assert (body["token_ids"], body["usage"]["prompt_tokens"]) == (want, prompt_len), case
    assert_clean(srv)


@pytest.mark.parametrize("family", FAMILIES)
async def test_chat_route_renders_image_parts(family, folders, servers):
    """`/v1/chat/completions` with data-URL image parts: the checkpoint's template sees them
    as {"type": "image"} parts; the answer and prompt_tokens are transformers'."""
    srv, folder = servers[family], folders[family]
    tok = _hf(folder)[1].tokenizer
    async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
        got = await asyncio.gather(*(chat(client, images, PROMPTS[0], where) for images, where in CASES.values()))
    for (images, where), body in zip(CASES.values(), got):
        want, prompt_len = reference(folder, images, PROMPTS[0], where, specials=False)
        assert body["usage"]["prompt_tokens"] == prompt_len, images
        assert body["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True), images
    assert_clean(srv)


@pytest.mark.parametrize("family", ["idefics3", "qwen2_5_vl"])  # Gemma 3's window label is never keyed
async def test_the_prefix_cache_keys_images_by_content(family, folders, servers):
    """The same long text after two different images, one after the other and then at
    once: each answer is transformers' for its own image. The same image again hits the
    prefix cache (the hit counter grows by its image and text rows) with the same answer
    (Qwen2.5-VL: rows after the image at M-RoPE positions that are not their row numbers)."""
    srv, folder = servers[family], folders[family]
    prompt = rendered(folder, ("small",), LONG, "after")
    want = {n: reference(folder, (n,), LONG, "after")[0] for n in ("small", "other")}
    assert want["small"] != want["other"]  # the images matter to this model

    async def tokens(name: str) -> list[int]:
        return (await generate(client, prompt, (name,)))["token_ids"]

    async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
        assert await tokens("small") == want["small"]
        assert await tokens("other") == want["other"]
        assert await asyncio.gather(tokens("other"), tokens("small")) == [want["other"], want["small"]]
        again = await generate(client, prompt, ("small",))
    assert again["token_ids"] == want["small"]
    prompt_rows = reference(folder, ("small",), LONG, "after")[1]
    want_hit = (prompt_rows - 1) // 8 * 8  # every full page but the one holding the last prompt row
    # this reply's own count (a /metrics counter read between requests may lag the workers'
    # last published hits: it once read 656 rows short)
    assert again["usage"]["cached_tokens"] == want_hit
    assert srv.wait_pages_free() == 0


async def test_image_refusals_name_the_part(servers):
    srv = servers["smolvlm"]
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
        bad = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"no").decode()}},
        ]}], "max_tokens": 2})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "messages[0].content[1].image_url.url"
        assert "could not be decoded as an image" in bad.json()["error"]["message"]
        count = await client.post("/generate", json={"prompt": "<image> and <image>", "images": [data_url("small")],
                                                      "max_tokens": 2})
        assert count.status_code == 400 and count.json()["error"]["param"] == "prompt"
        assert count.json()["error"]["message"] == "the prompt holds 2 image placeholder(s) ('<image>') for 1 image(s)"
        ids = await client.post("/generate", json={"input_ids": [1, 2], "images": [data_url("small")],
                                                    "max_tokens": 2})
        assert ids.status_code == 400 and ids.json()["error"]["param"] == "input_ids"
        card = (await client.get("/v1/models")).json()["data"][0]
    assert card["input_modalities"] == ["text", "image"] and card["image_placeholder"] == "<image>"
    assert srv.wait_pages_free() == 0


def test_the_openai_client_sends_image_parts(folders, servers):
    """The official `openai` client's chat call with an image part (its own types)."""
    import openai

    srv, folder = servers["idefics3"], folders["idefics3"]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": content(("wide",), PROMPTS[1], "after", url=True)}])
    want, prompt_len = reference(folder, ("wide",), PROMPTS[1], "after", specials=False)
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.choices[0].message.content == _hf(folder)[1].tokenizer.decode(want, skip_special_tokens=True)


def test_an_http_image_is_fetched_once_for_all_choices(folders, servers):
    """`n: 2` with an http(s) image part: one fetch (by the api, from a local server), both
    choices transformers' answer (greedy)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    gets = []

    class Image(BaseHTTPRequestHandler):
        def do_GET(self):
            gets.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(IMAGES["small"])))
            self.end_headers()
            self.wfile.write(IMAGES["small"])

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Image)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/small.png"
        srv, folder = servers["idefics3"], folders["idefics3"]
        part = {"type": "image_url", "image_url": {"url": url}}
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": PROMPTS[0]}]}],
            "n": 2, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
    assert r.status_code == 200, r.text
    want, _ = reference(folder, ("small",), PROMPTS[0], "after", specials=False)
    text = _hf(folder)[1].tokenizer.decode(want, skip_special_tokens=True)
    assert [c["message"]["content"] for c in r.json()["choices"]] == [text, text]
    assert gets == ["/small.png"]
