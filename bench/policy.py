"""`python -m bench.policy`: a robot policy (Pi0.5) served by mstar's `POST /v1/actions`
against transformers' `sample_actions` called one request at a time (what openpi's and
LeRobot's reference scripts do: one observation in, one chunk out, the next after it).

The checkpoint: a random `PI05ForConditionalGeneration` of a CPU-affordable shape with the
real model's request layout (two 224 x 224 cameras of 256 rows each, a short prompt with
the state's bins, a chunk of 50 actions of 32, 10 flow steps): SigLIP 6 x 384, Gemma 6 x
512 (8 heads, 1 KV head of 64), action expert 6 x 256; ~50M parameters (Pi0.5's real
vision tower is 27 x 1152, its Gemma 18 x 2048, its expert 18 x 1024). `--quick`: the
e2e tests' tiny shape (one 28 x 28 image row block per camera, chunk 5), for a smoke run.
Made once, cached beside the other bench checkpoints. Random weights: speed only.

Figures, rounds alternating the two systems (medians, per-round ratios with their spread):
- TTFT at c1: one request at a time, request to its whole chunk (a policy's only output);
  mstar: over HTTP (two PNG data URLs, decoded by the data worker), or with `--client
  openpi` through openpi's own `WebsocketClientPolicy` (LIBERO's keys, uint8 arrays in
  msgpack); transformers: the processor on the already decoded images, then `sample_actions`;
- actions/s at c1: chunk rows answered per second over those requests;
- c16: bursts of 16 observations arriving at once (16 robots, or one robot's 16 arms):
  TTFT is each one's time from the burst's start to its chunk (mstar: 16 concurrent
  requests, batched; transformers: served one after another, as its one-at-a-time call
  serves them), actions/s the burst's chunk rows over its wall time.

    python -m bench.policy                     # two rounds on the bench shape
    python -m bench.policy --quick --out /tmp/p   # a smoke run (tiny shape, a few requests)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from bench.checkpoints import cache_dir
from bench.report import results_dir
from bench.rounds import alternate, fill_defaults
from bench.server import MstarServer
from bench.side_by_side import Figure, report


class Shape(NamedTuple):
    name: str
    text: dict[str, Any]
    vision: dict[str, Any]
    dit: dict[str, Any]
    chunk: int
    action_dim: int
    steps: int
    state_dim: int


BENCH = Shape(
    "pi05-6x512-v1",
    dict(model_type="gemma", hidden_size=512, num_hidden_layers=6, intermediate_size=2048, num_attention_heads=8,
         num_key_value_heads=1, head_dim=64),
    dict(model_type="siglip_vision_model", hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
         num_attention_heads=6, image_size=224, patch_size=14, vision_use_head=False),
    dict(model_type="gemma", hidden_size=256, num_hidden_layers=6, intermediate_size=1024, num_attention_heads=4,
         num_key_value_heads=1, head_dim=64),
    chunk=50, action_dim=32, steps=10, state_dim=8)
QUICK = Shape(
    "pi05-tiny-v1",
    dict(model_type="gemma", hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
         num_key_value_heads=1, head_dim=16),
    dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
         num_attention_heads=2, image_size=28, patch_size=14, vision_use_head=False),
    dict(model_type="gemma", hidden_size=24, num_hidden_layers=2, intermediate_size=48, num_attention_heads=2,
         num_key_value_heads=1, head_dim=16),
    chunk=5, action_dim=8, steps=4, state_dim=5)
CAMERAS = ("base_0_rgb", "left_wrist_0_rgb")
PROMPT = "pick up the red cube and put it in the bowl"
BURST = 16


def make_processor(path: Path, shape: Shape) -> Any:
    """PI05Processor over the folder's tokenizer with the Pillow image processor (the
    torchvision one does not load here) and the folder's state quantiles."""
    import transformers

    from tests.policy_checkpoints import pil_image_processor_class

    size = shape.vision["image_size"]
    rows = (size // shape.vision["patch_size"]) ** 2
    images = pil_image_processor_class()(size={"max_height": size, "max_width": size},
                                         pad_size={"height": size, "width": size}, image_seq_length=rows)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    saved = path / "processor_config.json"
    stats = {k: v for k, v in json.loads(saved.read_text()).items() if "_q0" in k or "_q9" in k} \
        if saved.exists() else {"state_q01": [-1.0] * shape.state_dim, "state_q99": [1.0] * shape.state_dim,
                                "actions_q01": [-1.0] * shape.state_dim, "actions_q99": [1.0] * shape.state_dim}
    return transformers.PI05Processor(images, tok, max_state_dim=shape.action_dim, chunk_size=shape.chunk, **stats)


def make_checkpoint(path: Path, shape: Shape, seed: int = 0) -> Path:
    """The random Pi0.5 of `shape` with its processor and LeRobot's camera names, in the Hub's layout."""
    import torch
    import transformers

    from tests.checkpoints import make_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path, extra_specials=("<bos>",))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<bos>"}))
    processor = make_processor(path, shape)
    processor.save_pretrained(path)
    vocab = len(processor.tokenizer)
    cfg = transformers.PI05Config(
        vlm_config=dict(model_type="paligemma", text_config={**shape.text, "vocab_size": vocab},
                        vision_config=shape.vision, projection_dim=shape.text["hidden_size"],
                        image_token_id=processor.image_token_id, vocab_size=vocab),
        dit_config=shape.dit, chunk_size=shape.chunk, max_action_dim=shape.action_dim,
        num_inference_steps=shape.steps)
    torch.manual_seed(seed)
    model = transformers.PI05ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.normal_(0.0, 0.2)
    model.config.architectures = ["PI05ForConditionalGeneration"]
    model.save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    config["input_features"] = {f"observation.images.{c}": {"type": "VISUAL", "shape": [3, 224, 224]}
                                for c in CAMERAS}
    config["input_features"]["observation.state"] = {"type": "STATE", "shape": [shape.state_dim]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def ensure_checkpoint(shape: Shape, root: Path | None = None) -> Path:
    """The cached checkpoint of `shape`, made on first use (built aside, renamed into place)."""
    root = root or cache_dir()
    path = root / shape.name
    if (path / "model.safetensors").exists():
        return path
    tmp = make_checkpoint(root / f".{shape.name}.{os.getpid()}", shape)
    try:
        tmp.rename(path)
    except OSError:
        pass
    return path


def camera_images(shape: Shape) -> list[Any]:
    """Two camera frames at the model's size: smooth gradients with a little noise (a
    photograph's PNG size, not random noise's)."""
    import numpy as np
    from PIL import Image

    size = shape.vision["image_size"]
    y, x = np.mgrid[0:size, 0:size]
    rng = np.random.default_rng(0)
    out = []
    for i in range(len(CAMERAS)):
        base = np.stack([(x * (2 + i)) % 256, (y * 3) % 256, ((x + y) * (1 + i)) % 256], axis=-1)
        noisy = base + rng.integers(0, 8, base.shape)
        out.append(Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)))
    return out


