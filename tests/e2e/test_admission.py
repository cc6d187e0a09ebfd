"""Admission by footprint, data-parallel workers, and a worker's failure failing only
its own requests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.servers import MstarServer

DEBUG = {"MSTAR_KV_DEBUG_ASSERTS": "1"}


async def _watch(server: MstarServer, stop: asyncio.Event, seen: dict[str, float],
                 polling: asyncio.Event | None = None) -> None:
    """Sample the gauges while the load runs: the most waiting and the most pages used.
    `polling` is set once the first sample is in (the api's first status query opens its
    socket to the conductor), so a caller can start the load only when sampling is warm."""
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
        while not stop.is_set():
            text = (await client.get("/metrics")).text
            for line in text.splitlines():
                for name in ("mstar_requests_waiting", "mstar_kv_pages_used", "mstar_requests_running"):
                    if line.startswith(name + " ") or line.startswith(name + "{"):
                        seen[name] = max(seen.get(name, 0.0), float(line.rsplit(" ", 1)[1]))
            if polling is not None:
                polling.set()
            await asyncio.sleep(0.05)


async def test_footprint_admission_on_a_48_page_pool(slower_ckpt, tmp_path):
    """24 concurrent requests of 10 pages each on a 48-page pool: all finish with exactly
    their tokens, some waited, pages never above the pool, no overrun. The larger test
    model makes the load last long enough for the gauges to be sampled during it (on the
    tiny one it can be over between two samples); that some waited is read from the
    queue-time histogram, which no sampling can miss."""
    server = MstarServer(str(slower_ckpt), tmp_path / "log.txt", "--num-kv-pages", "48", "--page-size", "16",
                         env=DEBUG).start()
    try:
        seen: dict[str, float] = {}
        stop, polling = asyncio.Event(), asyncio.Event()
        watcher = asyncio.ensure_future(_watch(server, stop, seen, polling))
        await asyncio.wait_for(polling.wait(), 30)  # the load takes a second or two: sample from its start
        # 100 prompt rows + 60 new tokens (59 written) = 159 rows = 10 pages of 16.
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            rs = await asyncio.gather(*(client.post("/generate", json={
                "input_ids": [(7 * i + j) % 300 + 3 for j in range(100)], "max_tokens": 60, "temperature": 0,
                "ignore_eos": True,
            }) for i in range(24)))
        stop.set()
        await watcher
        assert [r.status_code for r in rs] == [200] * 24
        assert all(len(r.json()["token_ids"]) == 60 for r in rs)
        # Some waited: 4 x 10 pages fit in 48, so at least 20 queue behind a whole request
        # (60 decode steps). Read from the queue-time histogram, which counts every request,
        # not from the sampled gauge, which a loaded machine can sample past.
        queued = server.metric("mstar_request_queue_time_seconds_count")
        quick = server.metric("mstar_request_queue_time_seconds_bucket", '{le="0.1"}')
        assert queued == 24 and queued - quick >= 8, (queued, quick, seen)
        assert seen["mstar_kv_pages_used"] <= 48
        assert server.metric("mstar_kv_pages_peak") <= 48
        assert server.metric("mstar_requests_running") <= 4  # 4 x 10 pages fit in 48, 5 do not
        assert server.metric("mstar_kv_footprint_overruns_total") == 0
        assert server.wait_pages_free() == 0 and server.metric("mstar_kv_pages_reserved") == 0
    finally:
        server.stop()


def test_footprint_larger_than_the_pool_is_a_400(llama_ckpt, tmp_path):
    server = MstarServer(str(llama_ckpt), tmp_path / "log.txt", "--num-kv-pages", "8", "--page-size", "16").start()
    try:
        r = httpx.post(server.url + "/generate", json={"input_ids": [5] * 100, "max_tokens": 100}, timeout=60)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "the request needs 13 KV pages of pool 'kv', which holds 8 in all"
        # Without max_tokens it gets what the pool can hold: 8 pages = 128 rows.
        r = httpx.post(server.url + "/generate", json={"input_ids": [5] * 100, "ignore_eos": True, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and len(r.json()["token_ids"]) == 29
    finally:
        server.stop()


def _worker_pids(server: MstarServer) -> dict[str, int]:
    """worker id -> pid of the launcher's gpu worker children."""
    pids = {}
    for pid in server.children():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if b"services.gpu_worker" in argv:
            pids[argv[argv.index(b"--worker-id") + 1].decode()] = pid
    return pids


