"""Summaries of one load level: TTFT, ITL, TPOT and latency percentiles, throughput."""

from __future__ import annotations

import math

from bench.client import RequestResult


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN for no values."""
    if not values:
        return math.nan
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def ratio(a: float, b: float) -> float:
    """a / b, NaN where b is 0 (a figure not measured)."""
    return a / b if b else math.nan


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize(results: list[RequestResult], wall_s: float, client_cpu_s: float, concurrency: int) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itls]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    lat = [r.latency for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = 1000.0
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(ok),
        "errors": [r.error for r in results if not r.ok][:5],
        "num_errors": len(results) - len(ok),
        "prompt_tokens": sum(r.prompt_len for r in ok),
        "output_tokens": out_tokens,
        "duration_s": wall_s,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else math.nan,
        "output_throughput": out_tokens / wall_s if wall_s > 0 else math.nan,
        "ttft_ms": {"mean": mean(ttft) * ms, "p50": percentile(ttft, 50) * ms, "p99": percentile(ttft, 99) * ms},
        "itl_ms": {"mean": mean(itl) * ms, "p50": percentile(itl, 50) * ms, "p99": percentile(itl, 99) * ms},
        "tpot_ms": {"mean": mean(tpot) * ms, "p50": percentile(tpot, 50) * ms, "p99": percentile(tpot, 99) * ms},
        "latency_ms": {"mean": mean(lat) * ms, "p50": percentile(lat, 50) * ms, "p99": percentile(lat, 99) * ms},
        # The client shares the machine: its own CPU per output token, to judge how much of
        # the figures above it took from the server.
        "client_cpu_s": client_cpu_s,
        "client_cpu_us_per_token": client_cpu_s / out_tokens * 1e6 if out_tokens else math.nan,
        # ITL samples for the plot's distribution (a sample, not all, to keep the JSON small).
        "itl_sample_ms": [x * ms for x in itl[:: max(1, len(itl) // 2000)]],
    }
