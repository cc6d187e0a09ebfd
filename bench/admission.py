"""Admission by footprint vs a max_seq_len reservation, on the same mixed workload.

    python -m bench.admission [--requests 96] [--pages 256] [--max-seq-len 1024] [--out DIR]

Starts `mstar serve` twice on the same small checkpoint and pool, once per admission mode
(`--admission footprint`, `--admission max-seq-len`: what a server that cannot know
footprints must reserve never to preempt), sends the same requests (random prompt and
output lengths, sampled so some stop early on EOS) all at once, and samples /metrics to
report admitted concurrency, throughput and peak pages. Prints a table, writes JSON and
a PNG plot. Both modes run in one invocation, so the ratio is what to quote.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.server import REPO, MstarServer

GAUGES = ("mstar_requests_running", "mstar_requests_waiting", "mstar_kv_pages_used", "mstar_kv_pages_reserved",
          "mstar_kv_pages_peak")


def _checkpoint(cache: Path) -> Path:
    path = cache / "admission-llama"
    if not (path / "config.json").exists():
        sys.path.insert(0, str(REPO))
        from tests.checkpoints import make_checkpoint

        make_checkpoint(path, "llama", max_position_embeddings=2048, hidden_size=128, intermediate_size=256)
    return path


def workload(n: int, seed: int, max_seq_len: int) -> list[dict]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = rng.randint(16, 192)
        out = rng.randint(16, min(320, max_seq_len - prompt))
        ids = [rng.randint(3, 250) for _ in range(prompt)]
        reqs.append({"input_ids": ids, "max_tokens": out, "temperature": 1.0, "seed": i, "request_id": f"adm-{i}"})
    return reqs


def _gauges(text: str) -> dict[str, float]:
    out = {}
    for name in GAUGES:
        vals = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)]
        out[name] = sum(vals)
    return out


async def run_mode(server: MstarServer, reqs: list[dict]) -> dict:
    samples: list[tuple[float, dict[str, float]]] = []
    stop = asyncio.Event()

    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        async def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic(), _gauges((await client.get("/metrics")).text)))
                await asyncio.sleep(0.05)

        sampler = asyncio.ensure_future(sample())
        t0 = time.monotonic()
        rs = await asyncio.gather(*(client.post("/generate", json=r) for r in reqs))
        elapsed = time.monotonic() - t0
        stop.set()
        await sampler
        final = _gauges((await client.get("/metrics")).text)
    bodies = [r.json() for r in rs]
    statuses = [r.status_code for r in rs]
    errors = [b for r, b in zip(rs, bodies) if r.status_code != 200]
    if errors:
        print(f"{len(errors)} request(s) failed, e.g. {errors[0]}", file=sys.stderr)
    tokens = sum(len(b.get("token_ids", [])) for b in bodies)
    running = [g["mstar_requests_running"] for _, g in samples]
    # Time-weighted mean of the sampled running count.
    mean_running = (sum(g["mstar_requests_running"] * (t2 - t1) for (t1, g), (t2, _) in itertools.pairwise(samples))
                    / max(1e-9, samples[-1][0] - samples[0][0]))
    return {
        "requests": len(reqs),
        "ok": statuses.count(200),
        "stopped_early": sum(1 for b in bodies if b.get("finish_reason") == "stop"),
        "output_tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_per_s": round(tokens / elapsed, 1),
        "max_running": max(running),
        "mean_running": round(mean_running, 2),
        "max_waiting": max(g["mstar_requests_waiting"] for _, g in samples),
        "peak_pages": final["mstar_kv_pages_peak"],
        "max_pages_reserved": max(g["mstar_kv_pages_reserved"] for _, g in samples),
        "series": [(round(t - samples[0][0], 3), g["mstar_requests_running"], g["mstar_kv_pages_used"])
                   for t, g in samples],
    }


def plot(results: dict[str, dict], pages: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, r in results.items():
        t = [s[0] for s in r["series"]]
        a.plot(t, [s[1] for s in r["series"]], label=mode)
        b.plot(t, [s[2] for s in r["series"]], label=mode)
    a.set(title="requests running", xlabel="s")
    b.axhline(pages, color="grey", linestyle="--", label="pool")
    b.set(title="KV pages used", xlabel="s")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / time.strftime("admission-%Y%m%d-%H%M%S"))
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "mstar-bench")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    model = _checkpoint(args.cache)
    reqs = workload(args.requests, args.seed, args.max_seq_len)
    common = ["--num-kv-pages", str(args.pages), "--page-size", str(args.page_size),
              "--max-seq-len", str(args.max_seq_len), "--max-num-seqs", "256"]
    results = {}
    for mode in ("footprint", "max-seq-len"):
        server = MstarServer(str(model), args.out / f"{mode}.log", [*common, "--admission", mode]).start()
        try:
            results[mode] = asyncio.run(run_mode(server, reqs))
        finally:
            server.stop()
    fp, base = results["footprint"], results["max-seq-len"]
    ratios = {
        "admitted_concurrency_max": round(fp["max_running"] / max(1, base["max_running"]), 2),
        "admitted_concurrency_mean": round(fp["mean_running"] / max(1e-9, base["mean_running"]), 2),
        "throughput": round(fp["output_tok_per_s"] / max(1e-9, base["output_tok_per_s"]), 2),
    }
    cols = ["ok", "stopped_early", "output_tokens", "elapsed_s", "output_tok_per_s", "max_running", "mean_running",
            "max_waiting", "peak_pages", "max_pages_reserved"]
    print(f"{'admission':<12}" + "".join(f"{c:>19}" for c in cols))
    for mode, r in results.items():
        print(f"{mode:<12}" + "".join(f"{r[c]:>19}" for c in cols))
    print(f"pool {args.pages} pages x {args.page_size} rows, max_seq_len {args.max_seq_len}, {args.requests} requests")
    print("footprint / max-seq-len: " + ", ".join(f"{k} {v}x" for k, v in ratios.items()))
    (args.out / "admission.json").write_text(json.dumps(
        {"config": vars(args) | {"out": str(args.out), "cache": str(args.cache)}, "results": results, "ratios": ratios},
        indent=1))
    plot(results, args.pages, args.out / "admission.png")
    print(f"wrote {args.out / 'admission.json'} and {args.out / 'admission.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
