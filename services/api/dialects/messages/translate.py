"""A Messages body -> the chat request (`ChatRequest`) and plain-dict messages that the
one chat path (`services/api/chat.py`) renders and generates from.

Everything is checked here with Messages names before the chat path sees it, so a refusal
names the client's field (`messages.2.content.0.tool_use_id`), never a chat one.

The mapping (choices Anthropic's API leaves to a server are marked *):
- `system` (a string or text blocks, joined by newlines) -> a first `system` message;
- a user turn's `text` / `image` blocks -> one `user` message (text joined by newlines,
  vLLM's string form, or a list of parts for a vision model, as `/v1/chat/completions`);
  its `tool_result` blocks -> `tool` messages (`tool_call_id` = `tool_use_id`), in block
  order; each must answer a `tool_use` of an earlier assistant turn;
  * `is_error: true` writes the result as `Error: <content>` (chat has no error flag);
- an assistant turn's text -> `content`, its `tool_use` blocks -> `tool_calls` (arguments
  as the object), its `thinking` blocks are dropped (templates drop earlier thinking);
- a final assistant turn of text is Anthropic's prefill: the prompt is the conversation
  before it with the generation prompt, then that text, which the reply continues (the
  reply holds only the continuation). As Anthropic, it may not end in whitespace; it may
  not hold tool_use blocks, and (`routes.py`) is refused with forced tool calls or where
  the template thinks (the grammar and the thinking split start at the reply);
- `image` sources: base64 -> a `data:` URL, url -> the URL, through the api's image path;
- `tools[].input_schema` (type object, compiled by llguidance: a schema it cannot
  enforce is a 400 naming the tool) -> the function's `parameters`;
- `tool_choice`: auto -> auto, any -> required, tool -> the named function, none -> no
  tools shown; `disable_parallel_tool_use` -> at most one call where a grammar enforces
  calls (any, tool);
- `stop_sequences` -> stop strings; `temperature` (Anthropic's [0, 1]), `top_p`, `top_k`;
  the sampling fields a body leaves out take the model's generation_config.json defaults;
- `thinking`: * disabled -> a thinking template rendered with `enable_thinking: false`
  (Qwen3's switch; other templates ignore it); enabled -> allowed only where the template
  thinks, its budget checked as Anthropic checks it (>= 1024 and below `max_tokens`), not
  enforced past `max_tokens`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, NamedTuple

from services.api.chat_request import ChatRequest, check_model
from services.api.dialects.messages.schemas import (
    MessagesBase64Source,
    MessagesImageParam,
    MessagesInput,
    MessagesMessageParam,
    MessagesRequest,
    MessagesTextParam,
    MessagesThinkingEnabled,
    MessagesThinkingParam,
    MessagesToolChoiceAny,
    MessagesToolChoiceNone,
    MessagesToolChoiceTool,
    MessagesToolParam,
    MessagesToolResultParam,
    MessagesToolUseParam,
)
from services.api.errors import invalid
from services.api.reasoning import thinks
from services.api.structured import JSON_OPTIONS, validated
from services.api.tools import Tools
from services.api.validation import GenerateParams, ImageRef, stop_strings
from shared.frames import SamplingParams
from shared.generation_config import SAMPLING


class Translated(NamedTuple):
    """A Messages body as the chat path takes it."""

    req: ChatRequest
    messages: list[dict[str, Any]]
    #: the final assistant turn's text, which the reply continues ("" for none)
    prefill: str = ""


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _text(blocks: str | list[MessagesTextParam]) -> str:
    return blocks if isinstance(blocks, str) else "\n".join(b.text for b in blocks)


def _image_url(block: MessagesImageParam) -> str:
    source = block.source
    if isinstance(source, MessagesBase64Source):
        return f"data:{source.media_type};base64,{source.data}"
    return source.url


class _Turns:
    """Builds the chat messages turn by turn, remembering the tool_use ids seen so far."""

    def __init__(self, vision: bool) -> None:
        self.vision = vision
        self.out: list[dict[str, Any]] = []
        self.images: list[ImageRef] = []
        self.calls: set[str] = set()

    def content(self, parts: list[dict[str, Any]]) -> Any:
        """Parts as the template takes them: a list for a vision model, else the text joined."""
        if self.vision:
            return parts
        return "\n".join(p["text"] for p in parts if p["type"] == "text")

    def system(self, system: str | list[MessagesTextParam] | None) -> None:
        if system is None:
            return
        text = _text(system)
        if text:
            self.out.append({"role": "system", "content": self.content([{"type": "text", "text": text}])})

    def turn(self, i: int, msg: MessagesMessageParam) -> None:
        where = f"messages.{i}"
        blocks = [MessagesTextParam(text=msg.content)] if isinstance(msg.content, str) else msg.content
        if msg.role == "assistant":
            self._assistant(where, blocks)
        else:
            self._user(where, blocks)

    def _assistant(self, where: str, blocks: list[Any]) -> None:
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            at = f"{where}.content.{j}"
            if isinstance(block, MessagesTextParam):
                texts.append(block.text)
            elif isinstance(block, MessagesToolUseParam):
                if block.id in self.calls:
                    raise invalid(f"{at}.id", f"{at}.id: tool_use id {json.dumps(block.id)} is used twice")
                self.calls.add(block.id)
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            elif not isinstance(block, MessagesThinkingParam):
                kind = type(block).__struct_config__.tag
                raise invalid(f"{at}.type", f"{at}.type: a {kind} block is not allowed in an assistant message")
        entry: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
        if self.vision and entry["content"] is not None:
            entry["content"] = [{"type": "text", "text": entry["content"]}]
        if calls:
            entry["tool_calls"] = calls
        self.out.append(entry)

    def _user(self, where: str, blocks: list[Any]) -> None:
        parts: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            at = f"{where}.content.{j}"
            if isinstance(block, MessagesTextParam):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, MessagesImageParam):
                if not self.vision:
                    raise invalid(at, f"{at}: the served model takes no images")
                field = "data" if isinstance(block.source, MessagesBase64Source) else "url"
                self.images.append(ImageRef(_image_url(block), f"{at}.source.{field}"))
                parts.append({"type": "image"})
            elif isinstance(block, MessagesToolResultParam):
                if block.tool_use_id not in self.calls:
                    raise invalid(f"{at}.tool_use_id", f"{at}.tool_use_id: {json.dumps(block.tool_use_id)} answers "
                                  "no tool_use block of an earlier assistant message")
                self._flush(parts)
                text = _text(block.content) if block.content is not None else ""
                text = f"Error: {text}" if block.is_error else text
                self.out.append({"role": "tool", "content": self.content([{"type": "text", "text": text}]),
                                 "tool_call_id": block.tool_use_id})
            else:
                kind = type(block).__struct_config__.tag
                raise invalid(f"{at}.type", f"{at}.type: a {kind} block is not allowed in a user message")
        self._flush(parts)

    def _flush(self, parts: list[dict[str, Any]]) -> None:
        if parts:
            self.out.append({"role": "user", "content": self.content(list(parts))})
            parts.clear()


def _tool(i: int, tool: MessagesToolParam) -> dict[str, Any]:
    """A tool as the chat path takes it; its input_schema must be an object schema that
    llguidance compiles (a forced call is enforced by it)."""
    import llguidance

    matcher: Any = llguidance.LLMatcher
    param = f"tools.{i}.input_schema"
    schema = tool.input_schema
    if schema.get("type") != "object":
        raise invalid(param, f'{param}.type must be "object", got {json.dumps(schema.get("type"))}')
    try:
        grammar = matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise invalid(param, f"{param} is not a usable JSON schema: {exc}") from None
    validated(grammar, param)
    fn: dict[str, Any] = {"name": tool.name, "parameters": schema}
    if tool.description:
        fn["description"] = tool.description
    return {"type": "function", "function": fn}


def tools_of(req: MessagesInput) -> Tools | None:
    """The request's tools and tool_choice as the chat path's `Tools` (None: none shown)."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and not isinstance(choice, MessagesToolChoiceNone):
            kind = type(choice).__struct_config__.tag
            raise invalid("tool_choice", f'tool_choice {{"type": "{kind}"}} needs tools')
        return None
    tools = [_tool(i, t) for i, t in enumerate(req.tools)]
    names = [t.name for t in req.tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tools.{i}.name", f"tools.{i}.name: the tool name {json.dumps(name)} is used twice")
    if isinstance(choice, MessagesToolChoiceNone):
        return None
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    if isinstance(choice, MessagesToolChoiceTool):
        if choice.name not in names:
            raise invalid("tool_choice.name", f"tool_choice.name: {json.dumps(choice.name)} is not a tool "
                          f"({', '.join(names)})")
        return Tools([tools[names.index(choice.name)]], "named", choice.name, parallel=False)
    return Tools(tools, "required" if isinstance(choice, MessagesToolChoiceAny) else "auto", parallel=parallel)


def template_kwargs(req: MessagesInput, template: str | None, max_tokens: int | None) -> dict[str, Any]:
    """What `thinking` asks of the chat template."""
    thinking = req.thinking
    if thinking is None:
        return {}
    if not isinstance(thinking, MessagesThinkingEnabled):
        return {"enable_thinking": False} if thinks(template) else {}
    if not thinks(template):
        raise invalid("thinking", 'thinking: {"type": "enabled"} needs a reasoning model; the served model\'s chat '
                      'template does not think (send {"type": "disabled"} or leave thinking out)')
    if max_tokens is not None and thinking.budget_tokens >= max_tokens:
        raise invalid("thinking.budget_tokens", f"thinking.budget_tokens ({thinking.budget_tokens}) must be less "
                      f"than max_tokens ({max_tokens})")
    return {"enable_thinking": True}


def _prefill(req: MessagesInput) -> str:
    """The text of a final assistant turn ("" when the last turn is the user's)."""
    last, at = req.messages[-1], f"messages.{len(req.messages) - 1}"
    if last.role != "assistant":
        return ""
    blocks = [MessagesTextParam(text=last.content)] if isinstance(last.content, str) else last.content
    for j, block in enumerate(blocks):
        if not isinstance(block, MessagesTextParam | MessagesThinkingParam):
            kind = type(block).__struct_config__.tag
            raise invalid(f"{at}.content.{j}.type", f"{at}.content.{j}.type: a final assistant message (a prefill) "
                          f"holds text only, not a {kind} block")
    text = "\n".join(b.text for b in blocks if isinstance(b, MessagesTextParam))
    if text != text.rstrip():
        raise invalid(at, f"{at}: final assistant content cannot end with trailing whitespace")
    return text


def messages_of(req: MessagesInput, vision: bool) -> tuple[list[dict[str, Any]], list[ImageRef], str]:
    """The conversation as the chat path's plain-dict messages, its images in order, and
    the prefill (the final assistant turn's text, left out of the messages)."""
    turns = _Turns(vision)
    turns.system(req.system)
    prefill = _prefill(req)
    for i, msg in enumerate(req.messages[:-1] if prefill or req.messages[-1].role == "assistant" else req.messages):
        turns.turn(i, msg)
    return turns.out, turns.images, prefill


def translate(req: MessagesInput, served: str, template: str | None, vision: bool) -> Translated:
    """A decoded `/v1/messages` (or count_tokens) body -> the chat request and messages."""
    check_model(req.model, served)
    max_tokens = req.max_tokens if isinstance(req, MessagesRequest) else None
    kwargs = template_kwargs(req, template, max_tokens)
    tools = tools_of(req)
    messages, images, prefill = messages_of(req, vision)
    sampling = SamplingParams()
    stream, stops = False, []
    if isinstance(req, MessagesRequest):
        sampling = SamplingParams(temperature=sampling.temperature if req.temperature is None else req.temperature,
                                  top_p=sampling.top_p if req.top_p is None else req.top_p,
                                  top_k=sampling.top_k if req.top_k is None else req.top_k)
        stream, stops = bool(req.stream), stop_strings(req.stop_sequences)
    # the sampling fields left out take the model's generation_config.json defaults, as on chat
    defaulted = frozenset(name for name in SAMPLING if getattr(req, name, None) is None)
    params = GenerateParams(request_id=message_id(), sampling=sampling, max_tokens=max_tokens, prompt=None,
                            stream=stream, stop=stops, add_special_tokens=False, image_refs=tuple(images),
                            defaulted=defaulted)
    return Translated(ChatRequest(params=params, stream=stream, tools=tools, template_kwargs=kwargs), messages,
                      prefill)
