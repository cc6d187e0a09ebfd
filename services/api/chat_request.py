"""The chat request: the one request every dialect's chat body becomes (`ChatRequest`), and
the steps each takes to get there. The core of the api's dialects, beside `chat.py`: it
imports no route and no dialect.

- `ChatRequest`: what to generate (`GenerateParams`) and how to answer (stream, usage,
  logprobs, `n`, tools, template variables); `chat.plan_chat` fills in its prompt
  (`with_prompt`) and, for forced tool calls or a reasoning template, its grammar
  (`with_grammar`).
- `parse_chat`: OpenAI's chat body (`schemas.ChatCompletionRequest`) -> a `ChatRequest` and
  its messages as plain dicts (`parse_messages`, which `/tokenize` uses too).
  `/v1/chat/completions` reads its bodies with it, and so does `/v1/responses`, which
  writes its items as such a body first so a field is checked one way; `/v1/messages`
  builds its `ChatRequest` itself.
- `check_model`: the served model's name, every route's `model` check (the task routes'
  too); `stream_flags`, `check_n`: the rules across fields that chat and completions share.

The body's shape is declared in `schemas.py` (`ChatCompletionRequest`, whose sampling,
`max_tokens` and `stop` fields are `/generate`'s) and decoded by `validation.load`, so a
field is checked one way whichever route carries it. What is left here is what a
declaration cannot say: the served model's name, the rules across fields (`n`, `best_of`,
`stream_options` without `stream`, `max_tokens` vs `max_completion_tokens`, the messages'
roles), and the translation into `GenerateParams`. The rendering of `messages` is the chat
template's job (`chat_template.py`); this module makes them plain dicts.

Choices (OpenAI's and vLLM's behaviour, see the README):
- `model` may be omitted; given, it must be the served name, else 404 `model_not_found`.
- chat without `max_tokens` / `max_completion_tokens` gets the most the engine allows for
  the prompt, as `/generate` does.
- `n` (1-`MAX_N`) samples per prompt: choice `i * n + j` is sample j of prompt i, with
  seed `seed + j` when a seed is given; `best_of` may only equal `n` (vLLM's V1 engine
  ranks no samples either).
- `user` is accepted and not used (it only labels the end user for the provider).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

import msgspec

from services.api.errors import ApiError, HttpKind, invalid
from services.api.reasoning import RESERVED
from services.api.schemas import (
    ChatCompletionRequest,
    ChatMessageParam,
    ImageUrlPart,
    InputAudioPart,
    OpenAIFields,
    VideoUrlPart,
)
from services.api.structured import parse_structured, validated
from services.api.tools import Tools, parse_history_calls, parse_tools
from services.api.validation import (
    AudioRef,
    GenerateParams,
    ImageRef,
    VideoRef,
    left_out,
    load,
    sampling_params,
    stop_strings,
)
from shared.errors import ErrorKind

MAX_CHOICES = 256  # prompts x n


class ChatRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A validated chat request, whichever dialect's body it came from: what to generate
    and how to answer. `chat.plan_chat` renders its prompt; the dialect's reply reads the
    rest."""

    params: GenerateParams
    stream: bool = False
    include_usage: bool = False  # streaming: a last chunk with usage and no choices
    #: `top_logprobs` when `logprobs` is true (None: no logprobs)
    logprobs: int | None = None
    #: samples per prompt
    n: int = 1
    #: the request's tools (None: none, or tool_choice "none")
    tools: Tools | None = None
    #: extra variables for the chat template (vLLM's `chat_template_kwargs`)
    template_kwargs: dict[str, Any] = {}


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


#: every served model's name, where several models are served (`fleet.ModelRouter` sets it
#: per request): a refusal names them all, not only the app's own
SERVED: ContextVar[tuple[str, ...]] = ContextVar("served_models", default=())


def check_model(model: str | None, served: str) -> None:
    """`model`: omitted, null, or the served name (else 404 model_not_found, as OpenAI)."""
    if model is not None and model != served:
        names = ", ".join(f"`{n}`" for n in SERVED.get() or (served,))
        raise ApiError(HttpKind.MODEL_NOT_FOUND, f"The model `{model}` does not exist; this server serves {names}.",
                       "model", code="model_not_found")


