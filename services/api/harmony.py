"""gpt-oss's harmony format: a reply read into thinking, answer and tool calls.

A harmony template's generation prompt ends with `<|start|>assistant`; the reply goes on
from there as a run of messages, each a header, `<|message|>`, then its body:

    [ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ [<|constrain|>]TYPE]<|message|>BODY

A body ends at `<|end|>` (the next message then opens with `<|start|>assistant`), at
`<|call|>` (a tool call: the reply stops) or at `<|return|>` (the final answer: the reply
stops). The last two are end-of-sequence tokens, whose text a reply never shows, so the last
message runs to the reply's end. What each channel becomes (OpenAI's convention, and
llama.cpp's and vLLM's reading of it):

- `analysis`: the thinking (`reasoning_content`);
- `final`: the answer (`content`);
- `commentary` to `functions.NAME`: a call of NAME, its body the arguments (JSON);
- `commentary` with no recipient: a preamble the model says before its calls (content);
- any other recipient (a built-in tool such as `browser.search`): not shown.

The markers are special tokens: the reply is detokenized with them kept
(`GenerateParams.skip_special_tokens` False), and a reply with no marker at all is all
answer. `HarmonyStream` reads a reply as it streams, holding back a tail that may be the
start of a marker, so the streamed pieces join to exactly what `read_harmony` gives.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from services.api.tools import FunctionCall, ToolCall, Tools, fn_parameters, new_call_id

MESSAGE, START = "<|message|>", "<|start|>"
#: what ends a message's body: `<|end|>` (another message follows), `<|call|>`, `<|return|>`
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."


def is_harmony(template: str | None) -> bool:
    """A harmony template (gpt-oss's): channels and messages in its markers."""
    return bool(template) and "<|channel|>" in template and MESSAGE in template  # type: ignore[operator]


class Header(NamedTuple):
    #: "thinking", "content", "call" or "hidden"
    kind: str
    #: the function a call names
    name: str = ""


def read_header(text: str) -> Header:
    """What a message's header (the text before its `<|message|>`) makes its body."""
    channel = _CHANNEL.search(text)
    recipient = _RECIPIENT.search(text)
    to = recipient.group(1) if recipient else None
    if to is not None and to != "assistant":
        if to.startswith(FUNCTIONS):
            return Header("call", to[len(FUNCTIONS):])
        return Header("hidden")
    name = channel.group(1) if channel else "final"
    return Header("thinking" if name == "analysis" else "content")


class HarmonyStream:
    """A streamed harmony reply cut into (thinking, answer text) as it arrives; the calls
    come at `finish`."""

    def __init__(self) -> None:
        self.text = ""
        self.at = 0  # characters of `text` read
        self.header: Header | None = None  # the open message's (None: reading a header)
        self.calls: list[ToolCall] = []
        self.marked = False  # a header was read: the reply is harmony, not plain text
        self._body_start = 0  # where the open message's body began

    def feed(self, delta: str) -> tuple[str, str]:
        """(thinking, answer) text that can go out now."""
        self.text += delta
        out = {"thinking": "", "content": ""}
        while True:
            if self.header is None:
                found = self.text.find(MESSAGE, self.at)
                if found < 0:
                    return out["thinking"], out["content"]
                self.header = read_header(self.text[self.at : found])
                self.marked, self.at = True, found + len(MESSAGE)
                self._body_start = self.at
                continue
            end, marker = _first_end(self.text, self.at)
            if end < 0:
                safe = len(self.text) - _partial_tail(self.text, self.at)
                self._emit(self.text[self.at : safe], out)
                self.at = safe
                return out["thinking"], out["content"]
            self._emit(self.text[self.at : end], out)
            self._close(end)
            self.at = end + len(marker)
            if marker == ENDS[0]:
                start = self.text.find(START, self.at)
                # the next message's role header (`<|start|>assistant`) is read with its header
                if start == self.at:
                    self.at += len(START)

    def _emit(self, body: str, out: dict[str, str]) -> None:
        assert self.header is not None
        if self.header.kind in ("thinking", "content"):
            out[self.header.kind] += body

    def _close(self, end: int) -> None:
        """The open message ends at `end`: a call's arguments are its whole body."""
        assert self.header is not None
        call = _call(self.header.name, self.text[self._body_start : end]) if self.header.kind == "call" else None
        if call is not None:
            self.calls.append(call)
        self.header = None

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """At the reply's end: the text held back, and the calls. A reply in which no
        header was ever read is plain text: all answer."""
        if not self.marked:
            return "", self.text, []
        out = {"thinking": "", "content": ""}
        if self.header is not None:
            self._emit(self.text[self.at :], out)
            self._close(len(self.text))
        self.at = len(self.text)
        return out["thinking"], out["content"], self.calls


def read_harmony(text: str) -> tuple[str | None, str | None, list[ToolCall]]:
    """A whole reply's thinking (None: none), answer (None: calls only) and calls."""
    stream = HarmonyStream()
    thinking, content = stream.feed(text)
    more_thinking, more_content, calls = stream.finish()
    thinking, content = thinking + more_thinking, content + more_content
    if not stream.marked:
        return None, text, []
    return thinking or None, content if content or not calls else None, calls


#: an analysis message before the constrained one (at most one: a constrained reply cannot
#: think forever); its text is free up to `<|end|>`, a special token no text can spell
_ANALYSIS = ('analysis: <|channel|> "analysis" <|message|> THINK <|end|> <|start|> "assistant"\n'
             "THINK: /(.|\\n)+/\n")


def answer_grammar(grammar: str) -> str:
    """A structured output's grammar (llguidance's, as the api compiles it) over a harmony
    reply: an analysis message may come first, then the `final` channel whose body is
    `grammar` (the constraint binds the answer, as on a reasoning template's)."""
    subs = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    answer = {**subs[0], "name": subs[0].get("name") or "answer"}
    head = f'start: analysis? <|channel|> "final" <|message|> @{answer["name"]}\n' + _ANALYSIS
    return json.dumps({"grammars": [{"lark_grammar": head}, answer, *subs[1:]]})


def call_grammar(tools: Tools) -> str:
    """tool_choice "required" or a named function over a harmony reply: an analysis message
    may come first, then one call, to=functions.NAME in its channel header, its arguments
    matching that function's `parameters` (gpt-oss makes one call a message)."""
    fns = [f'fn{i}: <|channel|> {json.dumps("commentary to=" + FUNCTIONS + t["function"]["name"] + " ")} '
           f'<|constrain|> "json" <|message|> %json {json.dumps(fn_parameters(t))}'
           for i, t in enumerate(tools.tools)]
    head = "start: analysis? (" + " | ".join(f"fn{i}" for i in range(len(fns))) + ")"
    return "\n".join([head, *fns]) + "\n" + _ANALYSIS


def _first_end(text: str, at: int) -> tuple[int, str]:
    """(where the first end marker after `at` is, the marker), or (-1, "")."""
    found = [(i, m) for m in ENDS if (i := text.find(m, at)) >= 0]
    return min(found) if found else (-1, "")


def _partial_tail(text: str, at: int) -> int:
    """How many of `text`'s last characters (after `at`) may begin an end marker."""
    for k in range(min(max(map(len, ENDS)) - 1, len(text) - at), 0, -1):
        if any(m.startswith(text[-k:]) for m in ENDS):
            return k
    return 0


def _call(name: str, body: str) -> ToolCall | None:
    """A call of `name` with `body` as its arguments, JSON re-encoded as every format's calls
    are; None where the body is not a JSON object (a call cut short by max_tokens is no call,
    as with every other format)."""
    try:
        args = json.loads(body)
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), FunctionCall(name, json.dumps(args, ensure_ascii=False)))
