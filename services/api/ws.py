"""`/generate/ws`: many requests over one WebSocket (DESIGN.md section 7).

Client frames (`schemas.GenerateFrame`, `schemas.CancelFrame`): `{"type": "generate", "id":
..., <the /generate fields>}` and `{"type": "cancel", "id": ...}`. Server frames: the delta /
done / error objects of the SSE stream, each carrying the client's `id`. A bad frame gets an
error frame (naming the id if the frame had a string one) and leaves the socket and every
other request alone.

Choices (documented in the report / docs):
- `id` is required on both frame types: a string of 1-128 characters, unique among this
  socket's live requests (a duplicate is an error frame with status 409). It is only echoed;
  the wire id is the frame's `request_id` if given, else a fresh `gen-<uuid hex>`, so ids
  from different sockets never collide.
- `stream` defaults to true here; `stream: false` sends only the done frame.
- more than `ws_max_live` live requests on one socket: error frame with status 429.
- a cancel for an id that is not live (unknown, or already done): error frame with 404.
- closing the socket aborts every request still live on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.websockets import WebSocket

from services.api.errors import ApiError, HttpKind, internal_error
from services.api.events import DeltaEvent, encode, error_event, generate_event
from services.api.generation import Generation
from services.api.metrics import status_label
from services.api.schemas import CancelFrame, GenerateFrame
from services.api.state import ApiState
from services.api.validation import decode_json_object, generate_params, json_repr, load
from shared.errors import ErrorKind

log = logging.getLogger("mstar.api.ws")


class WsSession:
    """One accepted WebSocket: a reader loop plus one task per live request."""

    def __init__(self, ws: WebSocket, state: ApiState) -> None:
        self.ws = ws
        self.state = state
        self.live: dict[str, tuple[Generation, asyncio.Task[None]]] = {}
        self._send_lock = asyncio.Lock()
        self._gone = False

    async def run(self) -> None:
        await self.ws.accept()
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("bytes")
                if data is None:
                    data = (message.get("text") or "").encode("utf-8", "surrogatepass")
                await self._frame(data)
        finally:
            self._gone = True
            entries = list(self.live.values())
            self.live.clear()
            for gen, task in entries:
                gen.close()  # aborts it everywhere
                task.cancel()
            if entries:
                await asyncio.gather(*(t for _, t in entries), return_exceptions=True)

    async def _send(self, payload: bytes) -> bool:
        """Send one frame; False once the socket is gone (the reader loop then cleans up)."""
        if self._gone:
            return False
        try:
            async with self._send_lock:
                await self.ws.send_text(payload.decode())
            return True
        except Exception:  # closed socket: WebSocketDisconnect, RuntimeError, OSError...
            self._gone = True
            return False

    async def _send_error(self, client_id: str | None, err: ApiError) -> None:
        await self._send(encode(error_event(client_id, err)))

    async def _frame(self, data: bytes) -> None:
        client_id: str | None = None
        kind: Any = None
        try:
            limit = self.state.settings.max_body_bytes
            if len(data) > limit:
                raise ApiError(HttpKind.TOO_LARGE, f"frame exceeds {limit} bytes")
            obj = decode_json_object(data, what="frame")
            client_id = obj["id"] if isinstance(obj.get("id"), str) else None  # echoed on an error
            kind = obj.get("type")
            if kind == "generate":
                await self._generate(obj)
            elif kind == "cancel":
                self._cancel(obj)
            else:
                raise ApiError(ErrorKind.INVALID, f'type must be "generate" or "cancel", got {json_repr(kind)}', "type")
        except ApiError as err:
            if kind == "generate":
                self.state.metrics.count(status_label(err.status))
            await self._send_error(client_id, err)
        except Exception as exc:
            failure = internal_error("handling a websocket frame", exc)
            if kind == "generate":
                self.state.metrics.count(status_label(failure.status))
            await self._send_error(client_id, failure)

    async def _generate(self, obj: dict[str, Any]) -> None:
        started = time.perf_counter()
        arrival = time.time()
        frame = load(obj, GenerateFrame)
        if frame.id in self.live:
            raise ApiError(ErrorKind.CONFLICT, f"id {frame.id!r} is already live on this socket", "id")
        limit = self.state.settings.ws_max_live
        if len(self.live) >= limit:
            raise ApiError(HttpKind.RATE_LIMITED, f"too many live requests on this socket (limit {limit})")
        params = generate_params(frame)
        gen = await self.state.start_generation(params, client_id=frame.id, started=started, arrival_time=arrival)
        stream = True if params.stream is None else params.stream
        task = asyncio.get_running_loop().create_task(self._drive(gen, stream), name=f"ws-{gen.request_id}")
        self.live[frame.id] = (gen, task)

    def _cancel(self, obj: dict[str, Any]) -> None:
        frame = load(obj, CancelFrame)
        entry = self.live.get(frame.id)
        if entry is None:
            raise ApiError(HttpKind.NOT_FOUND, f"no live request with id {frame.id!r} on this socket", "id")
        entry[0].cancel()  # its task then sends done with finish_reason "abort"

    async def _drive(self, gen: Generation, stream: bool) -> None:
        try:
            async for event in gen.events():
                if not stream and type(event) is DeltaEvent:
                    continue
                if not await self._send(encode(generate_event(event))):
                    break
        except ApiError as err:
            await self._send_error(gen.client_id, err)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            gen.close("error_5xx")
            await self._send_error(gen.client_id, internal_error(f"streaming {gen.request_id} over websocket", exc))
        finally:
            gen.close()
            entry = self.live.get(gen.client_id)
            if entry is not None and entry[0] is gen:
                del self.live[gen.client_id]
