"""A client that goes away aborts its request in every service: its KV pages are free and
nothing runs within a second, for HTTP JSON, SSE (/generate and /v1) and WebSocket clients.

Each request asks for 400 tokens with ignore_eos and the client leaves right after its
first events; `mstar_requests_total{status="abort"}` shows it left before the request
finished (the api counts a disconnect as abort, a finished request as ok).

Every test but the JSON and SSE ones runs twice: on `llama_server`, and on `slow_server`
(tests/conftest.py), a wider and deeper random Llama whose 400 tokens take seconds on a CPU.
The tiny llama makes 400 tokens in well under a second, so there pages would be free within
a second even without an abort; on the slow one, free within a second means the workers
really stopped.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
import websockets

LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
FREED_WITHIN_S = 1.0


def aborts(server) -> float:
    return server.metric("mstar_requests_total", '{status="abort"}')


def assert_freed_within(server, seconds: float = FREED_WITHIN_S) -> float:
    """Pages used and requests running both reach 0 within `seconds`; returns the time taken."""
    start = time.monotonic()
    deadline = start + seconds
    while True:
        try:
            pages = server.metric("mstar_kv_pages_used")
            running = server.metric("mstar_requests_running")
        except KeyError:  # the conductor's status came late (a busy host): /metrics has no cluster gauges yet
            pages = running = float("nan")
        if pages == 0 and running == 0:
            return time.monotonic() - start
        assert time.monotonic() < deadline, f"after {seconds}s: {pages} pages used, {running} running"
        time.sleep(0.05)


def raw_post(server, path: str, body: dict) -> socket.socket:
    """An HTTP/1.1 POST on a plain socket, left open and unread (a JSON client waiting)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"prompt": "The quick brown fox", **LONG}),
        ("/v1/completions", {"prompt": "The quick brown fox", **LONG}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], **LONG}),
    ],
)
def test_json_client_disconnect(slow_server, path, body):
    """The client leaves as soon as the api has seen its first token. On the slow llama only:
    the tiny one's 400 tokens take ~100 ms, and a JSON client sees nothing before the end,
    so with the other core busy the request raced its client's close to the finish."""
    server = slow_server
    before, first_tokens = aborts(server), server.metric("mstar_ttft_seconds_count")
    sock = raw_post(server, path, body)
    try:
        deadline = time.monotonic() + 10
        while server.metric("mstar_ttft_seconds_count") == first_tokens:
            assert time.monotonic() < deadline, "no first token within 10 s"
            time.sleep(0.002)
    finally:
        sock.close()
    assert_freed_within(server)
    assert aborts(server) == before + 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"prompt": "The quick brown fox", **LONG}),
        ("/v1/completions", {"prompt": "The quick brown fox", **LONG}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], **LONG}),
    ],
)
def test_sse_client_disconnect_mid_stream(slow_server, path, body):
    """Two streams at once, each closed after its first event. On the slow llama only, as the
    JSON case: the tiny one's 400 tokens take ~100 ms, so the first stream could finish while
    the second's first event was read (a fresh-clone CI counted one abort, not two)."""
    server = slow_server
    before = aborts(server)
    with httpx.Client(timeout=30) as client:
        streams = [client.stream("POST", server.url + path, json={**body, "stream": True}) for _ in range(2)]
        responses = [s.__enter__() for s in streams]
        for r in responses:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data:")
        for s in streams:
            s.__exit__(None, None, None)  # closes the connection mid-stream
    assert_freed_within(server)
    assert aborts(server) == before + 2


async def test_websocket_close_mid_stream(slow_server):
    """Two streams on one socket, gone without a closing handshake once each has sent a
    delta. On the slow llama only, as the others: on the tiny one a 400-token request can
    end before the second's first delta is read (a fresh-clone CI saw it)."""
    server = slow_server
    before = aborts(server)
    url = server.url.replace("http://", "ws://") + "/generate/ws"
    ws = await websockets.connect(url)
    for i in range(2):
        await ws.send(json.dumps({"type": "generate", "id": f"w{i}", "prompt": "Hello world!", **LONG}))
    seen: set[str] = set()
    while len(seen) < 2:
        frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert frame["type"] == "delta", frame
        seen.add(frame["id"])
    ws.transport.abort()  # gone without a closing handshake, like a killed client
    await asyncio.to_thread(assert_freed_within, server)
    assert aborts(server) == before + 2


async def test_websocket_clean_close_mid_stream(slow_server):
    server = slow_server
    before = aborts(server)
    url = server.url.replace("http://", "ws://") + "/generate/ws"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": "Hello world!", **LONG}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "delta"
    await asyncio.to_thread(assert_freed_within, server)
    assert aborts(server) == before + 1
