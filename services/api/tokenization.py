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

`model`, when given, must be the served name (404 `model_not_found`, as the OpenAI
routes); an unknown field is a 400 naming it. Nothing here reaches the other services:
the api's own tokenizer answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from services.api.errors import ApiError
from services.api.openai_params import check_model, parse_messages
from services.api.serving import api_state, json_response, read_body
from services.api.state import ApiState
from services.api.validation import decode_json_object, get_bool, is_int, json_repr
from shared.errors import ErrorKind
from shared.version import mstar_version

PROMPT_FIELDS = ("model", "prompt", "add_special_tokens", "return_token_strs")
CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
               "return_token_strs")
DETOKENIZE_FIELDS = ("model", "tokens")


def _check_fields(obj: Mapping[str, Any], allowed: tuple[str, ...], form: str) -> None:
    for name in obj:
        if name not in allowed:
            raise ApiError(ErrorKind.INVALID, f"unknown field {name!r}{form}; allowed fields: "
                           f"{', '.join(sorted(allowed))}", name)


def _flag(obj: Mapping[str, Any], name: str, default: bool) -> bool:
    value = get_bool(obj, name)
    return default if value is None else value


def _render_chat(obj: Mapping[str, Any], state: ApiState) -> str:
    """The chat prompt as `/v1/chat/completions` would send it (or its variants)."""
    messages = parse_messages(obj)
    add_generation_prompt = _flag(obj, "add_generation_prompt", True)
    continue_final = _flag(obj, "continue_final_message", False)
    if add_generation_prompt and continue_final:
        raise ApiError(ErrorKind.INVALID, "continue_final_message and add_generation_prompt cannot both be true; "
                       "set add_generation_prompt to false", "continue_final_message")
    if state.chat_template is None:
        raise ApiError(ErrorKind.INVALID, f"the model `{state.settings.model_name}` has no chat template; "
                       "tokenize a formatted prompt instead", "messages")
    return state.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final)


def tokenize_body(obj: Mapping[str, Any], state: ApiState) -> dict[str, Any]:
    """A validated `/tokenize` body -> its reply."""
    if "messages" in obj and "prompt" in obj:
        raise ApiError(ErrorKind.INVALID, "give prompt or messages, not both", "messages")
    if "messages" in obj:
        _check_fields(obj, CHAT_FIELDS, " with messages")
    else:
        _check_fields(obj, PROMPT_FIELDS, " with prompt")
    check_model(obj, state.settings.model_name)
    token_strs = _flag(obj, "return_token_strs", False)
    if "messages" in obj:
        text = _render_chat(obj, state)
        special = _flag(obj, "add_special_tokens", False)  # the template holds them (vLLM's default)
    else:
        text = obj.get("prompt")
        if not isinstance(text, str):
            raise ApiError(ErrorKind.INVALID, f"prompt is required: a string (or give messages), got {json_repr(text)}",
                           "prompt")
        special = _flag(obj, "add_special_tokens", True)
    tokenizer = state.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=special).ids
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": state.settings.max_model_len, "tokens": ids}
    if token_strs:
        reply["token_strs"] = [tokenizer.id_to_token(i) or "" for i in ids]
    return reply


def detokenize_body(obj: Mapping[str, Any], state: ApiState) -> dict[str, Any]:
    """A validated `/detokenize` body -> its reply."""
    _check_fields(obj, DETOKENIZE_FIELDS, "")
    check_model(obj, state.settings.model_name)
    tokens = obj.get("tokens")
    if not isinstance(tokens, list):
        raise ApiError(ErrorKind.INVALID, f"tokens is required: a list of token ids, got {json_repr(tokens)}",
                       "tokens")
    vocab = state.tokenizer.get_vocab_size(with_added_tokens=True)
    for i, tok in enumerate(tokens):
        if not is_int(tok) or not 0 <= tok < vocab:
            raise ApiError(ErrorKind.INVALID, f"tokens[{i}] is {json_repr(tok)}; token ids must be integers "
                           f"in [0, {vocab - 1}] (the vocabulary has {vocab} tokens)", "tokens")
    return {"prompt": state.tokenizer.decode(tokens, skip_special_tokens=False)}


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
    return json_response({"version": mstar_version()})
