"""Request bodies of `/v1/completions`, `/v1/chat/completions` and the form fields of
`/v1/audio/transcriptions` -> `GenerateParams`.

Only the OpenAI-specific shapes are checked here (`model`, the forms of `prompt`,
`messages`, `stream_options`, `echo`, `max_completion_tokens`); every field the routes
share with `/generate` (sampling, `max_tokens`, `stop`, unknown and unsupported fields)
goes through the same functions of `validation.py`, so a field is checked one way
whichever route carries it. The rendering of `messages` is the chat template's job
(`chat_template.py`); this module only checks their shape and makes them plain dicts.

Choices (OpenAI's and vLLM's behaviour, see the README):
- `model` may be omitted; given, it must be the served name, else 404 `model_not_found`.
- `/v1/completions` without `max_tokens` gets 16 (OpenAI's documented default, also
  vLLM's); chat without `max_tokens` / `max_completion_tokens` gets the most the engine
  allows for the prompt, as `/generate` does.
- `prompt` may be a string, a list of token ids, or a list of those (up to
  `MAX_PROMPTS`): one choice per prompt (times `n`), in order, as vLLM answers a batch.
- `n` (1-`MAX_N`) samples per prompt: choice `i * n + j` is sample j of prompt i, with
  seed `seed + j` when a seed is given; `best_of` may only equal `n` (vLLM's V1 engine
  ranks no samples either).
- `user` is accepted and not used (it only labels the end user for the provider).
- transcriptions: `temperature` defaults to 0 (greedy; OpenAI's default too), `prompt`
  (previous-text conditioning) is refused unless empty, `response_format` is `json`,
  `text` or `verbose_json`, and `stream` works with `json` / `text` only.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from services.api.errors import ApiError, HttpKind
from services.api.reasoning import RESERVED
from services.api.structured import STRUCTURED_FIELDS, validated
from services.api.tools import TOOL_FIELDS, Tools, parse_history_calls, parse_tools
from services.api.validation import (
    INT32_MAX,
    SAMPLING_FIELDS,
    GenerateParams,
    check_audio,
    check_fields,
    get_bool,
    get_int,
    is_int,
    json_repr,
    parse_language,
    parse_logprobs,
    parse_max_tokens,
    parse_sampling,
    parse_stop,
    refuse_unsupported,
)
from shared.errors import ErrorKind

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_N = 16  # samples per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions call
MAX_CHOICES = 256  # prompts x n
#: OpenAI fields that cannot change the output: accepted (type-checked) and not acted on.
#: `store` asks OpenAI to keep the completion for its dashboard, `service_tier` picks a
#: price/latency class, `metadata` tags a stored completion: none of that exists here.
NEUTRAL_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
SERVICE_TIERS = ("auto", "default", "flex", "priority", "scale")
COMMON_FIELDS = (frozenset({"model", "max_tokens", "stop", "stream", "stream_options"})
                 | NEUTRAL_FIELDS | SAMPLING_FIELDS | STRUCTURED_FIELDS)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "logprobs", "prompt_logprobs", "n", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "n",
                               "chat_template_kwargs"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})
TRANSCRIPTION_FIELDS = frozenset({"model", "language", "prompt", "response_format", "temperature", "stream",
                                  "max_tokens", "ignore_eos", "seed"})
TRANSCRIPTION_FORMATS = ("json", "text", "verbose_json")


class OpenAIRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A validated `/v1/*` request: what to generate and how to answer."""

    params: GenerateParams
    stream: bool = False
    include_usage: bool = False  # streaming: a last chunk with usage and no choices
    echo: bool = False  # completions: the prompt text comes first in the choice's text
    #: completions: alternatives per token in the logprobs object (None: no logprobs);
    #: chat: `top_logprobs` when `logprobs` is true
    logprobs: int | None = None
    #: samples per prompt
    n: int = 1
    #: completions: every prompt, as (text, token ids) with one of them None; the first is
    #: also `params`'s
    prompts: list[tuple[str | None, list[int] | None]] = []
    #: chat: the request's tools (None: none, or tool_choice "none")
    tools: Tools | None = None
    #: chat: extra variables for the chat template (vLLM's `chat_template_kwargs`)
    template_kwargs: dict[str, Any] = {}


class TranscriptionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A validated `/v1/audio/transcriptions` form."""

    params: GenerateParams
    response_format: str = "json"
    stream: bool = False


def transcription_id() -> str:
    return f"trsc-{uuid.uuid4().hex}"


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def check_model(obj: Mapping[str, Any], served: str) -> None:
    """`model`: omitted, null, or the served name (else 404 model_not_found, as OpenAI)."""
    model = obj.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError(ErrorKind.INVALID, f"model must be a string, got {json_repr(model)}", "model")
    if model != served:
        raise ApiError(HttpKind.MODEL_NOT_FOUND, f"The model `{model}` does not exist; this server serves `{served}`.",
                       "model", code="model_not_found")


def parse_stream(obj: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage). `stream_options` is an object allowed only with stream."""
    stream = bool(get_bool(obj, "stream"))
    options = obj.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise ApiError(ErrorKind.INVALID, f"stream_options must be an object, got {json_repr(options)}",
                       "stream_options")
    if not stream:
        raise ApiError(ErrorKind.INVALID, "stream_options is only allowed when stream is true", "stream_options")
    for key in options:
        if key != "include_usage":
            raise ApiError(ErrorKind.INVALID, f"unknown field {key!r} in stream_options; allowed fields: include_usage",
                           f"stream_options.{key}")
    include = options.get("include_usage")
    if include is not None and type(include) is not bool:
        raise ApiError(ErrorKind.INVALID, f"stream_options.include_usage must be a boolean, got {json_repr(include)}",
                       "stream_options.include_usage")
    return stream, bool(include)


def parse_completion_prompt(obj: Mapping[str, Any]) -> list[tuple[str | None, list[int] | None]]:
    """A string, a list of token ids, or a list of up to MAX_PROMPTS of either."""
    value = obj.get("prompt")
    requirement = "a string, a list of token ids, or a list of those"
    if value is None:
        raise ApiError(ErrorKind.INVALID, f"prompt is required: {requirement}", "prompt")
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) > MAX_PROMPTS:
            raise ApiError(ErrorKind.INVALID, f"prompt holds {len(value)} prompts; at most {MAX_PROMPTS} are allowed",
                           "prompt")
        return [_one_prompt(v, f"prompt[{i}]", requirement) for i, v in enumerate(value)]
    return [_one_prompt(value, "prompt", requirement)]


def _one_prompt(value: Any, where: str, requirement: str) -> tuple[str | None, list[int] | None]:
    if isinstance(value, str):
        if not value:
            raise ApiError(ErrorKind.INVALID, f'{where} must be a non-empty string, got ""', where)
        return value, None
    if not isinstance(value, list) or not value:
        raise ApiError(ErrorKind.INVALID, f"{where} must be {requirement}, got {json_repr(value)}", where)
    for tok in value:
        if not is_int(tok) or not 0 <= tok <= INT32_MAX:
            raise ApiError(ErrorKind.INVALID,
                           f"{where} token ids must be integers in [0, {INT32_MAX}], got {json_repr(tok)}", where)
    return None, list(value)


def parse_n(obj: Mapping[str, Any], prompts: int = 1) -> int:
    """`n` samples per prompt (1-MAX_N; prompts x n at most MAX_CHOICES); `best_of`, when
    given, must equal n."""
    n = get_int(obj, "n", minimum=1, maximum=MAX_N) or 1
    if prompts * n > MAX_CHOICES:
        raise ApiError(ErrorKind.INVALID, f"{prompts} prompts x n={n} is {prompts * n} choices; at most "
                       f"{MAX_CHOICES} are allowed", "n")
    best_of = obj.get("best_of")
    if best_of is not None and (not is_int(best_of) or best_of != n):
        raise ApiError(ErrorKind.INVALID, f"best_of must equal n ({n}): samples are not ranked, got "
                       f"{json_repr(best_of)}", "best_of")
    return n


