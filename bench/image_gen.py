"""`python -m bench.image_gen`: text to image with a Cosmos 3 pipeline served by mstar's
`POST /v1/images/generations` against diffusers' `Cosmos3OmniPipeline` called one image at
a time (what its examples do), and what keeping the text's K/V saves per denoising step.

The checkpoint: a random pipeline in the diffusers layout of a CPU-affordable shape
(transformer 4 x 256, 4 heads, 2 KV heads of 64; the tests' tiny Wan VAE), made once and
cached beside the other bench checkpoints; `--quick`: the tests' tiny transformer. Random
weights: speed only (the tests check the pixels).

Figures, rounds alternating the two systems (medians, per-round ratios):
- c1 s/image: images one after another (request to PNG);
- c4 s/image: bursts of 4 requests at once (mstar batches their steps in one forward;
  diffusers serves them one after another), the burst's wall time over its images.
Both run torch on the same threads (`--threads`, default the worker's: CPUs - 1): two
OpenMP threads on a busy two-core machine ran the pipeline 15x slower than one.
And in process, once, per step and branch: the reference's transformer forward (text rows
and latent rows, as every step of `Cosmos3OmniPipeline` runs it), mstar's latent-rows
forward that reads the kept text K/V (`Cosmos3.velocity`), and mstar's text pass
(`Cosmos3.text_kv`): what a step would redo without the kept K/V, i.e. what keeping them
saves each step and branch (and its share of such a step).

    python -m bench.image_gen                       # two rounds on the bench shape
    python -m bench.image_gen --quick --out /tmp/ig # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.checkpoints import cache_dir
from bench.report import results_dir
from bench.server import MstarServer
from bench.side_by_side import Figure, report

BENCH = dict(hidden_size=256, intermediate_size=768, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=4, rope_axes_dim=[16, 8, 8])
PROMPT = "a red fox running through a snowy forest at dawn, cinematic light"
BURST = 4


def ensure_checkpoint(quick: bool) -> Path:
    """The cached pipeline folder (tests/cosmos_checkpoints.py's, the transformer widened
    unless `quick`)."""
    from tests import cosmos_checkpoints as cc

    path = cache_dir() / ("cosmos3-tiny-v1" if quick else "cosmos3-4x256-v1")
    if (path / "model_index.json").exists():
        return path
    saved = dict(cc.TRANSFORMER)
    if not quick:
        cc.TRANSFORMER.update(BENCH)
    try:
        cc.make_cosmos3(path)
    finally:
        cc.TRANSFORMER.clear()
        cc.TRANSFORMER.update(saved)
    return path


def body(args: Any, seed: int) -> dict:
    return {"prompt": PROMPT, "size": args.size, "seed": seed, "num_inference_steps": args.steps,
            "guidance_scale": 6.0}


async def mstar_round(url: str, args: Any) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        async def one(seed: int) -> None:
            r = await client.post("/v1/images/generations", json=body(args, seed))
            if r.status_code != 200:
                raise RuntimeError(f"/v1/images/generations answered {r.status_code}: {r.text[:300]}")

        start = time.perf_counter()
        for i in range(args.c1_images):
            await one(i)
        c1 = (time.perf_counter() - start) / args.c1_images
        start = time.perf_counter()
        for b in range(args.bursts):
            await asyncio.gather(*(one(100 + b * BURST + i) for i in range(BURST)))
        c4 = (time.perf_counter() - start) / (args.bursts * BURST)
    return {"c1_s": c1, "c4_s": c4}


class Reference:
    """diffusers: the pipeline, one image at a time, PNG out (as a server would send it)."""

    def __init__(self, folder: Path, args: Any) -> None:
        from tests.cosmos_checkpoints import load_pipeline

        self.pipe, self.args = load_pipeline(folder), args
        self.width, self.height = (int(v) for v in args.size.split("x"))

    def one(self, seed: int) -> None:
        import io

        import torch

        image = self.pipe(PROMPT, num_frames=1, height=self.height, width=self.width,
                          num_inference_steps=self.args.steps, guidance_scale=6.0,
                          generator=torch.Generator("cpu").manual_seed(seed), enable_safety_check=False).video[0]
        image.save(io.BytesIO(), format="PNG")

    def round(self) -> dict:
        start = time.perf_counter()
        for i in range(self.args.c1_images):
            self.one(i)
        c1 = (time.perf_counter() - start) / self.args.c1_images
        start = time.perf_counter()
        for i in range(self.args.bursts * BURST):
            self.one(100 + i)
        return {"c1_s": c1, "c4_s": (time.perf_counter() - start) / (self.args.bursts * BURST)}


def text_kv_saving(folder: Path, ref: Reference, repeats: int = 5) -> dict:
    """Per step and branch: the reference transformer's forward (text + latent rows) and
    mstar's latent-rows forward over the kept text K/V, timed in process (medians)."""
    import torch

    from services.gpu_worker.weights import build_model
    from shared.model_source import ModelSource

    src = ModelSource(str(folder))
    spec = src.spec(16)
    model = build_model(src, spec, torch.float32)
    captured: dict[str, Any] = {}
    forward = ref.pipe.transformer.forward

    def capture(*a: Any, **kw: Any) -> Any:
        captured.setdefault("kw", kw)
        return forward(*a, **kw)

    ref.pipe.transformer.forward = capture
    try:
        ref.one(0)
    finally:
        ref.pipe.transformer.forward = forward
    kw = captured["kw"]
    text_rows, ids = int(kw["und_len"]), kw["input_ids"]
    tokens = torch.randn(int(kw["vision_mse_loss_indexes"].numel()), model.transformer.proj_in.in_features)
    t = torch.full((tokens.shape[0],), 500.0)
    with torch.inference_mode():
        positions = kw["position_ids"].float()
        kv = model.text_kv(ids, positions[:, :text_rows])
        rope = model.rope(positions[:, text_rows:])

        def timed(fn: Any) -> float:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        ref_s = timed(lambda: ref.pipe.transformer(**kw))
        ours_s = timed(lambda: model.velocity(tokens, t, [rope], [(0, tokens.shape[0])], [kv]))
        text_s = timed(lambda: model.text_kv(ids, positions[:, :text_rows]))
    # what keeping the K/V saves each step and branch is the text pass the step would redo
    return {"text_rows": text_rows, "latent_rows": tokens.shape[0], "reference_forward_ms": ref_s * 1e3,
            "mstar_latent_forward_ms": ours_s * 1e3, "saved_per_step_and_branch_ms": text_s * 1e3,
            "saved_share_of_step": text_s / (text_s + ours_s)}


