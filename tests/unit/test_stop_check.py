"""The gpu worker's stop strings (`StopCheck`, for speech-out requests) end at the token
whose text first holds a match: the same token as a brute-force decode of every prefix, a
match that ends inside a token or across several included, never on half a character."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from services.gpu_worker.stop_check import StopCheck, StopChecks
from tests.unit.test_api_detokenize import CORPUS
from tests.unit.test_api_detokenize import tok as _tok

tok = _tok  # the module fixture: a byte-level BPE over emoji and CJK text


def first_match(tokenizer: Tokenizer, ids: list[int], stops: list[str]) -> int | None:
    """The index of the first token after which the decoded text holds a stop string."""
    for k in range(len(ids)):
        text = tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
        if any(s in text for s in stops):
            return k
    return None


def pushed(tokenizer: Tokenizer, ids: list[int], stops: list[str]) -> int | None:
    check = StopCheck(tokenizer, stops)
    return next((k for k, t in enumerate(ids) if check.push(t)), None)


def test_matches_where_the_text_first_holds_a_stop_string(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for text in CORPUS:
        ids = tok.encode(text).ids
        for _ in range(20):
            a = rng.randrange(len(text))
            stops = [text[a: a + rng.randint(1, 6)], "never in the corpus"]
            want = first_match(tok, ids, stops)
            assert want is not None and pushed(tok, ids, stops) == want, (text, stops)


def test_no_match_and_after_a_match(tok: Tokenizer) -> None:
    ids = tok.encode(CORPUS[0]).ids
    check = StopCheck(tok, ["zzz"])
    assert not any(check.push(t) for t in ids) and check.matched is None
    check = StopCheck(tok, ["world"])
    assert [check.push(t) for t in ids][-1] and check.matched == "world"


def test_the_tokenizer_is_built_once_and_only_for_stop_strings(tok: Tokenizer) -> None:
    built: list[int] = []
    checks = StopChecks(lambda: built.append(1) or tok)
    assert checks.make([]) is None and not built
    assert checks.make(["a"]) is not None and checks.make(["b"]) is not None and built == [1]
    with pytest.raises(ValueError, match="no tokenizer"):
        StopChecks(lambda: None).make(["a"])
