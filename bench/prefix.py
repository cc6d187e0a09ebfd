"""Prefix-cache TTFT: a long prompt cold vs repeated, in one run on one server.

    python -m bench.prefix [--model ''] [--prompt-len 1000] [--trials 3] [--out DIR]

Cold prompts are fresh random token ids each trial (nothing to share); the warm prompt is
one prompt sent again after a first (cold) pass, so all its full pages but the last row
come from the cache. TTFT is measured like a client: from sending the streaming request
to its first delta. Prints a table, writes JSON and a PNG; the ratio is what to quote.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.server import REPO, MstarServer


def ttft(client: httpx.Client, ids: list[int]) -> float:
    t0 = time.perf_counter()
    with client.stream("POST", "/generate", json={"input_ids": ids, "max_tokens": 2, "temperature": 0,
                                                  "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and json.loads(line[5:])["type"] == "delta":
                return time.perf_counter() - t0
    raise RuntimeError("no delta")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="'' = the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / time.strftime("prefix-%Y%m%d-%H%M%S"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    vocab = 40000 if not args.model else 250

    def prompt() -> list[int]:
        return [rng.randint(100, vocab) for _ in range(args.prompt_len)]

    server = MstarServer(args.model, args.out / "server.log",
                         ["--num-kv-pages", "1024", "--max-batch-tokens", "2048"]).start()
    try:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            ttft(client, prompt())  # warm the kernels up at this length
            cold = [ttft(client, prompt()) for _ in range(args.trials)]
            repeated = prompt()
            ttft(client, repeated)
            warm = [ttft(client, repeated) for _ in range(args.trials)]
            metrics = client.get("/metrics").text
    finally:
        server.stop()
    hits = next((float(ln.split()[-1]) for ln in metrics.splitlines()
                 if ln.startswith("mstar_prefix_cache_hit_tokens_total")), 0.0)
    result = {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "prompt_len": args.prompt_len,
              "cold_ttft_s": cold, "warm_ttft_s": warm, "cold_median_s": statistics.median(cold),
              "warm_median_s": statistics.median(warm), "ratio": statistics.median(warm) / statistics.median(cold),
              "hit_tokens_total": hits}
    print(f"{'prompt':<10}{'TTFT p50 (s)':>14}{'trials':>40}")
    print(f"{'cold':<10}{result['cold_median_s']:>14.3f}{[round(x, 3) for x in cold]!s:>40}")
    print(f"{'repeated':<10}{result['warm_median_s']:>14.3f}{[round(x, 3) for x in warm]!s:>40}")
    print(f"repeated / cold TTFT: {result['ratio']:.3f}x  ({args.prompt_len}-token prompt, hit tokens {hits:.0f})")
    (args.out / "prefix.json").write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(["cold", "repeated"], [result["cold_median_s"], result["warm_median_s"]], color=["tab:orange", "tab:blue"])
    ax.set(ylabel="TTFT p50 (s)", title=f"{args.prompt_len}-token prompt: {result['ratio']:.2f}x")
    fig.tight_layout()
    fig.savefig(args.out / "prefix.png", dpi=110)
    print(f"wrote {args.out / 'prefix.json'} and {args.out / 'prefix.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
