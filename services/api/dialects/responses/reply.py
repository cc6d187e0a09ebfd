"""The Responses API's answer: a generation's `DeltaEvent` / `DoneEvent` -> the `response`
object (JSON), or OpenAI's stream of typed SSE events.

The answer is read as chat's is (`answer.read_answer` / `AnswerStream`): a reasoning
template's thinking is split off into a `reasoning` item, and with tools the calls are
parsed from the text into `function_call` items; the rest is a `message` item with one
`output_text` part.

Stream (each event an SSE `event: <type>` line and a `data:` object with `type` and
`sequence_number`, numbered from 0): `response.created`, `response.in_progress`; for the
thinking `response.output_item.added`, `response.content_part.added`,
`response.reasoning_text.delta`..., `.done`, `response.content_part.done`,
`response.output_item.done`; for the text the same with `response.output_text.*`; for
each call `response.output_item.added`, one `response.function_call_arguments.delta` with
the whole arguments (a call is sent once it is whole, as chat sends it), `.done`,
`response.output_item.done`; then `response.completed` (or `response.incomplete`) with the
whole response, whose output is exactly the items streamed. A failure after the stream
began is an `error` event, then `response.failed`. No `[DONE]` line (OpenAI sends none).

Finish reasons: `length` -> status `incomplete` with `incomplete_details.reason`
`max_output_tokens`; a server-side abort -> `cancelled`; else `completed`. A finished
response is put in the store (`store.py`) unless the request said `store: false`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from services.api.answer import AnswerStream, read_answer
from services.api.dialects.responses.schemas import (
    RespArgumentsDeltaEvent,
    RespArgumentsDoneEvent,
    RespError,
    RespErrorEvent,
    RespFunctionCall,
    RespIncompleteDetails,
    RespInputTokensDetails,
    RespItemEvent,
    RespLifecycleEvent,
    ResponseObject,
    ResponsesInputItem,
    ResponsesReasoningConfig,
    ResponsesRequest,
    ResponsesTextConfig,
    ResponsesTextFormatText,
    RespOutputItem,
    RespOutputMessage,
    RespOutputText,
    RespOutputTokensDetails,
    RespPartEvent,
    RespReasoning,
    RespReasoningDeltaEvent,
    RespReasoningDoneEvent,
    RespReasoningText,
    RespTextDeltaEvent,
    RespTextDoneEvent,
    RespUsage,
)
from services.api.dialects.responses.store import ResponseStore, StoredResponse
from services.api.dialects.responses.translate import as_input
from services.api.errors import ApiError
from services.api.events import DeltaEvent, DoneEvent
from services.api.tools import ToolCall

_ENCODER = msgspec.json.Encoder()


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def echo_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as the response object repeats them (OpenAI's defaults
    where the request left them out; temperature and top_p as sent, null if not)."""
    text = req.text or ResponsesTextConfig()
    if text.format is None:
        text = msgspec.structs.replace(text, format=ResponsesTextFormatText())
    return {"instructions": req.instructions, "tools": list(req.tools or []), "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "top_p": req.top_p, "text": text, "reasoning": req.reasoning or ResponsesReasoningConfig(),
            "previous_response_id": req.previous_response_id, "max_output_tokens": req.max_output_tokens,
            "metadata": dict(req.metadata or {}), "user": req.user, "store": req.store is not False,
            "service_tier": "default" if req.service_tier in (None, "auto") else req.service_tier}


class ReplyContext(NamedTuple):
    """What a reply needs besides the generation's events."""

    response_id: str
    model: str
    created_at: int
    echo: dict[str, Any]
    #: how tool calls are written (None: no tools), whether the answer is calls only, and
    #: where the prompt leaves a reasoning template's thinking (None: not one)
    tool_format: str | None
    tools_forced: bool
    reasoning: str | None
    #: the conversation before this response's output (stored with it), and the store
    #: (None: `store: false`)
    items: tuple[ResponsesInputItem, ...]
    store: ResponseStore | None
    #: token count of a text (the thinking's, for `reasoning_tokens`)
    count_tokens: Callable[[str], int]


