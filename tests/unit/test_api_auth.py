"""The optional API key: every route but /health and /ready needs `Authorization: Bearer
<key>`; refusals are 401 in OpenAI's error shape; a WebSocket handshake is refused."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse

from services.api.__main__ import build_parser
from services.api.app import create_app
from tests.unit.test_api_openai import make_settings
from tests.unit.test_api_validation import tiny_tokenizer

KEY = "s3cret-key"
GOOD = {"Authorization": f"Bearer {KEY}"}
MISSING = {"error": {"message": "missing API key: send the header Authorization: Bearer <key>",
                     "type": "invalid_request_error", "param": None, "error_id": None, "code": "invalid_api_key"}}
INVALID = {"error": {**MISSING["error"], "message": "invalid API key"}}


@pytest.fixture()
def client(tmp_path):
    with TestClient(create_app(make_settings(tmp_path, api_key=KEY), tiny_tokenizer())) as c:
        yield c


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                              ("POST", "/v1/chat/completions"), ("POST", "/generate"),
                                              ("GET", "/metrics"), ("GET", "/nope"), ("POST", "/tokenize"),
                                              ("POST", "/detokenize"), ("GET", "/version")])
def test_routes_need_the_key(client: TestClient, method: str, path: str) -> None:
    r = client.request(method, path, content=b"{}")
    assert r.status_code == 401 and r.json() == MISSING and r.headers["www-authenticate"] == "Bearer"
    for bad in ({"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
                {"Authorization": f"Basic {KEY}"}):
        r = client.request(method, path, content=b"{}", headers=bad)
        assert r.status_code == 401
    assert client.request(method, path, content=b"{}", headers={"Authorization": "Bearer wrong"}).json() == INVALID


def test_the_key_lets_requests_through(client: TestClient) -> None:
    assert client.get("/v1/models", headers=GOOD).status_code == 200
    # scheme is case-insensitive
    assert client.get("/metrics", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    r = client.post("/generate", content=json.dumps({"prompt": "x", "max_tokens": 0}), headers=GOOD)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # reached validation


def test_probes_stay_open(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 503  # not ready (no conductor), but not 401


def test_websocket_handshake_refused_without_key(client: TestClient) -> None:
    with pytest.raises(WebSocketDenialResponse) as info, client.websocket_connect("/generate/ws"):
        pass
    assert info.value.status_code == 401 and info.value.json() == MISSING
    with client.websocket_connect("/generate/ws", headers=GOOD) as ws:
        ws.send_text("not json")
        assert ws.receive_json()["type"] == "error"


def test_no_key_no_check(tmp_path) -> None:
    with TestClient(create_app(make_settings(tmp_path), tiny_tokenizer())) as c:
        assert c.get("/v1/models").status_code == 200


def test_flag_has_no_visible_default() -> None:
    args = build_parser().parse_args([])
    assert args.api_key is None
    assert build_parser().parse_args(["--api-key", "k"]).api_key == "k"


async def test_websocket_without_denial_extension_closes_1008() -> None:
    from services.api.auth import ApiKeyMiddleware

    async def app(scope, receive, send):  # pragma: no cover - must not be reached
        raise AssertionError("the app was called without a key")

    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "websocket.connect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/generate/ws", "headers": [(b"authorization", b"Bearer nope")]}
    await ApiKeyMiddleware(app, KEY)(scope, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "invalid API key"}]


def test_openpi_socket_takes_openpi_clients_key_header(client: TestClient) -> None:
    """openpi's client sends `Authorization: Api-Key <key>`; /healthz (openpi's probe) is open.
    This model is no policy, so the socket answers with an error frame naming the task."""
    assert client.get("/healthz").status_code == 200
    with pytest.raises(WebSocketDenialResponse) as info, client.websocket_connect("/"):
        pass
    assert info.value.status_code == 401
    with client.websocket_connect("/", headers={"Authorization": f"Api-Key {KEY}"}) as ws:
        assert json.loads(ws.receive_text())["error"]["param"] == "model"
