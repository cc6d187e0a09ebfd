"""A byte-level BPE tokenizer from `vocab.json` + `merges.txt` and the added tokens of
`tokenizer_config.json`, for checkpoints that ship no tokenizer.json (Qwen3-TTS' repos).

It is what transformers' `Qwen2TokenizerFast` builds from the same files
(`convert_slow_tokenizer.Qwen2Converter`): NFC, Qwen2's split regex (isolated), byte-level
without its own regex, BPE with the merges, a byte-level decoder; each entry of
`added_tokens_decoder` an added token (special or not, as the file says).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from shared.gguf_tokenizer import _QWEN2_PATTERN


def has_bpe_files(path: Path) -> bool:
    return (path / "vocab.json").is_file() and (path / "merges.txt").is_file()


def tokenizer_from_bpe_files(path: Path) -> Tokenizer:
    """The folder's vocab.json + merges.txt (+ tokenizer_config.json's added tokens) as a
    `tokenizers.Tokenizer`."""
    vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
    merges = []
    for line in (path / "merges.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith("#version") or not line.strip():
            continue
        a, b = line.split(" ")
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab, merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    added = sorted(((int(i), t) for i, t in (cfg.get("added_tokens_decoder") or {}).items()), key=lambda x: x[0])
    for i, t in added:
        token = AddedToken(t["content"], single_word=t.get("single_word", False), lstrip=t.get("lstrip", False),
                           rstrip=t.get("rstrip", False), normalized=t.get("normalized", not t.get("special")),
                           special=bool(t.get("special", False)))
        if token.special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
        if tok.token_to_id(t["content"]) != i:
            raise ValueError(f"{path}: added token {t['content']!r} is id {i} in tokenizer_config.json but "
                             f"{tok.token_to_id(t['content'])} after vocab.json's {len(vocab)} entries")
    return tok
