"""SSE and WebSocket streaming: deltas join to the final text, streamed equals
non-streamed, one socket carries interleaved requests and a cancel."""

from __future__ import annotations

import asyncio
import json

import httpx
import websockets


def _sse_events(server, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
    return events


def test_sse_deltas_join_to_done_and_match_non_streamed(llama_server):
    body = {"prompt": "Numbers like 12345 and emoji 🎉 and 中文", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    events = _sse_events(llama_server, body)
    deltas, done = events[:-1], events[-1]
    assert all(e["type"] == "delta" for e in deltas) and done["type"] == "done"
    assert "".join(e["text"] for e in deltas) == done["text"]
    assert [t for e in deltas for t in e["token_ids"]] == done["token_ids"]
    plain = httpx.post(llama_server.url + "/generate", json=body, timeout=60).json()
    assert plain["token_ids"] == done["token_ids"] and plain["text"] == done["text"]
    assert done["finish_reason"] == "length" and done["usage"] == plain["usage"]
    assert len({e["id"] for e in events}) == 1


async def test_websocket_interleaved_requests_and_cancel(llama_server):
    url = llama_server.url.replace("http://", "ws://") + "/generate/ws"
    async with websockets.connect(url) as ws:
        for i in range(3):
            await ws.send(json.dumps({"type": "generate", "id": f"a{i}", "prompt": "Hello world! " * (i + 1),
                                      "max_tokens": 10 + i, "temperature": 0, "ignore_eos": True}))
        await ws.send(json.dumps({"type": "generate", "id": "long", "prompt": "The quick brown fox", "max_tokens": 400,
                                  "temperature": 0, "ignore_eos": True}))
        done: dict[str, dict] = {}
        text: dict[str, str] = {}
        cancelled = False
        while len(done) < 4:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if frame["type"] == "delta":
                text[frame["id"]] = text.get(frame["id"], "") + frame["text"]
                if frame["id"] == "long" and not cancelled:
                    await ws.send(json.dumps({"type": "cancel", "id": "long"}))
                    cancelled = True
            elif frame["type"] == "done":
                done[frame["id"]] = frame
            else:
                raise AssertionError(frame)
    for i in range(3):
        d = done[f"a{i}"]
        assert d["finish_reason"] == "length" and len(d["token_ids"]) == 10 + i
        assert text[f"a{i}"] == d["text"]
        plain = httpx.post(llama_server.url + "/generate",
                           json={"prompt": "Hello world! " * (i + 1), "max_tokens": 10 + i, "temperature": 0,
                                 "ignore_eos": True}, timeout=60).json()
        assert plain["token_ids"] == d["token_ids"]
    assert done["long"]["finish_reason"] == "abort" and len(done["long"]["token_ids"]) < 400


async def test_websocket_bad_frame_leaves_socket_alive(llama_server):
    url = llama_server.url.replace("http://", "ws://") + "/generate/ws"
    async with websockets.connect(url) as ws:
        await ws.send("not json")
        err = json.loads(await ws.recv())
        assert err["type"] == "error"
        await ws.send(json.dumps({"type": "generate", "id": "x", "max_tokens": 0, "prompt": "hi"}))
        err = json.loads(await ws.recv())
        assert err["type"] == "error" and err["id"] == "x" and err["error"]["param"] == "max_tokens"
        await ws.send(json.dumps({"type": "generate", "id": "ok", "prompt": "hi", "max_tokens": 3, "temperature": 0,
                                  "ignore_eos": True}))
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if frame["type"] == "done":
                break
        assert frame["id"] == "ok" and len(frame["token_ids"]) == 3
