"""Optional API key (`--api-key` / `MSTAR_API_KEY`): `Authorization: Bearer <key>` (or
`Api-Key <key>`, openpi's client's), or `x-api-key: <key>` (Anthropic's header, which its
SDK sends).

An ASGI middleware in front of every route, so no route can forget the check; only the
probes `/health` and `/ready` stay open (orchestrators call them without credentials).
`/metrics` needs the key like everything else (Prometheus can send a bearer token).

A refusal is 401 with OpenAI's error body (`type` invalid_request_error, `code`
invalid_api_key) and `WWW-Authenticate: Bearer`; under `/v1/messages` the body is
Anthropic's (`{"type": "error", "error": {"type": "authentication_error", ...}}`). A
WebSocket handshake without the key is refused before it is accepted: with a 401 and the
same body where the server offers the ASGI `websocket.http.response` extension, else by
closing with 1008 (policy violation), which servers turn into an HTTP 403 to the handshake.

The comparison is constant-time (`hmac.compare_digest`), so a key cannot be found by
timing replies.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from services.api.errors import ApiError, HttpKind
from services.api.events import encode

OPEN_PATHS = ("/health", "/healthz", "/ready")
WS_POLICY_VIOLATION = 1008


def bearer_token(scope: Scope) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header (or `Api-Key <token>`, what
    openpi's WebSocket client sends), or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() in (b"bearer", b"api-key") and token.strip():
                return token.strip()
            return None
    return None


def api_key_header(scope: Scope) -> bytes | None:
    """The value of an `x-api-key` header (Anthropic's), or None."""
    for name, value in scope.get("headers", ()):
        if name == b"x-api-key":
            return value.strip() or None
    return None


def auth_error(token: bytes | None) -> ApiError:
    message = "missing API key: send the header Authorization: Bearer <key>" if token is None else "invalid API key"
    return ApiError(HttpKind.UNAUTHORIZED, message, code="invalid_api_key")


def _body(err: ApiError, token: bytes | None, path: str) -> bytes:
    """The 401's body: Anthropic's error shape (naming its header) on its routes, OpenAI's elsewhere."""
    if path.startswith("/v1/messages"):
        message = "missing API key: send the header x-api-key: <key>" if token is None else err.message
        return encode({"type": "error", "error": {"type": "authentication_error", "message": message}})
    return encode(err.body())


class ApiKeyMiddleware:
    """Refuses HTTP requests and WebSocket handshakes that do not carry the key."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: Iterable[str] = OPEN_PATHS) -> None:
        if not api_key:
            raise ValueError("api_key must be non-empty")
        self.app = app
        self._key = api_key.encode()
        self._open = frozenset(open_paths)

    def _allowed(self, scope: Scope) -> tuple[bool, bytes | None]:
        tokens = [t for t in (bearer_token(scope), api_key_header(scope)) if t is not None]
        ok = [hmac.compare_digest(t, self._key) for t in tokens]  # each compared, in constant time
        return any(ok), tokens[0] if tokens else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in self._open:
            await self.app(scope, receive, send)
            return
        ok, token = self._allowed(scope)
        if ok:
            await self.app(scope, receive, send)
            return
        err = auth_error(token)
        if scope["type"] == "http":
            await _send_401(send, "http.response", _body(err, token, scope.get("path", "")))
            return
        # WebSocket: take the connect event, then refuse the handshake.
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        if "websocket.http.response" in scope.get("extensions", {}):
            await _send_401(send, "websocket.http.response", encode(err.body()))
        else:
            await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION, "reason": err.message})


async def _send_401(send: Send, prefix: str, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
               (b"content-length", str(len(body)).encode())]
    await send({"type": f"{prefix}.start", "status": 401, "headers": headers})
    await send({"type": f"{prefix}.body", "body": body})
