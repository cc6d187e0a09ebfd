"""`POST /v1/score` and `POST /v1/rerank` (vLLM's shapes; `/rerank` is Jina's and Cohere's).

A cross-encoder (task "score") reads each (text_1, text_2) pair as one input: the data
worker tokenizes the pair with the tokenizer's pair template (the second text gets token
type 1) and the score is the sigmoid of the classifier's logit, as
`CrossEncoder.predict`. An embedding model (task "embed") answers the same routes with
the cosine similarity of the two texts' embeddings, as vLLM does. Either way each input
is one engine request, batched with every other request's in the worker's steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.api.chat_request import check_model
from services.api.embeddings import pooled, pooled_choices, prepared, truncation
from services.api.errors import invalid
from services.api.events import DoneEvent
from services.api.schemas import (
    MAX_INPUTS,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
)
from services.api.serving import Prepared, serve
from services.api.state import ApiState, task_refusal
from services.api.streaming import EventStream
from services.api.validation import load
from shared.deferred import deferred

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)


def pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs a score request asks for; 400 for lists that do not pair."""
    first = [text_1] if isinstance(text_1, str) else text_1
    second = [text_2] if isinstance(text_2, str) else text_2
    if not first or not second:
        raise invalid("text_1" if not first else "text_2", "text_1 and text_2 must not be empty lists")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise invalid("text_2", f"text_1 and text_2 must pair up: one text_1 for any text_2, or lists of one length; "
                                f"got {len(first)} and {len(second)}")
    if len(first) > MAX_INPUTS:
        raise invalid("text_2", f"a request scores at most {MAX_INPUTS} pairs, got {len(first)}")
    return list(zip(first, second))


def scorer(state: ApiState, items: list[tuple[str, str]], cut: int | None):
    """(engine requests, scores from their done events) for `items` on the served model:
    a pair per request on a cross-encoder, each distinct text once on an embedding model."""
    settings = state.settings
    options = truncation(cut, settings.max_model_len)
    if settings.task == "score":
        if settings.dimensions != 1:
            raise invalid("model", f"model {settings.model_name!r} has {settings.dimensions} labels; scores need "
                                   "a classifier of one label")
        choices = pooled_choices([(a, None) for a, _ in items], options, pairs=[b for _, b in items])

        def scores(dones: list[DoneEvent]) -> list[float]:
            return [float(np.frombuffer(pooled(d, i), "<f4")[0]) for i, d in enumerate(dones)]

        return choices, scores
    if settings.task != "embed":
        raise invalid("model", task_refusal(settings.model_name, settings.task, "score"))
    texts = list(dict.fromkeys(t for pair in items for t in pair))  # each text embedded once
    at = {t: i for i, t in enumerate(texts)}

    def cosines(dones: list[DoneEvent]) -> list[float]:
        vecs = np.stack([np.frombuffer(pooled(d, i), "<f4") for i, d in enumerate(dones)]).astype(np.float64)
        vecs /= np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
        return [float(vecs[at[a]] @ vecs[at[b]]) for a, b in items]

    return pooled_choices([(t, None) for t in texts], options), cosines


def prompt_tokens(dones: list[DoneEvent]) -> int:
    return sum(d.usage.prompt_tokens for d in dones)


def accept_score(obj: Any, state: ApiState) -> Prepared:
    req = load(obj, ScoreRequest)
    check_model(req.model, state.settings.model_name)
    choices, scores = scorer(state, pairs(req.text_1, req.text_2), req.truncate_prompt_tokens)
    name = state.settings.model_name

    def answer(dones: list[DoneEvent], request_id: str, created: int) -> msgspec.Struct:
        data = [ScoreData(i, s) for i, s in enumerate(scores(dones))]
        tokens = prompt_tokens(dones)
        return ScoreResponse(f"score-{request_id}", data, name, ScoreUsage(tokens, tokens), created=created)

    return prepared(choices, answer, state.settings.task)


def accept_rerank(obj: Any, state: ApiState) -> Prepared:
    req = load(obj, RerankRequest)
    check_model(req.model, state.settings.model_name)
    if not req.documents:
        raise invalid("documents", "documents must not be an empty list")
    if len(req.documents) > MAX_INPUTS:
        raise invalid("documents", f"documents must hold at most {MAX_INPUTS} items, got {len(req.documents)}")
    choices, scores = scorer(state, [(req.query, d) for d in req.documents], req.truncate_prompt_tokens)
    name = state.settings.model_name

    def answer(dones: list[DoneEvent], request_id: str, created: int) -> msgspec.Struct:
        ranked = sorted(enumerate(scores(dones)), key=lambda p: -p[1])
        if req.top_n:
            ranked = ranked[: req.top_n]
        results = [RerankResult(i, s, RerankDocument(req.documents[i]) if req.return_documents else None)
                   for i, s in ranked]
        return RerankResponse(f"rerank-{request_id}", name, RerankUsage(prompt_tokens(dones)), results)

    return prepared(choices, answer, state.settings.task)


async def score(request: Request) -> Response | EventStream:
    """POST /v1/score (and /score)."""
    return await serve(request, accept_score, "/v1/score")


async def rerank(request: Request) -> Response | EventStream:
    """POST /v1/rerank (and /rerank, /v2/rerank)."""
    return await serve(request, accept_rerank, "/v1/rerank")
