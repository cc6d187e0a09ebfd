"""A Responses body -> the chat request the one chat path takes (`services/api/chat.py`).

The body is decoded against `ResponsesRequest` (an unknown field or item type is a 400
naming it), its items become chat messages (plain dicts, as `chat_request.parse_chat`
reads them), and its settings the chat body's fields (`text.format` -> `response_format`,
`max_output_tokens` -> `max_completion_tokens`, `tools` -> chat's function tools,
`reasoning.effort` -> the template variable `reasoning_effort`). `parse_chat` then checks
and compiles them exactly as for `/v1/chat/completions`, so the grammar, tool and template
code is one; a refusal it raises names the chat field, which `renamed` turns back into the
Responses field the client sent (`text.format.schema`, `input[2].content[0].image_url`).

Items -> messages:
- `instructions`: a system message first (this request's only: a previous response's
  instructions are not carried over, as OpenAI does);
- `message`: its role and content (parts: `input_text` / `output_text` / `refusal` as text,
  `input_image` as an image part);
- `function_call`: a call in an assistant message (the one just before, if the previous
  item was the assistant's, so text and calls are one turn as chat writes them);
- `function_call_output`: a `tool` message answering `call_id`;
- `reasoning`: left out (templates drop an earlier turn's thinking).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from services.api.dialects.responses.schemas import (
    RespFunctionCall,
    ResponsesFunctionCallItem,
    ResponsesFunctionCallOutputItem,
    ResponsesInputImage,
    ResponsesInputItem,
    ResponsesMessageItem,
    ResponsesOutputTextPart,
    ResponsesReasoningItem,
    ResponsesReasoningText,
    ResponsesRefusalPart,
    ResponsesRequest,
    ResponsesSummaryText,
    ResponsesTextFormatJsonObject,
    ResponsesTextFormatJsonSchema,
    ResponsesToolChoiceFunction,
    RespOutputItem,
    RespOutputMessage,
    RespReasoning,
)
from services.api.errors import ApiError, invalid
from services.api.validation import json_repr, load

T = TypeVar("T")
#: where a message came from, for a refusal's `param`: "instructions", "input[i]", or
#: "previous_response_id" (an item of the stored conversation)
Origins = list[str]
PREVIOUS = "previous_response_id"
#: chat's field names -> the Responses fields they were translated from
RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("chat_template_kwargs.reasoning_effort", "reasoning.effort"),
)
_TOOL_FIELD = re.compile(r"^tools\[(\d+)\]\.function\b")
_MESSAGE = re.compile(r"^messages\[(\d+)\](.*)$")


def normalize(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The body with OpenAI's "easy" input messages (`role` and `content`, no `type`)
    typed as `message` items, and a tool of another type than `function` refused by name
    (a hosted tool this server does not run: web_search, file_search, mcp, ...)."""
    out = dict(obj)
    items = out.get("input")
    if isinstance(items, list):
        out["input"] = [{"type": "message", **item} if isinstance(item, dict) and "type" not in item
                        and "role" in item else item for item in items]
    tools = out.get("tools")
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise invalid(f"tools[{i}].type", f"tools[{i}].type {json_repr(kind)} is not supported: this server "
                                                  'runs function tools only ({"type": "function", "name", '
                                                  '"parameters"})')
    return out


def parse_request(obj: Mapping[str, Any]) -> ResponsesRequest:
    """The decoded body, with the rules across fields checked."""
    req = load(normalize(obj), ResponsesRequest)
    if req.background:
        raise invalid("background", "background is not supported: responses run while the request waits "
                                    "(use stream: true for a long one)")
    if req.include and "message.output_text.logprobs" in req.include:
        raise invalid("include", 'include "message.output_text.logprobs" is not supported: no logprobs are given')
    if req.input is None and req.previous_response_id is None:
        raise invalid("input", "input is required (a string or a list of input items)")
    return req


