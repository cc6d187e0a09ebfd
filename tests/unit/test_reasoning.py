"""Reasoning models (issue 30): the thinking split from the answer in a whole reply and in a
stream cut anywhere (the chunks join to the whole reply's fields), with tool calls in the
answer, and a structured-output grammar that binds only the answer after the thinking."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest
from tokenizers import Tokenizer

from services.api.dialects.openai.reply import ChatReply
from services.api.events import DeltaEvent, DoneEvent, Usage
from services.api.reasoning import after_thinking, prompt_state, split, thinks
from services.api.schemas import ConstrainedFields
from services.api.structured import parse_structured
from tests.checkpoints import make_tokenizer

REPLY = ('<think>\nThe user wants 2 + 3.\n</think>\n\nSure.\n'
         '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')


@pytest.mark.parametrize("prompt, state", [
    ("<|im_start|>assistant\n", "free"),
    ("<|im_start|>assistant\n<think>\n", "open"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "closed"),
])
def test_the_prompt_says_where_the_reply_starts(prompt, state):
    assert prompt_state(prompt) == state


def test_split():
    assert split(REPLY, "free") == ("\nThe user wants 2 + 3.\n", REPLY.split("</think>\n\n")[1])
    assert split("so</think>\nok", "open") == ("so", "ok")
    assert split("still thinking", "open") == ("still thinking", "")
    assert split("<think>x</think>y", "closed") == (None, "<think>x</think>y")
    assert split("no thinking", "free") == (None, "no thinking")
    assert thinks("{{ '<think>' }}...{{ '</think>' }}") and not thinks("{{ messages }}")


def _stream(reply: ChatReply, text: str, step: int) -> list[dict]:
    events = [DeltaEvent("r", text[i:i + step], [1]) for i in range(0, len(text), step)]
    events.append(DoneEvent("r", text, [1] * len(events), "stop", Usage(3, len(events))))
    out = b"".join(reply.event(e) for e in events).decode()
    return [json.loads(line[6:]) for line in out.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_a_stream_joins_to_the_whole_reply(step):
    whole = ChatReply("r", "m", 0, tool_format="hermes", reasoning="free").choice(
        DoneEvent("r", REPLY, [1], "stop", Usage(3, 1)))
    chunks = _stream(ChatReply("r", "m", 0, tool_format="hermes", reasoning="free"), REPLY, step)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == whole.message.reasoning_content
    assert "".join(d.get("content") or "" for d in deltas) == whole.message.content == "Sure.\n"
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole.finish_reason == "tool_calls"


def test_a_grammar_binds_only_the_answer_after_the_thinking(tmp_path: Path):
    make_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    lt = llguidance.LLTokenizer(tok.to_str(), eos_token=tok.token_to_id("<|im_end|>"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = parse_structured(ConstrainedFields(guided_json=schema))

    def accepts(state: str, text: str) -> bool:
        m = llguidance.LLMatcher(lt, after_thinking(grammar, state))
        return m.consume_tokens(tok.encode(text, add_special_tokens=False).ids) and m.is_accepting()

    assert accepts("free", '<think>anything {not json}</think>\n\n{"a":1}')
    assert accepts("free", '{"a":1}')  # or no thinking at all
    assert accepts("open", 'thinking... </think>\n{"a":2}')
    assert accepts("closed", '{"a":3}')
    assert not accepts("free", '<think>x</think>\n\nnot json')
    assert not accepts("closed", '<think>x</think>{"a":3}')
