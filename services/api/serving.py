"""The life of one HTTP generation request, shared by `/generate` and the `/v1/*` routes.

read the body (413 past the limit) -> decode it (JSON, or a multipart form for audio
uploads) -> the route's `accept` validates it into what to generate and how to answer
(`Prepared`) -> submit -> one JSON (or plain text) reply, or an SSE stream whose status
line waits for the first event (so a conductor refusal is a real 4xx).
A disconnect watcher runs from submission on, so a client that goes away aborts its
request everywhere whether it was waiting for JSON or reading a stream.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket

from services.api.errors import ApiError, HttpKind, internal_error
from services.api.events import encode
from services.api.fanout import Choice, FanOut
from services.api.generation import Generation
from services.api.metrics import status_label
from services.api.state import ApiState
from services.api.streaming import EventStream, Reply, watch_disconnect
from services.api.validation import GenerateParams, decode_json_object
from shared import trace

JSON = "application/json"


class Prepared(NamedTuple):
    """A validated request: what to generate, whether to stream, and how to answer; with
    `choices`, several generations answered as one (`fanout.py`: n > 1, a prompt list), and
    `reply` reads a `FanOut`'s results (a `ManyReply`) instead of one `Generation`'s."""

    params: GenerateParams
    stream: bool
    reply: Reply[Any, Any]
    choices: tuple[Choice, ...] | list[Choice] = ()
    #: what the request asks of the model ("generate"; "embed" or "score" for the pooling
    #: routes): a model of another task refuses it (`ApiState.start_generation`)
    task: str = "generate"


async def with_images(prepared: Prepared, state: ApiState) -> Prepared:
    """The request with the images it names fetched and checked once, for all its choices
    (`n` > 1 samples one fetch), before any generation starts."""
    if not prepared.params.image_refs:
        return prepared
    images = await state.load_images(prepared.params)
    choices = [c._replace(params=msgspec.structs.replace(c.params, images=images)) for c in prepared.choices]
    return prepared._replace(params=msgspec.structs.replace(prepared.params, images=images), choices=choices)


def json_response(obj: msgspec.Struct | dict[str, Any], status: int = 200,
                  headers: Mapping[str, str] | None = None) -> Response:
    return Response(encode(obj), status_code=status, media_type=JSON, headers=headers)


def error_response(err: ApiError) -> Response:
    return json_response(err.body(), err.status)


def guard(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """A small route (no generation, so not through `serve`) whose bug is a 500 with an
    error id, never a traceback to the client; here so a dialect's small routes
    (`/v1/models`) get it as `app.py`'s do."""

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


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing anything past `limit` bytes (413) without reading it all."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(HttpKind.TOO_LARGE, f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(HttpKind.TOO_LARGE, f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def api_state(conn: Request | WebSocket) -> ApiState:
    return conn.app.state.api


def json_body(body: bytes, content_type: str | None) -> dict[str, Any]:
    """The default body decoder: a strict JSON object (the Content-Type is not checked)."""
    return decode_json_object(body)


async def serve(request: Request, accept: Callable[[Any, ApiState], Prepared | Awaitable[Prepared]], what: str,
                decode: Callable[[bytes, str | None], Any] = json_body,
                errors: Callable[[ApiError], Response] = error_response) -> Response | EventStream:
    """Run one request end to end; `what` names the route in logs. `decode` turns the body
    (and its Content-Type) into what `accept` takes: a JSON object, or a `forms.Form`.
    `errors` writes a refusal in the route's dialect (OpenAI's shape unless told)."""
    started = time.perf_counter()
    arrival = time.time()
    arrived_ms = time.monotonic() * 1e3
    state = api_state(request)
    gen: Generation | FanOut | None = None
    try:
        body = await read_body(request, state.settings.max_body_bytes)
        accepted = accept(decode(body, request.headers.get("content-type")), state)
        if inspect.isawaitable(accepted):  # a route that fetches its own media (/v1/actions' cameras)
            accepted = await accepted
        prepared = await with_images(accepted, state)
        params = prepared.params
        if trace.enabled():
            trace.stamp(params.request_id, "api.arrive", arrived_ms)
            trace.stamp(params.request_id, "api.accepted")
        if prepared.choices:
            gen = await FanOut(prepared.choices, lambda c: state.start_generation(
                c.params, client_id=c.params.request_id, started=started, arrival_time=arrival,
                count_prompt=c.after is None, task=prepared.task), params.request_id).start()
        else:
            gen = await state.start_generation(params, client_id=params.request_id, started=started,
                                               arrival_time=arrival, task=prepared.task)
    except ApiError as err:
        state.metrics.count(status_label(err.status))
        return errors(err)
    except Exception as exc:
        state.metrics.count("error_5xx")
        return errors(internal_error(f"accepting a {what} request", exc))

    watcher = watch_disconnect(request.receive, gen)
    handed_over = False
    try:
        if not prepared.stream:
            done = await gen.collect()
            reply = prepared.reply.json(done)
            return reply if isinstance(reply, Response) else json_response(reply)
        events = gen.events()
        # Wait for the first event before answering, so a refusal from the conductor
        # (a length limit, a footprint too large for the pool) is a real HTTP status.
        first = await anext(events)
        trace.stamp(gen.request_id, "api.first_event")
        handed_over = True
        return EventStream(gen, events, first, watcher, prepared.reply)
    except ApiError as err:
        return errors(err)
    except Exception as exc:
        gen.close("error_5xx")
        return errors(internal_error(f"serving {gen.request_id}", exc))
    finally:
        if not handed_over:
            watcher.cancel()
            gen.close()
