"""The api's periodic stats line, as vLLM logs it, every `log_stats_s` (10 s) while there
is traffic (and once more after it stops, so the log shows the engine went idle):

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 42.0%

Throughputs are the interval's tokens over its length, counted as outputs reach the api
(prompt tokens at a request's first output). Running, waiting and KV use (used / total
pages over every pool) are the cluster status the conductor answers; the prefix cache hit
rate is the prompt rows the workers served from the cache over the prompt tokens, both
over the interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import NamedTuple

from services.api.backend import Backend
from services.api.metrics import ApiMetrics, kv_usage
from shared.frames import ClusterStatus

log = logging.getLogger("mstar.api.stats")


class Snapshot(NamedTuple):
    at: float  # time.monotonic()
    prompt_tokens: int
    generation_tokens: int
    prefix_hit_tokens: int | None  # None: no cluster status seen yet


def snapshot(metrics: ApiMetrics, status: ClusterStatus | None, at: float) -> Snapshot:
    hits = sum(w.prefix_hit_tokens for w in status.workers) if status is not None else None
    return Snapshot(at, metrics.window.prompt_tokens, metrics.window.generation_tokens, hits)


def queued(status: ClusterStatus | None) -> tuple[int, int]:
    """(running, waiting) over the cluster."""
    if status is None:
        return 0, 0
    return sum(w.running for w in status.workers), status.waiting + sum(w.waiting for w in status.workers)


def stats_line(prev: Snapshot, cur: Snapshot, status: ClusterStatus | None) -> str:
    seconds = max(cur.at - prev.at, 1e-9)
    prompt = cur.prompt_tokens - prev.prompt_tokens
    generated = cur.generation_tokens - prev.generation_tokens
    hit_rate = 0.0
    if prompt > 0 and cur.prefix_hit_tokens is not None and prev.prefix_hit_tokens is not None:
        hits = max(0, cur.prefix_hit_tokens - prev.prefix_hit_tokens)  # a restarted worker counts from 0
        hit_rate = min(1.0, hits / prompt)
    running, waiting = queued(status)
    kv = kv_usage(status) if status is not None else 0.0
    return (f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {generated / seconds:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {kv * 100:.1f}%, "
            f"Prefix cache hit rate: {hit_rate * 100:.1f}%")


def busy(prev: Snapshot, cur: Snapshot, status: ClusterStatus | None) -> bool:
    """Traffic in the interval: tokens moved, or requests are running or waiting."""
    moved = cur.prompt_tokens != prev.prompt_tokens or cur.generation_tokens != prev.generation_tokens
    return moved or any(queued(status))


class StatsLogger:
    """Runs in the api's lifespan; `run()` until cancelled."""

    def __init__(self, metrics: ApiMetrics, backend: Backend, interval_s: float) -> None:
        self.metrics = metrics
        self.backend = backend
        self.interval_s = interval_s

    async def _status(self) -> ClusterStatus | None:
        """The conductor's answer, else the last one seen."""
        status = await self.backend.cluster_status()
        self.metrics.set_cluster_status(status)
        return self.metrics.cluster.status

    async def run(self) -> None:
        prev = snapshot(self.metrics, self.metrics.cluster.status, time.monotonic())
        was_busy = False
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                status = await self._status()
                cur = snapshot(self.metrics, status, time.monotonic())
                now_busy = busy(prev, cur, status)
                if now_busy or was_busy:
                    log.info("%s", stats_line(prev, cur, status))
                prev, was_busy = cur, now_busy
            except Exception:  # the stats line must never take the api down
                log.exception("stats line failed")
