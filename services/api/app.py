"""The Starlette app: routes only; validation, streaming and ZMQ live in their modules.

Routes: `POST /generate` (JSON or SSE), `/generate/ws` (WebSocket), `GET /health`,
`GET /ready`, `GET /metrics`. Build it with `create_app(settings, tokenizer)`; the backend
binds its socket in the lifespan (or at the first request if the lifespan did not run),
and nothing else needs to be up for the app to start and answer 400s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from tokenizers import Tokenizer

from services.api.errors import ApiError, internal_error
from services.api.events import encode, response_from_done
from services.api.generation import Generation
from services.api.metrics import CONTENT_TYPE, status_label
from services.api.settings import ApiSettings
from services.api.state import ApiState
from services.api.streaming import EventStream, watch_disconnect
from services.api.validation import decode_json_object, parse_generate
from services.api.ws import WsSession

log = logging.getLogger("mstar.api")

JSON = "application/json"


def json_response(obj: object, status: int = 200) -> Response:
    return Response(encode(obj), status_code=status, media_type=JSON)  # type: ignore[arg-type]


def error_response(err: ApiError) -> Response:
    return json_response(err.body(), err.status)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing anything past `limit` bytes (413) without reading it all."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _state(request: Request | WebSocket) -> ApiState:
    return request.app.state.api


async def generate(request: Request) -> Response | EventStream:
    """POST /generate: validate, submit, then one JSON reply or an SSE stream."""
    started = time.perf_counter()
    arrival = time.time()
    state = _state(request)
    gen: Generation | None = None
    try:
        body = await read_body(request, state.settings.max_body_bytes)
        params = parse_generate(decode_json_object(body))
        gen = await state.start_generation(params, client_id=params.request_id, started=started, arrival_time=arrival)
    except ApiError as err:
        state.metrics.count(status_label(err.status))
        return error_response(err)
    except Exception as exc:
        state.metrics.count("error_5xx")
        return error_response(internal_error("accepting a /generate request", exc))

    watcher = watch_disconnect(request.receive, gen)
    handed_over = False
    try:
        if not params.stream:
            done = await gen.collect()
            return json_response(response_from_done(done))
        events = gen.events()
        # Wait for the first event before answering, so a refusal from the conductor
        # (a length limit, a footprint too large for the pool) is a real HTTP status.
        first = await anext(events)
        handed_over = True
        return EventStream(gen, events, first, watcher)
    except ApiError as err:
        return error_response(err)
    except Exception as exc:
        gen.close("error_5xx")
        return error_response(internal_error(f"serving {gen.request_id}", exc))
    finally:
        if not handed_over:
            watcher.cancel()
            gen.close()


async def generate_ws(ws: WebSocket) -> None:
    await WsSession(ws, _state(ws)).run()


async def health(request: Request) -> Response:
    """200 while the process lives (liveness, not readiness)."""
    return json_response({"status": "ok"})


async def ready(request: Request) -> Response:
    """200 only when the conductor answers and reports at least one ready worker."""
    state = _state(request)
    status = await state.backend.cluster_status()
    state.metrics.set_cluster_status(status)
    if status is None:
        timeout = state.settings.status_timeout_s
        return json_response({"status": "not_ready", "reason": f"conductor did not answer within {timeout:g} s"}, 503)
    if status.ready_workers < 1:
        return json_response({"status": "not_ready", "reason": "no worker is ready yet", "ready_workers": 0}, 503)
    return json_response({"status": "ready", "ready_workers": status.ready_workers})


async def metrics(request: Request) -> Response:
    state = _state(request)
    state.metrics.set_cluster_status(await state.backend.cluster_status())
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def _guard(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """A bug in a small route is a 500 with an error id, never a traceback to the client."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as err:
            return error_response(err)
        except Exception as exc:
            return error_response(internal_error(f"serving {request.url.path}", exc))

    guarded.__name__ = handler.__name__
    guarded.__doc__ = handler.__doc__
    return guarded


async def _unhandled(request: Request, exc: Exception) -> Response:
    return error_response(internal_error(f"serving {request.url.path}", exc))


def create_app(settings: ApiSettings, tokenizer: Tokenizer, state: ApiState | None = None) -> Starlette:
    """The api as an ASGI app; run it with uvicorn (see `services.api.__main__`)."""
    api = state or ApiState(settings, tokenizer)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await api.backend.start()
        log.info("api serving %s", settings.model_name)
        try:
            yield
        finally:
            await api.backend.close()

    routes = [
        Route("/generate", generate, methods=["POST"]),
        WebSocketRoute("/generate/ws", generate_ws),
        Route("/health", _guard(health), methods=["GET"]),
        Route("/ready", _guard(ready), methods=["GET"]),
        Route("/metrics", _guard(metrics), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={Exception: _unhandled})
    app.state.api = api
    return app
