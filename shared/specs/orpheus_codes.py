"""Orpheus TTS: the map between the LLM's audio tokens and SNAC's codes (numpy only).

Orpheus is a Llama checkpoint whose added tokens `<custom_token_N>` (contiguous ids,
`<custom_token_0>` = 128256 in the 3B vocab) carry both its control tokens and its audio.
The audio is SNAC codes, 7 tokens per frame; the k-th audio token of an output (k counts
audio tokens only) is code `token_id - base - (k % 7) * codebook_size`, where `base` is the
id of `<custom_token_10>`: each of the 7 slots of a frame has its own id range, so the
sampler can restrict the k-th token to `allowed(k)` and every sampled token is a valid code.

A frame of 7 codes [a, b, c, d, e, f, g] fills SNAC's three codebooks (coarsest first) as
codes_0 += [a], codes_1 += [b, e], codes_2 += [c, d, f, g], which is what Orpheus' own
decoder (orpheus_tts/decoder.py) does before `snac.SNAC.decode`.

This module holds no torch so the api and the data worker (which build prompts and check
ids) can import it; the codec itself is services/gpu_worker/codecs/snac_codec.py.
Everything is derived from the vocab (by custom-token offset) and the codec's codebook size,
so a tiny test vocab and a tiny test codec work the same way as the real 3B model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from shared.deferred import deferred

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)


#: audio tokens per SNAC frame (1 + 2 + 4 codes for the 24 kHz codec's three codebooks)
CODES_PER_FRAME = 7
#: custom-token offset of the first audio token (`base`)
AUDIO_OFFSET = 10
#: slot of each of a frame's 7 codes in codebooks 0, 1, 2 (Orpheus' interleaving)
FRAME_LAYOUT: tuple[tuple[int, ...], ...] = ((0,), (1, 4), (2, 3, 5, 6))

#: the control tokens of Orpheus' prompt, as `<custom_token_N>` offsets
START_OF_SPEECH, END_OF_SPEECH, START_OF_HUMAN, END_OF_HUMAN, START_OF_AI = 1, 2, 3, 4, 5
#: Llama 3's end of turn, which Orpheus writes after the text
EOT_TOKEN = "<|eot_id|>"


def custom_token(n: int) -> str:
    """The added token with offset `n` (`<custom_token_n>`)."""
    return f"<custom_token_{n}>"


class OrpheusCodes:
    """Audio token <-> SNAC code arithmetic and the prompt's special ids for one vocab.

    Built from a tokenizer's vocab dict (token string -> id, added tokens included) and the
    codec's codebook size (4096 for snac_24khz; take it from the codec's config, so a tiny
    test codec with 64 codes works). The custom tokens must be contiguous from
    `<custom_token_0>` through the last audio token, because the arithmetic above (and a
    sampler's id ranges) assumes it; a vocab where they are not is refused at construction
    rather than decoding wrong sound later."""

    def __init__(self, vocab: Mapping[str, int], codebook_size: int) -> None:
        if codebook_size <= 0:
            raise ValueError(f"codebook_size must be positive, got {codebook_size}")
        self.codebook_size = codebook_size
        first = vocab.get(custom_token(0))
        if first is None:
            raise ValueError(f"the vocab has no {custom_token(0)}: not an Orpheus tokenizer")
        count = AUDIO_OFFSET + CODES_PER_FRAME * codebook_size
        for n in range(count):
            if vocab.get(custom_token(n)) != first + n:
                raise ValueError(f"{custom_token(n)} is {vocab.get(custom_token(n))}, expected {first + n}: "
                                 f"Orpheus needs <custom_token_0..{count - 1}> at contiguous ids")
        eot = vocab.get(EOT_TOKEN)
        if eot is None:
            raise ValueError(f"the vocab has no {EOT_TOKEN}")
        self.first_custom = first
        self.base = first + AUDIO_OFFSET
        self.end_of_text = eot
        self.start_of_speech = first + START_OF_SPEECH
        self.end_of_speech = first + END_OF_SPEECH  # the stop token
        self.start_of_human = first + START_OF_HUMAN
        self.end_of_human = first + END_OF_HUMAN
        self.start_of_ai = first + START_OF_AI

    def allowed(self, k: int) -> tuple[int, int]:
        """Half-open id range [lo, hi) of the k-th audio token (k counts audio tokens only, from 0):
        what a sampler restricts that step to (plus `end_of_speech` at a frame boundary)."""
        if k < 0:
            raise ValueError(f"audio token index must be >= 0, got {k}")
        lo = self.base + (k % CODES_PER_FRAME) * self.codebook_size
        return lo, lo + self.codebook_size

    def to_code(self, token_id: int, k: int) -> int:
        """SNAC code of `token_id` as the k-th audio token; ValueError when it is outside that
        slot's range (Orpheus' own decoder silently drops such tokens, which shifts every later
        frame: refusing makes the mistake visible)."""
        code = token_id - self.base - (k % CODES_PER_FRAME) * self.codebook_size
        if not 0 <= code < self.codebook_size:
            lo, hi = self.allowed(k)
            raise ValueError(f"token {token_id} is not an audio token for position {k} (expected [{lo}, {hi}))")
        return code

    def to_token(self, code: int, k: int) -> int:
        """Inverse of `to_code`: the token id that carries `code` as the k-th audio token."""
        if not 0 <= code < self.codebook_size:
            raise ValueError(f"code {code} outside [0, {self.codebook_size})")
        return self.allowed(k)[0] + code

    def codes(self, token_ids: Sequence[int], start: int = 0) -> list[int]:
        """Codes of consecutive audio tokens, the first being audio token number `start`."""
        return [self.to_code(t, start + i) for i, t in enumerate(token_ids)]

    def frames(self, codes: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """SNAC's three codebook arrays (int64; lengths n, 2n, 4n) for the complete frames of
        `codes` (a trailing partial frame is left out: it cannot be decoded yet). The codes
        are the k-th audio tokens' codes for k = 0, 1, ... so the first starts a frame."""
        n = len(codes) // CODES_PER_FRAME
        arr = np.asarray(codes[: n * CODES_PER_FRAME], dtype=np.int64).reshape(n, CODES_PER_FRAME)
        if arr.size and (arr.min() < 0 or arr.max() >= self.codebook_size):
            raise ValueError(f"codes outside [0, {self.codebook_size})")
        c0, c1, c2 = (np.ascontiguousarray(arr[:, list(slots)]).reshape(-1) for slots in FRAME_LAYOUT)
        return c0, c1, c2

    def prompt_ids(self, text_ids: Sequence[int]) -> list[int]:
        """Orpheus' prompt around the tokenized text (which carries the tokenizer's
        <|begin_of_text|>, and for a multi-voice model the "voice: " prefix): start_of_human,
        the text, end_of_text, end_of_human, start_of_ai, start_of_speech; the model then
        writes audio tokens and ends with end_of_speech."""
        return [self.start_of_human, *text_ids, self.end_of_text, self.end_of_human,
                self.start_of_ai, self.start_of_speech]