def check_neutral(obj: Mapping[str, Any]) -> None:
    """The output-neutral fields are accepted, but only with the types OpenAI gives them
    (a client bug shows as a 400 naming the field, as OpenAI's own API answers)."""
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        if obj.get(name) is not None and not isinstance(obj[name], str):
            raise ApiError(ErrorKind.INVALID, f"{name} must be a string, got {json_repr(obj[name])}", name)
    if obj.get("store") is not None and not isinstance(obj["store"], bool):
        raise ApiError(ErrorKind.INVALID, f"store must be a boolean, got {json_repr(obj['store'])}", "store")
    tier = obj.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise ApiError(ErrorKind.INVALID, f"service_tier must be one of {list(SERVICE_TIERS)}, got {json_repr(tier)}",
                       "service_tier")
    meta = obj.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or len(meta) > 16
                             or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                                        for k, v in meta.items())):
        raise ApiError(ErrorKind.INVALID, "metadata must be an object of at most 16 string values "
                                          "(keys up to 64 characters, values up to 512)", "metadata")


def parse_completion(obj: Mapping[str, Any], served: str) -> OpenAIRequest:
    """Validate a `/v1/completions` body."""
    check_fields(obj, COMPLETION_FIELDS)
    check_neutral(obj)
    refuse_unsupported(obj, honoured=("echo", "stream_options", "logprobs", "prompt_logprobs", "n", "best_of",
                                      "response_format"))
    check_model(obj, served)
    prompts = parse_completion_prompt(obj)
    prompt, input_ids = prompts[0]
    n = parse_n(obj, len(prompts))
    max_tokens = parse_max_tokens(obj)
    echo = get_bool(obj, "echo")
    stream, include_usage = parse_stream(obj)
    logprobs = parse_logprobs(obj)
    prompt_logprobs = parse_logprobs(obj, "prompt_logprobs")
    if echo and logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = logprobs  # the echoed prompt's tokens come with their logprobs (vLLM)
    params = GenerateParams(
        request_id=completion_id(),
        sampling=parse_sampling(obj, logprobs=logprobs, prompt_logprobs=prompt_logprobs),
        max_tokens=COMPLETION_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        prompt=prompt,
        input_ids=input_ids,
        stream=stream,
        stop=parse_stop(obj),
    )
    return OpenAIRequest(params=params, stream=stream, include_usage=include_usage, echo=bool(echo), logprobs=logprobs,
                         n=n, prompts=prompts)


