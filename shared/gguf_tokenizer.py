"""A GGUF file's tokenizer rebuilt as a ``tokenizers.Tokenizer`` (and its special-token facts).

GGUF records a tokenizer as llama.cpp uses it: the vocabulary, merges or scores, token
types, a pre-tokenizer *name* and the BOS/EOS settings. This module turns that back into
a ``tokenizers.Tokenizer`` that gives the ids llama.cpp (``src/llama-vocab.cpp``) gives,
which are those of the model's own Hugging Face tokenizer, so the rest of the engine needs
no GGUF special cases. Two kinds of ``tokenizer.ggml.model``:

- ``gpt2``: byte-level BPE with the file's merges, split first by the regexes llama.cpp
  runs for the file's ``tokenizer.ggml.pre`` (`PRE_TOKENIZERS`; an absent key is
  llama.cpp's ``default``), each the regex of the model's HF ``tokenizer.json``.
- ``llama``: SentencePiece (Llama 2, Mistral 7B, TinyLlama, Gemma, Phi-3). llama.cpp
  merges adjacent pieces highest score first; that is a BPE whose merges are every pair of
  pieces that makes a piece, ranked by that piece's score, with ``<0xNN>`` byte fallback.
  Spaces become U+2581, and a space is put before the text (and after every special or
  user-defined token) when ``tokenizer.ggml.add_space_prefix`` says so (its default).

Anything else is refused by name (`UnsupportedGGUFTokenizer`) rather than guessed at: a
wrong pre-tokenizer silently changes token ids, which is worse than failing.

Split out of ``shared.gguf_source`` (config, weights and the summary cache stay there;
that module re-exports `load_gguf_tokenizer`, `GGUFTokenizerInfo` and
`SUPPORTED_PRE_TOKENIZERS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # the reader is the caller's (shared.gguf_source): importing gguf costs numpy (~0.2 s)
    import gguf

__all__ = [
    "PRE_TOKENIZERS",
    "SUPPORTED_PRE_TOKENIZERS",
    "SUPPORTED_TOKENIZER_MODELS",
    "TOKENIZER_VERSION",
    "GGUFTokenizerInfo",
    "UnsupportedGGUFTokenizer",
    "check_gguf_tokenizer",
    "load_gguf_tokenizer",
]

#: bumped whenever the tokenizer built for a GGUF file changes: part of the key of
#: gguf_source's summary cache, which holds the built tokenizer's JSON
TOKENIZER_VERSION = 3

# llama.cpp token types (llama_token_type in llama.h).
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_TOKEN_TYPE_BYTE = 6

_SPACE = "\u2581"  # SentencePiece's visible space


class UnsupportedGGUFTokenizer(ValueError, NotImplementedError):
    """The file's tokenizer model or pre-tokenizer is not one this module rebuilds. A
    ValueError (what the services' startup refuses by name) and a NotImplementedError (what
    gguf_source's summary treats as a refused file)."""


@dataclass(frozen=True)
class _Pre:
    """How llama.cpp pre-tokenizes a byte-level BPE vocabulary of one ``tokenizer.ggml.pre``."""

    #: the regexes, each splitting every piece the one before left (llama.cpp's
    #: unicode_regex_split; HF's Sequence of Split(..., "isolated")); () for GPT-2's own
    splits: tuple[str, ...]
    #: llama.cpp's ignore_merges: a piece that is a whole vocab entry is that token
    ignore_merges: bool = False
    #: llama.cpp's add_bos default where the file has no tokenizer.ggml.add_bos_token
    add_bos: bool = False
    #: GPT-2's ByteLevel(use_regex=True) split, after the `splits`
    gpt2_regex: bool = False


# The split regexes of the models' HF tokenizer.json files, in HF's (Oniguruma's) spelling.
# llama.cpp's src/llama-vocab.cpp runs the same ones, some respelled for its regex engine
# (no (?i:...): (?:'[sS]|'[tT]|...); no \p{Lu} classes: lookaheads); tests check the two
# spellings split alike.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_PATTERN = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
#: Qwen3.5's: Qwen2's with combining marks (\p{M}) kept inside words (llama.cpp's
#: LLAMA_VOCAB_PRE_TYPE_QWEN35)
_QWEN35_PATTERN = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED_CODER_PATTERN = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_PATTERN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_PATTERN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's regex as llama.cpp writes it (no final |\s+: what no alternative takes stays a
# piece of its own either way)
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# DeepSeek LLM / Coder: letters of the scripts with case, CJK runs and digit runs apart.
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"
)
_DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    _DEEPSEEK_LLM_LETTERS,
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    _CJK,
    "\\p{N}+",
)
_DEEPSEEK_CODER_SPLITS = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK, "\\p{N}")
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: an absent key, "default"
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_PATTERN, r"\p{N}+", r"[0-9][0-9][0-9]")

