"""Speculative decoding by prompt lookup: draft tokens are copied from the request's own
history, and one forward verifies them all.

Text that quotes, repeats or edits its prompt (code, summaries, extraction, chat that
restates the question) continues an n-gram it has already seen. `NgramProposer` finds the
most recent earlier occurrence of the history's last n tokens (longest n first, from
`max_n` down to `min_n`) and proposes the tokens that followed it, continuing the loop when
the match is close to the end. There is no draft model:
nothing to load, no extra KV, and a miss costs only the dictionary lookups.

The index is incremental: each position's n-grams are added once, when the position stops
being the last one, so a proposal costs O(max_n) dictionary operations however long the
request is (a rescan per step would cost O(length) per request per step).

Verification is greedy: a draft token is accepted while it equals the model's argmax at
its position, so the tokens emitted are exactly those plain greedy decoding emits.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    """Prompt-lookup drafts for one request; `propose(tokens, k)` each step."""

    __slots__ = ("index", "indexed", "max_n", "min_n")

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        #: n-gram -> the index of its last token, most recent occurrence
        self.index: dict[tuple[int, ...], int] = {}
        #: positions 0..indexed-1 have all their n-grams in the index
        self.indexed = 0

    def _index_upto(self, tokens: Sequence[int], end: int) -> None:
        for i in range(self.indexed, end):
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                self.index[tuple(tokens[i - n + 1 : i + 1])] = i
        self.indexed = max(self.indexed, end)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest
        suffix of `tokens` (of at least `min_n` tokens) seen before; [] when none is."""
        last = len(tokens) - 1
        if k <= 0 or last < 1:
            return []
        self._index_upto(tokens, last)  # every position but the last: the suffix itself is no match
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            pos = self.index.get(tuple(tokens[last - n + 1 :]))
            if pos is not None:
                return _continue(tokens, pos, k)
        return []


def _continue(tokens: Sequence[int], pos: int, k: int) -> list[int]:
    """The k tokens after `pos`. Past the history's end the match's own continuation
    repeats with period `last - pos`: a run or a short loop (`a b a b`) gives k drafts,
    not the one or two that precede the end."""
    last = len(tokens) - 1
    out = list(tokens[pos + 1 : min(pos + 1 + k, last + 1)])
    while len(out) < k:
        out.append(out[len(out) - (last - pos)])
    return out


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts equal the model's greedy tokens: `targets[i]` is the argmax
    after the last token and drafts[:i], so draft i stands only if all before it did."""
    a = 0
    for d, t in zip(drafts, targets):
        if d != t:
            break
        a += 1
    return a
