"""Quantized GEMM (layers/quant.QuantLinear, kernels/qgemm.c) time per call at 1, 16, 128 rows
and 1 vs 2 (or given) threads, on the default model's shapes (Q4_1 layers, Q8_0 LM head).

Thread counts are interleaved round by round (each round: every shape, rows and thread count,
the median of `--calls` back-to-back calls), so a noisy shared machine biases none of them;
the table gives each cell's median over the rounds and its spread (min-max of the rounds).
`--busy N` starts N busy-loop processes for the run (contention: does the pool degrade to one
thread's speed when a core is taken?). `--kernels DIR` builds the kernels from another folder
(e.g. an older qgemm.c, with today's pool.c beside it so the library loads) for before/after.
The line above the table gives the other processes' CPU use during the run: on a shared
machine, compare runs made in like conditions.

    .venv/bin/python bench/qgemm_threads.py [--threads 1 2] [--rounds 7] [--busy 1] [--kernels DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from services.gpu_worker import cpu_kernels
from services.gpu_worker.layers import quant

SHAPES = [("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576)]


def layer(qtype: str, n: int, k: int, rng) -> quant.QuantLinear:
    raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType[qtype])
    return quant.QuantLinear.from_gguf(qtype, raw, (n, k))


def cpu_busy() -> float:
    """CPU-seconds the whole machine has spent busy (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--shapes", type=int, nargs="+", help="indexes into SHAPES")
    ap.add_argument("--kernels", help="build the kernels from this folder instead (e.g. an older qgemm.c)")
    a = ap.parse_args()
    if a.kernels:
        cpu_kernels.SOURCE_DIR = Path(a.kernels)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    shapes = [SHAPES[i] for i in a.shapes] if a.shapes else SHAPES
    layers = [(s, layer(*s, rng)) for s in shapes]
    xs = {(r, k): torch.randn(r, k) for r in a.rows for k in {s[2] for s in shapes}}
    busy = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(a.busy)]
    times: dict[tuple, list[float]] = {}
    busy0, own0, wall0 = cpu_busy(), time.process_time(), time.monotonic()
    try:
        time.sleep(0.2 if busy else 0)
        with torch.inference_mode():
            for _ in range(a.rounds):
                for rows in a.rows:
                    for nt in a.threads:
                        quant.set_threads(nt)
                        for s, lin in layers:
                            x = xs[(rows, s[2])]
                            for _ in range(3):
                                lin(x)
                            ts = []
                            for _ in range(a.calls):
                                t = time.perf_counter()
                                lin(x)
                                ts.append(time.perf_counter() - t)
                            times.setdefault((rows, s, nt), []).append(statistics.median(ts))
    finally:
        for p in busy:
            p.kill()
    others = (cpu_busy() - busy0 - (time.process_time() - own0)) / (time.monotonic() - wall0)
    print(f"us per call: median of {a.rounds} rounds [min-max] (each round the median of {a.calls} calls)"
          + (f", {a.busy} busy-loop process(es)" if a.busy else "")
          + f"; other processes used {others:.2f} of {len(os.sched_getaffinity(0))} CPUs meanwhile")
    lib = cpu_kernels.library()
    if hasattr(lib, "mstar_pool_stats"):
        st = (ctypes.c_int64 * 4)()
        lib.mstar_pool_stats(st)
        print(f"pool: {st[0]} jobs, {st[1]} tasks, {st[2] / max(1, st[1]):.0%} of them run by workers, "
              f"{st[3]} wakes")
    for rows in a.rows:
        for s, _ in layers:
            cells = []
            for nt in a.threads:
                r = times[(rows, s, nt)]
                cells.append(f"{nt}t {statistics.median(r) * 1e6:7.0f} [{min(r) * 1e6:.0f}-{max(r) * 1e6:.0f}]")
            base = statistics.median(times[(rows, s, a.threads[0])])
            ratio = " ".join(f"{base / statistics.median(times[(rows, s, nt)]):.2f}x" for nt in a.threads[1:])
            print(f"rows {rows:4d} {s[0]} {s[1]:5d}x{s[2]:<5d} " + " | ".join(cells) + f"  speedup {ratio}")


if __name__ == "__main__":
    main()
