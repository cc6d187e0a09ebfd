"""The quantized GEMM (kernels/qgemm.c) of two kernel classes side by side in one process: the
AVX-512 VNNI path and the AVX2 one (`-march=x86-64-v3`, what `MSTAR_CPU_CLASS=avx2` builds),
on the same repacked weights, calls alternated round by round so a noisy shared machine biases
neither.

Per GGUF type: the results' bits compared between the classes (the AVX2 path is meant to give
the AVX-512 path's bits), then a decode GEMV (one row) as GB/s of the weight's bytes (w, d, m:
what a decode step streams) and a prompt GEMM (`--prompt` rows) as GFLOP/s, each the median
of `--rounds` rounds [min-max] (a round: the median of `--calls` calls); beside them the
machine's streaming-read floor (bench/bandwidth.measure, every core). Only qgemm.c and pool.c
are built, into a temporary folder, so the kernels others are editing do not matter.

    .venv/bin/python -m bench.qgemm_classes [--types Q4_1 Q4_K Q6_K Q8_0] [--n 8192 --k 4096]
        [--rounds 7] [--threads 2] [--prompt 512] [--cpu-time]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench import bandwidth
from services.gpu_worker import cpu_kernels
from services.gpu_worker.layers import quant
from tests.unit.test_quant import random_blocks

#: the classes compared and their flags (cpu_kernels.CLASS_FLAGS)
CLASSES = ("avx512", "avx2")

#: the clock timings read: wall time, or with --cpu-time the calling thread's CPU time (one thread
#: on a shared host: time the thread spends descheduled does not count)
CLOCK = time.perf_counter


def build(cls: str, folder: Path) -> ctypes.CDLL:
    """qgemm.c and pool.c built for `cls` into folder (kept where it is newer than both)."""
    src = cpu_kernels.SOURCE_DIR
    out = folder / f"qgemm-{cls}.so"
    cc = shutil.which("cc") or "gcc"
    newest = max((src / f).stat().st_mtime for f in ("qgemm.c", "pool.c", "pool.h"))
    if not out.exists() or out.stat().st_mtime < newest:
        subprocess.run([cc, "-O3", "-fopenmp", "-shared", "-fPIC", *cpu_kernels.CLASS_FLAGS[cls], "-o", str(out),
                        str(src / "qgemm.c"), str(src / "pool.c"), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.mstar_qgemm_available.restype = i64
    lib.mstar_qlinear_scratch.restype = i64
    lib.mstar_qlinear_scratch.argtypes = [i64, i64]
    lib.mstar_qlinear.restype = ctypes.c_int
    lib.mstar_qlinear.argtypes = [ctypes.c_int, ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64,
                                  ctypes.c_int, ptr]
    assert lib.mstar_qgemm_available() == 1, cls
    return lib


def layer(qtype: str, n: int, k: int, seed: int) -> quant.QuantLinear:
    """random valid blocks (the `gguf` package cannot quantize the k-quants)"""
    return quant.QuantLinear.from_gguf(qtype, random_blocks(qtype, n, k, seed), (n, k))


def weight_bytes(lin: quant.QuantLinear) -> int:
    return sum(t.numel() * t.element_size() for t in (lin.w, lin.d, lin.m) if t is not None)


class Call:
    """One library's mstar_qlinear on a layer (the next of `layers` each call: together more
    than the caches hold, a decode step's stream from memory) and x, into its own output."""

    def __init__(self, lib: ctypes.CDLL, layers: list[quant.QuantLinear], x: torch.Tensor, threads: int,
                 xbytes: int = 2):
        self.lib, self.layers, self.x, self.threads, self.xbytes = lib, layers, x, threads, xbytes
        self.out = torch.empty(x.shape[0], layers[0].out_features)
        self.scratch = torch.empty(lib.mstar_qlinear_scratch(x.shape[0], layers[0].in_features), dtype=torch.uint8)
        self.at = 0

    def __call__(self) -> None:
        lin, x = self.layers[self.at], self.x
        self.at = (self.at + 1) % len(self.layers)
        rc = self.lib.mstar_qlinear(lin.form, self.xbytes, x.data_ptr(), x.shape[0], lin.in_features, x.stride(0),
                                    lin.w.data_ptr(), lin.d.data_ptr(), None if lin.m is None else lin.m.data_ptr(),
                                    lin.out_features, None, self.out.data_ptr(), lin.out_features, self.threads,
                                    self.scratch.data_ptr())
        assert rc == 0


