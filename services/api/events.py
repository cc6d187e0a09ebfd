"""The JSON objects the api sends back (DESIGN.md section 7), as msgspec Structs.

Structs rather than dicts because they are built once per output frame per request: this
is the hot path of streaming, and msgspec encodes a Struct without building a dict.
The same delta / done / error objects are SSE `data:` lines and WebSocket frames.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from services.api.errors import ApiError


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int


class DeltaEvent(msgspec.Struct, tag_field="type", tag="delta"):
    """New text and the ids that produced it; the text may be '' while a character is
    incomplete, and the ids may be [] when a held-back character is flushed at the end."""

    id: str
    text: str
    token_ids: list[int]


class DoneEvent(msgspec.Struct, tag_field="type", tag="done"):
    """The last event of a request: full text (== the deltas joined) and all ids."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    #: what the engine reported of the run (a speech request's "language")
    metadata: dict[str, str] | UnsetType = UNSET


class ErrorEvent(msgspec.Struct, tag_field="type", tag="error"):
    """A request failed (or a WebSocket frame was refused); `status` is the HTTP status
    the same failure would have had, `error` the usual error object."""

    id: str | None
    status: int
    error: dict[str, Any]


class GenerateResponse(msgspec.Struct):
    """The non-streaming `/generate` reply."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage


def error_event(client_id: str | None, err: ApiError) -> ErrorEvent:
    return ErrorEvent(client_id, err.status, err.error_object())


def response_from_done(done: DoneEvent) -> GenerateResponse:
    return GenerateResponse(done.id, done.text, done.token_ids, done.finish_reason, done.usage)


_encoder = msgspec.json.Encoder()


def encode(obj: msgspec.Struct | dict[str, Any]) -> bytes:
    return _encoder.encode(obj)


def sse_chunk(obj: msgspec.Struct) -> bytes:
    """One Server-Sent Event: `data: {json}` and a blank line."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"
