"""Server-Sent Events for `/generate` with `stream: true`, and disconnect detection.

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

from starlette.types import Receive, Scope, Send

from services.api.errors import ApiError, internal_error
from services.api.events import DeltaEvent, DoneEvent, error_event, sse_chunk
from services.api.generation import Generation

log = logging.getLogger("mstar.api")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx and friends: do not buffer the stream
]


async def _cancel_on_disconnect(receive: Receive, gen: Generation) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gen.cancel()
            return


def watch_disconnect(receive: Receive, gen: Generation) -> asyncio.Task[None]:
    """Start the watcher; call only after the request body has been read."""
    return asyncio.get_running_loop().create_task(_cancel_on_disconnect(receive, gen), name=f"disconnect-{gen.request_id}")


class EventStream:
    """ASGI response streaming one generation as `data: {json}` events.

    `first` is the event already taken from `events` (the route waits for it before
    answering, so an early refusal is a proper HTTP error instead of an SSE error event).
    """

    def __init__(self, gen: Generation, events: AsyncIterator[DeltaEvent | DoneEvent], first: DeltaEvent | DoneEvent, watcher: asyncio.Task[None]) -> None:
        self.gen = gen
        self.events = events
        self.first = first
        self.watcher = watcher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gen = self.gen
        try:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            await send({"type": "http.response.body", "body": sse_chunk(self.first), "more_body": True})
            try:
                async for event in self.events:
                    await send({"type": "http.response.body", "body": sse_chunk(event), "more_body": True})
            except ApiError as err:
                await send({"type": "http.response.body", "body": sse_chunk(error_event(gen.client_id, err)), "more_body": True})
            except (OSError, asyncio.CancelledError):
                raise
            except Exception as exc:
                gen.close("error_5xx")
                err = internal_error(f"streaming {gen.request_id}", exc)
                await send({"type": "http.response.body", "body": sse_chunk(error_event(gen.client_id, err)), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            log.debug("client of %s went away mid-stream", gen.request_id)
        finally:
            self.watcher.cancel()
            gen.close()
