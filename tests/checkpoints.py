"""Small random-weight checkpoints made with transformers, and a byte-level BPE tokenizer
trained here with `tokenizers`: the exact-token reference for parity tests (no download)."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Serving engines batch requests and page their KV cache.",
    "def add(a, b):\n    return a + b\n",
    "Numbers like 12345 and 3.14159 appear in text; so do emoji 🎉 and 中文字符.",
    "Hello world! Hello again, world. Goodbye, world.",
] * 20

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def make_tokenizer(path: Path, vocab_size: int = 512, family: str = "llama") -> None:
    """Byte-level BPE trained on CORPUS. Qwen2's pipeline (NFC + its split regex) for qwen
    families, because transformers' Qwen2Tokenizer imposes it whatever tokenizer.json says."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if family.startswith("qwen"):
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
    }))


def make_checkpoint(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random checkpoint of `family` (llama | qwen2 | qwen3) with its tokenizer."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path, family=family)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    eos = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id("<|im_end|>")
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=eos, bos_token_id=None, pad_token_id=0,
                  initializer_range=0.2)
    common.update(overrides)
    if family == "llama":
        cfg = transformers.LlamaConfig(tie_word_embeddings=True, **common)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=False, **common)
        cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(tie_word_embeddings=False, head_dim=32, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # random biases (HF inits them to zero), so the bias path is exercised
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def with_architecture(src: Path, dst: Path, architecture: str) -> Path:
    """A copy of checkpoint `src` that names another (plugin) architecture."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = [architecture]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