_DEFAULT = _Pre(_DEFAULT_SPLITS)
_GPT2 = _Pre((), gpt2_regex=True)
_STARCODER = _Pre((r"\p{N}",), gpt2_regex=True)
_LLAMA3 = _Pre((_LLAMA3_PATTERN,), ignore_merges=True, add_bos=True)
_QWEN2 = _Pre((_QWEN2_PATTERN,))

#: tokenizer.ggml.pre -> how llama.cpp splits text for it: every name llama.cpp's
#: converter writes for the families mstar serves (llama, mistral, qwen2, qwen3, qwen35; Gemma and
#: Phi-3 are SentencePiece, which has no pre-tokenizer), grouped as llama.cpp's
#: llama_vocab::impl::load groups them
PRE_TOKENIZERS: dict[str, _Pre] = {
    "default": _DEFAULT,
    # LLAMA_VOCAB_PRE_TYPE_GPT2 ("gpt2": what mstar wrote before llama.cpp's name)
    "gpt-2": _GPT2, "gpt2": _GPT2, "phi-2": _GPT2, "mellum": _GPT2, "a.x-4.0": _GPT2, "trillion": _GPT2,
    # LLAMA_VOCAB_PRE_TYPE_SMOLLM / STARCODER / MINERVA: digits one by one, then GPT-2's
    "smollm": _STARCODER, "starcoder": _STARCODER, "minerva-7b": _STARCODER,
    # LLAMA_VOCAB_PRE_TYPE_LLAMA3: Llama 3.x, DeepSeek-R1-Distill-Llama, Falcon 3, Pixtral
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "midm-2.0": _LLAMA3,
    # LLAMA_VOCAB_PRE_TYPE_SMAUG: Llama 3's regex, but merges always and no BOS by default
    "smaug-bpe": _Pre((_LLAMA3_PATTERN,)),
    # LLAMA_VOCAB_PRE_TYPE_QWEN2: Qwen2 / 2.5 / 3 (whose tokenizer.json NFC-normalizes), R1 distills
    # (no NFC step: the model's tokenizer.json has one, llama.cpp does not, nor does
    # transformers reading the GGUF file; they differ only on text that is not NFC already,
    # where llama-server's /tokenize is what a GGUF user gets)
    "qwen2": _Pre((_QWEN2_PATTERN,)), "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
    "kormo": _QWEN2, "f2llmv2": _QWEN2,
    # LLAMA_VOCAB_PRE_TYPE_QWEN35: Qwen3.5 (its tokenizer.json NFC-normalizes too; as above)
    "qwen35": _Pre((_QWEN35_PATTERN,)),
    # LLAMA_VOCAB_PRE_TYPE_TEKKEN: Mistral Nemo, Mistral Small 3.x, Ministral
    "tekken": _Pre((_TEKKEN_PATTERN,), ignore_merges=True, add_bos=True),
    # LLAMA_VOCAB_PRE_TYPE_GPT4O: Phi-4, Llama 4's text
    "gpt-4o": _Pre((_GPT4O_PATTERN,)), "llama4": _Pre((_GPT4O_PATTERN,)),
    # DeepSeek LLM / Coder (llama architecture)
    "deepseek-llm": _Pre(_DEEPSEEK_LLM_SPLITS), "deepseek-coder": _Pre(_DEEPSEEK_CODER_SPLITS),
    # LLAMA_VOCAB_PRE_TYPE_SEED_CODER (llama architecture)
    "seed-coder": _Pre((_SEED_CODER_PATTERN,)),
}
#: the accepted tokenizer.ggml.pre values (an absent key is llama.cpp's "default")
SUPPORTED_PRE_TOKENIZERS = tuple(PRE_TOKENIZERS)
#: the accepted tokenizer.ggml.model values: byte-level BPE and SentencePiece
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")


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


