"""A generation's delta / done events as Anthropic's `message` object, or as its stream:

    message_start (the message, no content yet) -> ping
    -> per content block: content_block_start, content_block_delta..., content_block_stop
    -> message_delta (stop_reason, stop_sequence, usage) -> message_stop

each as `event: <type>` and `data: <json>` lines. Blocks come in the order of the JSON
reply's `content`: a reasoning model's `thinking` (a `signature_delta` of "" before it
closes: nothing here signs it), the `text`, then each `tool_use` (whole, as one
`input_json_delta`: the calls are parsed once the reply is complete, as the chat route does).
The thinking is split and tool calls held back by the chat route's own pieces
(`reasoning.split` / `ReasoningStream`, `tools.extract` / `ToolStream`), so a streamed
reply joins to exactly the unstreamed one. A failure after the stream began is
`event: error` with Anthropic's error object; nothing follows it.

`stop_reason`: `tool_use` when the answer parses into calls, `max_tokens` when the length
ran out, `stop_sequence` (and `stop_sequence`, the string) when a stop sequence ended it,
else `end_turn` (EOS, and a request the server aborted).
"""

from __future__ import annotations

import json
import uuid

import msgspec

from services.api.dialects.messages.errors import error_event
from services.api.dialects.messages.schemas import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    MessageDelta,
    MessageDeltaBody,
    MessagesBlock,
    MessagesResponse,
    MessageStart,
    MessagesTextBlock,
    MessagesThinkingBlock,
    MessagesToolUseBlock,
    MessageStop,
    MessagesUsage,
    Ping,
    SignatureDelta,
    StopReason,
    TextDelta,
    ThinkingDelta,
)
from services.api.errors import ApiError
from services.api.events import DeltaEvent, DoneEvent, encode
from services.api.reasoning import ReasoningStream, split
from services.api.tools import ToolCall, ToolStream, extract


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def tool_use(call: ToolCall) -> MessagesToolUseBlock:
    """A parsed call as a `tool_use` block (its arguments, always a JSON object, as `input`)."""
    return MessagesToolUseBlock(tool_use_id(), call.function.name, json.loads(call.function.arguments))


def stop_of(done: DoneEvent, calls: bool) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a finished reply."""
    if calls:
        return "tool_use", None
    if done.finish_reason == "length":
        return "max_tokens", None
    if done.finish_reason == "stop" and isinstance(done.stop_reason, str):
        return "stop_sequence", done.stop_reason
    return "end_turn", None


def sse(event: msgspec.Struct) -> bytes:
    kind = type(event).__struct_config__.tag
    return b"event: " + str(kind).encode() + b"\ndata: " + encode(event) + b"\n\n"


class MessagesReply:
    """Answers one `/v1/messages` request (`streaming.Reply`): JSON, or the event stream.
    `input_tokens` is the prompt's count known before the first token (the message_start's
    usage); the message_delta carries the workers' count, which clients take as final."""

    def __init__(self, message_id: str, model: str, *, input_tokens: int = 0, tool_format: str | None = None,
                 tools_forced: bool = False, reasoning: str | None = None) -> None:
        self.id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.tool_format = tool_format
        self.reasoning = reasoning
        self._tools = ToolStream(tool_format, tools_forced) if tool_format is not None else None
        self._thinking = ReasoningStream(reasoning) if reasoning is not None else None
        self._started = False
        self._index = -1  # the index of the last block started
        self._open: str | None = None  # the kind of the block open now ("thinking", "text")

    # ---- JSON --------------------------------------------------------------------------------

    def content(self, text: str) -> tuple[list[MessagesBlock], bool]:
        """(the content blocks of a whole reply, whether it holds tool calls)."""
        thinking, answer = (None, text) if self.reasoning is None else split(text, self.reasoning)
        blocks: list[MessagesBlock] = [MessagesThinkingBlock(thinking)] if thinking else []
        calls: list[ToolCall] = []
        if self.tool_format is not None:
            content, calls = extract(answer, self.tool_format)
            if calls:
                answer = content or ""
        if answer:
            blocks.append(MessagesTextBlock(answer))
        blocks += [tool_use(c) for c in calls]
        return blocks, bool(calls)

    def json(self, done: DoneEvent) -> MessagesResponse:
        blocks, calls = self.content(done.text)
        reason, sequence = stop_of(done, calls)
        return MessagesResponse(self.id, self.model, blocks, reason, sequence,
                                MessagesUsage(done.usage.prompt_tokens, done.usage.completion_tokens))

    # ---- stream ------------------------------------------------------------------------------

    def _start(self, block: MessagesBlock) -> bytes:
        out = self._close()
        self._index += 1
        self._open = str(type(block).__struct_config__.tag)
        return out + sse(ContentBlockStart(self._index, block))

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        out = sse(ContentBlockDelta(self._index, SignatureDelta(""))) if self._open == "thinking" else b""
        self._open = None
        return out + sse(ContentBlockStop(self._index))

    def _text(self, text: str) -> bytes:
        if not text:
            return b""
        out = self._start(MessagesTextBlock("")) if self._open != "text" else b""
        return out + sse(ContentBlockDelta(self._index, TextDelta(text)))

    def _think(self, text: str) -> bytes:
        if not text:
            return b""
        out = self._start(MessagesThinkingBlock("")) if self._open != "thinking" else b""
        return out + sse(ContentBlockDelta(self._index, ThinkingDelta(text)))

    def _parts(self, thinking: str, answer: str) -> bytes:
        out = self._think(thinking)
        if self._tools is not None:
            answer = self._tools.feed(answer)
        return out + self._text(answer)

    def event(self, event: DeltaEvent | DoneEvent) -> bytes:
        out = b""
        if not self._started:
            self._started = True
            usage = MessagesUsage(self.input_tokens, 0)
            out = sse(MessageStart(MessagesResponse(self.id, self.model, [], None, None, usage))) + sse(Ping())
        if type(event) is DeltaEvent:
            if self._thinking is None and self._tools is None:
                return out + self._text(event.text)
            return out + self._parts(*(("", event.text) if self._thinking is None else self._thinking.feed(event.text)))
        assert type(event) is DoneEvent
        if self._thinking is not None:
            out += self._parts(*self._thinking.finish())
        calls: list[ToolCall] = []
        if self._tools is not None:
            rest, calls = self._tools.finish()
            out += self._text(rest)
            for call in calls:
                block = tool_use(call)
                out += self._start(MessagesToolUseBlock(block.id, block.name, {}))
                out += sse(ContentBlockDelta(self._index, InputJsonDelta(call.function.arguments)))
        out += self._close()
        reason, sequence = stop_of(event, bool(calls))
        usage = MessagesUsage(event.usage.prompt_tokens, event.usage.completion_tokens)
        return out + sse(MessageDelta(MessageDeltaBody(reason, sequence), usage)) + sse(MessageStop())

    def error(self, err: ApiError) -> bytes:
        return error_event(err)

    def end(self) -> bytes:
        return b""