def _message_text(content: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts joined with newlines (vLLM's
    "string" content format); null is empty (an assistant turn may have none)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(ErrorKind.INVALID, f"{where} must be a string or a list of text parts, got {json_repr(content)}",
                       where)
    texts: list[str] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ApiError(ErrorKind.INVALID, f"{at} must be an object, got {json_repr(part)}", at)
        kind = part.get("type")
        if kind != "text":
            raise ApiError(ErrorKind.INVALID, f'{at}.type {json_repr(kind)} is not supported; only "text" parts are',
                           f"{at}.type")
        for key in part:
            if key not in ("type", "text"):
                raise ApiError(ErrorKind.INVALID, f"unknown field {key!r} in a text part", f"{at}.{key}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ApiError(ErrorKind.INVALID, f"{at}.text must be a string, got {json_repr(text)}", f"{at}.text")
        texts.append(text)
    return "\n".join(texts)


def parse_messages(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`messages` as plain dicts {role, content[, name]} for the chat template."""
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(ErrorKind.INVALID,
                       f"messages must be a non-empty list of message objects, got {json_repr(messages)}", "messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ApiError(ErrorKind.INVALID, f"{where} must be an object, got {json_repr(msg)}", where)
        for key in msg:
            if key not in MESSAGE_FIELDS:
                raise ApiError(ErrorKind.INVALID,
                               f"unknown field {key!r} in {where}; allowed fields: {', '.join(sorted(MESSAGE_FIELDS))}",
                               f"{where}.{key}")
        role = msg.get("role")
        if msg.get("tool_calls") and role != "assistant":
            raise ApiError(ErrorKind.INVALID, f"{where}.tool_calls is only for an assistant message",
                           f"{where}.tool_calls")
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise ApiError(ErrorKind.INVALID, f"{where}.tool_call_id must be the id of the call this result answers",
                           f"{where}.tool_call_id")
        if role not in CHAT_ROLES:
            raise ApiError(ErrorKind.INVALID,
                           f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {json_repr(role)}",
                           f"{where}.role")
        if msg.get("content") is None and role != "assistant":
            raise ApiError(ErrorKind.INVALID, f"{where}.content is required for a {role} message", f"{where}.content")
        entry: dict[str, Any] = {"role": role, "content": _message_text(msg.get("content"), f"{where}.content")}
        name = msg.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise ApiError(ErrorKind.INVALID, f"{where}.name must be a string, got {json_repr(name)}",
                               f"{where}.name")
            entry["name"] = name
        if msg.get("tool_calls"):
            entry["tool_calls"] = parse_history_calls(msg["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            entry["tool_call_id"] = msg["tool_call_id"]
        out.append(entry)
    return out


def parse_chat_max_tokens(obj: Mapping[str, Any]) -> int | None:
    """`max_completion_tokens` (OpenAI's current name) or `max_tokens` (deprecated alias);
    both may be given only with the same value."""
    new = parse_max_tokens(obj, "max_completion_tokens")
    old = parse_max_tokens(obj, "max_tokens")
    if new is not None and old is not None and new != old:
        raise ApiError(ErrorKind.INVALID, f"max_tokens ({old}) and max_completion_tokens ({new}) disagree; give one",
                       "max_completion_tokens")
    return new if new is not None else old


def parse_chat(obj: Mapping[str, Any], served: str) -> tuple[OpenAIRequest, list[dict[str, Any]]]:
    """Validate a `/v1/chat/completions` body; the prompt is filled in by the caller from
    the rendered template (see `with_prompt`)."""
    check_fields(obj, CHAT_FIELDS)
    check_neutral(obj)
    refuse_unsupported(obj, honoured=("stream_options", "logprobs", "top_logprobs", "n", "response_format",
                                      *TOOL_FIELDS))
    check_model(obj, served)
    messages = parse_messages(obj)
    n = parse_n(obj)
    max_tokens = parse_chat_max_tokens(obj)
    stream, include_usage = parse_stream(obj)
    logprobs = parse_chat_logprobs(obj)
    params = GenerateParams(
        request_id=chat_completion_id(),
        sampling=parse_sampling(obj, logprobs=logprobs),
        max_tokens=max_tokens,
        prompt=None,
        stream=stream,
        stop=parse_stop(obj),
        add_special_tokens=False,
    )
    tools = parse_tools(obj)
    if tools is not None and tools.forced and params.sampling.grammar is not None:
        raise ApiError(ErrorKind.INVALID, "tool_choice required or a named function cannot be combined with a "
                       "structured-output constraint (response_format, structured_outputs, guided_*)", "tool_choice")
    return OpenAIRequest(params=params, stream=stream, include_usage=include_usage, logprobs=logprobs, n=n,
                         tools=tools, template_kwargs=parse_template_kwargs(obj)), messages


def parse_template_kwargs(obj: Mapping[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs`: variables the template reads (`enable_thinking`, ...); the
    ones the server sets itself are refused by name."""
    value = obj.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(ErrorKind.INVALID, f"chat_template_kwargs must be an object, got {json_repr(value)}",
                       "chat_template_kwargs")
    for key in value:
        if key in RESERVED:
            raise ApiError(ErrorKind.INVALID, f"chat_template_kwargs.{key} is set by the server, not the request",
                           f"chat_template_kwargs.{key}")
    return value


def parse_chat_logprobs(obj: Mapping[str, Any]) -> int | None:
    """Chat's `logprobs` (a boolean) and `top_logprobs` (0-20, only with logprobs true):
    None when no logprobs are asked, else the number of alternatives."""
    logprobs = get_bool(obj, "logprobs")
    top = parse_logprobs(obj, "top_logprobs")
    if top is not None and top > 0 and not logprobs:
        raise ApiError(ErrorKind.INVALID, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if logprobs else None


def with_prompt(req: OpenAIRequest, prompt: str) -> OpenAIRequest:
    """The request with its rendered chat prompt (refused if the template rendered nothing)."""
    if not prompt:
        raise ApiError(ErrorKind.INVALID, "the chat template rendered an empty prompt for these messages", "messages")
    return msgspec.structs.replace(req, params=msgspec.structs.replace(req.params, prompt=prompt))


def with_grammar(req: OpenAIRequest, grammar: str, check: str | None = "tools") -> OpenAIRequest:
    """The request constrained by `grammar`: the calls of `tool_choice` "required" or a
    named function, checked (a function's `parameters` that do not compile are a 400 naming
    `check`), or (`check` None) a constraint already checked, moved after a reasoning
    model's thinking."""
    if check is not None:
        grammar = validated(grammar, check)
    sampling = msgspec.structs.replace(req.params.sampling, grammar=grammar)
    return msgspec.structs.replace(req, params=msgspec.structs.replace(req.params, sampling=sampling))


def parse_response_format(obj: Mapping[str, Any]) -> str:
    value = obj.get("response_format")
    if value is None:
        return "json"
    if value in ("srt", "vtt", "diarized_json"):
        raise ApiError(ErrorKind.INVALID,
                       f"response_format {value!r} is not supported (no timestamps); use json, text or verbose_json",
                       "response_format")
    if not isinstance(value, str) or value not in TRANSCRIPTION_FORMATS:
        raise ApiError(ErrorKind.INVALID,
                       f"response_format must be one of {', '.join(TRANSCRIPTION_FORMATS)}, got {json_repr(value)}",
                       "response_format")
    return value


def parse_transcription(obj: Mapping[str, Any], audio: bytes | None, served: str) -> TranscriptionRequest:
    """Validate the fields of a `/v1/audio/transcriptions` form (typed by `forms.py`):
    OpenAI's `file`, `model`, `language`, `prompt`, `response_format`, `temperature`,
    `stream`, and mstar's `max_tokens`, `ignore_eos`, `seed`, with the `/generate` checks."""
    check_fields(obj, TRANSCRIPTION_FIELDS)
    refuse_unsupported(obj, honoured=("response_format",))
    check_model(obj, served)
    if obj.get("prompt") is not None:
        raise ApiError(ErrorKind.INVALID,
                       "prompt is not supported (no conditioning on previous text); leave it out or empty", "prompt")
    audio = check_audio(audio)
    response_format = parse_response_format(obj)
    stream = bool(get_bool(obj, "stream"))
    if stream and response_format == "verbose_json":
        raise ApiError(ErrorKind.INVALID, "stream is not supported with response_format verbose_json; use json or text",
                       "stream")
    if obj.get("temperature") is None:  # greedy unless asked otherwise (OpenAI's default is 0 too)
        obj = {**obj, "temperature": 0.0}
    params = GenerateParams(
        request_id=transcription_id(),
        sampling=parse_sampling(obj, structured=False),
        max_tokens=parse_max_tokens(obj),
        stream=stream,
        audio=audio,
        language=parse_language(obj),
        task="transcribe",
    )
    return TranscriptionRequest(params=params, response_format=response_format, stream=stream)
