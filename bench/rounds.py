"""The driver the request benches share (`python -m bench.world`, `bench.image_gen`): mstar
over HTTP, one request at a time and then bursts of concurrent ones, the reference called
one request at a time for the same bodies (a burst's requests served one after another, as
a one-at-a-time call serves them), and rounds alternating the two systems so that a busy
machine's drift falls on both."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import httpx


class Timings(NamedTuple):
    c1: list[float]  # each c1 request's time, request to its whole answer
    c1_wall: float
    burst: list[float]  # each burst request's time from its burst's start
    burst_wall: float


#: one request to its whole answer: (client, body) -> None, raising on an error status
Send = Callable[[httpx.AsyncClient, dict], Awaitable[None]]
POLL_S = 0.02  # a video job's poll period: small beside a job's seconds


def _ok(r: httpx.Response) -> httpx.Response:
    if r.status_code != 200:
        raise RuntimeError(f"{r.request.method} {r.request.url.path} answered {r.status_code}: {r.text[:300]}")
    return r


def post_to(route: str) -> Send:
    """A plain request: one POST, its answer the whole result."""
    async def send(client: httpx.AsyncClient, body: dict) -> None:
        _ok(await client.post(route, json=body))
    return send


async def video_job(client: httpx.AsyncClient, body: dict) -> None:
    """OpenAI's video job API: `POST /v1/videos`, `GET /v1/videos/{id}` until it ends, then
    its MP4 from `/content` (the job's result is the file, so its wall time ends there)."""
    job = _ok(await client.post("/v1/videos", json=body)).json()
    while job["status"] in ("queued", "in_progress"):
        await asyncio.sleep(POLL_S)
        job = _ok(await client.get(f"/v1/videos/{job['id']}")).json()
    if job["status"] != "completed":
        raise RuntimeError(f"video job {job['id']} {job['status']}: {job.get('error')}")
    _ok(await client.get(f"/v1/videos/{job['id']}/content"))


async def _timed(send: Send, client: httpx.AsyncClient, body: dict, t0: float) -> float:
    await send(client, body)
    return time.perf_counter() - t0


async def _http(url: str, send: Send, c1: list[dict], bursts: list[list[dict]]) -> Timings:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        start = time.perf_counter()
        one = [await _timed(send, client, b, time.perf_counter()) for b in c1]
        c1_wall = time.perf_counter() - start
        burst: list[float] = []
        start = time.perf_counter()
        for group in bursts:
            t0 = time.perf_counter()
            burst += await asyncio.gather(*(_timed(send, client, b, t0) for b in group))
        return Timings(one, c1_wall, burst, time.perf_counter() - start)


def http_round(url: str, route: str | Send, c1: list[dict], bursts: list[list[dict]]) -> Timings:
    """mstar: the c1 bodies one after another, then each burst's bodies at once; `route` a
    path to POST to, or a `Send` (`video_job`) for requests that take more than one call."""
    return asyncio.run(_http(url, post_to(route) if isinstance(route, str) else route, c1, bursts))


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


def fill_defaults(args: Any, counts: tuple[tuple[str, int, int], ...], threads: bool = False) -> None:
    """The flags left unset: each (name, full, quick) count by `--quick`, and (`threads`) the
    torch threads both sides run on, the worker's default (CPUs - 1)."""
    for name, full, quick in counts:
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if threads and args.threads is None:
        from shared.cgroup import available_cpus

        args.threads = max(1, available_cpus() - 1)
