"""The float kernels built for each x86 kernel class, timed side by side in one process.

    python -m bench.kernel_classes [--classes avx512 avx2] [--reps 7] [--threads 1 2] [--cpu-time]

Builds kernels/*.c once per class (cpu_kernels.build() under MSTAR_CPU_CLASS; an AVX-512
host builds and runs the avx2 class too), loads each shared object, and times the same
calls on each in turn, alternated rep by rep (a shared VM's noise then falls on every class
alike): decode attention over bfloat16 / float32 / int8 pages at 128, 512 and 2,048 keys
(SmolLM2-135M's heads, 9 x 3 x 64, and Gemma 3 1B's, 4 x 1 x 256; one row and 8 rows), the
prompt kernel at 512 rows, and the float GEMM at 512 rows (SmolLM2-135M's layer shapes).
Prints the median and the spread (min-max) of the reps per class; GFLOP/s where the
arithmetic is the cost.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Callable

import torch

from services.gpu_worker import cpu_kernels

i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

#: the clock timings read: wall time, or with --cpu-time the calling thread's CPU time (one thread
#: on a shared host: time the thread spends descheduled does not count)
CLOCK = time.perf_counter


def load(cls: str) -> ctypes.CDLL:
    """The kernels built for class `cls`, loaded on their own (each object has its own pool)."""
    old = os.environ.get("MSTAR_CPU_CLASS")
    os.environ["MSTAR_CPU_CLASS"] = cls
    cpu_kernels.cpu_class.cache_clear()
    try:
        path = cpu_kernels.build()
    finally:
        if old is None:
            os.environ.pop("MSTAR_CPU_CLASS", None)
        else:
            os.environ["MSTAR_CPU_CLASS"] = old
        cpu_kernels.cpu_class.cache_clear()
    if path is None:
        raise SystemExit(f"the {cls} kernels did not build")
    lib = ctypes.CDLL(str(path))
    for name in ("mstar_paged_decode", "mstar_paged_decode_bf16", "mstar_paged_decode_i8"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr, ptr, i64]
    lib.mstar_paged_decode_scratch.restype = i64
    lib.mstar_paged_decode_scratch.argtypes = [i64, i64, i64, i64]
    lib.mstar_prefill_attention.restype = ctypes.c_int
    lib.mstar_prefill_attention.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, i64, f32, ptr, i64]
    lib.mstar_gemm_nr.restype = i64
    lib.mstar_gemm_pack.restype = None
    lib.mstar_gemm_pack.argtypes = [ptr, i64, i64, ptr]
    lib.mstar_gemm.restype = lib.mstar_gemm_silu.restype = ctypes.c_int
    lib.mstar_gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64]
    lib.mstar_gemm_silu.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64]
    lib.mstar_pool_set_threads.restype = None
    lib.mstar_pool_set_threads.argtypes = [ctypes.c_int]
    return lib


def timed(fn: Callable[[], object], seconds: float = 0.05) -> float:
    """Seconds per call: a loop of calls lasting about `seconds`, after one warm call."""
    fn()
    t0, n = CLOCK(), 0
    while True:
        fn()
        n += 1
        el = CLOCK() - t0
        if el > seconds:
            return el / n


def compare(libs: dict[str, ctypes.CDLL], reps: int, make: Callable[[ctypes.CDLL], Callable[[], object] | None],
            flops: float | None, label: str) -> None:
    made = {c: make(lib) for c, lib in libs.items()}
    calls = {c: fn for c, fn in made.items() if fn is not None}  # None: no such kernel in that class
    times: dict[str, list[float]] = {c: [] for c in calls}
    for _ in range(reps):
        for c, fn in calls.items():
            times[c].append(timed(fn))
    parts = []
    for c, ts in times.items():
        med = statistics.median(ts)
        s = f"{c} {med * 1e6:9.1f} us ({min(ts) * 1e6:.1f}-{max(ts) * 1e6:.1f})"
        if flops:
            s += f" {flops / med / 1e9:6.1f} GFLOP/s"
        parts.append(s)
    first = list(times)
    if len(first) == 2 and len(calls) == len(libs):
        a, b = (statistics.median(times[c]) for c in first)
        parts.append(f"{first[1]}/{first[0]} {b / a:.2f}x")
    print(f"{label:34} " + " | ".join(parts), flush=True)


def decode_case(hq: int, hkv: int, d: int, keys: int, rows: int, dtype: torch.dtype):
    """A pool of scattered pages holding `rows` rows of `keys` keys each, and the call on a lib."""
    page = 16
    per = -(-keys // page)
    g = torch.Generator().manual_seed(0)
    n_pages = rows * per + 1
    if dtype == torch.int8:
        cache = torch.randint(-127, 128, (n_pages, 2, page, hkv, d + 4), dtype=torch.int8, generator=g)
        cache[..., d:] = torch.full((1,), 0.01).view(torch.int8)  # each head's float32 scale
    else:
        cache = (torch.randn(n_pages, 2, page, hkv, d, generator=g)).to(dtype)
    pages = torch.randperm(n_pages, generator=g)[: rows * per].view(rows, per).contiguous()
    q = torch.randn(rows, hq, d, generator=g)
    qrow = torch.arange(rows)
    lo, hi = torch.zeros(rows, dtype=torch.int64), torch.full((rows,), keys, dtype=torch.int64)
    out = torch.empty(rows, hq, d)
    name = {torch.float32: "mstar_paged_decode", torch.bfloat16: "mstar_paged_decode_bf16",
            torch.int8: "mstar_paged_decode_i8"}[dtype]

    def make(lib: ctypes.CDLL) -> Callable[[], object]:
        scratch = torch.empty(lib.mstar_paged_decode_scratch(rows, hq, d, keys))
        fn = getattr(lib, name)
        args = (q.data_ptr(), hq * d, cache.data_ptr(), pages.data_ptr(), per, qrow.data_ptr(), qrow.data_ptr(),
                lo.data_ptr(), hi.data_ptr(), rows, hq, hkv, d, page, d**-0.5, out.data_ptr(), scratch.data_ptr(),
                keys)
        assert fn(*args) == 0
        return lambda: (fn(*args), scratch)  # the lambda keeps the scratch alive

    return make


def prefill_case(hq: int, hkv: int, d: int, n: int):
    page = 16
    g = torch.Generator().manual_seed(0)
    per = -(-n // page)
    cache = torch.randn(per, 2, page, hkv, d, generator=g).to(torch.bfloat16)
    pages = torch.randperm(per, generator=g)
    q = torch.randn(n, hq, d, generator=g)
    out = torch.empty(n, hq, d)

    def make(lib: ctypes.CDLL) -> Callable[[], object] | None:
        args = (q.data_ptr(), hq * d, cache.data_ptr(), 1, pages.data_ptr(), n, n, hq, hkv, d, page, 0, d**-0.5,
                out.data_ptr(), hq * d)
        if lib.mstar_prefill_attention(*args) != 0:
            return None
        return lambda: lib.mstar_prefill_attention(*args)

    return make


def gemm_case(m: int, n: int, k: int, silu: bool):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * k**-0.5
    x = torch.randn(m, k, generator=g)
    out = torch.empty(m, n // 2 if silu else n)

    def make(lib: ctypes.CDLL) -> Callable[[], object] | None:
        nr = lib.mstar_gemm_nr()
        if nr == 0:
            return None
        packed = torch.empty(-(-n // nr) * nr * k)
        lib.mstar_gemm_pack(w.data_ptr(), n, k, packed.data_ptr())  # layout only: speed, not values
        if silu:
            args = (x.data_ptr(), m, k, k, packed.data_ptr(), n // 2, out.data_ptr(), n // 2)
            return lambda: (lib.mstar_gemm_silu(*args), packed)
        args2 = (x.data_ptr(), m, k, k, packed.data_ptr(), n, None, out.data_ptr(), n)
        return lambda: (lib.mstar_gemm(*args2), packed)

    return make


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kernel_classes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--classes", nargs="+", default=["avx512", "avx2"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cpu-time", action="store_true", help="time by the thread's CPU time (use with --threads 1)")
    ap.add_argument("--only", nargs="+", default=["decode", "prefill", "gemm"])
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(1)
    runnable = [c for c in args.classes if c in list(cpu_kernels.X86_CLASSES)[list(cpu_kernels.X86_CLASSES).index(
        cpu_kernels.host_class()):]] if cpu_kernels.host_class() in cpu_kernels.X86_CLASSES else []
    libs = {c: load(c) for c in runnable}
    print(f"classes: {', '.join(libs)}; gemm panels: {[lib.mstar_gemm_nr() for lib in libs.values()]}")
    for threads in args.threads:
        for lib in libs.values():
            lib.mstar_pool_set_threads(threads)
        print(f"-- {threads} thread(s)")
        if "decode" in args.only:
            for hq, hkv, d in ((9, 3, 64), (4, 1, 256)):
                for dtype in (torch.bfloat16, torch.float32, torch.int8):
                    for rows in (1, 8):
                        for keys in (128, 512, 2048):
                            label = f"decode {hq}x{hkv}x{d} {str(dtype)[6:]} {rows}r {keys}k"
                            compare(libs, args.reps, decode_case(hq, hkv, d, keys, rows, dtype), None, label)
        if "prefill" in args.only:
            for hq, hkv, d in ((9, 3, 64), (4, 1, 256)):
                n = 512
                flops = 4.0 * n * (n + 1) / 2 * hq * d
                compare(libs, args.reps, prefill_case(hq, hkv, d, n), flops, f"prefill {hq}x{hkv}x{d} {n} rows")
        if "gemm" in args.only:
            for name, n, k, silu in (("qkv", 960, 576, False), ("o", 576, 576, False), ("gate_up", 3072, 576, False),
                                     ("gate_up+silu", 3072, 576, True), ("down", 576, 1536, False)):
                for m in (1, 16, 512):
                    compare(libs, args.reps, gemm_case(m, n, k, silu), 2.0 * m * n * k, f"gemm {name} {m} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