def body(images: list[Any], shape: Shape, seed: int) -> dict:
    urls = {}
    for name, image in zip(CAMERAS, images, strict=True):
        buf = io.BytesIO()
        image.save(buf, "PNG")
        urls[name] = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    state = [0.1 * (i - shape.state_dim / 2) for i in range(shape.state_dim)]
    return {"observation": {"images": urls, "state": state}, "prompt": PROMPT, "seed": seed}


async def _act(client: httpx.AsyncClient, payload: dict, t0: float) -> float:
    r = await client.post("/v1/actions", json=payload)
    if r.status_code != 200:
        raise RuntimeError(f"/v1/actions answered {r.status_code}: {r.text[:500]}")
    return time.perf_counter() - t0


async def mstar_round(url: str, payload: dict, shape: Shape, c1_requests: int, bursts: int) -> dict:
    """c1: one request at a time; c16: bursts of BURST concurrent requests."""
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        start = time.perf_counter()
        c1 = [await _act(client, payload, time.perf_counter()) for _ in range(c1_requests)]
        c1_wall = time.perf_counter() - start
        burst_ttft: list[float] = []
        start = time.perf_counter()
        for _ in range(bursts):
            t0 = time.perf_counter()
            burst_ttft += await asyncio.gather(*(_act(client, payload, t0) for _ in range(BURST)))
        burst_wall = time.perf_counter() - start
    return figures(c1, c1_wall, burst_ttft, burst_wall, shape)


def openpi_round(port: int, obs: dict, shape: Shape, c1_requests: int, bursts: int) -> dict:
    """`mstar_round` through openpi's own client over the WebSocket (one socket a client,
    as a robot holds one; the burst's 16 from 16 threads, the client being synchronous)."""
    from concurrent.futures import ThreadPoolExecutor

    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    clients = [WebsocketClientPolicy("127.0.0.1", port) for _ in range(BURST)]

    def infer(client: Any, t0: float) -> float:
        client.infer(obs)
        return time.perf_counter() - t0

    try:
        start = time.perf_counter()
        c1 = [infer(clients[0], time.perf_counter()) for _ in range(c1_requests)]
        c1_wall = time.perf_counter() - start
        burst_ttft: list[float] = []
        start = time.perf_counter()
        with ThreadPoolExecutor(BURST) as pool:
            for _ in range(bursts):
                t0 = time.perf_counter()
                burst_ttft += pool.map(infer, clients, [t0] * len(clients))
        burst_wall = time.perf_counter() - start
    finally:
        for client in clients:
            client._ws.close()
    return figures(c1, c1_wall, burst_ttft, burst_wall, shape)


