"""A generation's delta / done events as Anthropic's `message` object, or as its stream:

    message_start (the message, no content yet) -> ping
    -> per content block: content_block_start, content_block_delta..., content_block_stop
    -> message_delta (stop_reason, stop_sequence, usage) -> message_stop

each as `event: <type>` and `data: <json>` lines. Blocks come in the order of the JSON
reply's `content`: a reasoning model's `thinking` (a `signature_delta` of "" before it
closes: nothing here signs it), the `text`, then each `tool_use` (whole, as one
`input_json_delta`: the calls are parsed once the reply is complete, as the chat route does).
The thinking is split and tool calls held back by the chat route's own pieces
(`answer.read_answer` / `AnswerStream`), so a streamed
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

from services.api.answer import AnswerStream, read_answer
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
from services.api.tools import ToolCall


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
        self._answer = AnswerStream(reasoning, tool_format, tools_forced)
        self._started = False
        self._index = -1  # the index of the last block started
        self._open: str | None = None  # the kind of the block open now ("thinking", "text")

    # ---- JSON --------------------------------------------------------------------------------

    def content(self, text: str) -> tuple[list[MessagesBlock], bool]:
        """(the content blocks of a whole reply, whether it holds tool calls)."""
        answer = read_answer(text, self.reasoning, self.tool_format)
        blocks: list[MessagesBlock] = [MessagesThinkingBlock(answer.thinking)] if answer.thinking else []
        if answer.content:
            blocks.append(MessagesTextBlock(answer.content))
        blocks += [tool_use(c) for c in answer.calls]
        return blocks, bool(answer.calls)

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
        return self._think(thinking) + self._text(answer)

    def event(self, event: DeltaEvent | DoneEvent) -> bytes:
        out = b""
        if not self._started:
            self._started = True
            usage = MessagesUsage(self.input_tokens, 0)
            out = sse(MessageStart(MessagesResponse(self.id, self.model, [], None, None, usage))) + sse(Ping())
        if type(event) is DeltaEvent:
            return out + self._parts(*self._answer.feed(event.text))
        assert type(event) is DoneEvent
        thinking, rest, calls = self._answer.finish()
        out += self._parts(thinking, rest)
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
