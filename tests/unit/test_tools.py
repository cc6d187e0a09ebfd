"""Tool calls: the format picked from the template, the calls parsed from each format, a
stream that holds back calls and joins to the unstreamed reply, the grammar of forced calls,
and history written for a template without tool support."""

from __future__ import annotations

import json

import llguidance
import pytest

from services.api.schemas import ChatCompletionRequest
from services.api.tools import (
    FORMATS,
    Tools,
    ToolStream,
    extract,
    parse_tools,
    pick_format,
    prepare_messages,
    tool_grammar,
)
from services.api.validation import load

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def tools_of(**fields) -> Tools | None:
    """The tools of a chat request with these fields (decoded as the route decodes them)."""
    return parse_tools(load({"messages": [{"role": "user", "content": "x"}], **fields}, ChatCompletionRequest))


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


@pytest.mark.parametrize("template, want", [
    (None, ("hermes", False)),
    ("{{ messages }}", ("hermes", False)),
    ("{% if tools %}<tool_call>{% endif %}", ("hermes", True)),
    ("{% if tools %}[TOOL_CALLS]{% endif %}", ("mistral", True)),
    ("{% if tools %}[TOOL_CALLS]{{ name }}[ARGS]{% endif %}", ("mistral_args", True)),
    ("{% if tools %}<|python_tag|>{% endif %}", ("llama3_json", True)),
])
def test_the_format_follows_the_template(template, want):
    assert pick_format(template) == want
    assert pick_format(template, "mistral")[0] == "mistral"


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", HERMES, "Let me check.\n", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", "<tool_call>\n{broken", "<tool_call>\n{broken", []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", {"x": 1}), ("g", {})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}', None, [("f", {"x": 1})]),
    ("llama3_json", "The answer is {x}", "The answer is {x}", []),
    ("mistral", 'Sure[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', "Sure", [("f", {"x": 1})]),
    ("mistral_args", 'Sure[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}', "Sure", [("f", {"x": 1}), ("g", {})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1}', None, [("f", {"x": 1})]),  # either parser reads both forms
    ("mistral_args", '[TOOL_CALLS][{"name": "f", "arguments": {}}]', None, [("f", {})]),
    ("mistral_args", "[TOOL_CALLS]f[ARGS]{broken", "[TOOL_CALLS]f[ARGS]{broken", []),
])
def test_calls_are_parsed_from_each_format(fmt, text, content, calls):
    got_content, got = extract(text, fmt)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_a_stream_joins_to_the_unstreamed_reply(step):
    s = ToolStream("hermes", forced=False)
    sent = "".join(s.feed(HERMES[i:i + step]) for i in range(0, len(HERMES), step))
    rest, calls = s.finish()
    content, whole = extract(HERMES, "hermes")
    assert sent + rest == content and "<tool" not in sent
    assert [(c.function.name, c.function.arguments) for c in calls] == [(c.function.name, c.function.arguments)
                                                                        for c in whole]


def test_text_that_only_looks_like_a_marker_is_sent():
    s = ToolStream("hermes", forced=False)
    sent = s.feed("a <tool") + s.feed("box> b")
    rest, calls = s.finish()
    assert sent + rest == "a <toolbox> b" and not calls


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_grammars_compile(fmt, parallel):
    tools = tools_of(tools=[WEATHER], tool_choice="required", parallel_tool_calls=parallel)
    assert tools == Tools([WEATHER], "required", parallel=parallel)
    assert llguidance.LLMatcher.validate_grammar_with_warnings(tool_grammar(tools, fmt)) == (False, [])


def test_a_forced_mistral_args_grammar_writes_calls_the_parser_reads(tmp_path):
    """The grammar's calls, written by a matcher over a real tokenizer, parse back."""
    from tokenizers import Tokenizer

    from tests.checkpoints import make_tokenizer

    make_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    lt = llguidance.LLTokenizer(tok.to_str(), eos_token=tok.token_to_id("<|im_end|>"))
    tools = tools_of(tools=[WEATHER], tool_choice="required")
    text = '[TOOL_CALLS]get_weather[ARGS]{"city":"Oslo"}[TOOL_CALLS]get_weather[ARGS]{"city":"Rome"}'
    m = llguidance.LLMatcher(lt, tool_grammar(tools, "mistral_args"))
    assert m.consume_tokens(tok.encode(text, add_special_tokens=False).ids) and m.is_accepting()
    _, calls = extract(text, "mistral_args")
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Oslo"}, {"city": "Rome"}]


def test_a_template_without_tools_is_taught_them_and_the_history():
    tools = tools_of(tools=[WEATHER])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "X"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = prepare_messages(messages, tools, "hermes", native=False)
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert prepare_messages(messages, tools, "hermes", native=True) is messages
