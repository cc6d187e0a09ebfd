"""Limits a client can hit, with their exact status and message, on a real server: the body
size limit (413) on every POST route and for WebSocket frames, and the live-requests-per-
WebSocket limit (429), which leaves the socket and its other requests alone."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import websockets

from services.api.settings import DEFAULT_MAX_BODY_BYTES, DEFAULT_WS_MAX_LIVE

TOO_LARGE = {"message": f"request body exceeds {DEFAULT_MAX_BODY_BYTES} bytes", "type": "request_too_large",
             "param": None, "error_id": None, "code": None}
BIG = "x" * (DEFAULT_MAX_BODY_BYTES + 10)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"prompt": BIG}),
        ("/v1/completions", {"prompt": BIG}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}),
    ],
)
def test_body_too_large_is_413(llama_server, path, body):
    r = httpx.post(llama_server.url + path, json=body, timeout=30)
    assert r.status_code == 413 and r.json() == {"error": TOO_LARGE}


def test_body_too_large_without_content_length_is_413(llama_server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(DEFAULT_MAX_BODY_BYTES // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    r = httpx.post(llama_server.url + "/generate", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and r.json() == {"error": TOO_LARGE}


def test_body_at_the_limit_is_read(llama_server):
    """A body of exactly the limit is not refused for its size (here: for the field)."""
    head, tail = b'{"prompt": "a", "max_tokens": 0, "pad": "', b'"}'
    body = head + b"x" * (DEFAULT_MAX_BODY_BYTES - len(head) - len(tail)) + tail
    assert len(body) == DEFAULT_MAX_BODY_BYTES
    r = httpx.post(llama_server.url + "/generate", content=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "pad"


def test_openai_client_sees_413(llama_server, llama_ckpt):
    client = openai.OpenAI(base_url=llama_server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=llama_ckpt.name, prompt=BIG)
    assert info.value.status_code == 413 and info.value.body == TOO_LARGE


async def test_websocket_frame_too_large_is_413(llama_server):
    url = llama_server.url.replace("http://", "ws://") + "/generate/ws"
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "big", "prompt": BIG}))
        frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert frame == {"type": "error", "id": None, "status": 413,
                         "error": {"message": f"frame exceeds {DEFAULT_MAX_BODY_BYTES} bytes",
                                   "type": "request_too_large", "param": None, "error_id": None, "code": None}}
        await ws.send(json.dumps({"type": "generate", "id": "ok", "prompt": "hi", "max_tokens": 2, "temperature": 0,
                                  "ignore_eos": True}))
        while (frame := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] != "done":
            pass
        assert frame["id"] == "ok" and len(frame["token_ids"]) == 2


async def test_websocket_live_limit_is_429(slow_server):
    """64 live requests (all but the first wait in the conductor's queue: the pool fits one),
    then one more is refused with 429; after a cancel, a new one is accepted; closing frees
    all. On the slow llama, whose 2000 tokens take many seconds, and without deltas (`stream`
    false: no flood of frames for the api to send while it should read the client's): no
    request can end before the test is done (a busy host let a tiny llama's requests end)."""
    url = slow_server.url.replace("http://", "ws://") + "/generate/ws"
    body = {"prompt": "Hello world!", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": False}
    async with websockets.connect(url) as ws:
        for i in range(DEFAULT_WS_MAX_LIVE):
            await ws.send(json.dumps({"type": "generate", "id": f"r{i}", **body}))
        await ws.send(json.dumps({"type": "generate", "id": "extra", **body}))
        refused = None
        while refused is None:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert frame["type"] != "done", f"{frame['id']} finished before the limit was tested"
            if frame["type"] == "error":
                refused = frame
        assert refused == {"type": "error", "id": "extra", "status": 429,
                           "error": {"message": f"too many live requests on this socket (limit {DEFAULT_WS_MAX_LIVE})",
                                     "type": "rate_limit_error", "param": None, "error_id": None, "code": None}}

        await ws.send(json.dumps({"type": "cancel", "id": "r63"}))
        frame = json.loads(await asyncio.wait_for(ws.recv(), 30))  # no deltas: the next frame is its done
        assert (frame["type"], frame["id"], frame.get("finish_reason")) == ("done", "r63", "abort"), frame
        await ws.send(json.dumps({"type": "generate", "id": "extra", **body}))  # a slot is free again
        await ws.send(json.dumps({"type": "cancel", "id": "extra"}))
        frame = json.loads(await asyncio.wait_for(ws.recv(), 30))  # no deltas: the next frame is its done
        assert (frame["type"], frame["id"], frame.get("finish_reason")) == ("done", "extra", "abort"), frame
    # leaving the socket aborts the 63 still live, queued ones included
    assert await asyncio.to_thread(slow_server.wait_pages_free, 5.0) == 0
    assert await asyncio.to_thread(slow_server.wait_metric, "mstar_requests_running", 0, 5.0) == 0
    assert await asyncio.to_thread(slow_server.wait_metric, "mstar_requests_waiting", 0, 5.0) == 0
