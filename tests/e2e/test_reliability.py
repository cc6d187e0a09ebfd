"""Reliability under load and faults, with real processes: nothing lost, nothing
duplicated, every page back, no service down because of a peer's fault."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from tests.servers import MstarServer

DEBUG = {"MSTAR_KV_DEBUG_ASSERTS": "1"}


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise KeyError(pid)


def _child_pid(server: MstarServer, module: str) -> int:
    for pid in server.children():
        if f"services.{module}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise KeyError(module)


@pytest.fixture(scope="module")
def load_server(llama_ckpt, tmp_path_factory):
    server = MstarServer(str(llama_ckpt), tmp_path_factory.mktemp("logs") / "load.log", "--num-kv-pages", "1024",
                         "--page-size", "16", env=DEBUG).start()
    yield server
    server.stop()


async def test_load_2000_requests_at_concurrency_64(load_server):
    """2,000 requests, 64 at a time, random prompt and output lengths: each answered once
    with exactly its tokens; pages back to zero; api and worker RSS flat across halves."""
    rng = random.Random(7)
    reqs = [{"request_id": f"load-{i}", "input_ids": [rng.randint(3, 250) for _ in range(rng.randint(1, 48))],
             "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.8]), "seed": i, "ignore_eos": True}
            for i in range(2000)]
    results: dict[str, dict] = {}
    sem = asyncio.Semaphore(64)
    pids = {m: _child_pid(load_server, m) for m in ("api", "gpu_worker")}
    rss: list[dict[str, int]] = []

    async with httpx.AsyncClient(base_url=load_server.url, timeout=300,
                                 limits=httpx.Limits(max_connections=64)) as client:
        async def one(body):
            async with sem:
                r = await client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            assert body["request_id"] not in results, "answered twice"
            results[body["request_id"]] = r.json()

        for half in (reqs[:1000], reqs[1000:]):
            await asyncio.gather(*(one(b) for b in half))
            rss.append({m: _rss_kb(p) for m, p in pids.items()})
    assert len(results) == 2000
    for body in reqs:
        out = results[body["request_id"]]
        assert out["id"] == body["request_id"] and len(out["token_ids"]) == body["max_tokens"]
        assert out["usage"] == {"prompt_tokens": len(body["input_ids"]), "completion_tokens": body["max_tokens"]}
    assert load_server.wait_pages_free() == 0
    assert load_server.metric("mstar_kv_footprint_overruns_total") == 0
    for m in pids:
        assert rss[1][m] <= rss[0][m] * 1.10 + 8 * 1024, (m, rss)
    print("rss kB after each half:", rss)


async def test_disconnect_storm_frees_every_page(load_server):
    """200 streaming clients drop mid-stream: every request is aborted in the worker and
    every page is back within a second of the last drop."""
    async def client_that_drops(i: int) -> None:
        async with httpx.AsyncClient(base_url=load_server.url, timeout=60) as client:
            body = {"input_ids": [5 + i % 200] * (8 + i % 40), "max_tokens": 400, "ignore_eos": True, "stream": True}
            try:
                async with asyncio.timeout(0.3 + (i % 10) / 10):
                    async with client.stream("POST", "/generate", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data:") and json.loads(line[5:])["type"] == "delta":
                                break  # leave mid-stream: the context managers close the connection
            except TimeoutError:
                pass

    await asyncio.gather(*(client_that_drops(i) for i in range(200)))
    dropped_at = time.monotonic()
    while time.monotonic() - dropped_at < 1.0:
        if load_server.metric("mstar_kv_pages_used") == 0 and load_server.metric("mstar_requests_running") == 0 \
                and load_server.metric("mstar_requests_waiting") == 0:
            break
        await asyncio.sleep(0.05)
    assert load_server.metric("mstar_kv_pages_used") == 0, "pages still held 1 s after the storm"
    print(f"disconnect storm: pages back {time.monotonic() - dropped_at:.2f}s after the last drop")
    assert load_server.metric("mstar_requests_running") == 0 and load_server.metric("mstar_requests_waiting") == 0
    # The server still serves.
    r = httpx.post(load_server.url + "/generate", json={"prompt": "still here", "max_tokens": 3, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200


def test_malformed_frames_from_a_peer_are_logged_and_dropped(load_server):
    """Garbage on every service's ZMQ input is logged with the peer and dropped; nothing
    crashes and the next request is served."""
    addrs = []
    for pid in load_server.children():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        for flag in (b"--conductor-addr", b"--data-worker-addr", b"--api-addr", b"--bind-addr"):
            if flag in argv:
                addrs.append(argv[argv.index(flag) + 1].decode())
    addrs = sorted(set(addrs))
    assert len(addrs) == 4, addrs
    ctx = zmq.Context()
    try:
        for addr in addrs:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(addr)
            for frames in ([b"\xc1garbage"], [msgspec.msgpack.encode(["no_such_tag", 1])],
                           [msgspec.msgpack.encode(["new_request", "x", 5])], [b"", b"", b""]):
                sock.send_multipart(frames)
            sock.close()
    finally:
        ctx.term()
    time.sleep(0.5)
    r = httpx.post(load_server.url + "/generate", json={"prompt": "after garbage", "max_tokens": 3, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200
    assert len(load_server.children()) == 4
    assert load_server.log().count("protocol error from") >= 4


async def test_sigstopped_worker_is_detected_by_heartbeats(llama_ckpt, tmp_path):
    """A worker that stops answering (SIGSTOP) fails its requests within a few seconds
    instead of hanging them; once it resumes it serves again."""
    server = MstarServer(str(llama_ckpt), tmp_path / "log.txt", "--num-kv-pages", "256",
                         env={"MSTAR_HEARTBEAT_TIMEOUT": "2"}).start()
    try:
        worker = _child_pid(server, "gpu_worker")
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            first = asyncio.Event()

            async def stream():
                events = []
                async with client.stream("POST", "/generate", json={"prompt": "Hello", "max_tokens": 480,
                                                                    "ignore_eos": True, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            events.append(json.loads(line[5:]))
                            first.set()
                return events

            task = asyncio.ensure_future(stream())
            await first.wait()
            os.kill(worker, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                events = await asyncio.wait_for(task, 30)
            finally:
                os.kill(worker, signal.SIGCONT)
            detected = time.monotonic() - t0
        assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "worker_failed"
        assert detected < 10
        print(f"SIGSTOPped worker detected after {detected:.2f}s (heartbeat timeout 2s)")
        deadline = time.monotonic() + 20
        while httpx.get(server.url + "/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        r = httpx.post(server.url + "/generate", json={"prompt": "resumed", "max_tokens": 3, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200
        assert server.wait_pages_free() == 0
    finally:
        server.stop()


async def test_sigterm_drains_running_requests_then_exits_cleanly(llama_ckpt, tmp_path):
    """SIGTERM: new requests get 503, running ones finish, every child exits, no stale
    ipc socket is left."""
    server = MstarServer(str(llama_ckpt), tmp_path / "log.txt", "--num-kv-pages", "256").start()
    children = server.children()
    run_dirs = {a.split("ipc://", 1)[1].rsplit("/", 1)[0] for pid in children
                for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") if a.startswith("ipc://")}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        running = asyncio.ensure_future(client.post("/generate", json={"prompt": "Hello", "max_tokens": 300,
                                                                       "ignore_eos": True}))
        await asyncio.sleep(0.15)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        try:
            late = await client.post("/generate", json={"prompt": "late", "max_tokens": 3})
            assert late.status_code == 503
        except httpx.TransportError:
            pass  # or the listener is already closed: refused, not accepted and dropped
        r = await running
    assert r.status_code == 200 and len(r.json()["token_ids"]) == 300
    assert server.proc.wait(30) == 0
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    for d in run_dirs:
        assert not Path(d).exists() or not list(Path(d).glob("*.sock")), f"stale ipc sockets in {d}"
    server.stop()


@pytest.mark.parametrize("victim", ["conductor", "data_worker"])
async def test_conductor_or_data_worker_crash_fails_only_unscheduled_requests(llama_ckpt, tmp_path, victim):
    """SIGKILL of the conductor or the data worker: requests already on the gpu worker
    finish, those still waiting to be placed end at once with a 503, the launcher
    restarts the service, and new requests are served after it."""
    server = MstarServer(str(llama_ckpt), tmp_path / "log.txt", "--num-kv-pages", "40", "--page-size", "16").start()
    try:
        # 32 pages of 40, so one at a time; each still takes only ~0.2 s on this model, shorter
        # than the worker's stats interval, so the running gauge is not watched (it can read 0
        # through the whole run); the waiting gauge is the conductor's own queue length.
        body = {"input_ids": list(range(5, 105)), "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            # Sixteen, and the kill while 3..14 still wait: at most 14 waiting means at least
            # two were placed on the gpu worker (they must finish with 200); at least 3
            # waiting, read through a status cached up to 0.25 s, leaves some unplaced at the
            # kill (503). Sixteen rather than ten: on a loaded host the requests reach the
            # conductor spread out, nearly as fast as each one finishes, and a queue of ten
            # could stay under 3 throughout (CI saw it once).
            n = 16
            tasks = [asyncio.ensure_future(client.post("/generate", json=body)) for _ in range(n)]
            deadline = time.monotonic() + 30
            while not 3 <= await asyncio.to_thread(server.metric, "mstar_requests_waiting") <= n - 2:
                assert time.monotonic() < deadline, "requests never queued"
                await asyncio.sleep(0.02)
            os.kill(_child_pid(server, victim), signal.SIGKILL)
            rs = await asyncio.gather(*tasks)
            codes = sorted(r.status_code for r in rs)
            assert codes[0] == 200 and codes[-1] == 503, codes
            for r in rs:
                if r.status_code == 200:
                    assert len(r.json()["token_ids"]) == 400
                else:
                    assert r.json()["error"]["type"] == "service_unavailable" and r.json()["error"]["error_id"]
            deadline = time.monotonic() + 60
            while (await client.get("/ready")).status_code != 200:
                assert time.monotonic() < deadline, "not ready again after the restart"
                await asyncio.sleep(0.2)
            r = await client.post("/generate", json={"prompt": "after the crash", "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200 and len(r.json()["token_ids"]) == 4
        assert f"{victim} exited with code -9; restarting" in server.log()
        assert server.wait_pages_free() == 0
    finally:
        server.stop()