def stream_flags(req: OpenAIFields) -> tuple[bool, bool]:
    """(stream, include_usage). `stream_options` is allowed only with stream."""
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    return bool(req.stream), bool(req.stream_options and req.stream_options.include_usage)


def check_n(n: int, prompts: int = 1, best_of: int | None = None) -> int:
    """`n` samples per prompt (prompts x n at most MAX_CHOICES); `best_of`, when given, must
    equal n (vLLM's V1 engine ranks no samples either)."""
    if prompts * n > MAX_CHOICES:
        raise invalid("n", f"{prompts} prompts x n={n} is {prompts * n} choices; at most {MAX_CHOICES} are allowed")
    if best_of is not None and best_of != n:
        raise invalid("best_of", f"best_of must equal n ({n}): samples are not ranked, got {best_of}")
    return n


def parse_messages(messages: list[ChatMessageParam], parts: bool = False, audios: list[AudioRef] | None = None,
                   videos: list[VideoRef] | None = None) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """(`messages` as plain dicts {role, content[, name, tool_calls, tool_call_id]} for the
    chat template, the image parts in prompt order). Text parts are joined with newlines
    (vLLM's "string" content format); with `parts` (a vision model, whose template walks a
    list) content is a list of parts, each image as `{"type": "image"}` as transformers'
    processors pass it. `audios` (an omni model's chat): its audio parts are appended there
    and go to the template as `{"type": "audio"}`; without it an audio part is a 400
    naming the part. `videos` likewise for `video_url` parts (`{"type": "video"}`)."""
    out: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if msg.tool_calls and msg.role != "assistant":
            raise invalid(f"{where}.tool_calls", f"{where}.tool_calls is only for an assistant message")
        if msg.role == "tool" and msg.tool_call_id is None:
            raise invalid(f"{where}.tool_call_id",
                          f"{where}.tool_call_id must be the id of the call this result answers")
        if msg.content is None and msg.role != "assistant":
            raise invalid(f"{where}.content", f"{where}.content is required for a {msg.role} message")
        entry: dict[str, Any] = {"role": msg.role, "content": _content(msg, where, parts, images, audios, videos)}
        if msg.name is not None:
            entry["name"] = msg.name
        if msg.tool_calls:
            entry["tool_calls"] = parse_history_calls(msg.tool_calls, f"{where}.tool_calls")
        if msg.role == "tool":
            entry["tool_call_id"] = msg.tool_call_id
        thinking = msg.reasoning_content if msg.reasoning_content is not None else msg.reasoning
        if thinking is not None:
            if msg.role != "assistant":
                field = "reasoning_content" if msg.reasoning_content is not None else "reasoning"
                raise invalid(f"{where}.{field}", f"{where}.{field} is only for an assistant message")
            entry["reasoning_content"] = thinking
        out.append(entry)
    return out, images


def _content(msg: ChatMessageParam, where: str, parts: bool, images: list[ImageRef],
             audios: list[AudioRef] | None = None, videos: list[VideoRef] | None = None) -> Any:
    """A message's content for the template; its image parts appended to `images`, its
    audio parts to `audios`, its video parts to `videos` (a 400 naming the part where the
    model takes none)."""
    if msg.content is None or isinstance(msg.content, str):
        return [{"type": "text", "text": msg.content}] if parts and msg.content is not None else msg.content
    listed: list[dict[str, Any]] = []
    for j, part in enumerate(msg.content):
        if isinstance(part, ImageUrlPart):
            images.append(ImageRef(part.image_url.url, f"{where}.content[{j}].image_url.url"))
            listed.append({"type": "image"})
        elif isinstance(part, InputAudioPart):
            if audios is None:
                raise invalid(f"{where}.content[{j}]", f"the served model takes no audio inputs: {where}.content[{j}] "
                                                       "is an input_audio part")
            audios.append(AudioRef(part.input_audio.data, f"{where}.content[{j}].input_audio.data"))
            listed.append({"type": "audio"})
        elif isinstance(part, VideoUrlPart):
            if videos is None:
                raise invalid(f"{where}.content[{j}]", f"the served model takes no video inputs: {where}.content[{j}] "
                                                       "is a video_url part")
            videos.append(VideoRef(part.video_url.url, f"{where}.content[{j}].video_url.url"))
            listed.append({"type": "video"})
        else:
            listed.append({"type": "text", "text": part.text})
    if parts:
        return listed
    return "\n".join(p["text"] for p in listed if p["type"] == "text")


