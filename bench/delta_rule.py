"""Qwen3.5's linear attention per layer (services/gpu_worker/layers/delta_rule.py): the C
kernels against the torch path on the CPU, at Qwen3.5-0.8B's shapes.

    python -m bench.delta_rule [--batch 1 16] [--prefill 512] [--threads N]

Per decode step of B requests (one row each, continuing their slots) and per prefill chunk of
`--prefill` rows (one request): the causal conv, the gated delta rule and the gated RMSNorm,
best of three timed loops each. The torch path here is what the CUDA build runs, timed on
the CPU: it says what the C kernels save on a CPU, not what a GPU does. Threads: torch's
and the kernels' pool both get `--threads` (default: the kernels' default).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from services.gpu_worker import cpu_kernels
from services.gpu_worker.layers import delta_rule
from services.gpu_worker.layers.delta_rule import StateBatch, causal_conv, gated_delta, gated_rms_norm

#: Qwen3.5-0.8B's linear attention
HK, HV, DK, DV, KERNEL = 16, 16, 128, 128, 4
CHANNELS = 2 * HK * DK + HV * DV


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _case(b: int, rows: int, reps: int) -> dict[str, float]:
    """Microseconds per call of each function, C then torch, for b requests of `rows` rows."""
    gen = torch.Generator().manual_seed(b * 1000 + rows)
    t = b * rows
    batch = StateBatch.build(range(0, t + 1, rows), range(b), [False] * b)
    x = torch.randn(t, CHANNELS, generator=gen)
    conv_w = torch.randn(CHANNELS, KERNEL, generator=gen) * 0.3
    conv_state = torch.randn(b, KERNEL - 1, CHANNELS, generator=gen)
    q, k = torch.randn(t, HK, DK, generator=gen), torch.randn(t, HK, DK, generator=gen)
    v = torch.randn(t, HV, DV, generator=gen)
    g, beta = -F.softplus(torch.randn(t, HV, generator=gen)), torch.rand(t, HV, generator=gen)
    state = torch.randn(b, HV, DK, DV, generator=gen) * 0.1
    z, norm_w = torch.randn(t, HV, DV, generator=gen), torch.randn(DV, generator=gen)
    out: dict[str, float] = {}
    for path in ("c", "torch"):
        delta_rule.C_KERNELS = path == "c"
        out[f"conv {path}"] = _best(lambda: causal_conv(x, conv_state, conv_w, batch), reps) * 1e6
        out[f"delta {path}"] = _best(lambda: gated_delta(q, k, v, g, beta, state, batch), reps) * 1e6
        out[f"norm {path}"] = _best(lambda: gated_rms_norm(v, z, norm_w, 1e-6), reps) * 1e6
    delta_rule.C_KERNELS = True
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="requests per decode step")
    p.add_argument("--prefill", type=int, nargs="*", default=[512], help="rows of a one-request prefill chunk")
    p.add_argument("--threads", type=int, default=0, help="threads for torch and the kernels (0: their defaults)")
    args = p.parse_args()
    lib = cpu_kernels.library()
    if lib is None:
        raise SystemExit("the C kernels did not build: nothing to compare")
    if args.threads:
        torch.set_num_threads(args.threads)
        lib.mstar_pool_set_threads(args.threads)
    print(f"{cpu_kernels.describe()}, kernel threads {lib.mstar_pool_threads()}, torch threads "
          f"{torch.get_num_threads()}; Hk={HK} Hv={HV} Dk={DK} Dv={DV} C={CHANNELS} K={KERNEL}; us per call")
    cases = [(f"decode B={b}", b, 1, 200 if b == 1 else 50) for b in args.batch]
    cases += [(f"prefill {n} rows", 1, n, 3) for n in args.prefill]
    print(f"{'step':<18}" + "".join(f"{f + ' ' + p:>13}" for f in ("conv", "delta", "norm") for p in ("C", "torch")))
    for name, b, rows, reps in cases:
        r = _case(b, rows, reps)
        print(f"{name:<18}" + "".join(f"{r[f + ' ' + p]:>13.1f}" for f in ("conv", "delta", "norm")
                                     for p in ("c", "torch")))


if __name__ == "__main__":
    main()
