"""Stop strings checked in the gpu worker, for requests that ask it to (`SamplingParams.stop`).

Why here and not only in the api: a stop string is found on detokenized text, which the api
alone has for a plain text request; it aborts the request at the match, which is enough
there. A speech-out request (Qwen3-Omni's thinker feeding its talker) cannot end that way:
by the time the api sees the match the talker has read text past it, and an abort loses the
voice. So the api sends such a request's stop strings to the worker, which decodes each
new thinker token with the same incremental detokenizer and matcher as the api
(`shared.detokenize`, `shared.stop_strings`) and ends the thinker's stage at the token
that completes the match (finish_reason "stop"), as transformers' `StopStringCriteria`
does (a match that ends before a character the token leaves unfinished included: the text
the detokenizer holds back is read too, `IncrementalDetokenizer.pending`); the talker then
speaks every token up to and including that one (transformers'
`generate(thinker_stop_strings=...)` feeds its talker the same sequence), and the api cuts
the text before the match (it finds it at the latest when the request ends).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenizers import Tokenizer

from shared.detokenize import IncrementalDetokenizer
from shared.stop_strings import StopMatcher


class StopCheck:
    """One request's stop strings over its generated tokens."""

    __slots__ = ("_detok", "_match")

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self._match = StopMatcher(stops)

    @property
    def matched(self) -> str | None:
        """The stop string found, once one is."""
        return self._match.matched

    def push(self, token: int) -> bool:
        """Add one generated token; whether a stop string is now complete (the request's
        text ends before it, its tokens at this one)."""
        m = self._match
        if m.matched is None:
            m.push(self._detok.push([token]))
        if m.matched is None:  # text the detokenizer holds before an unfinished character
            m.matched = m.peek(self._detok.pending())
        return m.matched is not None


class StopChecks:
    """Makes a `StopCheck` per request that carries stop strings, over the model's tokenizer
    (built at first use: a worker whose requests never carry any never builds it)."""

    def __init__(self, tokenizer: Callable[[], Tokenizer | None]) -> None:
        self._load = tokenizer
        self._tokenizer: Tokenizer | None = None

    def make(self, stops: Sequence[str]) -> StopCheck | None:
        """None when `stops` is empty. ValueError when the worker has no tokenizer."""
        if not stops:
            return None
        if self._tokenizer is None:
            self._tokenizer = self._load()
            if self._tokenizer is None:
                raise ValueError("this worker has no tokenizer for stop strings")
        return StopCheck(self._tokenizer, stops)
