"""`python -m bench.world`: a V-JEPA 2-AC world model served by mstar's `POST /v1/world/rollout`
against the reference's autoregressive rollout called one request at a time (`cc-vjepa2`'s
encoder and AC predictor stepped as Meta's training code does, tests/world_checkpoints.py:
each step runs the predictor over every frame so far; mstar keeps each step's K/V and runs
only the new frame's rows).

The checkpoint: a random V-JEPA 2-AC of a realistic-but-small shape: the real model's
layout (RoPE video ViT encoder, each context frame its own tubelet; the AC predictor with
an action and a state row per frame, 7-dim actions, 16 predictor frames = 8 steps at most)
at 128 px with 16 px patches (64 rows a frame; the real one: 256 px, 256 rows), encoder
4 x 256 (4 heads; the real one ViT-g, 40 x 1408), predictor 6 x 384 (6 heads; the real
one 24 x 1024). `--quick`: the e2e tests' tiny shape. Made once, cached beside the other
bench checkpoints. Random weights: speed only (the e2e tests check the values).

Each request: 2 context frames (PNG data URLs) and 6 steps, a fresh clip each (so both
systems encode it). Figures, rounds alternating the two systems (medians, per-round ratios):
- c1 rollout (ms) and rollout steps/s: one request at a time;
- c4 and c16 steps/s: bursts of 4 (of 16) requests at once (mstar batches their steps;
  the reference serves them one after another), the bursts' steps over their wall time;
- 8 rollouts of one clip (s): a planner's candidates from one clip, the first alone and 7
  at once (mstar encodes the clip once and keeps it; the reference encodes it each time);
  mstar's same 8 over 8 different clips, right after it in the same round, is in the JSON
  and printed (the clip cache's effect: the encoder's share of a rollout, small at this
  shape, whose encoder is 4 x 256 against a 6 x 384 predictor; V-JEPA 2-AC's ViT-g encoder
  outweighs its predictor).
Both run torch on the same threads (`--threads`, default the worker's: CPUs - 1).

    python -m bench.world                       # two rounds on the bench shape
    python -m bench.world --quick --out /tmp/w  # a smoke run
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.checkpoints import cache_dir
from bench.report import results_dir
from bench.rounds import Timings, alternate, fill_defaults, http_round, serial_round
from bench.server import MstarServer
from bench.side_by_side import Figure, report

ENCODER = {"img_size": 128, "patch_size": 16, "tubelet_size": 2, "embed_dim": 256, "depth": 4, "num_heads": 4,
           "mlp_ratio": 4.0, "use_silu": False, "wide_silu": True, "use_rope": True}
PREDICTOR = {"predictor_embed_dim": 384, "depth": 6, "num_heads": 6, "mlp_ratio": 4.0, "num_frames": 16,
             "action_embed_dim": 7, "use_silu": True, "wide_silu": True, "use_extrinsics": False}
FRAMES, STEPS, SEED = 2, 6, 0
BURSTS = (4, 16)
_clips = itertools.count()  # every body's clip is new unless given


def shapes(quick: bool) -> tuple[dict, dict, str]:
    from tests import world_checkpoints as wc

    return (wc.ENCODER, wc.PREDICTOR, "vjepa2ac-tiny-v1") if quick else (ENCODER, PREDICTOR, "vjepa2ac-4x256-6x384-v1")


def ensure_checkpoint(quick: bool) -> Path:
    from tests.world_checkpoints import make_world_checkpoint

    encoder, predictor, name = shapes(quick)
    path = cache_dir() / name
    if not (path / "model.safetensors").exists():
        make_world_checkpoint(path, SEED, encoder, predictor)
    return path


def body(size: int, clip: int | None = None, seed: int = 0) -> dict:
    """FRAMES noisy gradient frames (a photograph's PNG size) of clip `clip` (a new one by
    default), the actions and states of `seed`."""
    import numpy as np
    from PIL import Image

    clip = next(_clips) if clip is None else clip
    rng = np.random.default_rng(clip)
    y, x = np.mgrid[0:size, 0:size]
    urls = []
    for i in range(FRAMES):
        base = np.stack([(x * (2 + i) + clip) % 256, (y * 3) % 256, (x + y) % 256], axis=-1)
        buf = io.BytesIO()
        Image.fromarray(np.clip(base + rng.integers(0, 8, base.shape), 0, 255).astype(np.uint8)).save(buf, "PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    act = np.random.default_rng(10_000 + seed).normal(size=(2, FRAMES + STEPS - 1, 7)).round(4)
    return {"frames": urls, "actions": act[0].tolist(), "states": act[1].tolist(), "steps": STEPS}


class Reference:
    """The reference rollout on the body's decoded frames, its models built once."""

    def __init__(self, quick: bool) -> None:
        from tests.world_checkpoints import reference_models

        encoder, predictor, _ = shapes(quick)
        self.models = reference_models(SEED, encoder, predictor)

    def one(self, payload: dict) -> None:
        import numpy as np
        from PIL import Image

        from tests.world_checkpoints import rollout

        frames = [np.asarray(Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB"))
                  for u in payload["frames"]]
        rollout(*self.models, frames, np.asarray(payload["actions"], np.float32),
                np.asarray(payload["states"], np.float32), payload["steps"])


def figures(size: int, run: Any, args: Any, eight_clips: bool = False) -> dict:
    """One round of one system: `run(c1_bodies, bursts)` -> Timings; with `eight_clips`
    (mstar's) also the one-clip eight's layout over 8 different clips, right after it."""
    out: dict[str, Any] = {}
    for n in BURSTS:
        t: Timings = run([body(size) for _ in range(args.c1_requests)] if n == BURSTS[0] else [],
                         [[body(size) for _ in range(n)] for _ in range(args.bursts)])
        if t.c1:
            out |= {"c1_s": statistics.median(t.c1), "c1_steps_s": STEPS * len(t.c1) / t.c1_wall}
        out[f"c{n}_steps_s"] = STEPS * len(t.burst) / t.burst_wall
    clip = next(_clips)
    one_clip = run([body(size, clip, 0)], [[body(size, clip, s) for s in range(1, 8)]])
    out["one_clip_8_s"] = one_clip.c1_wall + one_clip.burst_wall
    if eight_clips:
        t = run([body(size)], [[body(size) for _ in range(7)]])
        out["eight_clips_8_s"] = t.c1_wall + t.burst_wall
    return out


FIGURES = [Figure("c1 rollout (ms)", "c1_s", 1e3), Figure("c1 steps/s", "c1_steps_s", higher_is_better=True),
           *(Figure(f"c{n} steps/s", f"c{n}_steps_s", higher_is_better=True) for n in BURSTS),
           Figure("8 rollouts of one clip (s)", "one_clip_8_s")]


def world(args: Any) -> Path:
    import torch

    out = results_dir(args.out)
    folder = ensure_checkpoint(args.quick)
    size = shapes(args.quick)[0]["img_size"]
    torch.set_num_threads(args.threads)
    print(f"starting mstar serve ({args.threads} torch threads, as the reference) ...", file=sys.stderr)
    server = MstarServer(str(folder), out / "logs" / "mstar.log", list(args.serve_arg),
                         env={"MSTAR_TORCH_THREADS": str(args.threads)}).start()
    ref = Reference(args.quick)

    def ours(c1: list[dict], bursts: list[list[dict]]) -> Timings:
        return http_round(server.url, "/v1/world/rollout", c1, bursts)

    def theirs(c1: list[dict], bursts: list[list[dict]]) -> Timings:
        return serial_round(ref.one, c1, bursts)

    try:
        ours([body(size)], [[body(size) for _ in range(4)]])  # warm both (a burst: the batched path)
        ref.one(body(size))
        runs = alternate({"mstar": lambda: figures(size, ours, args, eight_clips=True),
                          "reference": lambda: figures(size, theirs, args)}, args.rounds, "c1_s")
    finally:
        server.stop()
    one_clip, eight = (statistics.median(r[k] for r in runs["mstar"]) for k in ("one_clip_8_s", "eight_clips_8_s"))
    cache = {"mstar_8_rollouts_8_clips_s": eight, "mstar_8_rollouts_one_clip_s": one_clip,
             "clip_cache_saves": 1 - one_clip / eight}
    print("clip cache: " + ", ".join(f"{k} {v:.3f}" for k, v in cache.items()))
    title = (f"random V-JEPA 2-AC {folder.name}, {FRAMES} frames of {size} px + {STEPS} steps")
    return report(out, runs, FIGURES, "reference", title,
                  {"mode": "world", "args": vars(args), "model": str(folder), "clip_cache": cache,
                   "shape": dict(zip(("encoder", "predictor"), shapes(args.quick)[:2]))})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.world", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tests' tiny shape, one round (a smoke run)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 2; --quick: 1)")
    p.add_argument("--c1-requests", type=int, default=None, help="c1 rollouts a round (default 4; --quick: 2)")
    p.add_argument("--bursts", type=int, default=1, help="bursts of each size a round (default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the worker and of the reference (default: the worker's, CPUs - 1)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `mstar serve` flag (repeat)")
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    fill_defaults(args, (("rounds", 2, 1), ("c1_requests", 4, 2)), threads=True)
    world(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
