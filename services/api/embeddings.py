"""`POST /v1/embeddings` (OpenAI's and vLLM's shape) for embedding models.

Each input is one engine request (a prompt and no decode loop), so the inputs of one call
and of many calls batch together in the gpu worker's steps, under its token budget; the
pooled vector comes back as float32 bytes, sent as a JSON list of floats or, with
`encoding_format: "base64"`, as those bytes in base64 (what the `openai` client asks for
by default). `input` is a string, a list of strings, a list of token ids, or a list of
such lists. An input longer than the model's max length is a 400 from the conductor,
unless the client sets `truncate_prompt_tokens` (a count, or -1 for the max length): then
it is cut as the tokenizer's own truncation cuts (sentence-transformers' way).
`dimensions` cuts a Matryoshka model's vectors (normalized again where the model
normalizes); for other models it is a 400, as vLLM answers.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.api.chat_request import check_model
from services.api.errors import ApiError, invalid
from services.api.events import DoneEvent
from services.api.fanout import Choice
from services.api.schemas import MAX_INPUTS, EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from services.api.serving import Prepared, serve
from services.api.state import ApiState, task_refusal
from services.api.streaming import EventStream
from services.api.validation import GenerateParams, load, new_request_id
from shared.deferred import deferred
from shared.frames import SamplingParams

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

#: a pooling route's reply from its requests' done events (in input order), its id and time
Answer = Callable[[list[DoneEvent], str, int], msgspec.Struct]


class PooledReply:
    """How a pooling route answers: one JSON body from all of its inputs' results (never
    streamed: the `Reply` methods of a stream are not reached)."""

    def __init__(self, answer: Answer, request_id: str) -> None:
        self.answer, self.request_id, self.created = answer, request_id, int(time.time())

    def json(self, dones: list[DoneEvent]) -> msgspec.Struct:
        return self.answer(dones, self.request_id, self.created)

    # never reached: a pooling route is not streamed (`Prepared.stream` is False)
    def event(self, event: object) -> bytes:
        raise RuntimeError("a pooling route does not stream")

    def error(self, err: ApiError) -> bytes:
        raise RuntimeError("a pooling route does not stream")

    def end(self) -> bytes:
        raise RuntimeError("a pooling route does not stream")


def prepared(choices: list[Choice], answer: Answer, task: str) -> Prepared:
    """The pooling request as `serving.serve` runs it: its inputs fanned out, one reply."""
    request_id = choices[0].params.request_id.rsplit("-", 1)[0]
    return Prepared(choices[0].params, False, PooledReply(answer, request_id), choices, task)


def inputs(req: EmbeddingRequest) -> list[tuple[str | None, list[int] | None]]:
    """Each input as (text, None) or (None, ids); 400 for an empty or mixed list."""
    value = req.input
    if isinstance(value, str):
        return [(value, None)]
    if not value:
        raise invalid("input", "input must not be an empty list")
    if len(value) > MAX_INPUTS:
        raise invalid("input", f"input must hold at most {MAX_INPUTS} items, got {len(value)}")
    kinds = {type(v) for v in value}
    if kinds == {str}:
        return [(v, None) for v in value]  # type: ignore[misc]  # narrowed by the kinds check
    if kinds == {int}:
        return [(None, list(value))]  # type: ignore[arg-type]  # one input of token ids
    if kinds == {list}:
        for i, ids in enumerate(value):
            if not ids:
                raise invalid("input", f"input[{i}] must not be an empty list of token ids")
        return [(None, list(v)) for v in value]  # type: ignore[arg-type]
    raise invalid("input", "input must be a string, a list of strings, a list of token ids, or a list of lists of "
                           "token ids, not a mix")


def accept(obj: Any, state: ApiState) -> Prepared:
    """One engine request per input, and how their results become the reply."""
    settings = state.settings
    if settings.task != "embed":
        raise invalid("model", task_refusal(settings.model_name, settings.task, "embed"))
    req = load(obj, EmbeddingRequest)
    check_model(req.model, settings.model_name)
    if req.dimensions is not None:
        if not settings.matryoshka:
            raise invalid("dimensions", f"model {settings.model_name!r} does not support matryoshka "
                                        "representation; dimensions must be omitted")
        if req.dimensions > settings.dimensions:
            raise invalid("dimensions", f"dimensions must be <= the model's {settings.dimensions}, "
                                        f"got {req.dimensions}")
    choices = pooled_choices(inputs(req), truncation(req.truncate_prompt_tokens, settings.max_model_len),
                             req.add_special_tokens)

    def answer(dones: list[DoneEvent], request_id: str, created: int) -> msgspec.Struct:
        data = []
        for i, done in enumerate(dones):
            vec = vector(pooled(done, i), req.dimensions, settings.normalized)
            out: list[float] | str = (base64.b64encode(vec.tobytes()).decode() if req.encoding_format == "base64"
                                      else vec.tolist())
            data.append(EmbeddingData(i, out))
        tokens = sum(d.usage.prompt_tokens for d in dones)
        return EmbeddingResponse(f"embd-{request_id}", data, settings.model_name, EmbeddingUsage(tokens, tokens),
                                 created=created)

    return prepared(choices, answer, "embed")


def truncation(cut: int | None, max_len: int) -> dict[str, int | str | float | bool]:
    """The data worker's options for vLLM's `truncate_prompt_tokens` (-1: the max length)."""
    if cut is None:
        return {}
    if cut == 0:
        raise invalid("truncate_prompt_tokens", "truncate_prompt_tokens must be an integer >= 1, or -1 for the "
                                                "model's max length, got 0")
    return {"truncate_prompt_tokens": max_len if cut == -1 else cut}


def pooled_choices(items: list[tuple[str | None, list[int] | None]], options: dict[str, int | str | float | bool],
                   add_special_tokens: bool = True, pairs: list[str] | None = None) -> list[Choice]:
    """One engine request per input (text or ids; with `pairs`, each text's second text)."""
    base = GenerateParams(request_id=new_request_id(), sampling=SamplingParams(), max_tokens=1,
                          add_special_tokens=add_special_tokens, options=options)
    return [Choice(msgspec.structs.replace(
        base, request_id=f"{base.request_id}-{i}", prompt=text, input_ids=ids,
        options=options if pairs is None else {**options, "text_pair": pairs[i]}), None)
        for i, (text, ids) in enumerate(items)]


def pooled(done: DoneEvent, i: int) -> bytes:
    if not isinstance(done.pooled, bytes):
        raise RuntimeError(f"input {i} finished ({done.finish_reason}) without a pooled result")
    return done.pooled


def vector(pooled: bytes, dimensions: int | None, normalized: bool) -> np.ndarray:
    """The engine's float32 bytes as a vector, cut to `dimensions` (normalized again when
    the model's vectors are)."""
    vec = np.frombuffer(pooled, dtype="<f4")
    if dimensions is not None and dimensions < vec.size:
        vec = vec[:dimensions]
        if normalized:
            vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    return vec.astype("<f4")


async def embeddings(request: Request) -> Response | EventStream:
    """POST /v1/embeddings."""
    return await serve(request, accept, "/v1/embeddings")