def input_items(req: ResponsesRequest) -> list[ResponsesInputItem]:
    """The request's `input` as items (a string is one user message)."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [ResponsesMessageItem(role="user", content=req.input)]
    return list(req.input)


def _part(part: Any, where: str) -> dict[str, Any]:
    if isinstance(part, ResponsesInputImage):
        if part.image_url is None:
            raise invalid(f"{where}.image_url", f"{where}.image_url is required (this server keeps no files)")
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    if isinstance(part, ResponsesRefusalPart):
        return {"type": "text", "text": part.refusal}
    return {"type": "text", "text": part.text}


def _arguments(item: ResponsesFunctionCallItem, where: str) -> str:
    """The call's arguments, checked to be a JSON object as text."""
    try:
        args = json.loads(item.arguments) if item.arguments.strip() else {}
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise invalid(f"{where}.arguments", f"{where}.arguments must be a JSON object as text, got "
                                            f"{json_repr(item.arguments)}")
    return item.arguments


def to_messages(items: Sequence[ResponsesInputItem], first: int,
                instructions: str | None) -> tuple[list[dict[str, Any]], Origins]:
    """Chat messages of `items` (those before `first` from the previous response's
    conversation), and where each came from."""
    messages: list[dict[str, Any]] = []
    origins: Origins = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    for i, item in enumerate(items):
        where = PREVIOUS if i < first else f"input[{i - first}]"
        if isinstance(item, ResponsesMessageItem):
            content: Any = item.content
            if not isinstance(content, str):
                content = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
            messages.append({"role": item.role, "content": content})
            origins.append(where)
        elif isinstance(item, ResponsesFunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item, where)}}
            if messages and messages[-1]["role"] == "assistant" and origins[-1] != "instructions":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(where)
        elif isinstance(item, ResponsesFunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "\n".join(p.text for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            origins.append(where)
    return messages, origins


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The `/v1/chat/completions` body that asks what `req` asks."""
    body: dict[str, Any] = {"messages": messages}
    simple = {"model": req.model, "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
              "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls, "user": req.user,
              "metadata": req.metadata, "stream": req.stream or None}
    body.update({k: v for k, v in simple.items() if v is not None})
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": {
            k: v for k, v in (("name", t.name), ("description", t.description), ("parameters", t.parameters),
                              ("strict", t.strict)) if v is not None}} for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, ResponsesToolChoiceFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, ResponsesTextFormatJsonSchema):
        spec = {"schema": fmt.schema, "name": fmt.name, "description": fmt.description, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {k: v for k, v in spec.items() if v is not None}}
    elif isinstance(fmt, ResponsesTextFormatJsonObject):
        body["response_format"] = {"type": "json_object"}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["chat_template_kwargs"] = {"reasoning_effort": req.reasoning.effort}
    return body


def rename(param: str, origins: Origins) -> str:
    """A chat field's path as the Responses field the client sent."""
    if param == "messages":
        return "input"
    m = _MESSAGE.match(param)
    if m is not None:
        k, rest = int(m[1]), m[2]
        origin = origins[k] if k < len(origins) else "input"
        part = re.match(r"^(\.content\[\d+\])", rest)
        return origin + (part[1] + (".image_url" if ".image_url" in rest else "") if part else "")
    m = _TOOL_FIELD.match(param)
    if m is not None:
        return f"tools[{m[1]}]" + param[m.end():]
    for old, new in RENAMES:
        if param == old or param.startswith(old + ".") or param.startswith(old + "["):
            return new + param[len(old):]
    return param


def renamed(origins: Origins, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` with a refusal's `param` (and the message's mention of it)
    named as the Responses field."""
    try:
        return fn(*args, **kwargs)
    except ApiError as err:
        if err.param is not None:
            new = rename(err.param, origins)
            if new != err.param:
                err.message = err.message.replace(err.param, new)
                err.args = (err.message,)
                err.param = new
        raise


def as_input(item: RespOutputItem) -> ResponsesInputItem:
    """An output item as the input item it is when a later request continues from it."""
    if isinstance(item, RespOutputMessage):
        return ResponsesMessageItem(role="assistant", id=item.id, status=item.status,  # type: ignore[arg-type]
                                    content=[ResponsesOutputTextPart(text=p.text) for p in item.content])
    if isinstance(item, RespFunctionCall):
        return ResponsesFunctionCallItem(id=item.id, call_id=item.call_id, name=item.name, arguments=item.arguments,
                                         status=item.status)  # type: ignore[arg-type]
    assert isinstance(item, RespReasoning)
    return ResponsesReasoningItem(id=item.id, summary=[ResponsesSummaryText(text=s.text) for s in item.summary],
                                  content=[ResponsesReasoningText(text=c.text) for c in item.content])
