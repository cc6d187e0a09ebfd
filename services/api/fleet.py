"""Several models behind one api (llama-server's router mode, issue 57).

Each served model has the whole single-model app (`app.create_app`: its settings, its
tokenizer and chat template, its backend bound at its own output socket and sending to
its own data worker, its metrics under its `model_name`); `ModelRouter` is the ASGI app
in front of them:
- a request is handed to the app of the model its body names: a JSON body's `model`, a
  form's `model` field, a WebSocket's `?model=` query; where a route has none (`/generate`)
  or names none, to the default model (the first). A name no model has is a 404
  `model_not_found` listing the served names (Anthropic's error shape on `/v1/messages`,
  OpenAI's elsewhere; a WebSocket's handshake is refused with it, as a missing API key's
  is); a body that does not parse goes to the default app, whose 400 says why;
- its own routes: `GET /v1/models[/{model}]` (every model's card, each as its app gives
  it: with its task), llama-server's `GET /models`, `POST /models/load` and
  `/models/unload` (`{"model": name}`: the conductor loads or drains it, `ModelCommand`),
  `/ready` (200 once a worker of any model is ready), `/metrics` (every app's series,
  merged by family: each series carries its `model_name`); `/v1/responses/{id}` is asked
  of each app in turn (a stored response lives in its model's app).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from services.api.auth import WS_POLICY_VIOLATION
from services.api.backend import Backend
from services.api.chat_request import SERVED, check_model
from services.api.errors import ApiError, invalid
from services.api.events import encode
from services.api.forms import is_form, parse_form
from services.api.metrics import CONTENT_TYPE
from services.api.serving import guard, json_response
from shared.errors import ErrorKind
from shared.frames import ClusterStatus, ModelCommand, StatusQuery

log = logging.getLogger("mstar.api")

#: the most bytes a WebSocket close frame's reason may have (RFC 6455: 125 less the code's 2)
WS_REASON_BYTES = 123
#: the router's own paths; every other path is a model's
OWN_PATHS = ("/v1/models", "/models", "/models/load", "/models/unload", "/ready", "/metrics")


class _ModelField(msgspec.Struct):
    """What the router reads of a JSON body: its `model`, any type (the app checks it)."""

    model: Any = None


class ModelRouter:
    def __init__(self, apps: dict[str, Starlette], max_body_bytes: int) -> None:
        self.apps = apps
        self.default = next(iter(apps))
        self.names = tuple(apps)
        self.max_body_bytes = max_body_bytes
        self.own = Starlette(routes=[
            Route("/v1/models", guard(self.list_cards), methods=["GET"]),
            Route("/v1/models/{model:path}", guard(self.get_card), methods=["GET"]),
            Route("/models", guard(self.list_models), methods=["GET"]),
            Route("/models/load", guard(self.load), methods=["POST"]),
            Route("/models/unload", guard(self.unload), methods=["POST"]),
            Route("/ready", guard(self.ready), methods=["GET"]),
            Route("/metrics", guard(self.metrics), methods=["GET"]),
        ])

    @property
    def control(self) -> Backend:
        """The default model's backend: its DEALER asks the conductor for every model."""
        return self.apps[self.default].state.api.backend

    def fail_live(self, message: str = "server is shutting down") -> int:
        return sum(app.state.api.backend.fail_live(message) for app in self.apps.values())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        SERVED.set(self.names)
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path = scope.get("path", "")
        if path in OWN_PATHS or path.startswith("/v1/models/"):
            await self.own(scope, receive, send)
            return
        if scope["type"] == "websocket":
            name = parse_qs(scope.get("query_string", b"").decode()).get("model", [None])[0]
            if name is not None and name not in self.apps:
                await _refuse_handshake(scope, receive, send, self._not_found_error(name))
                return
            await self.apps[name or self.default](scope, receive, send)
            return
        if path.startswith("/v1/responses/"):  # a stored response lives in its model's app
            await self._first_found(scope, receive, send)
            return
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.apps[self.default](scope, receive, send)
            return
        chunks, more = await self._read(receive)
        name = self._model_of(b"".join(chunks), _header(scope, b"content-type")) if not more else None
        if isinstance(name, str) and name not in self.apps:
            await self._not_found(scope, name)(scope, receive, send)
            return
        app = self.apps.get(name if isinstance(name, str) else self.default, self.apps[self.default])
        await app(scope, _replay(chunks, more, receive), send)

    def _not_found_error(self, name: str) -> ApiError:
        """The 404 `model_not_found` of a name no model has, naming every served model."""
        try:
            check_model(name, self.default)
        except ApiError as err:
            return err
        raise AssertionError("check_model passed an unknown name")

    def _not_found(self, scope: Scope, name: str) -> Response:
        """404 `model_not_found` naming every served model, in the route's dialect
        (Anthropic's shape on /v1/messages, OpenAI's elsewhere)."""
        err = self._not_found_error(name)
        if scope.get("path", "").startswith("/v1/messages"):
            body = {"type": "error", "error": {"type": "not_found_error", "message": f"model: {err.message}"}}
            return json_response(body, err.status)
        return json_response(err.body(), err.status)

    async def _first_found(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The answer of the first app that does not answer 404 (the last app's 404 else):
        `/v1/responses/{id}` (GET, DELETE, cancel) names a response only its model's app
        stored. Each app's answer is held until its status is known."""
        chunks, _ = await self._read(receive)
        apps = list(self.apps.values())
        for i, app in enumerate(apps):
            held: list[Message] = []
            await app(scope, _replay(chunks, False, receive), _holder(held))
            status = next((m["status"] for m in held if m["type"] == "http.response.start"), 500)
            if status != 404 or i == len(apps) - 1:
                for message in held:
                    await send(message)
                return

    async def _read(self, receive: Receive) -> tuple[list[bytes], bool]:
        """The body's chunks, up to the body limit: (chunks, whether more follows unread);
        past the limit the app reads the rest itself and refuses it (413)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return chunks, False
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False):
                return chunks, False
            if size > self.max_body_bytes:
                return chunks, True

    @staticmethod
    def _model_of(body: bytes, content_type: str | None) -> Any:
        """The body's `model` (None where it names none or does not parse: the default
        app then answers it, its 400 included)."""
        try:
            if is_form(content_type):
                return parse_form(body, content_type).fields.get("model")
            return msgspec.json.decode(body, type=_ModelField).model
        except (ApiError, msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Every model's app starts (its backend binds) and stops with the router."""
        message = await receive()
        assert message["type"] == "lifespan.startup"
        async with contextlib.AsyncExitStack() as stack:
            try:
                for app in self.apps.values():
                    await stack.enter_async_context(app.router.lifespan_context(app))
            except Exception as exc:
                log.exception("an app failed to start")
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
            await send({"type": "lifespan.startup.complete"})
            message = await receive()
        await send({"type": "lifespan.shutdown.complete"})

    # -- the router's own routes ---------------------------------------------------------------

    async def _ask(self, query: StatusQuery | ModelCommand) -> ClusterStatus:
        status = await self.control.ask(query)
        if status is None:
            raise ApiError(ErrorKind.UNAVAILABLE, "the conductor did not answer")
        return status

    async def _cards(self) -> list[dict[str, Any]]:
        cards = []
        for app in self.apps.values():
            status, body = await asgi_get(app, "/v1/models")
            if status == 200:
                cards += msgspec.json.decode(body)["data"]
        return cards

    async def list_cards(self, request: Request) -> Response:
        """GET /v1/models: every served model's card (its own app's, with its task)."""
        return json_response({"object": "list", "data": await self._cards()})

    async def get_card(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.apps:
            check_model(name, self.default)
        status, body = await asgi_get(self.apps[name], "/v1/models")
        return json_response(msgspec.json.decode(body)["data"][0], status)

    async def list_models(self, request: Request) -> Response:
        """GET /models (llama-server's router): each model with its load `status` and
        whether the conductor wants it loaded (the launcher starts and stops its workers by it)."""
        status = await self._ask(StatusQuery())
        cards = {c["id"]: c for c in await self._cards()}
        data = [{**cards.get(m.name, {"id": m.name, "object": "model"}), "status": {"value": m.status},
                 "wanted": m.wanted, "ready_workers": m.ready_workers, "running": m.running, "waiting": m.waiting,
                 "idle_s": m.idle_s} for m in status.models]
        return json_response({"object": "list", "data": data})

    async def _command(self, request: Request, action: str) -> Response:
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            raise invalid("model", f"the body must be a JSON object {{\"model\": name}}: {exc}") from None
        name = body.get("model") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise invalid("model", "`model` (a served model's name) is required")
        if name not in self.apps:
            check_model(name, self.default)
        status = await self._ask(ModelCommand(action, name))
        if status.error:
            raise invalid("model", status.error)
        return json_response({"success": True})

    async def load(self, request: Request) -> Response:
        """POST /models/load {"model": name}: loads it (taking the least recently used
        model's slot under --models-max); answers at once, the load runs on."""
        return await self._command(request, "load")

    async def unload(self, request: Request) -> Response:
        """POST /models/unload {"model": name}: it finishes what runs, then its gpu workers stop."""
        return await self._command(request, "unload")

    async def ready(self, request: Request) -> Response:
        status = await self.control.ask(StatusQuery())
        if status is None:
            return json_response({"status": "not_ready", "reason": "the conductor did not answer"}, 503)
        models = {m.name: m.status for m in status.models}
        if status.ready_workers < 1:
            return json_response({"status": "not_ready", "reason": "no worker is ready yet", "ready_workers": 0,
                                  "models": models}, 503)
        return json_response({"status": "ready", "ready_workers": status.ready_workers, "models": models})

    async def metrics(self, request: Request) -> Response:
        texts = [(await asgi_get(app, "/metrics"))[1].decode() for app in self.apps.values()]
        return Response(merge_metrics(texts), media_type=CONTENT_TYPE)


def merge_metrics(texts: Iterable[str]) -> str:
    """Prometheus texts of several registries as one: each family's HELP and TYPE once,
    then every registry's samples of it (the format wants a family's lines together)."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    current: tuple[list[str], list[str]] | None = None
    for text in texts:
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                head, _ = current = families.setdefault(name, ([], []))
                if len(head) < 2 and line not in head:
                    head.append(line)
            elif line and current is not None:
                current[1].append(line)
    return "".join("\n".join(head + samples) + "\n" for head, samples in families.values())


async def asgi_get(app: Starlette, path: str) -> tuple[int, bytes]:
    """GET `path` of an app in process (no socket): its status and body."""
    scope: dict[str, Any] = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(),
                             "query_string": b"", "headers": [], "http_version": "1.1", "scheme": "http",
                             "server": ("127.0.0.1", 0), "client": ("127.0.0.1", 0), "root_path": "", "app": app}
    got: dict[str, Any] = {"status": 500, "body": []}

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            got["status"] = message["status"]
        elif message["type"] == "http.response.body":
            got["body"].append(message.get("body", b""))

    await app(scope, receive, send)
    return got["status"], b"".join(got["body"])


async def _refuse_handshake(scope: Scope, receive: Receive, send: Send, err: ApiError) -> None:
    """Refuse a WebSocket handshake as the api key check does (services/api/auth.py): the
    error's status and its JSON body where the server offers the ASGI
    `websocket.http.response` extension (uvicorn does), else a close with 1008 (policy
    violation, which servers answer the handshake with a 403), its reason the message cut
    to the 123 bytes a close frame allows."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        body = encode(err.body())
        await send({"type": "websocket.http.response.start", "status": err.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    reason = err.message.encode()[:WS_REASON_BYTES].decode(errors="ignore")
    await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION, "reason": reason})


def _holder(held: list[Message]) -> Send:
    """A send that keeps what the app sends, for the router to pass on or drop."""

    async def hold(message: Message) -> None:
        held.append(message)

    return hold


def _header(scope: Scope, name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == name), None)


def _replay(chunks: list[bytes], more: bool, receive: Receive) -> Receive:
    """A receive that gives the chunks already read, then the rest from `receive`."""
    pending = list(chunks)

    async def replay() -> Message:
        if pending:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending) or more}
        return await receive()

    return replay

