"""Bad input never produces a 5xx, a dead socket for the other requests on it, or a
crashed service: a hypothesis fuzz of /generate, /v1/* and /generate/ws frames."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIELDS = ["prompt", "input_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stream",
          "request_id", "stop", "n", "logprobs", "model", "messages", "max_completion_tokens", "stream_options",
          "tools", "echo", "best_of", "response_format", "__proto__", "kv_key", "prefix_key", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "min_tokens", "stop_token_ids",
          "top_logprobs", "prompt_logprobs"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.sampled_from(["", "\ud800", "\x00", "<|im_end|>", "a" * 300]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)
ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions"]


def _encode(body) -> bytes:
    return json.dumps(body, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _cap(body: dict) -> dict:
    """Keep the fuzz quick: a body that happens to be valid asks for few tokens."""
    for k in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(k), int) and not isinstance(body.get(k), bool) and 8 < body[k] < 10**6:
            body[k] = 8
    body.pop("stream", None)
    return body


@pytest.fixture(scope="module")
def client(llama_server):
    with httpx.Client(base_url=llama_server.url, timeout=60) as c:
        yield c


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), body=bodies)
def test_fuzzed_json_bodies_never_5xx(client, route, body):
    r = client.post(route, content=_encode(_cap(body)), headers={"content-type": "application/json"})
    assert r.status_code < 500, (route, body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param"} and err["message"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES),
       raw=st.one_of(st.binary(max_size=200),
                     st.sampled_from([b"", b"[]", b"null", b"{", b'{"prompt": "\xff\xfe"}', b"\xc3\x28"])))
def test_raw_bytes_never_5xx(client, route, raw):
    r = client.post(route, content=raw)
    assert 400 <= r.status_code < 500, (route, raw, r.text)


def test_huge_body_is_a_413(client):
    r = client.post("/generate", content=b'{"prompt": "' + b"a" * (8 << 20) + b'"}')
    assert r.status_code == 413


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
async def test_fuzzed_websocket_frames_leave_the_socket_and_its_requests_alive(llama_server):
    frames = st.one_of(
        bodies.map(lambda b: json.dumps({"type": "generate", **_cap(b)}, allow_nan=True)),
        bodies.map(lambda b: json.dumps({"type": "generate", "id": "dup", **_cap(b)}, allow_nan=True)),
        st.text(max_size=50), values.map(lambda v: json.dumps(v, allow_nan=True)),
        st.just(json.dumps({"type": "cancel", "id": "nope"})),
    )
    samples = [frames.example() for _ in range(80)]
    url = llama_server.url.replace("http://", "ws://") + "/generate/ws"
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "keeper", "prompt": "Hello", "max_tokens": 200,
                                  "temperature": 0, "ignore_eos": True}))
        for frame in samples:
            await ws.send(frame)
        keeper = None
        while keeper is None:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert msg["type"] in ("delta", "done", "error")
            if msg["type"] == "error":
                assert msg["error"].get("error_id") is None or msg.get("status", 400) < 500, msg
            if msg.get("id") == "keeper" and msg["type"] == "done":
                keeper = msg
        assert len(keeper["token_ids"]) == 200
    assert httpx.get(llama_server.url + "/health").status_code == 200
