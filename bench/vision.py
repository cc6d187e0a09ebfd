"""`python -m bench vision`: a one-image chat, mstar against transformers' `generate`.

The bench checkpoint is random, made once and cached: `--family qwen2_5_vl` (the default)
has the text bench checkpoint's shape (8 layers, hidden 512, M-RoPE) and a 6-block ViT of
384 (14 px patches, windows of 112 px, two full-attention blocks): a 512 x 384 photo is
252 image rows; `--family smolvlm` has the same text model and a 6-layer SigLIP of 384 over
256 px tiles (16 rows a tile): the photo is 2 x 2 tiles plus the whole image, 80 rows.

Figures, rounds alternating the two systems (medians, spreads, per-round ratios):
- TTFT of one chat turn with one image (a new image every request, so nothing is cached),
  from the request to the first token: mstar over HTTP (the turn as the chat template
  renders it, to a streamed `/generate`, which reports token ids; the data URL's decoding,
  preprocessing, the tower, prefill), transformers in process (processor + generate to
  the first token, streamer-timed);
- decode tokens/s of one stream (c1: tokens after the first / time after the first) and
  the output throughput of 8 streams at once (c8): mstar's 8 concurrent HTTP requests,
  transformers' `generate` on a batch of the 8 turns (same image size, so no padding).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from bench.checkpoints import cache_dir
from bench.report import results_dir
from bench.server import MstarServer
from bench.side_by_side import Figure, report

QUESTION = "Describe this picture in detail: the colours, the shapes and where each thing is."
TEXT = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)
VISION = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6, image_size=256,
              patch_size=16)


#: Qwen2.5-VL's bench shape: the same text model (M-RoPE sections of its 64-wide heads),
#: a 6-block ViT (14 px patches, 112 px windows, two full-attention blocks), up to 512x512
#: pixels: the 512x384 photo is a 36x28 patch grid, 252 image rows after the 2x2 merge
QWEN_TEXT = {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
             "initializer_range": 0.02}
QWEN_VISION = dict(depth=6, hidden_size=384, intermediate_size=1536, num_heads=6, patch_size=14, window_size=112,
                   fullatt_block_indexes=[2, 5], out_hidden_size=512, initializer_range=0.02)
QWEN_PIXELS = {"shortest_edge": 56 * 56, "longest_edge": 512 * 512}


def ensure_checkpoint(family: str = "qwen2_5_vl", root: Path | None = None) -> Path:
    """The cached bench folder of `family` (made aside and renamed, so a crash leaves none)."""
    from tests.vlm_checkpoints import make_idefics3_checkpoint, make_qwen25_vl_checkpoint

    root = root or cache_dir()
    path = root / f"{family}-bench-8x512-v1"
    if (path / "model.safetensors").exists():
        return path
    tmp = root / f".{path.name}.{os.getpid()}"
    if family == "smolvlm":
        make_idefics3_checkpoint(tmp, "smolvlm", text=TEXT, vision=VISION, scale_factor=4, longest_edge=512,
                                 tile=256, initializer_range=0.02)
    else:
        make_qwen25_vl_checkpoint(tmp, text=QWEN_TEXT, vision=QWEN_VISION, pixels=QWEN_PIXELS)
    try:
        tmp.rename(path)
    except OSError:
        pass
    return path


def photo(seed: int, width: int = 512, height: int = 384) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def turn(image: bytes | None) -> list[dict]:
    """The chat turn: an image_url part (mstar) or the processor's image part (image None)."""
    part = ({"type": "image"} if image is None else
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}})
    return [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]


async def mstar_one(client: httpx.AsyncClient, prompt: str, image: bytes, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, decode s after the first token, tokens) of one streamed `/generate` of the
    chat turn (the prompt the chat route renders; `/generate` streams token ids, which
    chat deltas do not: a random model's tokens are often text-less)."""
    body = {"prompt": prompt, "images": ["data:image/png;base64," + base64.b64encode(image).decode()],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async with client.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "delta" and event["token_ids"]:
                last = time.perf_counter()
                first = first or last
            elif event["type"] == "done":
                tokens = len(event["token_ids"])
    return first - t0, last - first, tokens


async def mstar_round(url: str, prompt: str, seed: int, max_tokens: int, concurrency: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        ttft, decode, tokens = await mstar_one(client, prompt, photo(seed), max_tokens)
        t0 = time.perf_counter()
        many = await asyncio.gather(*(mstar_one(client, prompt, photo(seed + 1 + i), max_tokens)
                                      for i in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"ttft_s": ttft, "c1_tok_s": (tokens - 1) / decode, "cN_tok_s": sum(m[2] for m in many) / wall}


class _Clock:
    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt = False

    def put(self, value) -> None:
        if self._prompt:
            self.times.append(time.perf_counter())
        self._prompt = True

    def end(self) -> None:
        pass


def hf_round(model, proc, seed: int, max_tokens: int, concurrency: int) -> dict:
    import torch
    from PIL import Image

    kw = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    prompt = proc.apply_chat_template(turn(None), add_generation_prompt=True)

    def inputs(seeds: list[int]):
        images = [[Image.open(io.BytesIO(photo(s))).convert("RGB")] for s in seeds]
        return proc(text=[prompt] * len(seeds), images=images, return_tensors="pt")

    with torch.inference_mode():
        clock = _Clock()
        t0 = time.perf_counter()
        model.generate(**inputs([seed]), streamer=clock, **kw)
        ttft, decode = clock.times[0] - t0, clock.times[-1] - clock.times[0]
        t0 = time.perf_counter()
        out = model.generate(**inputs([seed + 1 + i for i in range(concurrency)]), **kw)
        wall = time.perf_counter() - t0
    return {"ttft_s": ttft, "c1_tok_s": (len(clock.times) - 1) / decode,
            "cN_tok_s": concurrency * max_tokens / wall, "batch_shape": list(out.shape)}


def vision(args) -> Path:
    import torch
    import transformers

    from tests.vlm_checkpoints import load_processor

    out = results_dir(args.out)
    folder = Path(args.model) if args.model else ensure_checkpoint(args.family)
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    proc = load_processor(folder)
    print("starting mstar serve ...", file=sys.stderr)
    server = MstarServer(str(folder), out / "logs" / "mstar.log", ["--no-prefix-cache", *args.serve_arg]).start()
    runs: dict[str, list[dict]] = {"mstar": [], "transformers": []}
    prompt = proc.apply_chat_template(turn(None), add_generation_prompt=True)
    try:
        asyncio.run(mstar_round(server.url, prompt, 10_000, 8, 2))  # warm
        hf_round(hf, proc, 10_000, 4, 2)
        for r in range(args.rounds):
            seed = 100 * (r + 1)
            runs["mstar"].append(asyncio.run(mstar_round(server.url, prompt, seed, args.max_tokens,
                                                         args.concurrency)))
            runs["transformers"].append(hf_round(hf, proc, seed, args.max_tokens, args.concurrency))
            print(f"round {r + 1}: {runs}", file=sys.stderr)
    finally:
        server.stop()
    c = args.concurrency
    figures = [Figure("TTFT, one-image chat (ms)", "ttft_s", 1e3), Figure("decode tok/s, c1", "c1_tok_s", 1, True),
               Figure(f"output tok/s, c{c}", "cN_tok_s", 1, True)]
    return report(out, runs, figures, "transformers", f"random {args.family} bench checkpoint, one 512x384 image",
                  {"mode": "vision", "args": vars(args), "model": str(folder)})
