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
from shared.frames import TokenLogprobs

#: what a -inf logprob (a masked token) is shown as: JSON has no infinity (vLLM's and OpenAI's value)
LOGPROB_FLOOR = -9999.0


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    #: prompt tokens the prefix cache served (OpenAI's `prompt_tokens_details.cached_tokens`);
    #: None (not shown) unless the deployment reports them (--enable-prompt-tokens-details)
    cached_tokens: int | None = None


class TopLogprob(msgspec.Struct, omit_defaults=True):
    token_id: int
    logprob: float


class Logprob(msgspec.Struct):
    """`/generate`'s logprobs of one position: the token, its logprob and rank (1 = most
    likely), and the `logprobs` most likely tokens, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[TopLogprob]


def floor(lp: float) -> float:
    return max(lp, LOGPROB_FLOOR)


def logprob_entries(ids: list[int], lps: list[TokenLogprobs]) -> list[Logprob]:
    return [Logprob(t, floor(lp.logprob), lp.rank,
                    [TopLogprob(i, floor(v)) for i, v in zip(lp.top_ids, lp.top_logprobs)])
            for t, lp in zip(ids, lps)]


class DeltaEvent(msgspec.Struct, tag_field="type", tag="delta"):
    """New text and the ids that produced it; the text may be '' while a character is
    incomplete, and the ids may be [] when a held-back character is flushed at the end.
    `logprobs`: one per id, only for a request that asked for them."""

    id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | UnsetType = UNSET
    #: on the first delta of a request that asked for its prompt's logprobs (as on done)
    prompt_logprobs: list[TokenLogprobs] | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    #: a speech model's sound these tokens made final: float32 little-endian samples
    #: (base64 in JSON)
    audio: bytes | UnsetType = UNSET


class DoneEvent(msgspec.Struct, tag_field="type", tag="done"):
    """The last event of a request: full text (== the deltas joined) and all ids (with
    their logprobs, and the prompt's, when asked)."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprobs] | UnsetType = UNSET
    #: one per prompt token after the first (the first has none)
    prompt_logprobs: list[TokenLogprobs] | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    #: what the engine reported of the run (a speech request's "language")
    metadata: dict[str, str] | UnsetType = UNSET
    #: vLLM's: the stop string, or the `stop_token_ids` token, that ended it
    stop_reason: int | str | UnsetType = UNSET
    #: a pooling request's result: float32 little-endian (the embedding routes decode it)
    pooled: bytes | UnsetType = UNSET
    #: a speech model's whole clip: float32 little-endian samples (base64 in JSON)
    audio: bytes | UnsetType = UNSET


class ErrorEvent(msgspec.Struct, tag_field="type", tag="error"):
    """A request failed (or a WebSocket frame was refused); `status` is the HTTP status
    the same failure would have had, `error` the usual error object."""

    id: str | None
    status: int
    error: dict[str, Any]


class GenerateResponse(msgspec.Struct):
    """The non-streaming `/generate` reply (`logprobs` / `prompt_logprobs` when asked)."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[Logprob] | UnsetType = UNSET
    prompt_logprobs: list[Logprob | None] | UnsetType = UNSET
    #: a speech model's clip: float32 little-endian samples at its rate, base64
    audio: bytes | UnsetType = UNSET


class GenerateDelta(msgspec.Struct, tag_field="type", tag="delta"):
    """`/generate`'s stream event for a request that asked for logprobs."""

    id: str
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | UnsetType = UNSET
    prompt_logprobs: list[Logprob | None] | UnsetType = UNSET


class GenerateDone(GenerateResponse, tag_field="type", tag="done"):
    """`/generate`'s last stream event for a request that asked for logprobs: the
    non-streaming reply's fields, tagged."""


def error_event(client_id: str | None, err: ApiError) -> ErrorEvent:
    return ErrorEvent(client_id, err.status, err.error_object())


def response_from_done(done: DoneEvent) -> GenerateResponse:
    out = GenerateResponse(done.id, done.text, done.token_ids, done.finish_reason, done.usage)
    out.logprobs, out.prompt_logprobs = _logprob_fields(done)
    out.audio = done.audio
    return out


def _logprob_fields(done: DoneEvent | DeltaEvent) -> tuple[list[Logprob] | UnsetType,
                                                           list[Logprob | None] | UnsetType]:
    lps = UNSET if done.logprobs is UNSET else logprob_entries(done.token_ids, done.logprobs)
    prompt: list[Logprob | None] | UnsetType = UNSET
    if done.prompt_logprobs is not UNSET and done.prompt_token_ids is not UNSET:
        prompt = [None, *logprob_entries(done.prompt_token_ids[1:], done.prompt_logprobs)]
    return lps, prompt


def generate_event(event: DeltaEvent | DoneEvent) -> msgspec.Struct:
    """The `/generate` stream / WebSocket object of an event (logprobs in `Logprob` form)."""
    if isinstance(event, DeltaEvent):  # a msgspec tagged union: no subclasses
        if event.logprobs is UNSET and event.prompt_logprobs is UNSET:
            return event
        return GenerateDelta(event.id, event.text, event.token_ids, *_logprob_fields(event))
    if event.logprobs is UNSET and event.prompt_logprobs is UNSET:
        return event
    lps, prompt = _logprob_fields(event)
    return GenerateDone(event.id, event.text, event.token_ids, event.finish_reason, event.usage, lps, prompt)


_encoder = msgspec.json.Encoder()


def encode(obj: msgspec.Struct | dict[str, Any]) -> bytes:
    return _encoder.encode(obj)


def sse_chunk(obj: msgspec.Struct) -> bytes:
    """One Server-Sent Event: `data: {json}` and a blank line."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"
