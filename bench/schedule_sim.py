"""The real scheduler in a simulated closed loop, with a known step-cost model.

    python -m bench.schedule_sim [-c 16 64] [--target-ms 30] [--budget 2048] [--jitter-ms 15]
    python -m bench.schedule_sim -c 4 -n 64 --target-ms 15 100 --budget 2048 --prompt-len 2048 \
        --output-len 128 --c0-ms 6 --row-ms 0.25 --sample-ms 0.3 --key-ms 0.1 --jitter-ms 5

No model runs: a step takes `c0 + row * rows + sample * sampled + key * keys / 1024`
(defaults fitted to the bench checkpoint on this machine: a 16-row decode step ~16 ms, a
prompt row ~0.25 ms) times a random +-10%, and `concurrency` clients send their next
request `jitter` after the last one ends (uniform in [2 ms, --jitter-ms]). It isolates the
scheduling policy from the machine's noise: the same seed gives the same figures, so
policies (the time target, the token budget) can be compared exactly. It also runs a
vLLM-like policy (no time target, token budget 2048), which in this closed loop of equal
lengths prefills each wave of prompts in one step while nobody decodes.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics

import numpy as np

from services.gpu_worker.request import Request
from services.gpu_worker.scheduler import Limits, Scheduler
from services.gpu_worker.step_costs import StepCosts, StepShape
from shared.frames import SamplingParams


class _FreeKV:
    """Admission always fits (the bench's pool does), nothing to release."""

    def can_admit(self, kv) -> bool:
        return True

    def admit(self, kv) -> int:
        return 0

    def remove(self, request_id: str, ran_to_caps: bool = False) -> int:
        return 0


def simulate(args, concurrency: int, n: int, target_ms: float, budget: int, seed: int) -> dict:
    rng = random.Random(seed)
    coef = (args.c0_ms / 1e3, args.row_ms / 1e3, args.sample_ms / 1e3, args.key_ms / 1e3)

    def cost(s: StepShape) -> float:
        return coef[0] + coef[1] * s.rows + coef[2] * s.sampled + coef[3] * s.keys / 1024

    s = Scheduler(_FreeKV(), Limits(256, budget, 1 << 20, None, target_ms / 1e3), ("decode_loop",))
    s.costs = StepCosts()
    for _ in range(50):  # warm-up: the cost model learns the true costs
        shape = StepShape(rng.randint(1, 500), rng.randint(1, 40), rng.randint(0, 60000))
        s.costs.observe(shape, cost(shape))
    s.costs.anchor()
    jitter = (0.002, max(0.002, args.jitter_ms / 1e3))
    t, sent, done = 0.0, concurrency, 0
    arrivals = sorted((rng.uniform(*jitter), i) for i in range(concurrency))
    times: dict[str, tuple[float, list[float]]] = {}
    out_len = args.output_len
    while done < n:
        if not s.running and not s.waiting:
            t = max(t, arrivals[0][0])
        while arrivals and arrivals[0][0] <= t:
            at, i = arrivals.pop(0)
            r = Request(f"r{i}", "", SamplingParams(temperature=0.0), out_len, {"decode_loop": out_len - 1},
                        [1] * args.prompt_len, None, None, iters={"decode_loop": 0})
            s.add(r)
            times[r.request_id] = (at, [])
        s.admit()
        plan = s.schedule()
        dt = cost(plan.shape) * (1 + rng.uniform(-0.1, 0.1))
        t += dt
        s.observe(plan, dt)
        for e in plan.entries:
            r = e.request
            r.num_computed += e.rows
            if r.num_computed >= r.tokens_len:
                r.output.append(1)
                times[r.request_id][1].append(t)
            if len(r.output) >= out_len:
                s.remove(r.request_id)
                done += 1
                if sent < n:
                    arrivals.append((t + rng.uniform(*jitter), sent))
                    arrivals.sort()
                    sent += 1
    return _summary([v for v in times.values() if len(v[1]) == out_len], out_len, args.gap_ms / 1e3)


def _summary(reqs: list[tuple[float, list[float]]], out_len: int, gap: float) -> dict:
    itl = [b - a for _, toks in reqs for a, b in itertools.pairwise(toks)]
    return {
        "out tok/s": out_len * len(reqs) / max(toks[-1] for _, toks in reqs),
        "TTFT p50": statistics.median(toks[0] - at for at, toks in reqs) * 1e3,
        "TPOT p50": statistics.median((toks[-1] - toks[0]) / (out_len - 1) for _, toks in reqs) * 1e3,
        "ITL p50": float(np.percentile(itl, 50)) * 1e3,
        "ITL p99": float(np.percentile(itl, 99)) * 1e3,
        "gaps": sum(x > gap for x in itl),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.schedule_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", "-c", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--num-requests", "-n", type=int, default=None, help="default max(192, 4 x concurrency)")
    ap.add_argument("--target-ms", type=float, nargs="+", default=[0.0, 30.0], help="mstar's --itl-target-ms values")
    ap.add_argument("--budget", type=int, nargs="+", default=[512, 2048], help="mstar's --max-batch-tokens values")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--jitter-ms", type=float, default=15.0)
    ap.add_argument("--c0-ms", type=float, default=4.0)
    ap.add_argument("--row-ms", type=float, default=0.25)
    ap.add_argument("--sample-ms", type=float, default=0.5)
    ap.add_argument("--key-ms", type=float, default=0.02, help="per 1024 attention keys")
    ap.add_argument("--seeds", type=int, default=3, help="median over this many seeds")
    ap.add_argument("--gap-ms", type=float, default=200.0, help="count the inter-token gaps longer than this")
    args = ap.parse_args(argv)
    policies = [("vLLM-like (no target, budget 2048)", 0.0, 2048)]
    policies += [(f"target {t:g} ms, budget {b}", t, b) for t in args.target_ms for b in args.budget]
    for c in args.concurrency:
        n = args.num_requests or max(192, 4 * c)
        print(f"\nc{c}, {n} requests, prompt {args.prompt_len}, output {args.output_len}, "
              f"jitter <= {args.jitter_ms:g} ms")
        names = ["out tok/s", "TTFT p50", "TPOT p50", "ITL p50", "ITL p99", f"gaps > {args.gap_ms:g} ms"]
        print(f"| policy | {' | '.join(names)} |")
        print("|---|" + "---:|" * len(names))
        for name, target, budget in policies:
            runs = [simulate(args, c, n, target, budget, seed) for seed in range(args.seeds)]
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            cells = [f"{v:,.0f}" if k == "gaps" else f"{v:,.1f}" for k, v in row.items()]
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
