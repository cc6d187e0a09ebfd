"""The CPU path's GEMMs alone: the C kernel (kernels/gemm.c) against oneDNN's packed GEMM.

    python -m bench.gemm [--rows 1 16 512] [--hidden 512] [--inter 1408] [--vocab 32000]

One compute thread, the bench checkpoint's shapes by default (fused qkv, o, fused
gate/up, down, LM head), best of three timed loops per shape, and the largest difference
from a float64 reference. On a shared VM interleave runs before reading much into a
few percent.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def _best(fn, args: tuple, reps: int) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gemm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from services.gpu_worker.layers.linear import (
        kernel_available,
        kernel_linear,
        kernel_pack,
        onednn_available,
        pack_weight,
        packed_linear,
    )

    if not kernel_available():
        print("the C GEMM kernel is not built here (no compiler, no AVX-512, or MSTAR_CPU_KERNELS=0)")
        return 1
    h, d = args.hidden, args.hidden // args.heads
    shapes = [("qkv", h + 2 * args.kv_heads * d, h, True), ("o", h, h, False), ("gate_up", 2 * args.inter, h, False),
              ("down", h, args.inter, False), ("head", args.vocab, h, False)]
    print(f"{'rows':>5} {'gemm':8} {'kernel ms':>10} {'GFLOP/s':>8} {'oneDNN ms':>10} {'GFLOP/s':>8} "
          f"{'speed-up':>8} {'max err':>8}")
    for m in args.rows:
        for name, n, k, has_bias in shapes:
            w = torch.randn(n, k) * k**-0.5
            bias = torch.randn(n) if has_bias else None
            x = torch.randn(m, k)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            packed = kernel_pack(w)
            err = (kernel_linear(x, packed, n, bias).double() - ref).abs().max().item()
            reps = max(2, int(2e8 / (m * n * k)))
            ours = _best(kernel_linear, (x, packed, n, bias), reps)
            flops = 2 * m * n * k
            line = f"{m:5d} {name:8} {ours * 1e3:10.3f} {flops / ours / 1e9:8.1f}"
            if onednn_available():
                od = pack_weight(w)
                theirs = _best(packed_linear, (x, od, bias), reps)
                line += f" {theirs * 1e3:10.3f} {flops / theirs / 1e9:8.1f} {theirs / ours:7.2f}x"
            print(f"{line} {err:8.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
