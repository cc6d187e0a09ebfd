"""A chat reply's text read the same way by every dialect: a reasoning template's thinking
split from the answer (`reasoning.py`), and with tools the calls parsed from the answer
(`tools.py`). `read_answer` reads a whole reply; `AnswerStream` reads one as it streams,
holding the answer back from where a call may begin, so the streamed thinking, text and
calls join to exactly what `read_answer` gives. OpenAI chat, Responses and Messages each
write the pieces in their own shapes.
"""

from __future__ import annotations

from typing import NamedTuple

from services.api.harmony import HarmonyStream, read_harmony
from services.api.reasoning import HARMONY, ReasoningStream, split
from services.api.tools import ToolCall, ToolStream, extract


class Answer(NamedTuple):
    #: the thinking (None: not a reasoning template, or nothing before the answer)
    thinking: str | None
    #: the text beside the calls (None or "" where the reply is calls only)
    content: str | None
    calls: list[ToolCall]


def read_answer(text: str, reasoning: str | None, tool_format: str | None) -> Answer:
    """A whole reply's thinking, text and calls; `reasoning`: where the prompt left the
    thinking (None: no reasoning template); `tool_format`: how calls are written (None: the
    request has no tools)."""
    if reasoning == HARMONY:  # gpt-oss: channels carry the thinking, the answer and the calls
        return Answer(*read_harmony(text))
    thinking, answer = (None, text) if reasoning is None else split(text, reasoning)
    if tool_format is not None:
        content, calls = extract(answer, tool_format)
        if calls:
            return Answer(thinking, content, calls)
    return Answer(thinking, answer, [])


class AnswerStream:
    """A streamed reply's deltas cut into (thinking, answer text to send now); the text that
    may start a call is held back until `finish` says whether it was one."""

    def __init__(self, reasoning: str | None, tool_format: str | None, tools_forced: bool = False) -> None:
        self._harmony = HarmonyStream() if reasoning == HARMONY else None
        harmony = self._harmony is not None
        self._thinking = ReasoningStream(reasoning) if reasoning is not None and not harmony else None
        self._tools = ToolStream(tool_format, tools_forced) if tool_format is not None and not harmony else None

    @property
    def plain(self) -> bool:
        """Neither thinking nor tools: every delta's text is answer text as it comes."""
        return self._thinking is None and self._tools is None and self._harmony is None

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer text) of the next delta."""
        if self._harmony is not None:
            return self._harmony.feed(text)
        thinking, answer = ("", text) if self._thinking is None else self._thinking.feed(text)
        if self._tools is not None:
            answer = self._tools.feed(answer)
        return thinking, answer

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """At the reply's end: the thinking and text held back, and the calls."""
        if self._harmony is not None:
            return self._harmony.finish()
        thinking, answer = ("", "") if self._thinking is None else self._thinking.finish()
        if self._tools is None:
            return thinking, answer, []
        answer = self._tools.feed(answer)
        rest, calls = self._tools.finish()
        return thinking, answer + rest, calls
