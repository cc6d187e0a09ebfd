"""The benchmark checkpoint: a small Qwen2-shaped model with random weights, made with
transformers (`save_pretrained`) and a synthetic byte-level BPE tokenizer, into a cache
folder (`$MSTAR_BENCH_CACHE`, default ~/.cache/mstar-bench). Nothing is downloaded.

Default shape: 8 layers, hidden 512, 8 heads / 2 KV heads (head_dim 64), intermediate
1408, vocab 32000, tied embeddings: 22.5M parameters in the layers, 38.9M in all.

`python -m bench.checkpoints [--vocab N] [--out DIR]` makes it and prints its folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import string
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)


def cache_dir() -> Path:
    return Path(os.environ.get("MSTAR_BENCH_CACHE") or Path.home() / ".cache" / "mstar-bench")


def _byte_chars() -> list[str]:
    """GPT-2's byte -> character map, in byte order (what ByteLevel emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def synthetic_tokenizer(path: Path, vocab_size: int = 32000) -> None:
    """A byte-level BPE of exactly `vocab_size` ids: the 3 specials (ids 0-2), the 256 bytes,
    then synthetic merges (all pairs of 64 common characters, then triples) up to the size,
    so every id decodes to text. Written as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_chars()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in chars:
        vocab[ch] = len(vocab)
    common = [chars[ord(c)] for c in string.ascii_letters + string.digits] + [chars[ord(" ")], chars[ord(".")]]
    merges: list[tuple[str, str]] = []
    pairs = [(a, b) for a in common for b in common]
    triples = ((a + b, c) for a, b in pairs for c in common)
    for a, b in [*pairs, *triples]:
        if len(vocab) >= vocab_size:
            break
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    if len(vocab) < vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is more than this synthetic scheme makes ({len(vocab)})")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 1024,
    }))


def make_bench_checkpoint(path: Path, *, vocab_size: int = 32000, seed: int = 0,
                          max_position_embeddings: int = 1024) -> Path:
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    synthetic_tokenizer(path, vocab_size)
    cfg = transformers.Qwen2Config(
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True, use_sliding_window=False, eos_token_id=SPECIALS.index("<|im_end|>"),
        bos_token_id=None, pad_token_id=0, **SHAPE,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random q/k/v biases (HF inits them to zero)
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, cfg.initializer_range)
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg.eos_token_id, "pad_token_id": 0}))
    return path


def ensure_bench_checkpoint(vocab_size: int = 32000, root: Path | None = None, context: int = 1024) -> Path:
    """The cached checkpoint folder, made on first use (atomically: built aside, renamed);
    `context`: its max_position_embeddings (the long-prompt benches want 8,192)."""
    root = root or cache_dir()
    path = root / (f"qwen2-8x512-v{vocab_size}" + ("" if context == 1024 else f"-ctx{context}"))
    if (path / "model.safetensors").exists() and (path / "tokenizer.json").exists():
        return path
    tmp = root / f".{path.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    make_bench_checkpoint(tmp, vocab_size=vocab_size, max_position_embeddings=context)
    try:
        tmp.rename(path)
    except OSError:  # made meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def count_parameters(path: Path) -> dict:
    from safetensors import safe_open

    total = layers = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            n = 1
            for d in f.get_slice(k).get_shape():
                n *= d
            total += n
            layers += n if ".layers." in k else 0
    return {"total": total, "layers": layers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoints", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--out", type=Path, default=None, help=f"cache root (default {cache_dir()})")
    args = p.parse_args(argv)
    path = ensure_bench_checkpoint(args.vocab, args.out)
    print(path, count_parameters(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
