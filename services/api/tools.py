"""Tool calling on `/v1/chat/completions`: the request's `tools`, `tool_choice` and
`parallel_tool_calls`, tool calls and results in the history, and the calls the model writes.

A model writes calls in the format its chat template teaches it; mstar picks that format
from the template (`pick_format`), or `--tool-call-parser` names it:
- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per
  call (Qwen2.5 / Qwen3, Hermes, SmolLM3 and every template that says `<tool_call>`);
- `llama3_json`: a bare `{"name": ..., "parameters": {...}}` (Llama 3.1+; several joined
  by `;`), optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (v3
  tokenizers: Mistral 7B v0.3, Nemo);
- `mistral_args`: `[TOOL_CALLS]name[ARGS]{...}`, one marker per call (v11+ tokenizers:
  Mistral Small 3.1+, Magistral, Devstral; their templates say `[ARGS]`). Either Mistral
  parser reads both forms.

A template that never mentions `tools` (the default SmolLM2, most small chat models) is
taught the hermes format by a system message listing the tools, as llama.cpp does for
templates without native support; the history's calls and results are written into
messages the template can render.

`tool_choice`: `none` (the tools are not shown), `auto` (the model chooses; what it writes
is parsed), `required` or a named function: enforced with a grammar (llguidance, as
structured outputs are), so the reply always parses into calls whose arguments match each
function's `parameters` schema. Replies carry `message.tool_calls` and finish reason
`tool_calls`; a stream holds back the text from where a call begins and sends each call as
one `delta.tool_calls` entry at the end, so the chunks join to exactly the unstreamed calls.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import msgspec

from services.api.errors import invalid
from services.api.schemas import NAME_RE, ChatCompletionRequest, HistoryToolCall, ToolDefinition
from services.api.structured import JSON_OPTIONS, tightened

FORMATS = ("hermes", "llama3_json", "mistral", "mistral_args")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_TAG = "<|python_tag|>"

#: taught to a template without tool support (Qwen2.5's own words for the hermes format)
PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ToolCallDelta(msgspec.Struct):
    """One call in a stream: sent whole, once (its fragments would join to the same)."""

    index: int
    id: str
    function: FunctionCall
    type: str = "function"


class Tools(msgspec.Struct, frozen=True):
    """What a request asked of its tools: the validated tool objects (as templates take
    them), the choice ("auto", "required" or "named": `name`), and parallel calls."""

    tools: list[dict[str, Any]]
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"



def _function(tool: ToolDefinition) -> dict[str, Any]:
    """A tool as templates take it (`parameters` defaults to an empty object)."""
    fn = tool.function
    parameters = fn.parameters if fn.parameters is not None else EMPTY_PARAMETERS
    out: dict[str, Any] = {"name": fn.name, "parameters": parameters}
    if fn.description:
        out["description"] = fn.description
    return {"type": "function", "function": out}


def parse_tools(req: ChatCompletionRequest) -> Tools | None:
    """The request's tools, or None when it has none or `tool_choice` is "none" (their
    shapes are declared in `schemas.py`; here, the rules across fields)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice", f"tool_choice {msgspec.json.encode(choice).decode()} needs tools")
        return None
    tools = [_function(t) for t in req.tools]
    names = [t["function"]["name"] for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise invalid("tools", f"tools name function {dup!r} twice")
    if choice == "none":
        return None
    if choice is None or isinstance(choice, str):
        return Tools(tools, choice or "auto", parallel=req.parallel_tool_calls is not False)
    name = choice.function.name
    if name not in names:
        raise invalid("tool_choice.function.name", f"tool_choice names function {json.dumps(name)}, "
                                                   f"which is not in tools ({', '.join(names)})")
    return Tools([tools[names.index(name)]], "named", name, parallel=False)


def parse_history_calls(calls: list[HistoryToolCall], where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, as templates take them (arguments as an object)."""
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}].function.arguments"
        args = call.function.arguments
        if isinstance(args, str):
            text = args
            try:
                args = json.loads(text) if text.strip() else {}
            except ValueError:
                raise invalid(at, f"{at} must be a JSON object (as text), got {json.dumps(text[:60])}") from None
        if not isinstance(args, dict):
            raise invalid(at, f"{at} must be a JSON object")
        out.append({"id": call.id or "", "type": "function", "function": {"name": call.function.name,
                                                                          "arguments": args}})
    return out


# -- formats ---------------------------------------------------------------------------------


def pick_format(template: str | None, override: str = "auto") -> tuple[str, bool]:
    """(the format calls are written in, whether the template renders tools itself)."""
    source = template or ""
    native = "tools" in source
    if override != "auto":
        return override, native
    if MISTRAL_MARKER in source:
        return ("mistral_args" if MISTRAL_ARGS in source else "mistral"), native
    if HERMES_OPEN in source or not native:
        return "hermes", native
    if PYTHON_TAG in source or "ipython" in source or '"parameters"' in source:
        return "llama3_json", native
    return "hermes", native


def _call_text(name: str, args: dict[str, Any], fmt: str) -> str:
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


def prepare_messages(messages: list[dict[str, Any]], tools: Tools | None, fmt: str,
                     native: bool) -> list[dict[str, Any]]:
    """The messages as the template renders them: for a template without tool support,
    the tools taught in the system message, past calls written into the assistant's text
    and tool results as `<tool_response>` user turns (Qwen's convention)."""
    if native:
        return messages
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(_call_text(c["function"]["name"], c["function"]["arguments"], fmt)
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content"), calls]))})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append(m)
    if tools is not None:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools)
        preamble = PREAMBLE.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def fn_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A function's `parameters` as its calls' arguments are held to (the JSON schema tightened
    as every format's call grammar takes it)."""
    return {**tightened(tool["function"]["parameters"]), "x-guidance": JSON_OPTIONS}


def _fn_schema(tool: dict[str, Any], key: str) -> dict[str, Any]:
    fn = tool["function"]
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: tightened(fn["parameters"])},
            "required": ["name", key], "additionalProperties": False, "x-guidance": JSON_OPTIONS}


def tool_grammar(tools: Tools, fmt: str) -> str:
    """The llguidance (Lark) grammar of a reply that is only calls, for `required` and a
    named function; every call's arguments match that function's `parameters`."""
    key = "parameters" if fmt == "llama3_json" else "arguments"
    alts = [json.dumps(_fn_schema(t, key)) for t in tools.tools]
    if fmt == "mistral":
        items = {"anyOf": [_fn_schema(t, key) for t in tools.tools]}
        array = {"type": "array", "items": items, "minItems": 1, **({} if tools.parallel else {"maxItems": 1})}
        return f"start: {json.dumps(MISTRAL_MARKER)} %json {json.dumps(array)}\n"
    if fmt == "mistral_args":
        fns = [f"fn{i}: {json.dumps(t['function']['name'] + MISTRAL_ARGS)} "
               f"%json {json.dumps({**tightened(t['function']['parameters']), 'x-guidance': JSON_OPTIONS})}"
               for i, t in enumerate(tools.tools)]
        call = f"call: {json.dumps(MISTRAL_MARKER)} (" + " | ".join(f"fn{i}" for i in range(len(fns))) + ")"
        return "\n".join(["start: call+" if tools.parallel else "start: call", call, *fns]) + "\n"
    lines = ["body: " + " | ".join(f"fn{i}" for i in range(len(alts)))]
    lines += [f"fn{i}: %json {a}" for i, a in enumerate(alts)]
    if fmt == "llama3_json":
        head = 'start: body (";" body)*' if tools.parallel else "start: body"
    else:
        head = 'start: call ("\\n" call)*' if tools.parallel else "start: call"
        lines.insert(0, f'call: {json.dumps(HERMES_OPEN + chr(10))} body {json.dumps(chr(10) + HERMES_CLOSE)}')
    return "\n".join([head, *lines]) + "\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(obj: Any, key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), FunctionCall(obj["name"], json.dumps(args, ensure_ascii=False)))


def _json_values(text: str) -> list[Any] | None:
    """The JSON values `text` is made of (separated by whitespace or `;`), or None."""
    dec, i = json.JSONDecoder(), 0
    out: list[Any] = []
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def extract(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """(the content before the calls, or None; the calls) of a whole reply; no calls when
    what follows the marker does not parse (the text is then all content)."""
    if fmt == "hermes":
        at = text.find(HERMES_OPEN)
        if at < 0:
            return text, []
        bodies = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text[at:], re.S)
        calls = [_as_call(_one(b), "arguments") for b in bodies]
    elif fmt in ("mistral", "mistral_args"):
        at = text.find(MISTRAL_MARKER)
        if at < 0:
            return text, []
        calls = _mistral_calls(text[at:])
    else:
        stripped = text.strip()
        if stripped.startswith(PYTHON_TAG):
            stripped = stripped[len(PYTHON_TAG):].strip()
        if not stripped.startswith("{"):
            return text, []
        at = 0
        values = _json_values(stripped)
        calls = [_as_call(v, "parameters") for v in values] if values else [None]
    if not calls or any(c is None for c in calls):
        return text, []
    content = text[:at]
    return content if content.strip() else None, [c for c in calls if c is not None]


def _mistral_calls(text: str) -> list[ToolCall | None]:
    """`[TOOL_CALLS]` + a JSON list (v3), or `[TOOL_CALLS]name[ARGS]{...}` per call (v11+)."""
    rest = text[len(MISTRAL_MARKER):]
    if rest.lstrip()[:1] in ("[", "{"):
        values = _json_values(rest)
        items = [v for value in values or [] for v in (value if isinstance(value, list) else [value])]
        return [_as_call(v, "arguments") for v in items] if values else [None]
    calls: list[ToolCall | None] = []
    for part in text.split(MISTRAL_MARKER)[1:]:
        name, sep, args = part.partition(MISTRAL_ARGS)
        values = _json_values(args) if sep and NAME_RE.fullmatch(name.strip()) else None
        calls.append(_as_call({"name": name.strip(), "arguments": values[0]}, "arguments")
                     if values is not None and len(values) == 1 else None)
    return calls


def _one(body: str) -> Any:
    values = _json_values(body)
    return values[0] if values and len(values) == 1 else None


def _marker(fmt: str) -> str:
    return {"hermes": HERMES_OPEN, "mistral": MISTRAL_MARKER, "mistral_args": MISTRAL_MARKER}.get(fmt, "{")


class ToolStream:
    """A streamed reply's text as content until a call may have begun: from there it is
    held back, and at the end parsed (`finish`) into the rest of the content and the calls."""

    def __init__(self, fmt: str, forced: bool) -> None:
        self.fmt, self.forced = fmt, forced
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content
        self.holding = forced
        self.free = False  # llama3_json: the reply began as text, so it holds no call

    def feed(self, delta: str) -> str:
        """The part of `delta` that can go out as content now."""
        self.text += delta
        if self.holding:
            return ""
        marker = _marker(self.fmt)
        if self.fmt == "llama3_json" and not self.free:  # a call is the whole reply
            head = self.text.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return ""  # it may still begin a call: wait
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self.holding = True
                return ""
            self.free = True  # it begins as text: all of it is content
        if self.fmt == "llama3_json":
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        at = self.text.find(marker, self.sent)
        if at >= 0:
            self.holding = True
            out, self.sent = self.text[self.sent:at], at
            return out
        # keep back a tail that could be the marker's beginning
        keep = next((k for k in range(min(len(marker) - 1, len(self.text) - self.sent), 0, -1)
                     if marker.startswith(self.text[-k:])), 0)
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, the calls) once the reply is whole."""
        content, calls = extract(self.text, self.fmt)
        if not calls:
            return self.text[self.sent:], []
        return (content or "")[self.sent:], calls
