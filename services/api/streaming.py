"""Server-Sent Events (`/generate`, the dialects' and the task routes with `stream: true`),
and disconnect detection.

What each event looks like on the wire is the route's `Reply` (`GenerateReply` here, each
dialect's in its `reply.py`); this module only runs the stream.

A client that goes away must abort its request everywhere (DESIGN.md section 4), also
while we are only waiting for its first token. So a small task watches the ASGI receive
channel for `http.disconnect` and cancels the generation; the cancel wakes whoever waits
on the request's queue, so no send or read ever waits on a gone client. This is our own
ASGI response instead of Starlette's StreamingResponse because the latter only closes its
iterator on disconnect for some ASGI spec versions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol, TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from services.api.errors import ApiError, internal_error
from services.api.events import DeltaEvent, DoneEvent, error_event, generate_event, response_from_done, sse_chunk
from shared import trace

log = logging.getLogger("mstar.api")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx and friends: do not buffer the stream
]


D_contra = TypeVar("D_contra", contravariant=True)
E_contra = TypeVar("E_contra", contravariant=True)


class Generating(Protocol):
    """What the stream and the disconnect watcher use of a `Generation`, or of a `FanOut`
    (several generations answered as one)."""

    client_id: str

    @property
    def request_id(self) -> str: ...

    def cancel(self) -> None: ...

    def close(self, label: str = ..., /) -> None: ...


async def _cancel_on_disconnect(receive: Receive, gen: Generating) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gen.cancel()
            return


class Reply(Protocol[D_contra, E_contra]):
    """How one route answers: the JSON body of a non-streamed reply (or a whole `Response`,
    e.g. a transcription as text/plain), and the SSE bytes of each event, of a failure after
    the stream began, and of its end. `D_contra` and `E_contra` are what its generation's
    `collect()` and `events()` give: a `DoneEvent` and `DeltaEvent | DoneEvent` events for
    one `Generation`, a list of them and `Indexed` events for a `FanOut` (`ManyReply`)."""

    def json(self, done: D_contra, /) -> msgspec.Struct | dict[str, Any] | Response: ...

    def event(self, event: E_contra, /) -> bytes: ...

    def error(self, err: ApiError) -> bytes: ...

    def end(self) -> bytes: ...


class GenerateReply:
    """`/generate`: the `GenerateResponse` body; SSE `data:` lines of the delta / done /
    error objects themselves (DESIGN.md section 7), nothing after the last."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id

    def json(self, done: DoneEvent) -> msgspec.Struct:
        return response_from_done(done)

    def event(self, event: DeltaEvent | DoneEvent) -> bytes:
        return sse_chunk(generate_event(event))

    def error(self, err: ApiError) -> bytes:
        return sse_chunk(error_event(self.client_id, err))

    def end(self) -> bytes:
        return b""


def watch_disconnect(receive: Receive, gen: Generating) -> asyncio.Task[None]:
    """Start the watcher; call only after the request body has been read."""
    return asyncio.get_running_loop().create_task(_cancel_on_disconnect(receive, gen),
                                                  name=f"disconnect-{gen.request_id}")


class EventStream:
    """ASGI response streaming one generation as `data: {json}` events.

    `first` is the event already taken from `events` (the route waits for it before
    answering, so an early refusal is a proper HTTP error instead of an SSE error event).
    The events are whatever `gen` yields (`Indexed` ones for a `FanOut`): `reply` is the one
    that reads them (`GenerateReply` by default, for a `Generation`'s).
    """

    def __init__(
        self,
        gen: Generating,
        events: AsyncIterator[Any],
        first: Any,
        watcher: asyncio.Task[None],
        reply: Reply[Any, Any] | None = None,
    ) -> None:
        self.gen = gen
        self.events = events
        self.first = first
        self.watcher = watcher
        self.reply = reply or GenerateReply(gen.client_id)
        #: a reply that streams something else than events (raw audio) says its own headers
        self.headers = getattr(self.reply, "headers", None) or SSE_HEADERS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gen = self.gen
        reply = self.reply
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            await self._body(send, reply.event(self.first))
            trace.stamp(gen.request_id, "api.first_written")
            try:
                async for event in self.events:
                    await self._body(send, reply.event(event))
            except ApiError as err:
                await self._body(send, reply.error(err))
            except (OSError, asyncio.CancelledError):
                raise
            except Exception as exc:
                gen.close("error_5xx")
                failure = internal_error(f"streaming {gen.request_id}", exc)
                await self._body(send, reply.error(failure))
            await send({"type": "http.response.body", "body": reply.end(), "more_body": False})
        except OSError:
            log.debug("client of %s went away mid-stream", gen.request_id)
        finally:
            self.watcher.cancel()
            gen.close()

    @staticmethod
    async def _body(send: Send, chunk: bytes) -> None:
        if chunk:  # an event that shows nothing (an OpenAI delta with no text) sends nothing
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