def timed(calls: dict[str, Call], rounds: int, n: int) -> dict[str, list[float]]:
    """Seconds per call, per class: rounds alternated, each the median of n calls."""
    times: dict[str, list[float]] = {c: [] for c in calls}
    for r in range(rounds):
        for cls in (CLASSES if r % 2 == 0 else CLASSES[::-1]):
            call = calls[cls]
            for _ in range(len(call.layers) + 2):
                call()
            ts = []
            for _ in range(n):
                t0 = CLOCK()
                call()
                ts.append(CLOCK() - t0)
            times[cls].append(statistics.median(ts))
            time.sleep(0.002)  # the other pool's workers back asleep
    return times


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):6.1f} [{min(values):.1f}-{max(values):.1f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.qgemm_classes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", nargs="+", default=["Q4_1", "Q4_K", "Q6_K", "Q8_0"])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8, help="decode GEMV layers cycled (8 of 4096 x 4096: 70-140 MB)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true", help="time by the thread's CPU time (use with --threads 1)")
    ap.add_argument("--prompt", type=int, default=512, help="rows of the prompt GEMM (0: none)")
    ap.add_argument("--prompt-n", type=int, default=2048, help="columns of the prompt GEMM")
    ap.add_argument("--libs", help="build into (and reuse from) this folder, not a temporary one")
    a = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time if a.cpu_time else time.perf_counter
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {c: build(c, Path(a.libs or tmp)) for c in CLASSES}
        floor = bandwidth.measure(1.0) / 1e9
        print(f"streaming-read floor (bench/bandwidth.measure, every core): {floor:.1f} GB/s; {a.threads} threads")
        print("type   decode GEMV GB/s (us) median [min-max]: avx512 | avx2        "
              f"prompt {a.prompt} rows GFLOP/s: avx512 | avx2   bits")
        for i, qtype in enumerate(a.types):
            lins = [layer(qtype, a.n, a.k, seed=100 * i + j) for j in range(a.layers)]
            x = torch.randn(1, a.k)
            calls = {c: Call(libs[c], lins, x, a.threads) for c in CLASSES}
            t = timed(calls, a.rounds, a.calls)
            same = torch.equal(calls["avx512"].out, calls["avx2"].out)
            gbs = {c: [weight_bytes(lins[0]) / s / 1e9 for s in t[c]] for c in CLASSES}
            line = (f"{qtype:6s} {cell(gbs['avx512'])} ({statistics.median(t['avx512']) * 1e6:.0f}) | "
                    f"{cell(gbs['avx2'])} ({statistics.median(t['avx2']) * 1e6:.0f})")
            if a.prompt:
                small = layer(qtype, a.prompt_n, a.k, seed=100 + i)
                xp = torch.randn(a.prompt, a.k)
                pcalls = {c: Call(libs[c], [small], xp, a.threads) for c in CLASSES}
                pt = timed(pcalls, max(3, a.rounds // 2), 2)
                same = same and torch.equal(pcalls["avx512"].out, pcalls["avx2"].out)
                flop = 2.0 * a.prompt * a.prompt_n * a.k
                line += (f"   {cell([flop / s / 1e9 for s in pt['avx512']])} | "
                         f"{cell([flop / s / 1e9 for s in pt['avx2']])}")
            print(line + f"   {'same' if same else 'DIFFER'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
