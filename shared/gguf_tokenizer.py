"""A GGUF file's tokenizer rebuilt as a ``tokenizers.Tokenizer`` (and its special-token facts).

GGUF records a tokenizer as llama.cpp uses it: the vocabulary, merges or scores, token
types, a pre-tokenizer *name* and the BOS/EOS settings. This module turns that back
into the tokenizer HF's ``tokenizer.json`` of the same model would be, so the rest of the
engine needs no GGUF special cases.

Supported: byte-level BPE (``tokenizer.ggml.model = "gpt2"``) with the pre-tokenizers
``gpt2``, ``smollm``, ``llama-bpe`` and ``qwen2``. Anything else is refused by name
rather than guessed at.

Split out of ``shared.gguf_source`` (config, weights and the summary cache stay there;
that module re-exports `load_gguf_tokenizer`, `GGUFTokenizerInfo` and
`SUPPORTED_PRE_TOKENIZERS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

__all__ = [
    "SUPPORTED_PRE_TOKENIZERS",
    "TOKENIZER_VERSION",
    "GGUFTokenizerInfo",
    "load_gguf_tokenizer",
]

#: bumped whenever the tokenizer built for a GGUF file changes: part of the key of
#: gguf_source's summary cache, which holds the built tokenizer's JSON
TOKENIZER_VERSION = 1

# llama.cpp token types (llama_token_type in llama.h).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


# Split regexes of HF's tokenizer.json files, verbatim. llama.cpp's
# src/llama-vocab.cpp spells the contraction group (?:'[sS]|'[tT]|...) because
# its regex engine has no (?i:); HF's tokenizers (Oniguruma) runs the original.
# Llama 3 (llama.cpp pre "llama-bpe"): digits in runs of up to three.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 / Qwen2.5 / Qwen3 (pre "qwen2"): one digit at a time.
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE_TOKENIZERS = ("gpt2", "smollm", "llama-bpe", "qwen2")
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3 names we accept: whole-word vocab hits
# skip the merges (HF's ignore_merges), and BOS is added unless the file says not.
_LLAMA3_PRES = ("llama-bpe",)


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    """Tokenizer plus the special-token facts the chat/stop logic needs.

    Kept next to the tokenizer because a bare ``tokenizers.Tokenizer`` has no
    notion of BOS/EOS or a chat template, and GGUF stores them separately.
    """

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    bos_token: str | None
    eos_token_id: int
    eos_token: str
    pad_token_id: int | None
    add_bos_token: bool


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _split_byte_level(pattern: str) -> pre_tokenizers.PreTokenizer:
    """HF's own spelling of a regex-split byte-level BPE (Llama 3, Qwen2 tokenizer.json)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _pre_tokenizer(
    pre: str,
) -> tuple[normalizers.Normalizer | None, pre_tokenizers.PreTokenizer]:
    """Rebuild HF's normalizer and pre-tokenizer, which GGUF only records by name.

    Only names whose HF pre-tokenizer we know are accepted: a wrong
    pre-tokenizer silently changes token ids, which is worse than failing.
    """
    if pre == "smollm":
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        return None, pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre == "gpt2":
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "llama-bpe":
        return None, _split_byte_level(_LLAMA3_PATTERN)
    if pre == "qwen2":
        # Qwen2's tokenizer.json (and transformers' Qwen2Tokenizer) NFC-normalize first.
        return normalizers.NFC(), _split_byte_level(_QWEN2_PATTERN)
    raise NotImplementedError(
        f"unsupported tokenizer.ggml.pre {pre!r}; supported: "
        f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}"
    )


def load_gguf_tokenizer(path: str | Path | gguf.GGUFReader) -> GGUFTokenizerInfo:
    """Build an HF-equivalent byte-level BPE tokenizer from GGUF metadata.

    CONTROL and USER_DEFINED tokens are registered as added tokens so that
    chat markers such as ``<|im_start|>`` are matched whole, never BPE-split.
    No unk token, as in HF: SmolLM2's vocab lacks a few byte symbols (0x04,
    0x06, 0x13, 0x14, 0x16, 0x1D, and UTF-8 lead bytes 0xF1/0xF2, i.e. the
    unassigned planes U+40000-U+BFFFF), and those bytes are dropped.
    """
    from shared.gguf_source import _open, gguf_summary  # not at the top: gguf_source imports this module

    summary = gguf_summary(path)
    if summary is not None:
        tok = summary["tokenizer"]
        return GGUFTokenizerInfo(tokenizer=Tokenizer.from_str(tok["json"]),
                                 **{k: v for k, v in tok.items() if k != "json"})
    reader = _open(path)
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise NotImplementedError(
            f"only byte-level BPE ('gpt2') GGUF tokenizers, got {model!r}"
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    pre = _field(reader, "tokenizer.ggml.pre", "gpt2")
    tokenizer = _bpe_tokenizer(reader, tokens, pre)

    def token_id(name: str) -> int | None:
        value = _field(reader, f"tokenizer.ggml.{name}_token_id")
        return None if value is None else int(value)

    bos_id, eos_id, pad_id = token_id("bos"), token_id("eos"), token_id("padding")
    if eos_id is None:
        raise ValueError("GGUF has no tokenizer.ggml.eos_token_id")
    # llama.cpp's default when the key is absent: on for the Llama 3 pre-tokenizers.
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", pre in _LLAMA3_PRES))
    add_bos = add_bos and bos_id is not None
    tokenizer.post_processor = _post_processor(tokens[bos_id] if add_bos and bos_id is not None else None, bos_id)
    return GGUFTokenizerInfo(
        tokenizer=tokenizer,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token_id=bos_id,
        bos_token=None if bos_id is None else tokens[bos_id],
        eos_token_id=eos_id,
        eos_token=tokens[eos_id],
        pad_token_id=pad_id,
        add_bos_token=add_bos,
    )


def _bpe_tokenizer(reader: gguf.GGUFReader, tokens: list[str], pre: str) -> Tokenizer:
    """The BPE model, normalizer, pre-tokenizer, decoder and added tokens of the GGUF's
    tokenizer: everything but the post-processor.

    Apart from `load_gguf_tokenizer` because this part is fixed by the vocabulary and
    `pre` alone, while the post-processor depends on the BOS settings read after it.
    """
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type", [])
    merges = [
        tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])
    ]

    normalizer, pre_tokenizer = _pre_tokenizer(pre)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre in _LLAMA3_PRES,
        )
    )
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()

    # Added in id order so each keeps its existing vocab id.
    added = [
        AddedToken(tokens[i], special=t == _TOKEN_TYPE_CONTROL, normalized=False)
        for i, t in enumerate(token_types)
        if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    if len(tokenizer.get_vocab(with_added_tokens=True)) != len(tokens):
        raise ValueError("GGUF added tokens did not map onto existing vocab ids")
    return tokenizer


def _post_processor(bos: str | None, bos_id: int | None) -> processors.PostProcessor:
    """Byte-level offsets, and with `bos` (None: no BOS is added) a template that puts
    it before each sequence.

    Apart from `load_gguf_tokenizer` because whether BOS is added comes from llama.cpp's
    add_bos_token rule, and this is where that choice becomes HF's post-processor.
    """
    byte_level = processors.ByteLevel(trim_offsets=False)
    if bos is None:
        return byte_level
    # As HF's Llama 3 tokenizer.json: BOS before each sequence (add_special_tokens only).
    return processors.Sequence(
        [
            byte_level,
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, bos_id)],
            ),
        ]
    )