def _wait_workers(server: MstarServer, n: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    ready = 0
    while time.monotonic() < deadline:
        ready = httpx.get(server.url + "/ready").json().get("ready_workers", 0)
        if ready == n:
            break
        time.sleep(0.2)
    return ready


@pytest.fixture(scope="module")
def slower_ckpt(tmp_path_factory):
    """Big enough that 500 tokens take seconds, so a worker can be killed mid-request."""
    return make_checkpoint(tmp_path_factory.mktemp("slow") / "llama", "llama", hidden_size=256, intermediate_size=768,
                           num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=1024)


@pytest.fixture
def two_workers(slower_ckpt, tmp_path):
    server = MstarServer(str(slower_ckpt), tmp_path / "log.txt", "--num-kv-pages", "96", "--workers", "2",
                         env={"MSTAR_LOG_LEVEL": "DEBUG"}).start()
    _wait_workers(server, 2)
    yield server
    server.stop()


async def test_requests_spread_over_two_workers(two_workers):
    async with httpx.AsyncClient(base_url=two_workers.url, timeout=120) as client:
        rs = await asyncio.gather(*(client.post("/generate", json={"prompt": "Hello world", "max_tokens": 30,
                                                                   "temperature": 0, "ignore_eos": True})
                                    for _ in range(8)))
    assert all(r.status_code == 200 for r in rs)
    # The replies come straight from the workers; the conductor logs each finish when the
    # worker's RequestFinished reaches it, a moment later: wait for all eight lines.
    deadline = time.monotonic() + 10
    while True:
        finished = [line.rsplit(" ", 1)[1] for line in two_workers.log().splitlines() if "finished on" in line]
        if len(finished) >= 8 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert len(finished) == 8
    assert set(finished) == {"worker-0", "worker-1"}, "both workers served requests"


async def test_sigkill_of_one_worker_fails_only_its_requests(two_workers):
    pids = _worker_pids(two_workers)
    assert sorted(pids) == ["worker-0", "worker-1"]
    started = asyncio.Semaphore(0)

    async def stream(client, i):
        events = []
        async with client.stream("POST", "/generate", json={"prompt": f"Hello {i}", "max_tokens": 500, "temperature": 0,
                                                            "ignore_eos": True, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if len(events) == 1:
                        started.release()
        events[-1]["_ended_at"] = time.monotonic()
        return events

    async with httpx.AsyncClient(base_url=two_workers.url, timeout=120) as client:
        tasks = [asyncio.ensure_future(stream(client, i)) for i in range(4)]  # 2 per worker (33 pages each)
        for _ in tasks:
            await started.acquire()
        t0 = time.monotonic()
        os.kill(pids["worker-0"], signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        failed_at = time.monotonic() - t0
        # The survivor keeps serving while its peer restarts.
        r = await client.post("/generate", json={"prompt": "after", "max_tokens": 5, "temperature": 0,
                                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
    last = [ev[-1] for ev in results]
    failed = [e for e in last if e["type"] == "error"]
    done = [e for e in last if e["type"] == "done"]
    assert failed and done, last
    assert len(failed) == 2 and len(done) == 2, last
    assert all(e["error"]["type"] == "worker_failed" and e["status"] == 503 for e in failed)
    assert all(len(e["token_ids"]) == 500 for e in done)
    assert failed_at < 60
    detected = max(e["_ended_at"] for e in failed) - t0
    # The launcher restarts the worker and /ready returns to 200 with both workers.
    assert _wait_workers(two_workers, 2) == 2
    assert detected < 2.0
    print(f"worker SIGKILL: its requests failed after {detected:.3f}s, "
          f"both workers ready again after {time.monotonic() - t0:.2f}s")
    assert "gpu_worker-0 exited with code -9; restarting" in two_workers.log()
