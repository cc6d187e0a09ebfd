"""The driver the request benches share (`python -m bench.world`, `bench.image_gen`): mstar
over HTTP, one request at a time and then bursts of concurrent ones, the reference called
one request at a time for the same bodies (a burst's requests served one after another, as
a one-at-a-time call serves them), and rounds alternating the two systems so that a busy
machine's drift falls on both."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import httpx


class Timings(NamedTuple):
    c1: list[float]  # each c1 request's time, request to its whole answer
    c1_wall: float
    burst: list[float]  # each burst request's time from its burst's start
    burst_wall: float


async def _post(client: httpx.AsyncClient, route: str, body: dict, t0: float) -> float:
    r = await client.post(route, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{route} answered {r.status_code}: {r.text[:300]}")
    return time.perf_counter() - t0


async def _http(url: str, route: str, c1: list[dict], bursts: list[list[dict]]) -> Timings:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        start = time.perf_counter()
        one = [await _post(client, route, b, time.perf_counter()) for b in c1]
        c1_wall = time.perf_counter() - start
        burst: list[float] = []
        start = time.perf_counter()
        for group in bursts:
            t0 = time.perf_counter()
            burst += await asyncio.gather(*(_post(client, route, b, t0) for b in group))
        return Timings(one, c1_wall, burst, time.perf_counter() - start)


def http_round(url: str, route: str, c1: list[dict], bursts: list[list[dict]]) -> Timings:
    """mstar: the c1 bodies one after another, then each burst's bodies at once."""
    return asyncio.run(_http(url, route, c1, bursts))


def serial_round(one: Callable[[dict], Any], c1: list[dict], bursts: list[list[dict]]) -> Timings:
    """The reference: `one(body)` for every body, one after another (a burst's each waits
    for those before it)."""
    times = []
    start = time.perf_counter()
    for b in c1:
        t0 = time.perf_counter()
        one(b)
        times.append(time.perf_counter() - t0)
    c1_wall = time.perf_counter() - start
    burst: list[float] = []
    start = time.perf_counter()
    for group in bursts:
        t0 = time.perf_counter()
        for b in group:
            one(b)
            burst.append(time.perf_counter() - t0)
    return Timings(times, c1_wall, burst, time.perf_counter() - start)


def alternate(systems: dict[str, Callable[[], dict]], rounds: int, key: str) -> dict[str, list[dict]]:
    """`rounds` rounds of every system, the order flipped each round; logs each round's `key`."""
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    order = list(systems.items())
    for r in range(rounds):
        for name, run in order if r % 2 == 0 else order[::-1]:
            runs[name].append(run())
        print(f"round {r + 1}: " + ", ".join(f"{k} {key} {v[-1][key]:.3f}" for k, v in runs.items()), file=sys.stderr)
    return runs
