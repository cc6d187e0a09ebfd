"""`python -m bench.image_gen`: text to image with a Cosmos 3 pipeline served by mstar's
`POST /v1/images/generations` against diffusers' `Cosmos3OmniPipeline` called one image at
a time (what its examples do), and what keeping the text's K/V saves per denoising step;
`--family bagel`: BAGEL (`--task image`) against ByteDance's own inferencer (`bagel2`'s
`InterleaveInferencer.interleave_inference([prompt])`, one image at a time, as its app).
`--frames N` (N > 1, Cosmos 3): videos of N frames instead, mstar through OpenAI's video
job API (`POST /v1/videos` with `num_frames`, `size`, `num_inference_steps`, `seed`; poll
`GET /v1/videos/{id}` every 20 ms until it is completed; `GET .../content`, the MP4: the
request's time ends there), the pipeline with `num_frames=N` one video at a time, its frames
rounded as diffusers' `numpy_to_pil` and encoded by the server's own encoder
(`videos.mp4`: PyAV, H.264): both sides' times include the encoding.

The checkpoint: a random pipeline in the diffusers layout of a CPU-affordable shape
(transformer 4 x 256, 4 heads, 2 KV heads of 64; the tests' tiny Wan VAE), made once and
cached beside the other bench checkpoints; `--quick`: the tests' tiny transformer. BAGEL:
tests/bagel_checkpoints.py's folder (the Hub's layout, MoT Qwen2 with qk-norm, FLUX-shaped
VAE cut down) with its LLM widened to 4 x 256 (4 heads, 2 KV heads of 64; BAGEL-7B-MoT's is
28 x 3584), 128 x 128 images (64 latent rows; CFG 4 on the text, the inferencer's image CFG
1.5, which has no image to drop here). Random weights: speed only (the tests check the pixels).

Figures, rounds alternating the two systems (medians, per-round ratios):
- c1 s/image: images one after another (request to PNG; `--frames`: s/video, request to MP4);
- c4 s/image: bursts of 4 requests at once (mstar batches their steps in one forward;
  diffusers serves them one after another), the burst's wall time over its images.
Both run torch on the same threads (`--threads`, default the worker's: CPUs - 1): two
OpenMP threads on a busy two-core machine ran the pipeline 15x slower than one.
And in process, once, per step and branch: the reference's transformer forward (text rows
and latent rows, as every step of `Cosmos3OmniPipeline` runs it), mstar's latent-rows
forward that reads the kept text K/V (`Cosmos3.velocity`), and mstar's text pass
(`Cosmos3.text_kv`): what a step would redo without the kept K/V, i.e. what keeping them
saves each step and branch (and its share of such a step). BAGEL: the inferencer keeps
the text's K/V as well (its `NaiveCache`, the steps forward the latent rows alone), so the
two do not differ there; its text pass (`update_context_text`) is timed to say what a step
would redo without them.

    python -m bench.image_gen                       # two rounds on the bench shape
    python -m bench.image_gen --quick --out /tmp/ig # a smoke run
    python -m bench.image_gen --family bagel        # BAGEL, two rounds
    python -m bench.image_gen --frames 5            # 5-frame videos, two rounds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.checkpoints import cache_dir
from bench.report import results_dir
from bench.rounds import Timings, alternate, fill_defaults, http_round, serial_round, video_job
from bench.server import MstarServer
from bench.side_by_side import Figure, report

BENCH = dict(hidden_size=256, intermediate_size=768, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=4, rope_axes_dim=[16, 8, 8])
BAGEL_LLM = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_window_layers=4)
PROMPT = "a red fox running through a snowy forest at dawn, cinematic light"
BURST = 4
#: family -> (size, guidance, the reference's name, extra `mstar serve` flags)
FAMILIES = {"cosmos3": ("64x64", 6.0, "diffusers", []), "bagel": ("128x128", 4.0, "bagel2", ["--task", "image"])}


def ensure_checkpoint(quick: bool, family: str = "cosmos3") -> Path:
    """The cached folder (tests/cosmos_checkpoints.py's pipeline, the transformer widened
    unless `quick`; tests/bagel_checkpoints.py's BAGEL, its LLM widened unless `quick`)."""
    if family == "bagel":
        from tests.bagel_checkpoints import make_bagel_checkpoint

        path = cache_dir() / ("bagel-tiny-v1" if quick else "bagel-4x256-v1")
        if not (path / "ema.safetensors").exists():
            make_bagel_checkpoint(path, 0, None if quick else BAGEL_LLM)
        return path
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
    extra = {"num_frames": args.frames} if args.frames > 1 else {}
    return {"prompt": PROMPT, "size": args.size, "seed": seed, "num_inference_steps": args.steps,
            "guidance_scale": args.guidance, **extra}


def bodies(args: Any, c1: int, bursts: int) -> tuple[list[dict], list[list[dict]]]:
    return [body(args, i) for i in range(c1)], [[body(args, 100 + b * BURST + i) for i in range(BURST)]
                                                for b in range(bursts)]


def per_image(t: Timings) -> dict:
    return {"c1_s": t.c1_wall / len(t.c1), "c4_s": t.burst_wall / len(t.burst)}


class Reference:
    """diffusers: the pipeline, one image at a time, PNG out (as a server would send it);
    `--frames` > 1: one video at a time, MP4 out by the server's encoder."""

    def __init__(self, folder: Path, args: Any) -> None:
        from tests.cosmos_checkpoints import load_pipeline

        self.pipe, self.args = load_pipeline(folder), args
        self.width, self.height = (int(v) for v in args.size.split("x"))

    def one(self, request: dict) -> None:
        import io

        import torch

        frames = self.args.frames
        video = self.pipe(PROMPT, num_frames=frames, height=self.height, width=self.width,
                          num_inference_steps=self.args.steps, guidance_scale=request["guidance_scale"],
                          generator=torch.Generator("cpu").manual_seed(request["seed"]),
                          output_type="pil" if frames == 1 else "np", enable_safety_check=False).video
        if frames == 1:
            video[0].save(io.BytesIO(), format="PNG")
            return
        from services.api.dialects.openai.images import to_uint8
        from services.api.dialects.openai.videos import mp4

        mp4(to_uint8(video))  # [F, H, W, 3] floats in [0, 1]


class BagelReference:
    """bagel2: the inferencer on the prompt alone, one image at a time, PNG out."""

    def __init__(self, folder: Path, args: Any) -> None:
        from bagel2.inferencer import InterleaveInferencer

        from tests.bagel_checkpoints import build_reference

        ref = build_reference(folder)
        self.inf = InterleaveInferencer(ref["model"], ref["vae"], ref["tokenizer"], ref["vae_transform"],
                                        ref["vit_transform"], ref["ids"])
        width, height = (int(v) for v in args.size.split("x"))
        self.shape = (height, width)

    def one(self, request: dict) -> None:
        import io

        import torch

        torch.manual_seed(request["seed"])
        image = self.inf.interleave_inference([request["prompt"]], image_shapes=self.shape,
                                              num_timesteps=request["num_inference_steps"],
                                              cfg_text_scale=request["guidance_scale"])[-1]
        image.save(io.BytesIO(), format="PNG")

    def text_pass(self, repeats: int = 5) -> dict:
        """The prompt's text pass (what a step would redo per branch without the kept K/V)."""
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.inf.update_context_text(PROMPT, self.inf.init_gen_context())
            times.append(time.perf_counter() - t0)
        return {"text_pass_ms": statistics.median(times) * 1e3,
                "note": "bagel2 keeps the text K/V too: both skip this pass each step"}


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
        ref.one(body(ref.args, 0))
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


def figures(frames: int) -> list[Figure]:
    unit = "image" if frames == 1 else "video"
    return [Figure(f"c1 s/{unit}", "c1_s"), Figure(f"c{BURST} s/{unit}", "c4_s")]


def image_gen(args: Any) -> Path:
    import torch

    out = results_dir(args.out)
    folder = Path(args.model) if args.model else ensure_checkpoint(args.quick, args.family)
    reference_name, serve = FAMILIES[args.family][2], FAMILIES[args.family][3]
    # one torch thread count for both: the worker's default (MSTAR_TORCH_THREADS), the reference's own
    torch.set_num_threads(args.threads)
    print(f"starting mstar serve ({args.threads} torch threads, as the reference) ...", file=sys.stderr)
    server = MstarServer(str(folder), out / "logs" / "mstar.log", [*serve, *args.serve_arg],
                         env={"MSTAR_TORCH_THREADS": str(args.threads)}).start()
    ref = (BagelReference if args.family == "bagel" else Reference)(folder, args)
    route = "/v1/images/generations" if args.frames == 1 else video_job
    try:
        warm = bodies(args, 1, 1)
        http_round(server.url, route, *warm)
        ref.one(warm[0][0])
        runs = alternate({"mstar": lambda: per_image(http_round(server.url, route, *bodies(args, args.c1_images,
                                                                                          args.bursts))),
                          reference_name: lambda: per_image(serial_round(ref.one, *bodies(args, args.c1_images,
                                                                                           args.bursts)))},
                         args.rounds, "c1_s")
    finally:
        server.stop()
    saving = ref.text_pass() if isinstance(ref, BagelReference) else text_kv_saving(folder, ref)
    print("text K/V kept, per step and branch: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                            for k, v in saving.items()))
    frames = f", {args.frames} frames" if args.frames > 1 else ""
    title = f"random {args.family} {folder.name}, {args.size}{frames}, {args.steps} steps, CFG {args.guidance}"
    return report(out, runs, figures(args.frames), reference_name, title,
                  {"mode": "image_gen", "args": vars(args), "model": str(folder), "text_kv": saving})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.image_gen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=tuple(FAMILIES), default="cosmos3",
                   help="Cosmos 3 against diffusers (default), or BAGEL against bagel2")
    p.add_argument("--quick", action="store_true", help="the tests' tiny transformer, one round (a smoke run)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 2; --quick: 1)")
    p.add_argument("--c1-images", type=int, default=None, help="c1 images a round (default 4; --quick: 2)")
    p.add_argument("--bursts", type=int, default=None, help=f"bursts of {BURST} a round (default 2; --quick: 1)")
    p.add_argument("--size", default=None, help="WxH, multiples of 16 (default 64x64; BAGEL 128x128)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--frames", type=int, default=1,
                   help="frames a sample: 1 images (default), N > 1 videos through /v1/videos (Cosmos 3 only)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default 6; BAGEL 4)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the worker and of the reference (default: the worker's, CPUs - 1)")
    p.add_argument("--model", default="", help="a folder of the family (default: the cached bench one)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `mstar serve` flag (repeat)")
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.frames < 1 or (args.frames > 1 and args.family != "cosmos3"):
        p.error("--frames: at least 1, and above 1 (video) for --family cosmos3 only")
    fill_defaults(args, (("rounds", 2, 1), ("c1_images", 4, 2), ("bursts", 2, 1)), threads=True)
    size, guidance = FAMILIES[args.family][:2]
    args.size, args.guidance = args.size or size, args.guidance if args.guidance is not None else guidance
    image_gen(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
