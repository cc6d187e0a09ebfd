"""The null model (`--model null`): no compute, deterministic tokens, real layouts and pages.

It measures what serving costs around the model: every service, frame, layout, page and
step runs as for a real decoder LM (it *is* a `DecoderLMSpec`: one pool "kv", one keyed
label "text", the same `process_prompt` and `get_loop_caps`), but the torch module
(`services.gpu_worker.modeling.decoder.null_lm.NullLM`) only writes zero K/V rows into a tiny pool
(1 layer, 1 KV head, head_dim 8) and returns logits whose argmax is the next printable
ASCII byte after the last input id, so greedy output is known in advance and never EOS.

Its config and its byte-level tokenizer are built here in code. The only thing on disk is
an empty safetensors file in a per-user temporary folder, because the gpu worker's
`build_model` loads `*.safetensors` from the source's folder for every non-GGUF model.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from shared.specs.decoder_lm import DecoderLMSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

NULL_MODEL = "null"
NULL_ARCHITECTURE = "NullLM"
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
BYTE_TOKENS = 256
VOCAB_SIZE = BYTE_TOKENS + len(SPECIALS)  # ids 0..255 are the bytes, then the specials
EOS_ID = BYTE_TOKENS + SPECIALS.index(EOS_TOKEN)
FIRST_PRINTABLE, NUM_PRINTABLE = 0x20, 0x7F - 0x20  # the outputs cycle through ' '..'~'
#: KV bytes per row of a small real model (8 layers x 2 KV heads x head_dim 64, float32):
#: the null model sizes its default pool from memory as such a model would, not by its
#: own 32 bytes per row (which would make millions of pages).
NOMINAL_ROW_BYTES = 8 * 2 * 2 * 64 * 4
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def next_token(token_id: int) -> int:
    """The null model's greedy successor of `token_id` (the next printable ASCII byte)."""
    return FIRST_PRINTABLE + (token_id - FIRST_PRINTABLE + 1) % NUM_PRINTABLE


def null_config() -> dict:
    return {
        "architectures": [NULL_ARCHITECTURE],
        "model_type": "llama",  # the spec is a decoder LM spec: its math family
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "max_position_embeddings": 4096,
        "eos_token_id": EOS_ID,
        "bos_token_id": None,
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def null_tokenizer() -> Tokenizer:
    """Byte-level: token id b is byte b (no merges), then the three specials. (With
    CHAT_TEMPLATE, EOS_ID and EOS_TOKEN, `ModelSource("null")` makes its bundle of it.)"""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def null_weights_dir() -> Path:
    """A per-user folder holding one empty safetensors file (the null model has no weights)."""
    path = Path(tempfile.gettempdir()) / f"mstar-null-model-{os.getuid()}"
    weights = path / "model.safetensors"
    if not weights.exists():
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".model.safetensors.{os.getpid()}"
        # The safetensors format of an empty state dict: header length 8, header "{}" padded.
        tmp.write_bytes((8).to_bytes(8, "little") + b"{}      ")
        os.replace(tmp, weights)
    return path


class NullLMSpec(DecoderLMSpec):
    int8_kv = False  # its rows are stand-ins written through torch: nothing to quantize

    def parameter_counts(self) -> tuple[int, int] | None:
        """None: a stand-in model with no weights."""
        return None

    def bytes_per_page(self, page_size: int) -> int:
        return max(super().bytes_per_page(page_size), NOMINAL_ROW_BYTES * page_size)