FIGURES = [Figure("c1 s/image", "c1_s"), Figure(f"c{BURST} s/image", "c4_s")]


def image_gen(args: Any) -> Path:
    import torch

    out = results_dir(args.out)
    folder = Path(args.model) if args.model else ensure_checkpoint(args.quick)
    # one torch thread count for both: the worker's default (MSTAR_TORCH_THREADS), the reference's own
    torch.set_num_threads(args.threads)
    print(f"starting mstar serve ({args.threads} torch threads, as the reference) ...", file=sys.stderr)
    server = MstarServer(str(folder), out / "logs" / "mstar.log", list(args.serve_arg),
                         env={"MSTAR_TORCH_THREADS": str(args.threads)}).start()
    ref = Reference(folder, args)
    runs: dict[str, list[dict]] = {"mstar": [], "diffusers": []}
    try:
        asyncio.run(mstar_round(server.url, argparse.Namespace(**{**vars(args), "c1_images": 1, "bursts": 1})))
        ref.one(0)
        for r in range(args.rounds):
            systems = [("mstar", lambda: asyncio.run(mstar_round(server.url, args))), ("diffusers", ref.round)]
            for name, run in systems if r % 2 == 0 else systems[::-1]:
                runs[name].append(run())
            print(f"round {r + 1}: " + ", ".join(f"{k} c1 {v[-1]['c1_s']:.3f} s" for k, v in runs.items()),
                  file=sys.stderr)
    finally:
        server.stop()
    saving = text_kv_saving(folder, ref)
    print("text K/V kept, per step and branch: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                            for k, v in saving.items()))
    title = f"random Cosmos 3 {folder.name}, {args.size}, {args.steps} steps, CFG 6"
    return report(out, runs, FIGURES, "diffusers", title,
                  {"mode": "image_gen", "args": vars(args), "model": str(folder), "text_kv": saving})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.image_gen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tests' tiny transformer, one round (a smoke run)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 2; --quick: 1)")
    p.add_argument("--c1-images", type=int, default=None, help="c1 images a round (default 4; --quick: 2)")
    p.add_argument("--bursts", type=int, default=None, help=f"bursts of {BURST} a round (default 2; --quick: 1)")
    p.add_argument("--size", default="64x64", help="WxH, multiples of 16 (default 64x64)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the worker and of the reference (default: the worker's, CPUs - 1)")
    p.add_argument("--model", default="", help="a Cosmos 3 diffusers folder (default: the cached bench one)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `mstar serve` flag (repeat)")
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads is None:
        from shared.cgroup import available_cpus

        args.threads = max(1, available_cpus() - 1)
    for name, full, quick in (("rounds", 2, 1), ("c1_images", 4, 2), ("bursts", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    image_gen(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
