"""gpt-oss's harmony replies (services/api/harmony.py): a whole reply and the same reply
streamed in every cut give the same thinking, answer and calls; the grammars of a structured
output and a forced call accept what gpt-oss writes and nothing that skips the channels."""

from __future__ import annotations

import json

import pytest

from services.api.answer import AnswerStream, read_answer
from services.api.harmony import answer_grammar, call_grammar, is_harmony
from services.api.reasoning import HARMONY
from services.api.tools import Tools

CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
CASES = {
    "analysis then final": ("<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant"
                            "<|channel|>final<|message|>Hello! How can I help?",
                            "The user greets me.", "Hello! How can I help?", []),
    "analysis then a call": ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant" + CALL,
                             "Need the weather.", None, [("get_weather", {"city": "Paris"})]),
    "recipient in the role header": (
        "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.lookup<|channel|>commentary json"
        '<|message|>{"q": 1}', "x", None, [("lookup", {"q": 1})]),
    "a preamble, then a call": ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant" + CALL,
                                None, "Let me check.", [("get_weather", {"city": "Paris"})]),
    "a built-in tool is not shown": ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary"
                                     " to=browser.search<|message|>{}<|end|><|start|>assistant<|channel|>final"
                                     "<|message|>done", "a", "done", []),
    "cut short while thinking": ("<|channel|>analysis<|message|>Still thinking ab", "Still thinking ab", "", []),
    "plain text": ("Just text, no channels.", None, "Just text, no channels.", []),
    "a call cut short is no call": ("<|channel|>analysis<|message|>t<|end|><|start|>assistant" + CALL[:-3],
                                    "t", "", []),
    "a body holding a partial marker": ("<|channel|>final<|message|>a <| b <|en d", None, "a <| b <|en d", []),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_whole_reply_is_read_into_thinking_answer_and_calls(case):
    text, thinking, content, calls = CASES[case]
    got = read_answer(text, HARMONY, "harmony")
    assert (got.thinking, got.content) == (thinking, content)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got.calls] == calls


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_the_streamed_pieces_join_to_the_whole(case, step):
    text, thinking, content, calls = CASES[case]
    stream = AnswerStream(HARMONY, "harmony")
    assert not stream.plain
    think = answer = ""
    for i in range(0, len(text), step):
        t, a = stream.feed(text[i : i + step])
        think, answer = think + t, answer + a
        assert "<|" not in t.replace("<| b", "").replace("<|en d", "")  # no marker ever leaks
    t, a, got = stream.finish()
    think, answer = think + t, answer + a
    assert (think or None, answer) == (thinking, content or "")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls


def test_harmony_templates_are_told_apart():
    assert is_harmony("{{- '<|start|>assistant<|channel|>final<|message|>' + content }}")
    assert not is_harmony("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}")
    assert not is_harmony(None)


SPECIALS = ["<|start|>", "<|end|>", "<|channel|>", "<|message|>", "<|call|>", "<|return|>", "<|constrain|>"]
TOOLS = Tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], "required")


@pytest.fixture(scope="module")
def matcher(tmp_path_factory):
    import llguidance
    from tokenizers import Tokenizer

    from tests.checkpoints import make_tokenizer

    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(SPECIALS)
    ll = llguidance.LLTokenizer(tok.to_str())

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(ll, grammar)
        assert not m.get_error(), m.get_error()
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids) and m.is_accepting()

    return accepts


def test_a_forced_call_takes_an_analysis_message_then_one_call(matcher):
    grammar = call_grammar(TOOLS)
    think = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
    assert matcher(grammar, CALL)
    assert matcher(grammar, think + CALL)
    assert not matcher(grammar, '{"city": "Paris"}')  # no channel: refused
    assert not matcher(grammar, CALL.replace('"Paris"', "7"))  # arguments outside the schema
    assert not matcher(grammar, think + think + CALL)  # one analysis message at most


def test_a_structured_output_binds_the_final_channel(matcher):
    grammar = answer_grammar('start: "yes" | "no"\n')
    assert matcher(grammar, "<|channel|>final<|message|>yes")
    assert matcher(grammar, "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>no")
    assert not matcher(grammar, "<|channel|>final<|message|>maybe")
    assert not matcher(grammar, "yes")