def observation(images: list[Any], payload: dict) -> dict:
    """The observation as openpi's LIBERO example sends it (mstar maps its cameras to base_0_rgb
    and left_wrist_0_rgb), with the body's state, prompt and seed."""
    import numpy as np

    return {"observation/image": np.asarray(images[0]), "observation/wrist_image": np.asarray(images[1]),
            "observation/state": np.asarray(payload["observation"]["state"], dtype=np.float32),
            "prompt": payload["prompt"], "seed": payload["seed"]}


def figures(c1: list[float], c1_wall: float, burst: list[float], burst_wall: float, shape: Shape) -> dict:
    return {"c1_ttft_s": statistics.median(c1), "c1_actions_s": shape.chunk * len(c1) / c1_wall,
            "c16_ttft_s": statistics.median(burst), "c16_actions_s": shape.chunk * len(burst) / burst_wall,
            "c1_all_s": c1, "c16_all_s": burst}


class Reference:
    """transformers: the processor, then `sample_actions`, one observation at a time."""

    def __init__(self, folder: Path, shape: Shape, images: list[Any], payload: dict) -> None:
        import torch
        import transformers

        self.shape, self.images = shape, images
        self.processor = make_processor(folder, shape)
        self.model = transformers.PI05ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        self.state = torch.tensor([payload["observation"]["state"]], dtype=torch.float32)

    def one(self) -> None:
        import torch

        with torch.inference_mode():
            inputs = self.processor(images=[self.images], text=[PROMPT], state=self.state)
            self.model.sample_actions(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
                                      attention_mask=inputs["attention_mask"],
                                      pixel_attention_mask=inputs["pixel_attention_mask"])

    def round(self, c1_requests: int, bursts: int) -> dict:
        c1 = []
        start = time.perf_counter()
        for _ in range(c1_requests):
            t0 = time.perf_counter()
            self.one()
            c1.append(time.perf_counter() - t0)
        c1_wall = time.perf_counter() - start
        burst_ttft: list[float] = []
        start = time.perf_counter()
        for _ in range(bursts):
            t0 = time.perf_counter()
            for _ in range(BURST):  # one after another: each waits for those before it
                self.one()
                burst_ttft.append(time.perf_counter() - t0)
        return figures(c1, c1_wall, burst_ttft, time.perf_counter() - start, self.shape)


FIGURES = [Figure("c1 TTFT (ms)", "c1_ttft_s", 1e3), Figure("c1 actions/s", "c1_actions_s", higher_is_better=True),
           Figure(f"c{BURST} TTFT (ms)", "c16_ttft_s", 1e3),
           Figure(f"c{BURST} actions/s", "c16_actions_s", higher_is_better=True)]


def policy(args) -> Path:
    shape = QUICK if args.quick else BENCH
    out = results_dir(args.out)
    folder = Path(args.model) if args.model else ensure_checkpoint(shape)
    images = camera_images(shape)
    payload = body(images, shape, args.seed)
    ref = Reference(folder, shape, images, payload)
    print("starting mstar serve ...", file=sys.stderr)
    server = MstarServer(str(folder), out / "logs" / "mstar.log", list(args.serve_arg)).start()

    def ours(c1_requests: int, bursts: int) -> dict:
        if args.client == "openpi":
            return openpi_round(server.port, observation(images, payload), shape, c1_requests, bursts)
        return asyncio.run(mstar_round(server.url, payload, shape, c1_requests, bursts))

    try:
        ours(1, 1)  # warm both (a burst: the batched path)
        ref.one()
        runs = alternate({"mstar": lambda: ours(args.c1_requests, args.bursts),
                          "transformers": lambda: ref.round(args.c1_requests, args.bursts)}, args.rounds, "c1_ttft_s")
    finally:
        server.stop()
    title = (f"random Pi0.5 {shape.name} (mstar over {args.client}), {len(CAMERAS)} cameras of "
             f"{shape.vision['image_size']} px, chunk {shape.chunk} x {shape.action_dim}, {shape.steps} steps")
    return report(out, runs, FIGURES, "transformers", title,
                  {"mode": "policy", "args": vars(args), "model": str(folder), "shape": shape._asdict()})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.policy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny shape, one round, few requests (a smoke run)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 2; --quick: 1)")
    p.add_argument("--c1-requests", type=int, default=None, help="c1 requests a round (default 6; --quick: 2)")
    p.add_argument("--bursts", type=int, default=None, help=f"bursts of {BURST} a round (default 2; --quick: 1)")
    p.add_argument("--model", default="", help="a Pi0.5 folder (default: the cached bench checkpoint)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client", choices=("http", "openpi"), default="http",
                   help="mstar through POST /v1/actions (JSON, PNG data URLs), or openpi's own "
                        "WebsocketClientPolicy (msgpack arrays; needs openpi-client)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `mstar serve` flag (repeat)")
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    fill_defaults(args, (("rounds", 2, 1), ("c1_requests", 6, 2), ("bursts", 2, 1)))
    policy(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