def _check(model: Any, pre: Any) -> None:
    """Refuse, in one line naming the value and the supported ones, a tokenizer model or
    (for byte-level BPE) pre-tokenizer this module does not rebuild. SentencePiece has no
    pre-tokenizer: llama.cpp ignores the key there, and so do we."""
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise UnsupportedGGUFTokenizer(
            f"unsupported tokenizer.ggml.model {model!r}; supported: gpt2 (byte-level BPE), llama (SentencePiece)"
        )
    if model == "gpt2" and pre is not None and pre not in PRE_TOKENIZERS:
        raise UnsupportedGGUFTokenizer(
            f"unsupported tokenizer.ggml.pre {pre!r}; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
        )


def check_gguf_tokenizer(reader: gguf.GGUFReader) -> None:
    """Raise `UnsupportedGGUFTokenizer` where the file's tokenizer would be refused (the
    cached form by path is `shared.gguf_source.check_gguf_tokenizer`)."""
    _check(_field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre"))


def load_gguf_tokenizer(reader: gguf.GGUFReader) -> GGUFTokenizerInfo:
    """Build the tokenizer llama.cpp runs for this GGUF file, as a ``tokenizers.Tokenizer``
    (the cached form by path is `shared.gguf_source.load_gguf_tokenizer`).

    CONTROL and USER_DEFINED tokens (and UNKNOWN ones of SentencePiece) are registered
    as added tokens so that chat markers such as ``<|im_start|>`` are matched whole in the
    raw text, never split, as llama.cpp's special-token partition does. Byte-level BPE has
    no unk token, as in HF: SmolLM2's vocab lacks a few byte symbols (0x04, 0x06, 0x13,
    0x14, 0x16, 0x1D, and UTF-8 lead bytes 0xF1/0xF2, i.e. the unassigned planes
    U+40000-U+BFFFF), and those bytes are dropped.
    """
    model = _field(reader, "tokenizer.ggml.model")
    pre_name = _field(reader, "tokenizer.ggml.pre")
    _check(model, pre_name)
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    if model == "llama":
        tokenizer = _spm_tokenizer(reader, tokens)
        # llama.cpp's SentencePiece defaults: <unk> 0, <s> 1, </s> 2; BOS added, EOS not
        defaults = {"bos": 1, "eos": 2}
        add_bos_default = True
    else:
        pre = PRE_TOKENIZERS[pre_name if pre_name is not None else "default"]
        tokenizer = _bpe_tokenizer(reader, tokens, pre)
        defaults = {}
        add_bos_default = pre.add_bos

    def token_id(name: str) -> int | None:
        value = _field(reader, f"tokenizer.ggml.{name}_token_id", defaults.get(name))
        return None if value is None or not 0 <= int(value) < len(tokens) else int(value)

    bos_id, eos_id, pad_id = token_id("bos"), token_id("eos"), token_id("padding")
    if eos_id is None:
        raise ValueError("GGUF has no tokenizer.ggml.eos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", add_bos_default)) and bos_id is not None
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    post_processor = _post_processor(
        None if not add_bos or bos_id is None else (tokens[bos_id], bos_id),
        (tokens[eos_id], eos_id) if add_eos else None,
        byte_level=model == "gpt2",
    )
    if post_processor is not None:
        tokenizer.post_processor = post_processor
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


