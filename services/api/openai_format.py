"""OpenAI response objects built from a generation's delta / done events.

The engine side (`Generation`) knows nothing of OpenAI: it yields the same `DeltaEvent`s
and `DoneEvent` for every route, and these classes turn them into `text_completion` /
`chat.completion` objects, or into SSE chunks with OpenAI's framing:
- chat: a first chunk with `delta: {"role": "assistant", "content": ""}`, then one chunk
  per delta with text (deltas that only carry ids are not sent), then a chunk with an
  empty delta and the finish reason;
- completions: one chunk per delta with text, then one with `""` and the finish reason
  (with `echo`, the prompt text is the first chunk's text);
- with `stream_options.include_usage`, every chunk has `"usage": null` and a last chunk
  has `"choices": []` and the usage; then `data: [DONE]`.
- an error after the stream began is `data: {"error": {...}}` (which the openai client
  raises as an APIError), then `data: [DONE]`.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from services.api.errors import ApiError
from services.api.events import DeltaEvent, DoneEvent, encode

DONE_LINE = b"data: [DONE]\n\n"


class OpenAIUsage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage_of(done: DoneEvent) -> OpenAIUsage:
    u = done.usage
    return OpenAIUsage(u.prompt_tokens, u.completion_tokens, u.prompt_tokens + u.completion_tokens)


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(msgspec.Struct):
    """`text_completion`: the reply and each stream chunk of `/v1/completions`."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: OpenAIUsage | UnsetType | None = UNSET


class ChatMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: OpenAIUsage | UnsetType | None = UNSET


def _data(obj: msgspec.Struct) -> bytes:
    return b"data: " + encode(obj) + b"\n\n"


def error_chunk(err: ApiError) -> bytes:
    return b"data: " + encode(err.body()) + b"\n\n"


class CompletionReply:
    """Answers one `/v1/completions` request, as JSON or as SSE chunks."""

    def __init__(self, request_id: str, model: str, created: int, *, include_usage: bool = False,
                 echo: str = "") -> None:
        self.id = request_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self._echo = echo
        self._usage: OpenAIUsage | UnsetType | None = None if include_usage else UNSET

    def json(self, done: DoneEvent) -> Completion:
        choice = CompletionChoice(0, self._echo + done.text, done.finish_reason)
        return Completion(self.id, self.created, self.model, [choice], usage=usage_of(done))

    def _chunk(self, text: str, finish_reason: str | None) -> bytes:
        choice = CompletionChoice(0, text, finish_reason)
        return _data(Completion(self.id, self.created, self.model, [choice], usage=self._usage))

    def event(self, event: DeltaEvent | DoneEvent) -> bytes:
        out = b""
        if self._echo:
            out, self._echo = self._chunk(self._echo, None), ""
        if type(event) is DeltaEvent:
            return out + (self._chunk(event.text, None) if event.text else b"")
        assert type(event) is DoneEvent
        out += self._chunk("", event.finish_reason)
        if self.include_usage:
            out += _data(Completion(self.id, self.created, self.model, [], usage=usage_of(event)))
        return out

    def error(self, err: ApiError) -> bytes:
        return error_chunk(err)

    def end(self) -> bytes:
        return DONE_LINE


class ChatReply:
    """Answers one `/v1/chat/completions` request, as JSON or as SSE chunks."""

    def __init__(self, request_id: str, model: str, created: int, *, include_usage: bool = False) -> None:
        self.id = request_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self._usage: OpenAIUsage | UnsetType | None = None if include_usage else UNSET
        self._started = False

    def json(self, done: DoneEvent) -> ChatCompletion:
        choice = ChatChoice(0, ChatMessage(done.text), done.finish_reason)
        return ChatCompletion(self.id, self.created, self.model, [choice], usage_of(done))

    def _chunk(self, delta: ChatDelta, finish_reason: str | None) -> bytes:
        chunk = ChatCompletionChunk(self.id, self.created, self.model, [ChatChunkChoice(0, delta, finish_reason)],
                                    usage=self._usage)
        return _data(chunk)

    def event(self, event: DeltaEvent | DoneEvent) -> bytes:
        out = b""
        if not self._started:
            self._started = True
            out = self._chunk(ChatDelta(role="assistant", content=""), None)
        if type(event) is DeltaEvent:
            return out + (self._chunk(ChatDelta(content=event.text), None) if event.text else b"")
        assert type(event) is DoneEvent
        out += self._chunk(ChatDelta(), event.finish_reason)
        if self.include_usage:
            out += _data(ChatCompletionChunk(self.id, self.created, self.model, [], usage=usage_of(event)))
        return out

    def error(self, err: ApiError) -> bytes:
        return error_chunk(err)

    def end(self) -> bytes:
        return DONE_LINE
