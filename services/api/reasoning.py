"""Reasoning models (Qwen3, DeepSeek-R1 style): the thinking a reply opens with, split from
its answer into `message.reasoning_content` (and `delta.reasoning_content` when streamed).

A template that thinks says `<think>` and `</think>`. What the prompt ends with tells where
the reply starts (`prompt_state`):
- "open": the prompt opened the thinking (DeepSeek-R1, or Qwen3 templates that write
  `<think>\\n` themselves): the reply is thinking up to `</think>`, then the answer;
- "closed": the prompt holds an empty thinking block (Qwen3 with
  `chat_template_kwargs: {"enable_thinking": false}`): the reply is all answer;
- "free": the model may open `<think>` itself, or answer at once.

A structured-output or forced tool-call grammar applies to the answer only: the thinking
before it is free text up to the first `</think>` (`after_thinking`), as vLLM applies it
once its reasoning parser sees the end of the thinking.
"""

from __future__ import annotations

import json

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: a harmony template's reply (gpt-oss): its channels, not tags, say what is thinking
#: (`harmony.py`); `ChatPlan.reasoning` for it
HARMONY = "harmony"
#: template variables a client may not set through `chat_template_kwargs`
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"})


def thinks(template: str | None) -> bool:
    return bool(template and THINK_OPEN in template and THINK_CLOSE in template)


def prompt_state(prompt: str) -> str:
    tail = prompt.rstrip()
    if tail.endswith(THINK_OPEN):
        return "open"
    if tail.endswith(THINK_CLOSE):
        return "closed"
    return "free"


def split(text: str, state: str) -> tuple[str | None, str]:
    """(the thinking, or None; the answer) of a whole reply."""
    if state == "closed":
        return None, text
    body = text
    if state == "free":
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return None, text
        body = stripped[len(THINK_OPEN):]
    end = body.find(THINK_CLOSE)
    if end < 0:  # still thinking when the reply ended (max_tokens)
        return body, ""
    return body[:end], body[end + len(THINK_CLOSE):].lstrip("\n")


class ReasoningStream:
    """A streamed reply cut into thinking and answer as it arrives; a tag split across
    deltas is held back until it is whole."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.text = ""
        self.phase = "answer" if state == "closed" else ("think" if state == "open" else "start")
        self.at = 0  # characters of `text` handed out

    def feed(self, delta: str) -> tuple[str, str]:
        """(thinking, answer) text that can go out now."""
        self.text += delta
        think = answer = ""
        while True:
            rest = self.text[self.at:]
            if self.phase == "start":
                stripped = rest.lstrip()
                if not stripped or (THINK_OPEN.startswith(stripped) and stripped != THINK_OPEN):
                    return think, answer  # may still open a thinking block
                if stripped.startswith(THINK_OPEN):
                    self.at += len(rest) - len(stripped) + len(THINK_OPEN)
                    self.phase = "think"
                    continue
                self.phase = "answer"
                continue
            if self.phase == "think":
                end = rest.find(THINK_CLOSE)
                if end >= 0:
                    think += rest[:end]
                    self.at += end + len(THINK_CLOSE)
                    self.phase = "after"
                    continue
                keep = next((k for k in range(min(len(THINK_CLOSE) - 1, len(rest)), 0, -1)
                             if THINK_CLOSE.startswith(rest[-k:])), 0)
                think += rest[:len(rest) - keep]
                self.at += len(rest) - keep
                return think, answer
            if self.phase == "after":  # the newlines between the thinking and the answer
                stripped = rest.lstrip("\n")
                if not stripped:
                    return think, answer
                self.at += len(rest) - len(stripped)
                self.phase = "answer"
                continue
            answer += rest
            self.at += len(rest)
            return think, answer

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the reply is whole."""
        rest = self.text[self.at:]
        self.at = len(self.text)
        if self.phase == "think":
            return rest, ""
        if self.phase == "after":
            return "", rest.lstrip("\n")
        return "", rest


def after_thinking(grammar: str, state: str) -> str:
    """`grammar` (llguidance's, as the api compiles it) applied to the answer after the
    thinking a reply in `state` may hold."""
    if state == "closed":
        return grammar
    subs = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    answer = {**subs[0], "name": subs[0].get("name") or "answer"}
    name = answer["name"]
    body = 'body[lazy]: /(.|\\n)*<\\/think>/\n'
    if state == "open":
        head = f'start: body /\\n*/ @{name}\n{body}'
    else:
        head = f'start: think? @{name}\nthink: "{THINK_OPEN}" body /\\n*/\n{body}'
    return json.dumps({"grammars": [{"lark_grammar": head}, answer, *subs[1:]]})