def _pre_tokenizer(pre: _Pre) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's regexes in sequence, then the bytes spelled as GPT-2's alphabet."""
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in pre.splits
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.gpt2_regex))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _bpe_tokenizer(reader: gguf.GGUFReader, tokens: list[str], pre: _Pre) -> Tokenizer:
    """The byte-level BPE model, normalizer, pre-tokenizer, decoder and added tokens of the
    GGUF's tokenizer: everything but the post-processor (which depends on the BOS/EOS
    settings read after it)."""
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                   ignore_merges=pre.ignore_merges)
    )
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    _add_tokens(tokenizer, reader, tokens, (_TOKEN_TYPE_CONTROL,))
    return tokenizer


def _add_tokens(tokenizer: Tokenizer, reader: gguf.GGUFReader, tokens: list[str], special: tuple[int, ...]) -> None:
    """The USER_DEFINED tokens and those of the `special` types as added tokens, matched in
    the raw text (normalized=False) before anything else, as llama.cpp's partition does.
    Added in id order so each keeps its existing vocab id."""
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type", [])
    added = [
        AddedToken(tokens[i], special=t in special, normalized=False)
        for i, t in enumerate(token_types)
        if t in special or t == _TOKEN_TYPE_USER_DEFINED
    ]
    tokenizer.add_tokens(added)
    if len(tokenizer.get_vocab(with_added_tokens=True)) != len(tokens):
        raise ValueError("GGUF added tokens did not map onto existing vocab ids")


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """llama.cpp's SentencePiece tokenizer as BPE merges.

    llama.cpp (as SentencePiece's own BPE) repeatedly joins the adjacent pair whose joined
    text is a vocab piece of the highest score, the leftmost on a tie. That is a BPE whose
    merges are every (left, right) pair of pieces that joins into a piece, ranked by the
    joined piece's score (best first; equal scores by id, where llama.cpp would take the
    leftmost pair: real vocabularies give their mergeable pieces distinct scores).
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked = []
    for i, tok in enumerate(tokens):
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_tokenizer(reader: gguf.GGUFReader, tokens: list[str]) -> Tokenizer:
    """A SentencePiece GGUF vocabulary (``tokenizer.ggml.model = "llama"``) as llama.cpp
    tokenizes it: see `_spm_merges`; a character no piece holds becomes its UTF-8 bytes'
    ``<0xNN>`` pieces (the unknown piece where those are missing); spaces are U+2581, with
    one put before each stretch of text between added tokens where
    ``tokenizer.ggml.add_space_prefix`` is on (llama.cpp's default; Gemma's files set it
    off). No pre-tokenizer: llama.cpp merges the whole stretch at once."""
    scores = [float(s) for s in _field(reader, "tokenizer.ggml.scores", [0.0] * len(tokens))]
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id", 0)
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores), unk_token=unk, fuse_unk=True,
                   byte_fallback="<0x00>" in vocab)
    )
    add_space_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", _SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if add_space_prefix else replace
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    _add_tokens(tokenizer, reader, tokens, (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNKNOWN))
    return tokenizer


def _post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None, *,
                    byte_level: bool) -> processors.PostProcessor | None:
    """BOS before and EOS after each sequence where given (add_special_tokens only), after
    byte-level offsets for a byte-level vocabulary."""
    steps: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    if bos is not None or eos is not None:
        first = f"{bos[0]}:0 " if bos else ""
        last = f" {eos[0]}:0" if eos else ""
        special = [t for t in (bos, eos) if t is not None]
        steps.append(processors.TemplateProcessing(
            single=f"{first}$A:0{last}",
            pair=f"{first}$A:0{last} {first.replace(':0', ':1')}$B:1{last.replace(':0', ':1')}",
            special_tokens=list(dict(special).items()),
        ))
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else processors.Sequence(steps)
