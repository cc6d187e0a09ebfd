"""Constrained decoding: a request's grammar, enforced on its logits token by token.

The api compiles a request's structured-output fields into an llguidance grammar
(`services/api/structured.py`) and the frame carries it (`SamplingParams.grammar`). Here
each such request gets a `Guide`: an llguidance matcher over the model's own tokenizer.
Before a row is sampled, the guide's mask sets every token the grammar does not allow next
to -inf (after the logits processors and the logprobs, as top-k and top-p choose among
them); the sampled token then advances the matcher. The grammar changes which tokens are
sampled, never a layout (DESIGN.md): a constrained request batches with the others, and it
does not speculate (drafts would need the grammar's verdict on each).

Once the grammar is complete the mask allows only the end-of-sequence tokens, so the
request ends with finish reason "stop" as any other does.

The tokenizer (`llguidance.LLTokenizer`, built from the model's `tokenizers` JSON: ~1 s and
a few MB for a 50k vocabulary) is made at the first constrained request, not at start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger("mstar.guided")


class Guide:
    """One request's grammar state: what it may write next, and what it wrote."""

    def __init__(self, matcher, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)

    def allowed(self) -> torch.Tensor:
        """bool[vocab_size]: the tokens the grammar allows next (only EOS once it is complete).
        The matcher's tokenizer was built with the model's `vocab_size`, so its bitmask
        covers every row of the logits (ids the tokenizer lacks are never allowed)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if not allowed.any():  # a matcher in its error state allows nothing: end the request
            log.error("grammar matcher allows no token (%s); allowing only EOS", self.matcher.get_error())
            allowed[[t for t in self.eos_ids if t < self.vocab_size]] = True
        return torch.from_numpy(allowed)

    def greedy(self, x: np.ndarray) -> int:
        """The allowed token of highest logit in `x` (one row): the row's own argmax where
        the grammar takes it (one token checked by the matcher, ~20 us), else the argmax of
        the masked row. The same token either way (a first maximum the grammar refuses
        falls through to the mask, whose first allowed maximum wins), without the
        vocabulary-wide mask (~250 us with the caches cold from a step) for most tokens of
        a model that writes its JSON well."""
        top = int(x.argmax())
        if top < self.vocab_size and self.matcher.validate_tokens([top]) == 1:
            return top
        return int(np.where(self.allowed().numpy(), x, -np.inf).argmax())

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (one row of logits) with every token the grammar forbids at -inf (a new tensor)."""
        return x.masked_fill(~self.allowed(), float("-inf"))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token) and token not in self.eos_ids:
            log.error("grammar matcher refused sampled token %d: %s", token, self.matcher.get_error())


class Guides:
    """Makes a `Guide` per constrained request, over one llguidance tokenizer built at first use."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None

    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance

            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                     eos_token=self.eos_ids or None)
        return self._tokenizer

    def new(self, grammar: str) -> Guide:
        """A guide at the grammar's start; ValueError when the grammar does not compile
        against this model's tokenizer."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the request's grammar does not compile: {matcher.get_error()}")
        return Guide(matcher, self.vocab_size, self.eos_ids)
