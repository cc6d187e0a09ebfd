"""The structured-output fields compile to one llguidance grammar, or a 400 naming the field
and the reason (issue 30); the grammar enforced by a real matcher over a real tokenizer."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest

from services.api.errors import ApiError
from services.api.schemas import ConstrainedFields
from services.api.structured import parse_structured
from services.api.validation import load
from services.gpu_worker.guided import Guides
from tests.checkpoints import make_tokenizer


def structured(body: dict) -> str | None:
    """The grammar of a body's structured-output fields, decoded as the routes decode them."""
    return parse_structured(load(body, ConstrainedFields))


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "tag": {"enum": ["a", "b"]}},
          "required": ["n", "tag"], "additionalProperties": False}


@pytest.mark.parametrize("body", [
    {},
    {"response_format": {"type": "text"}},
    {"response_format": None, "guided_json": None},
])
def test_no_constraint(body):
    assert structured(body) is None


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
    {"structured_outputs": {"json": SCHEMA}},
    {"structured_outputs": {"json": json.dumps(SCHEMA)}},
    {"structured_outputs": {"regex": "[a-z]+@[a-z]+\\.com"}},
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"structured_outputs": {"grammar": 'start: "x" ("," "x")*'}},
    {"structured_outputs": {"json_object": True}},
    {"guided_json": SCHEMA},
    {"guided_regex": "\\d{3}"},
    {"guided_choice": ["red", "green"]},
    {"guided_grammar": 'root ::= "a" | "b"'},
])
def test_each_form_compiles(body):
    grammar = structured(body)
    assert grammar and llguidance.LLMatcher.validate_grammar(grammar) == ""


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format.type",
     'response_format.type must be one of text, json_object, json_schema, got "xml"'),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", '"name" and "schema"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format.json_schema.schema", 'Unimplemented keys: ["not"]'),
    ({"guided_regex": "(abc"}, "guided_regex", "unclosed group"),
    ({"guided_choice": []}, "guided_choice", "a list of 1 to 1024 non-empty strings"),
    ({"guided_grammar": "start: foo"}, "guided_grammar", 'unknown name: "foo"'),
    ({"guided_json": "{not json"}, "guided_json", "its string is not JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag",
     "unknown field 'structural_tag' in structured_outputs"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "only one"),
])
def test_bad_constraints_are_400s_naming_the_field(body, param, words):
    with pytest.raises(ApiError) as info:
        structured(body)
    assert info.value.param == param and words in str(info.value), str(info.value)


@pytest.fixture(scope="module")
def guides(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    text = (folder / "tokenizer.json").read_text()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(text)
    return Guides(lambda: text, tok.get_vocab_size() + 7, [tok.token_to_id("<|im_end|>")]), tok


def test_a_guide_allows_only_what_the_grammar_does_then_eos(guides):
    factory, tok = guides
    g = factory.new(structured({"guided_choice": ["yes", "no"]}))
    allowed = g.allowed()
    assert allowed.shape == (factory.vocab_size,) and not allowed[-7:].any()  # the head's extra rows
    ok = {tok.decode([t]) for t in allowed.nonzero().flatten().tolist()}
    assert ok and all("yes".startswith(s) or "no".startswith(s) for s in ok), ok
    for t in tok.encode("yes", add_special_tokens=False).ids:
        assert g.allowed()[t]
        g.accept(t)
    assert g.allowed().nonzero().flatten().tolist() == factory.eos_ids


def test_a_grammar_the_tokenizer_cannot_compile_is_a_value_error(guides):
    factory, _ = guides
    with pytest.raises(ValueError, match="does not compile"):
        factory.new('start: foo')


def test_greedy_is_the_masked_argmax_whether_or_not_the_rows_own_argmax_is_allowed(guides):
    """`Guide.greedy` checks the row's own argmax with the matcher and masks only when the
    grammar refuses it: the token is the masked row's argmax every time, on rows whose top
    is allowed (its logit raised) and on rows whose top is not."""
    factory, _ = guides
    g = factory.new(structured({"guided_json": SCHEMA}))
    rng = np.random.default_rng(0)
    kinds = set()
    for step in range(40):
        x = rng.standard_normal(factory.vocab_size).astype(np.float32)
        allowed = g.allowed().numpy()
        if step % 2:  # make the row's own top an allowed token
            x[rng.choice(np.flatnonzero(allowed))] = x.max() + 1.0
        want = int(np.where(allowed, x, -np.inf).argmax())
        kinds.add(bool(allowed[int(x.argmax())]))
        assert g.greedy(x) == want, step
        if want in factory.eos_ids:
            break
        g.accept(want)
    assert kinds == {True, False}  # both ways were taken