def parse_chat(obj: Mapping[str, Any], served: str, vision: bool = False,
               audio: bool = False, video: bool = False) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """Validate a `/v1/chat/completions` body (`schemas.ChatCompletionRequest`); the prompt
    is filled in by the caller from the rendered template (see `with_prompt`). `vision`:
    the served model takes images (content goes to its template as a list of parts);
    `audio`: it takes audio inputs (`input_audio` parts) too; `video`: `video_url` parts."""
    req = load(obj, ChatCompletionRequest)
    check_model(req.model, served)
    audios: list[AudioRef] | None = [] if audio else None
    videos: list[VideoRef] | None = [] if video else None
    messages, images = parse_messages(req.messages, parts=vision or audio, audios=audios, videos=videos)
    n = check_n(req.n or 1)
    new, old = req.max_completion_tokens, req.max_tokens  # OpenAI's current name, and its deprecated alias
    if new is not None and old is not None and new != old:
        raise invalid("max_completion_tokens",
                      f"max_tokens ({old}) and max_completion_tokens ({new}) disagree; give one")
    max_tokens = new if new is not None else old
    stream, include_usage = stream_flags(req)
    if req.top_logprobs and not req.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = GenerateParams(
        request_id=chat_completion_id(),
        sampling=sampling_params(req, max_tokens, grammar=parse_structured(req), logprobs=logprobs),
        max_tokens=max_tokens,
        prompt=None,
        stream=stream,
        stop=stop_strings(req.stop),
        add_special_tokens=False,
        image_refs=tuple(images),
        audio_refs=tuple(audios or ()),
        video_refs=tuple(videos or ()),
        defaulted=left_out(req),
    )
    tools = parse_tools(req)
    if tools is not None and tools.forced and params.sampling.grammar is not None:
        raise invalid("tool_choice", "tool_choice required or a named function cannot be combined with a "
                      "structured-output constraint (response_format, structured_outputs, guided_*)")
    kwargs = req.chat_template_kwargs or {}
    if req.reasoning_effort is not None and "reasoning_effort" not in kwargs:
        kwargs = {**kwargs, "reasoning_effort": req.reasoning_effort}
    for key in kwargs:
        if key in RESERVED:
            raise invalid(f"chat_template_kwargs.{key}", f"chat_template_kwargs.{key} is set by the server, "
                          "not the request")
    return ChatRequest(params=params, stream=stream, include_usage=include_usage, logprobs=logprobs, n=n,
                       tools=tools, template_kwargs=kwargs), messages


def with_prompt(req: ChatRequest, prompt: str) -> ChatRequest:
    """The request with its rendered chat prompt (refused if the template rendered nothing)."""
    if not prompt:
        raise ApiError(ErrorKind.INVALID, "the chat template rendered an empty prompt for these messages", "messages")
    return msgspec.structs.replace(req, params=msgspec.structs.replace(req.params, prompt=prompt))


def with_specials_kept(req: ChatRequest) -> ChatRequest:
    """The request's reply detokenized with its special tokens (a harmony reply's channel
    markers, which say what is thinking, answer and call)."""
    return msgspec.structs.replace(req, params=msgspec.structs.replace(req.params, skip_special_tokens=False))


def with_grammar(req: ChatRequest, grammar: str, check: str | None = "tools") -> ChatRequest:
    """The request constrained by `grammar`: the calls of `tool_choice` "required" or a
    named function, checked (a function's `parameters` that do not compile are a 400 naming
    `check`), or (`check` None) a constraint already checked, moved after a reasoning
    model's thinking."""
    if check is not None:
        grammar = validated(grammar, check)
    sampling = msgspec.structs.replace(req.params.sampling, grammar=grammar)
    return msgspec.structs.replace(req, params=msgspec.structs.replace(req.params, sampling=sampling))
