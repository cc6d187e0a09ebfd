"""`/v1/completions` bodies -> `TextCompletionRequest` (OpenAI's legacy completions: a
prompt, no messages). Chat bodies are read by the core (`chat_request.parse_chat`), since
`/v1/responses` reads its bodies through it too.

The body's shape is declared in `schemas.py` (`CompletionRequest`) and decoded by
`validation.load`; what is left here is the prompt forms and the rules across fields.

Choices (OpenAI's and vLLM's behaviour, see the README):
- without `max_tokens`, 16 (OpenAI's documented default, also vLLM's);
- `prompt` may be a string, a list of token ids, or a list of those (up to
  `MAX_PROMPTS`): one choice per prompt (times `n`), in order, as vLLM answers a batch;
- `echo` with `logprobs` computes the prompt's logprobs too (vLLM).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from services.api.chat_request import check_model, check_n, stream_flags
from services.api.errors import invalid
from services.api.schemas import CompletionRequest
from services.api.structured import parse_structured
from services.api.validation import GenerateParams, json_repr, left_out, load, sampling_params, stop_strings

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 64  # prompts in one /v1/completions call


class TextCompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A validated `/v1/completions` request: what to generate and how to answer. Its own
    struct, not a `ChatRequest`: it has prompts and an echo, and never meets a template."""

    params: GenerateParams
    stream: bool = False
    include_usage: bool = False  # streaming: a last chunk with usage and no choices
    echo: bool = False  # the prompt text comes first in the choice's text
    #: alternatives per token in the logprobs object (None: no logprobs)
    logprobs: int | None = None
    #: samples per prompt
    n: int = 1
    #: every prompt, as (text, token ids) with one of them None; the first is also `params`'s
    prompts: list[tuple[str | None, list[int] | None]] = []


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def completion_prompts(prompt: str | list[Any]) -> list[tuple[str | None, list[int] | None]]:
    """The prompts of `/v1/completions` (a string, token ids, or a list of up to MAX_PROMPTS
    of either) as (text, token ids) pairs: a list is token ids or prompts, not a mix."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    ids = type(prompt[0]) is int
    for i, item in enumerate(prompt):
        if (type(item) is int) != ids:
            kind = "an integer (prompt[0] is a token id)" if ids else "a string or a list of token ids (prompt[0] is)"
            raise invalid(f"prompt[{i}]", f"prompt[{i}] must be {kind}, got {json_repr(item)}")
    if ids:
        return [(None, list(prompt))]
    if len(prompt) > MAX_PROMPTS:
        raise invalid("prompt", f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed")
    return [(p, None) if isinstance(p, str) else (None, p) for p in prompt]


def parse_completion(obj: Mapping[str, Any], served: str) -> TextCompletionRequest:
    """Validate a `/v1/completions` body (`schemas.CompletionRequest`)."""
    req = load(obj, CompletionRequest)
    check_model(req.model, served)
    prompts = completion_prompts(req.prompt)
    n = check_n(req.n or 1, len(prompts), req.best_of)
    stream, include_usage = stream_flags(req)
    logprobs, prompt_logprobs = req.logprobs, req.prompt_logprobs
    if req.echo and logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = logprobs  # the echoed prompt's tokens come with their logprobs (vLLM)
    sampling = sampling_params(req, req.max_tokens, grammar=parse_structured(req), logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs)
    prompt, input_ids = prompts[0]
    params = GenerateParams(
        request_id=completion_id(),
        sampling=sampling,
        max_tokens=COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens,
        prompt=prompt,
        input_ids=input_ids,
        stream=stream,
        stop=stop_strings(req.stop),
        defaulted=left_out(req),
    )
    return TextCompletionRequest(params=params, stream=stream, include_usage=include_usage, echo=bool(req.echo),
                                 logprobs=logprobs, n=n, prompts=prompts)
