"""The one place a client request is checked (DESIGN.md sections 4 and 7).

Everything a client sends goes through here before anything is submitted, so a bad request
is a 400 naming the field and the limit, never a crash or a silently dropped field further
down. The checks are strict on purpose: a bool is not an int, `"5"` is not a number, an
unknown field is an error, and a field the engine cannot honour (`n` > 1 on `/generate`,
`tools`, `response_format`, ...) is refused rather than ignored.

Length limits (prompt + max_tokens vs max_seq_len, max_tokens vs the decode loop's cap,
footprint vs pool) are not checked here: only the conductor knows them, and its
`RequestError` becomes the HTTP error.

The pieces (`decode_json_object`, `check_fields`, `refuse_unsupported`,
`parse_sampling`, `parse_max_tokens`, `parse_stop`, `parse_request_id`, `parse_language`)
are public: the OpenAI routes (`openai_params.py`) build their field sets from these same
checks and messages, so `/generate`, the WebSocket and `/v1/*` can never disagree on a field.

Audio requests (`/generate` as multipart/form-data, `/v1/audio/transcriptions`) come as
form fields; `forms.py` turns each string into the JSON value it spells (`"5"` -> 5,
`"true"` -> true) and the same checks run on the result (`parse_audio_generate`). Whether
the audio itself decodes (container, rate, length) is the data worker's check, not ours.

`null` for an optional field means "not given" (OpenAI's convention).
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from services.api.errors import ApiError
from services.api.structured import STRUCTURED_FIELDS, parse_structured
from shared.errors import ErrorKind
from shared.frames import SamplingParams

INT32_MAX = 2**31 - 1  # ceiling for counts and token ids: keeps every frame encodable
SEED_MAX = 2**63 - 1  # seeds must fit torch / numpy generators on every worker
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_STOP_CHARS = 512  # per stop string: bounds the per-delta hold-back scan

MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs; OpenAI's chat allows 20)
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's range, vLLM's check)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)
MAX_STOP_TOKEN_IDS = 256  # bounds the per-token stop check
#: vLLM's logits processors: honoured on every route that samples text
PROCESSOR_FIELDS: frozenset[str] = frozenset({"presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                                              "logit_bias", "min_tokens", "stop_token_ids"})
SAMPLING_FIELDS: frozenset[str] = frozenset({"temperature", "top_p", "top_k", "seed", "ignore_eos"}) | PROCESSOR_FIELDS
GENERATE_FIELDS: frozenset[str] = frozenset(
    {"prompt", "input_ids", "max_tokens", "stop", "stream", "request_id", "logprobs", "prompt_logprobs"}
    | SAMPLING_FIELDS | STRUCTURED_FIELDS
)
#: the fields of the unsupported table that `/generate` honours
GENERATE_HONOURED = ("logprobs", "prompt_logprobs", "response_format")
#: what a speech model's request may carry besides the audio file (the prompt is the audio)
AUDIO_FIELDS: frozenset[str] = frozenset({"language", "task"})
AUDIO_GENERATE_FIELDS: frozenset[str] = (GENERATE_FIELDS - {"prompt", "input_ids"} - STRUCTURED_FIELDS) | AUDIO_FIELDS
AUDIO_TASKS = ("transcribe", "translate")
#: a language code ("en", "haw", "pt-BR") or a Whisper language token ("<|en|>"); whether the
#: model knows it is the data worker's answer (400 with param "language")
LANGUAGE_RE = re.compile(r"<\|[A-Za-z_-]{1,28}\|>|[A-Za-z_-]{1,32}")


def _unset_or(*neutral: Any) -> Callable[[Any], bool]:
    """Accept null or one of the values that ask for nothing (e.g. `n: 1`, `tools: []`)."""

    def ok(value: Any) -> bool:
        return value is None or any(type(value) is type(n) and value == n for n in neutral)

    return ok


# Fields a vLLM / OpenAI client may send that this engine does not honour. A neutral value
# (null, or one that changes nothing) is accepted; anything else is a 400 naming the field.
UNSUPPORTED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_unset_or(1), "n > 1 is not supported; n must be 1"),
    "best_of": (_unset_or(1), "best_of > 1 is not supported; best_of must be 1"),
    "logprobs": (_unset_or(False), "logprobs is not supported"),
    "top_logprobs": (_unset_or(0), "top_logprobs is not supported"),
    "prompt_logprobs": (_unset_or(), "prompt_logprobs is not supported"),
    "tools": (_unset_or([]), "tools is not supported"),
    "tool_choice": (_unset_or("none"), "tool_choice is not supported"),
    "functions": (_unset_or([]), "functions is not supported"),
    "function_call": (_unset_or("none"), "function_call is not supported"),
    "parallel_tool_calls": (_unset_or(), "parallel_tool_calls is not supported (no tools)"),
    "echo": (_unset_or(False), "echo is not supported"),
    "response_format": (_unset_or({"type": "text"}), 'response_format is not supported; only {"type": "text"}'),
    "suffix": (_unset_or(""), "suffix is not supported"),
    "stream_options": (_unset_or(), "stream_options is only supported on the /v1 routes"),
    "modalities": (_unset_or(["text"]), 'modalities is not supported; only ["text"]'),
    "audio": (_unset_or(), "audio output is not supported"),
    "prediction": (_unset_or(), "prediction (predicted outputs) is not supported"),
    "reasoning_effort": (_unset_or(), "reasoning_effort is not supported"),
    "web_search_options": (_unset_or(), "web_search_options is not supported"),
}


class GenerateParams(msgspec.Struct, frozen=True, kw_only=True):
    """A validated `/generate` request (also what WebSocket `generate` frames become)."""

    request_id: str
    sampling: SamplingParams
    max_tokens: int | None = None
    prompt: str | None = None
    input_ids: list[int] | None = None
    stream: bool | None = None  # None: the route's default (false for HTTP, true for WS)
    stop: list[str] = []  # stop strings, matched by the api on the detokenized text
    add_special_tokens: bool = True  # False for a chat-templated prompt (it holds its specials)
    audio: bytes | None = None  # speech models: the uploaded WAV/FLAC file (then no prompt)
    language: str | None = None  # speech models: the language to force (None: the model's)
    task: str | None = None  # speech models: "transcribe" / "translate" (None: the model's)


# ---- helpers -------------------------------------------------------------------------


def json_repr(value: Any, limit: int = 60) -> str:
    """The offending value as the client wrote it (JSON), shortened for the message."""
    try:
        text = msgspec.json.encode(value).decode()
    except (TypeError, OverflowError, msgspec.EncodeError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(value: Any) -> bool:
    """A JSON integer: Python int but not bool (a bool is not an int here)."""
    return type(value) is int


def is_number(value: Any) -> bool:
    return type(value) is int or type(value) is float


def _bad(name: str, requirement: str, value: Any) -> ApiError:
    return ApiError(ErrorKind.INVALID, f"{name} must be {requirement}, got {json_repr(value)}", name)


def decode_json_object(body: bytes, what: str = "request body") -> dict[str, Any]:
    """Decode strict JSON (no NaN/Infinity, valid UTF-8) that must be an object."""
    if not body.strip():
        raise ApiError(ErrorKind.INVALID, f"{what} is empty; expected a JSON object")
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ApiError(ErrorKind.INVALID, f"{what} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ApiError(ErrorKind.INVALID, f"{what} must be a JSON object, got {_json_kind(obj)}")
    return obj


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return "a number"


def check_fields(obj: Mapping[str, Any], allowed: Iterable[str]) -> None:
    """Unknown fields are a 400 naming the first one (unsupported ones are refused later)."""
    allowed = frozenset(allowed)
    for name in obj:
        if name not in allowed and name not in UNSUPPORTED_FIELDS:
            listed = ", ".join(sorted(allowed))
            raise ApiError(ErrorKind.INVALID, f"unknown field {name!r}; allowed fields: {listed}", name)


def refuse_unsupported(obj: Mapping[str, Any], honoured: Iterable[str] = ()) -> None:
    """Fields the engine cannot honour are refused unless they ask for nothing.

    `honoured` names the fields of the table that the calling route does implement (the
    OpenAI completions route honours `echo` and `stream_options`), so they are skipped.
    """
    skip = frozenset(honoured)
    for name, (neutral, message) in UNSUPPORTED_FIELDS.items():
        if name in obj and name not in skip and not neutral(obj[name]):
            raise ApiError(ErrorKind.INVALID, f"{message}, got {json_repr(obj[name])}", name)


def get_int(obj: Mapping[str, Any], name: str, *, minimum: int, maximum: int,
            requirement: str | None = None) -> int | None:
    """An optional integer in [minimum, maximum]; None when absent or null."""
    value = obj.get(name)
    if value is None:
        return None
    low = requirement or f"an integer >= {minimum}"
    if not is_int(value) or value < minimum:
        raise _bad(name, low, value)
    if value > maximum:
        raise _bad(name, f"an integer <= {maximum}", value)
    return value


def get_number(obj: Mapping[str, Any], name: str, ok: Callable[[float], bool], requirement: str) -> float | None:
    """An optional finite number (int or float, not bool) that satisfies `ok`."""
    value = obj.get(name)
    if value is None:
        return None
    if not is_number(value):
        raise _bad(name, requirement, value)
    try:
        number = float(value)
    except OverflowError:
        raise _bad(name, requirement, value) from None
    if not math.isfinite(number) or not ok(number):
        raise _bad(name, requirement, value)
    return number


def get_bool(obj: Mapping[str, Any], name: str) -> bool | None:
    value = obj.get(name)
    if value is None:
        return None
    if type(value) is not bool:
        raise _bad(name, "a boolean", value)
    return value


# ---- the field groups the routes share -----------------------------------------------


def parse_sampling(obj: Mapping[str, Any], *, structured: bool = True, **logprobs: int | None) -> SamplingParams:
    """temperature / top_p / top_k / seed / ignore_eos, the logits processors and the
    structured-output constraint (`services/api/structured.py`; not on routes where
    `response_format` means something else: `structured=False`) -> the frame's
    SamplingParams (`logprobs` / `prompt_logprobs`, already parsed by the route).

    top_k -1 is normalised to 0, the frame's single "off" value.
    """
    d = SamplingParams()
    temperature = get_number(obj, "temperature", lambda t: t >= 0.0, "a number >= 0 (0 = greedy)")
    top_p = get_number(obj, "top_p", lambda p: 0.0 < p <= 1.0, "a number in (0, 1]")
    top_k = get_int(obj, "top_k", minimum=-1, maximum=INT32_MAX, requirement="an integer >= 1, or 0 or -1 for off")
    seed = get_int(obj, "seed", minimum=0, maximum=SEED_MAX, requirement=f"an integer in [0, {SEED_MAX}]")
    ignore_eos = get_bool(obj, "ignore_eos")
    return SamplingParams(
        temperature=d.temperature if temperature is None else temperature,
        top_p=d.top_p if top_p is None else top_p,
        top_k=0 if top_k is None or top_k == -1 else top_k,
        seed=seed,
        ignore_eos=d.ignore_eos if ignore_eos is None else ignore_eos,
        **parse_processors(obj),
        **{k: v for k, v in logprobs.items() if v is not None},
        grammar=parse_structured(obj) if structured else None,
    )


def parse_processors(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The logits processors' fields that are set (absent or null: the default)."""
    penalty = f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
    out: dict[str, Any] = {
        "presence_penalty": get_number(obj, "presence_penalty", lambda v: abs(v) <= MAX_PENALTY, penalty),
        "frequency_penalty": get_number(obj, "frequency_penalty", lambda v: abs(v) <= MAX_PENALTY, penalty),
        "repetition_penalty": get_number(obj, "repetition_penalty", lambda v: v > 0.0, "a number > 0 (1 = off)"),
        "min_p": get_number(obj, "min_p", lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
        "min_tokens": get_int(obj, "min_tokens", minimum=0, maximum=INT32_MAX),
        "logit_bias": parse_logit_bias(obj),
        "stop_token_ids": parse_token_ids(obj, "stop_token_ids", MAX_STOP_TOKEN_IDS),
    }
    max_tokens = obj.get("max_tokens") if obj.get("max_tokens") is not None else obj.get("max_completion_tokens")
    if out["min_tokens"] and is_int(max_tokens) and out["min_tokens"] > max_tokens:
        raise ApiError(ErrorKind.INVALID, f"min_tokens ({out['min_tokens']}) must be at most max_tokens ({max_tokens})",
                       "min_tokens")
    return {k: v for k, v in out.items() if v is not None}


def parse_logit_bias(obj: Mapping[str, Any], name: str = "logit_bias") -> dict[int, float] | None:
    """An object mapping token ids (as JSON keys: "50256") to a bias in [-100, 100]."""
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(name, "an object mapping token ids to numbers in [-100, 100]", value)
    out: dict[int, float] = {}
    for key, bias in value.items():
        tok = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else -1
        if not 0 <= tok <= INT32_MAX:
            raise _bad(f"{name}[{json_repr(key)}]", "keyed by a token id (a non-negative integer)", key)
        if not is_number(bias) or not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
            raise _bad(f"{name}[{json_repr(key)}]", f"a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", bias)
        out[tok] = float(bias)
    return out or None


def parse_token_ids(obj: Mapping[str, Any], name: str, limit: int) -> list[int] | None:
    """A list of up to `limit` token ids."""
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad(name, f"a list of up to {limit} token ids", value)
    if len(value) > limit:
        raise ApiError(ErrorKind.INVALID, f"{name} must have at most {limit} token ids, got {len(value)}", name)
    for i, tok in enumerate(value):
        if not is_int(tok) or not 0 <= tok <= INT32_MAX:
            raise _bad(f"{name}[{i}]", f"an integer in [0, {INT32_MAX}]", tok)
    return list(dict.fromkeys(value)) or None


def parse_logprobs(obj: Mapping[str, Any], name: str = "logprobs") -> int | None:
    """An integer count of alternatives per token, 0 (the token's own only) to 20."""
    value = obj.get(name)
    if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
        raise _bad(name, f"an integer in [0, {MAX_LOGPROBS}]", value)
    return value


def check_token_ids(sampling: SamplingParams, vocab_size: int) -> None:
    """logit_bias keys and stop_token_ids must be tokens of the model's vocabulary."""
    for tok in sampling.logit_bias:
        if tok >= vocab_size:
            raise ApiError(ErrorKind.INVALID, f"logit_bias token id {tok} is out of the vocabulary "
                           f"(token ids are below {vocab_size})", "logit_bias")
    for tok in sampling.stop_token_ids:
        if tok >= vocab_size:
            raise ApiError(ErrorKind.INVALID, f"stop_token_ids token id {tok} is out of the vocabulary "
                           f"(token ids are below {vocab_size})", "stop_token_ids")


def parse_max_tokens(obj: Mapping[str, Any], name: str = "max_tokens") -> int | None:
    """max_tokens: an int >= 1, or None (the conductor then allows the most it can)."""
    return get_int(obj, name, minimum=1, maximum=INT32_MAX)


def parse_stop(obj: Mapping[str, Any], name: str = "stop") -> list[str]:
    """stop: null, a string, or a list of up to 4 strings; each 1-512 characters.

    An empty string is refused rather than read as "no stop": it would match at once.
    """
    value = obj.get(name)
    if value is None:
        return []
    requirement = f"a string or a list of up to {MAX_STOP} strings"
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise _bad(name, requirement, value)
    if len(items) > MAX_STOP:
        raise ApiError(ErrorKind.INVALID, f"{name} must have at most {MAX_STOP} strings, got {len(items)}", name)
    for i, item in enumerate(items):
        where = name if isinstance(value, str) else f"{name}[{i}]"
        if not isinstance(item, str):
            raise _bad(where, "a string", item)
        if not item:
            raise _bad(where, "a non-empty string", item)
        if len(item) > MAX_STOP_CHARS:
            raise ApiError(ErrorKind.INVALID, f"{where} must be at most {MAX_STOP_CHARS} characters, got {len(item)}",
                           where)
    return list(dict.fromkeys(items))


def parse_request_id(obj: Mapping[str, Any], name: str = "request_id") -> str:
    """The client's id (1-128 chars of [A-Za-z0-9._:-]) or a fresh `gen-<uuid hex>`."""
    value = obj.get(name)
    if value is None:
        return new_request_id()
    if not isinstance(value, str) or not REQUEST_ID_RE.fullmatch(value):
        raise _bad(name, "a string of 1-128 characters from [A-Za-z0-9._:-]", value)
    return value


def new_request_id() -> str:
    return f"gen-{uuid.uuid4().hex}"


def parse_prompt(obj: Mapping[str, Any]) -> tuple[str | None, list[int] | None]:
    """Exactly one of `prompt` (non-empty string) or `input_ids` (non-empty list of ids)."""
    prompt = obj.get("prompt")
    input_ids = obj.get("input_ids")
    if prompt is None and input_ids is None:
        raise ApiError(ErrorKind.INVALID, "one of prompt (a string) or input_ids (a list of integers) is required",
                       "prompt")
    if prompt is not None and input_ids is not None:
        raise ApiError(ErrorKind.INVALID, "prompt and input_ids are mutually exclusive; give exactly one", "input_ids")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise _bad("prompt", "a non-empty string", prompt)
        return prompt, None
    if not isinstance(input_ids, list) or not input_ids:
        raise _bad("input_ids", "a non-empty list of integers >= 0", input_ids)
    for i, tok in enumerate(input_ids):
        if not is_int(tok) or tok < 0:
            raise _bad(f"input_ids[{i}]", "an integer >= 0", tok)
        if tok > INT32_MAX:
            raise _bad(f"input_ids[{i}]", f"an integer <= {INT32_MAX}", tok)
    return None, input_ids


def parse_language(obj: Mapping[str, Any], name: str = "language") -> str | None:
    """language: null, or a code ("en") / Whisper token ("<|en|>") of 1-32 characters."""
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not LANGUAGE_RE.fullmatch(value):
        raise _bad(name, 'a language code such as "en" (letters, "-" or "_", 1-32 characters)', value)
    return value


def parse_task(obj: Mapping[str, Any], name: str = "task") -> str | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or value not in AUDIO_TASKS:
        raise _bad(name, " or ".join(f'"{t}"' for t in AUDIO_TASKS), value)
    return value


def _generate_params(obj: Mapping[str, Any], prompt: str | None, input_ids: list[int] | None,
                     **audio: Any) -> GenerateParams:
    """The fields `/generate` shares between a text prompt and an audio file."""
    max_tokens = parse_max_tokens(obj)
    sampling = parse_sampling(obj, logprobs=parse_logprobs(obj), prompt_logprobs=parse_logprobs(obj, "prompt_logprobs"))
    stop = parse_stop(obj)
    stream = get_bool(obj, "stream")
    request_id = parse_request_id(obj)
    return GenerateParams(
        request_id=request_id,
        sampling=sampling,
        max_tokens=max_tokens,
        prompt=prompt,
        input_ids=input_ids,
        stream=stream,
        stop=stop,
        **audio,
    )


def parse_generate(obj: Mapping[str, Any], *, envelope: Iterable[str] = ()) -> GenerateParams:
    """Validate a `/generate` body (or a WebSocket frame, whose `envelope` keys such as
    `type` and `id` the caller checks itself) into `GenerateParams`; raises `ApiError`."""
    check_fields(obj, GENERATE_FIELDS | frozenset(envelope))
    refuse_unsupported(obj, honoured=GENERATE_HONOURED)
    prompt, input_ids = parse_prompt(obj)
    return _generate_params(obj, prompt, input_ids)


def check_audio(audio: bytes | None, name: str = "file") -> bytes:
    """The uploaded file must be there and non-empty (decoding it is the data worker's job)."""
    if audio is None:
        raise ApiError(ErrorKind.INVALID,
                       f"{name} is required: upload a WAV or FLAC file as the multipart/form-data field {name!r}", name)
    if not audio:
        raise ApiError(ErrorKind.INVALID, f"{name} is empty; upload a WAV or FLAC file", name)
    return audio


def parse_audio_generate(obj: Mapping[str, Any], audio: bytes | None) -> GenerateParams:
    """Validate the fields of a multipart `/generate` (already typed by `forms.py`) that
    carries an audio file: the `/generate` fields less `prompt` / `input_ids` (the audio is
    the prompt; given, they are a 400), plus `language` and `task`."""
    check_fields(obj, (GENERATE_FIELDS - STRUCTURED_FIELDS) | AUDIO_FIELDS)
    refuse_unsupported(obj, honoured=("logprobs", "prompt_logprobs"))  # no grammar over a transcript
    for name in ("prompt", "input_ids"):
        if obj.get(name) is not None:
            raise ApiError(ErrorKind.INVALID,
                           f"{name} must be absent when an audio file is sent: the audio is the prompt", name)
    audio = check_audio(audio)
    language = parse_language(obj)
    task = parse_task(obj)
    return _generate_params(obj, None, None, audio=audio, language=language, task=task)
