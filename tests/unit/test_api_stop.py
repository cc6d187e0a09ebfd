"""StopMatcher: the first stop string ends the text, and no released piece ever holds part
of it, however the text is split into deltas."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.stop_strings import StopMatcher


def run(chunks: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    m = StopMatcher(stops)
    out = [m.push(c) for c in chunks]
    out.append(m.flush())
    assert "".join(out) == m.text
    return out, m.matched


def reference(text: str, stops: list[str]) -> str:
    cuts = [i for i in (text.find(s) for s in stops) if i != -1]
    return text[: min(cuts)] if cuts else text


def test_no_stops_passes_everything() -> None:
    assert run(["a", "b", ""], []) == (["a", "b", "", ""], None)


def test_match_inside_one_delta() -> None:
    out, matched = run(["Hello\n\nUser: hi"], ["\n\nUser:"])
    assert "".join(out) == "Hello" and matched == "\n\nUser:"


def test_match_across_deltas_never_leaks() -> None:
    out, matched = run(["Hello", "\n", "\nUs", "er:", " more"], ["\n\nUser:"])
    assert out == ["Hello", "", "", "", "", ""] and matched == "\n\nUser:"


def test_held_text_released_when_it_cannot_match() -> None:
    out, matched = run(["ab", "c", "x"], ["cd"])
    assert out == ["ab", "", "cx", ""] and matched is None


def test_held_text_released_at_the_end() -> None:
    out, matched = run(["abc"], ["cd"])
    assert out == ["ab", "c"] and matched is None


def test_earliest_match_wins() -> None:
    out, matched = run(["xx", "yyBBAA"], ["AA", "BB"])
    assert "".join(out) == "xxyy" and matched == "BB"


def test_overlapping_prefixes() -> None:
    # "aab" with stop "ab": the held "a" must not hide the match that starts one later
    out, _ = run(["a", "a", "b"], ["ab"])
    assert "".join(out) == "a"


def test_nothing_after_a_match() -> None:
    m = StopMatcher(["s"])
    assert m.push("as") == "a"
    assert m.push("more") == "" and m.flush() == "" and m.text == "a"


def test_empty_stop_refused() -> None:
    with pytest.raises(ValueError):
        StopMatcher([""])


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc\n🎉", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n🎉", min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_any_split_gives_the_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    want = reference(text, stops)
    m = StopMatcher(stops)
    released = ""
    for chunk in chunks:
        released += m.push(chunk)
        assert want.startswith(released)  # never a character past the cut
    released += m.flush()
    assert released == want
    assert (m.matched is not None) == (want != text or any(s in text for s in stops))
