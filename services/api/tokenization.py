"""vLLM's `/tokenize`, `/detokenize` and `/version` (vLLM's `serving_tokenization.py`
request and reply shapes).

- `POST /tokenize`, one of two bodies:
  `{"prompt": str, "add_special_tokens": true, "return_token_strs": false, "model"}`, or
  `{"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
  "add_special_tokens": false, "return_token_strs": false, "model"}` (the chat template
  rendered exactly as `/v1/chat/completions` renders it, so `count` is the chat
  completion's `usage.prompt_tokens`). Reply `{"count", "max_model_len", "tokens"}`,
  plus `token_strs` when asked for.
- `POST /detokenize`: `{"tokens": [int, ...], "model"}` -> `{"prompt": str}` (special
  tokens kept, as vLLM decodes); an id outside the vocabulary is a 400 naming `tokens`
  and the limit.
- `GET /version`: `{"version"}`, mstar's.

The bodies are declared in `schemas.py`; `model`, when given, must be the served name
(404 `model_not_found`, as the OpenAI routes); an unknown field is a 400 naming it.
Nothing here reaches the other services: the api's own tokenizer answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from services.api.chat_request import check_model, parse_messages
from services.api.errors import invalid
from services.api.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from services.api.serving import api_state, json_response, read_body
from services.api.state import ApiState
from services.api.validation import AudioRef, VideoRef, decode_json_object, load
from shared.version import mstar_version


def _render_chat(req: TokenizeChatRequest, state: ApiState) -> str:
    """The chat prompt as `/v1/chat/completions` would send it (or its variants)."""
    audio = bool(state.settings.audio_placeholder)
    audios: list[AudioRef] | None = [] if audio else None
    videos: list[VideoRef] | None = [] if state.settings.video_placeholder else None
    messages, images = parse_messages(req.messages, parts=bool(state.settings.image_placeholder) or audio,
                                      audios=audios, videos=videos)
    media = [*images, *(audios or ()), *(videos or ())]
    if media:
        kind = "image" if images else "audio" if audios else "video"
        raise invalid(media[0].param, f"/tokenize counts no {kind} rows; send the chat to /v1/chat/completions "
                      "(its usage.prompt_tokens counts them)")
    add_generation_prompt = req.add_generation_prompt is not False
    continue_final = bool(req.continue_final_message)
    if add_generation_prompt and continue_final:
        raise invalid("continue_final_message", "continue_final_message and add_generation_prompt cannot both be "
                      "true; set add_generation_prompt to false")
    if state.chat_template is None:
        raise invalid("messages", f"the model `{state.settings.model_name}` has no chat template; "
                      "tokenize a formatted prompt instead")
    return state.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final)


def tokenize_body(obj: Mapping[str, Any], state: ApiState) -> TokenizeResponse:
    """A `/tokenize` body (`schemas.TokenizeCompletionRequest` or `TokenizeChatRequest`,
    by whether it has `messages`) -> its reply."""
    req: TokenizeCompletionRequest | TokenizeChatRequest
    if "messages" in obj:
        if "prompt" in obj:
            raise invalid("messages", "give prompt or messages, not both")
        req = load(obj, TokenizeChatRequest, " with messages")
        check_model(req.model, state.settings.model_name)
        text = _render_chat(req, state)
        special = req.add_special_tokens is True  # the template holds them (vLLM's default)
    else:
        req = load(obj, TokenizeCompletionRequest, " with prompt")
        check_model(req.model, state.settings.model_name)
        text, special = req.prompt, req.add_special_tokens is not False
    tokenizer = state.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=special).ids
    strs = [tokenizer.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
    return TokenizeResponse(len(ids), state.settings.max_model_len, ids, strs)


def detokenize_body(obj: Mapping[str, Any], state: ApiState) -> DetokenizeResponse:
    """A `/detokenize` body (`schemas.DetokenizeRequest`) -> its reply; the ids must be
    of the vocabulary (a limit known at run time)."""
    req = load(obj, DetokenizeRequest)
    check_model(req.model, state.settings.model_name)
    vocab = state.tokenizer.get_vocab_size(with_added_tokens=True)
    for i, tok in enumerate(req.tokens):
        if not 0 <= tok < vocab:
            raise invalid("tokens", f"tokens[{i}] is {tok}; token ids must be integers in [0, {vocab - 1}] "
                          f"(the vocabulary has {vocab} tokens)")
    return DetokenizeResponse(state.tokenizer.decode(req.tokens, skip_special_tokens=False))


async def _json_object(request: Request, state: ApiState) -> dict[str, Any]:
    return decode_json_object(await read_body(request, state.settings.max_body_bytes))


async def tokenize(request: Request) -> Response:
    """POST /tokenize."""
    state = api_state(request)
    return json_response(tokenize_body(await _json_object(request, state), state))


async def detokenize(request: Request) -> Response:
    """POST /detokenize."""
    state = api_state(request)
    return json_response(detokenize_body(await _json_object(request, state), state))


async def version(request: Request) -> Response:
    """GET /version."""
    return json_response(VersionResponse(mstar_version()))