def _status(finish_reason: str) -> tuple[str, RespIncompleteDetails | None]:
    if finish_reason == "length":
        return "incomplete", RespIncompleteDetails("max_output_tokens")
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def _sse(event: msgspec.Struct, kind: str) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _ENCODER.encode(event) + b"\n\n"


class ResponsesReply:
    """Answers one `/v1/responses` request, as the response object or as its SSE events."""

    def __init__(self, ctx: ReplyContext) -> None:
        self.ctx = ctx
        self._seq = 0
        self._started = False
        self._output: list[RespOutputItem] = []
        self._answer = AnswerStream(ctx.reasoning, ctx.tool_format, ctx.tools_forced)
        self._open: RespOutputMessage | RespReasoning | None = None  # the item whose text is streaming
        self._text = ""  # the open item's text so far
        self._thought = ""  # all the thinking, for reasoning_tokens

    # ---- the whole response ----------------------------------------------------------------

    def response(self, status: str, output: list[RespOutputItem], usage: RespUsage | None = None,
                 incomplete: RespIncompleteDetails | None = None, error: RespError | None = None) -> ResponseObject:
        ctx = self.ctx
        done = status not in ("in_progress",)
        return ResponseObject(id=ctx.response_id, created_at=ctx.created_at, status=status,  # type: ignore[arg-type]
                              model=ctx.model, output=output, usage=usage, incomplete_details=incomplete, error=error,
                              completed_at=int(time.time()) if done else None, **ctx.echo)

    def _usage(self, done: DoneEvent, thinking: str) -> RespUsage:
        u = done.usage
        reasoning = self.ctx.count_tokens(thinking) if thinking else 0
        return RespUsage(u.prompt_tokens, u.completion_tokens, u.prompt_tokens + u.completion_tokens,
                         RespInputTokensDetails(u.cached_tokens or 0),
                         RespOutputTokensDetails(min(reasoning, u.completion_tokens)))

    def _finished(self, done: DoneEvent, output: list[RespOutputItem], thinking: str) -> ResponseObject:
        status, incomplete = _status(done.finish_reason)
        resp = self.response(status, output, self._usage(done, thinking), incomplete)
        if self.ctx.store is not None:
            self.ctx.store.put(StoredResponse(resp, (*self.ctx.items, *(as_input(i) for i in output))))
        return resp

    def json(self, done: DoneEvent) -> ResponseObject:
        ctx = self.ctx
        thinking, content, calls = read_answer(done.text, ctx.reasoning, ctx.tool_format)
        message_status = "incomplete" if done.finish_reason == "length" else "completed"
        output: list[RespOutputItem] = []
        if thinking is not None:
            output.append(RespReasoning(new_id("rs"), [], [RespReasoningText(thinking)]))
        if content is not None:
            output.append(RespOutputMessage(new_id("msg"), message_status, [RespOutputText(content)]))
        output += [RespFunctionCall(new_id("fc"), c.id, c.function.name, c.function.arguments) for c in calls]
        return self._finished(done, output, thinking or "")

    # ---- the stream ------------------------------------------------------------------------

    def _emit(self, event: Any) -> bytes:
        event.sequence_number = self._seq
        self._seq += 1
        return _sse(event, event.type)

    def _add(self, item: RespOutputItem) -> bytes:
        self._output.append(item)
        return self._emit(RespItemEvent("response.output_item.added", 0, len(self._output) - 1, item))

    def _open_item(self, item: RespOutputMessage | RespReasoning) -> bytes:
        """Start a text-carrying item (its part comes empty, filled by deltas)."""
        out = self._add(item)
        self._open, self._text = item, ""
        part = RespOutputText("") if isinstance(item, RespOutputMessage) else RespReasoningText("")
        return out + self._emit(RespPartEvent("response.content_part.added", 0, item.id, len(self._output) - 1, 0,
                                              part))

    def _close_item(self, status: str = "completed") -> bytes:
        item, text, index = self._open, self._text, len(self._output) - 1
        if item is None:
            return b""
        self._open = None
        if isinstance(item, RespOutputMessage):
            part: RespOutputText | RespReasoningText = RespOutputText(text)
            out = self._emit(RespTextDoneEvent("response.output_text.done", 0, item.id, index, 0, text))
            final: RespOutputItem = RespOutputMessage(item.id, status, [part])  # type: ignore[list-item]
        else:
            part = RespReasoningText(text)
            out = self._emit(RespReasoningDoneEvent("response.reasoning_text.done", 0, item.id, index, 0, text))
            final = RespReasoning(item.id, [], [part])
        out += self._emit(RespPartEvent("response.content_part.done", 0, item.id, index, 0, part))
        self._output[index] = final
        return out + self._emit(RespItemEvent("response.output_item.done", 0, index, final))

    def _think(self, text: str) -> bytes:
        if not text:
            return b""
        out = b""
        if not isinstance(self._open, RespReasoning):
            out += self._close_item() + self._open_item(RespReasoning(new_id("rs"), [], [], "in_progress"))
        assert self._open is not None
        self._text += text
        self._thought += text
        return out + self._emit(RespReasoningDeltaEvent("response.reasoning_text.delta", 0, self._open.id,
                                                        len(self._output) - 1, 0, text))

    def _say(self, text: str) -> bytes:
        if not text:
            return b""
        out = b""
        if not isinstance(self._open, RespOutputMessage):
            out += self._close_item() + self._open_item(RespOutputMessage(new_id("msg"), "in_progress", []))
        assert self._open is not None
        self._text += text
        return out + self._emit(RespTextDeltaEvent("response.output_text.delta", 0, self._open.id,
                                                   len(self._output) - 1, 0, text))

    def _parts(self, thinking: str, answer: str) -> bytes:
        return self._think(thinking) + self._say(answer)

    def _call(self, call: ToolCall) -> bytes:
        item = RespFunctionCall(new_id("fc"), call.id, call.function.name, "", "in_progress")
        out = self._add(item)
        index = len(self._output) - 1
        args = call.function.arguments
        out += self._emit(RespArgumentsDeltaEvent("response.function_call_arguments.delta", 0, item.id, index, args))
        out += self._emit(RespArgumentsDoneEvent("response.function_call_arguments.done", 0, item.id, index,
                                                 call.function.name, args))
        final = RespFunctionCall(item.id, call.id, call.function.name, args)
        self._output[index] = final
        return out + self._emit(RespItemEvent("response.output_item.done", 0, index, final))

    def event(self, event: DeltaEvent | DoneEvent) -> bytes:
        out = b""
        if not self._started:
            self._started = True
            snapshot = self.response("in_progress", [])
            out += self._emit(RespLifecycleEvent("response.created", 0, snapshot))
            out += self._emit(RespLifecycleEvent("response.in_progress", 0, snapshot))
        if type(event) is DeltaEvent:
            return out + self._parts(*self._answer.feed(event.text))
        assert type(event) is DoneEvent
        thinking, rest, calls = self._answer.finish()
        out += self._parts(thinking, rest)
        if not calls and not any(isinstance(i, RespOutputMessage) for i in self._output):  # an empty answer
            out += self._close_item() + self._open_item(RespOutputMessage(new_id("msg"), "in_progress", []))
        out += self._close_item("incomplete" if event.finish_reason == "length" else "completed")
        for call in calls:
            out += self._call(call)
        resp = self._finished(event, list(self._output), self._thought)
        kind = "response.incomplete" if resp.status == "incomplete" else "response.completed"
        return out + self._emit(RespLifecycleEvent(kind, 0, resp))

    def error(self, err: ApiError) -> bytes:
        out = self._emit(RespErrorEvent("error", 0, err.code or err.type, err.message, err.param))
        failed = self.response("failed", list(self._output),
                               error=RespError("server_error" if err.status >= 500 else "invalid_request",
                                               err.message))
        return out + self._emit(RespLifecycleEvent("response.failed", 0, failed))

    def end(self) -> bytes:
        return b""
