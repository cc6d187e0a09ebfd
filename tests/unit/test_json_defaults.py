"""The defaults a JSON schema gets before it is compiled (issue 48): objects that declare
their properties are closed to them, integers and numbers have at most 16 integer digits,
as llama.cpp's schema converter and vLLM's strict backends give; what a schema says itself
(`additionalProperties: true`, its own bounds) wins. Checked on the grammar a real matcher
enforces over a real tokenizer, for `response_format` and for forced tool calls."""

from __future__ import annotations

import json

import llguidance
import pytest

from services.api.schemas import ConstrainedFields
from services.api.structured import INTEGER_DIGITS, parse_structured, tightened
from services.api.tools import Tools, tool_grammar
from services.api.validation import load
from tests.checkpoints import make_tokenizer

CITY = {"type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer", "minimum": 0}},
        "required": ["name", "population"]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> llguidance.LLTokenizer:
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return llguidance.LLTokenizer((folder / "tokenizer.json").read_text())


def accepts(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar's matcher takes `text` whole and may end there."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.tokenize_str(text)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def schema_grammar(schema: dict) -> str:
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    grammar = parse_structured(load(body, ConstrainedFields))
    assert grammar is not None
    return grammar


def test_an_object_with_properties_is_closed_to_them(tokenizer):
    grammar = schema_grammar(CITY)
    assert accepts(tokenizer, grammar, '{"name":"Oslo","population":700000}')
    assert not accepts(tokenizer, grammar, '{"name":"Oslo","population":700000,"x":1}')


def test_additional_properties_true_reopens_it(tokenizer):
    grammar = schema_grammar({**CITY, "additionalProperties": True})
    assert accepts(tokenizer, grammar, '{"name":"Oslo","population":7,"x":1}')


def test_an_object_without_properties_and_json_object_stay_open(tokenizer):
    for body in ({"response_format": {"type": "json_object"}},
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                             "schema": {"type": "object"}}}}):
        grammar = parse_structured(load(body, ConstrainedFields))
        assert grammar is not None and accepts(tokenizer, grammar, '{"anything":[1,2],"b":{"c":null}}')


def test_integers_stop_at_16_digits_unless_the_schema_bounds_them(tokenizer):
    grammar = schema_grammar(CITY)
    assert accepts(tokenizer, grammar, '{"name":"a","population":' + "9" * INTEGER_DIGITS + "}")
    assert not accepts(tokenizer, grammar, '{"name":"a","population":' + "1" * (INTEGER_DIGITS + 1) + "}")
    assert not accepts(tokenizer, grammar, '{"name":"a","population":-1}')  # its own minimum kept
    big = schema_grammar({"type": "integer", "maximum": 10**18})
    assert accepts(tokenizer, big, "1" * 18) and not accepts(tokenizer, big, "-" + "1" * 17)


def test_a_numbers_integer_part_is_bounded_too(tokenizer):
    grammar = schema_grammar({"type": "number"})
    assert accepts(tokenizer, grammar, "-3.25") and accepts(tokenizer, grammar, "9" * INTEGER_DIGITS)
    assert not accepts(tokenizer, grammar, "1" * (INTEGER_DIGITS + 1))


def test_nested_objects_close_but_allof_members_merge(tokenizer):
    nested = {"type": "object", "properties": {"home": CITY, "tags": {"type": "array", "items": CITY}},
              "required": ["home"]}
    grammar = schema_grammar(nested)
    assert accepts(tokenizer, grammar, '{"home":{"name":"a","population":1}}')
    assert not accepts(tokenizer, grammar, '{"home":{"name":"a","population":1,"z":2}}')
    merged = tightened({"allOf": [{"properties": {"a": {"type": "string"}}},
                                  {"properties": {"b": {"type": "string"}}}]})
    assert all("additionalProperties" not in member for member in merged["allOf"])


def test_the_schema_given_is_not_changed():
    schema = json.loads(json.dumps(CITY))
    tightened(schema)
    assert schema == CITY


def test_forced_tool_arguments_are_closed_and_bounded(tokenizer):
    tool = {"type": "function", "function": {"name": "web_search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"]}}}
    grammar = tool_grammar(Tools([tool], "named", "web_search", parallel=False), "hermes")
    call = '<tool_call>\n{"name":"web_search","arguments":{"query":"x","limit":5}}\n</tool_call>'
    assert accepts(tokenizer, grammar, call)
    assert not accepts(tokenizer, grammar, call.replace('"limit":5', '"limit":5,"description":"y"'))
    assert not accepts(tokenizer, grammar, call.replace('"limit":5', '"limit":' + "1" * 17))


def test_the_gap_between_tokens_is_llama_cpps_space_rule(tokenizer):
    grammar = schema_grammar(CITY)
    assert accepts(tokenizer, grammar, '{"name": "Oslo", "population": 7}')
    assert accepts(tokenizer, grammar, '{\n  "name": "Oslo",\n  "population": 7\n}')
    assert not accepts(tokenizer, grammar, '{"name":  "Oslo","population":7}')  # two spaces
    assert not accepts(tokenizer, grammar, '{"name":' + "\n" + " " * 21 + '"Oslo","population":7}')
