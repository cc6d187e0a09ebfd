"""Incremental detokenization for streaming: text deltas that never split a character.

A byte-level BPE token can end in the middle of a UTF-8 character (an emoji is four
bytes, often two or three tokens), and SentencePiece-style decoders treat the first token
of a sequence differently (they drop its leading space). Decoding each token on its own is
therefore wrong. This follows vLLM's scheme: keep two offsets into the generated ids,

- `prefix_offset`: where the window of already-emitted context starts,
- `read_offset`: where the not-yet-emitted tokens start,

decode `ids[prefix_offset:read_offset]` and `ids[prefix_offset:]`, and emit the difference,
unless the newer decode ends in U+FFFD (an unfinished character): then nothing is emitted
and the tokens wait for the ones that complete it. `finish()` flushes whatever is held, so
the deltas joined always equal `tokenizer.decode(all_ids, skip_special_tokens=True)`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's generated ids, as they arrive, into text deltas."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (the deltas joined)."""
        return "".join(self._parts)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=self._skip) if ids else ""

    def push(self, new_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete ('' while held back)."""
        if not new_ids:
            return ""
        self.token_ids.extend(new_ids)
        return self._advance(final=False)

    def pending(self) -> str:
        """The text of the held tokens up to their first unfinished character: not emitted
        (a later token may still change what follows it), but what precedes an unfinished
        character at the end is final. The gpu worker's stop check reads it, so a stop
        string that ends before such a character ends the text at the token that made it."""
        ids = self.token_ids
        if self._read_offset >= len(ids):
            return ""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        return new_text[len(prefix_text) :].rstrip(REPLACEMENT) if len(new_text) > len(prefix_text) else ""

    def finish(self) -> str:
        """The text still held back (a character the generation never completed)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        ids = self.token_ids
        if self._read_offset >= len(ids):
            return ""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT)):
            # Either an unfinished character, or tokens that decode to nothing yet (special
            # tokens, a bare byte); keep them and decode again with the next tokens.
            if len(new_text) <= len(prefix_text) and not new_text.endswith(REPLACEMENT):
                # Nothing to hold back: the tokens are complete but add no text. Advance so
                # the window does not grow without need.
                self._read_offset = len(ids)
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if delta:
            self._parts.append(delta)
        return delta
