"""GGUF files written from the small random HF checkpoints of `tests.checkpoints`, the way
llama.cpp's `convert_hf_to_gguf.py --outtype f32` writes them (gguf-py's `GGUFWriter`,
`TensorNameMap` and `SpecialVocab`; q/k rows permuted for the `llama` architecture only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# Meta's Llama 3 tokenizer.json split regex, verbatim (spelled here, not imported from the
# code under test, so a typo there shows up as different token ids).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (q with n_head, k with n_kv_head): each head's two
    rotary halves interleaved, for its GPT-J-style RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_theta(cfg: dict) -> float:
    # transformers 5 writes rope_parameters; classic configs a top-level rope_theta.
    return float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    return None if kind in (None, "default") else scaling


def write_gguf(hf_ckpt_dir: Path, out_path: Path, arch: str, pre: str, *,
               rope_scaling: dict[str, Any] | None = None, rope_freqs: bool = False,
               general_architecture: str | None = None, qtypes: dict[str, str] | None = None) -> Path:
    """Write `hf_ckpt_dir` (a `make_checkpoint` folder) as an all-F32 GGUF of `arch`
    (llama | qwen2 | qwen3) whose `tokenizer.ggml.pre` is `pre`.

    `rope_scaling` (HF form, e.g. {"rope_type": "yarn", "factor": 4.0,
    "original_max_position_embeddings": 128}) overrides the checkpoint's; `rope_freqs` adds
    the `rope_freqs.weight` tensor llama.cpp writes for Llama 3.1-style scaling;
    `general_architecture` overrides the architecture name written (to test refusals).
    `qtypes`: GGUF tensor-name suffix (e.g. "ffn_down.weight", "token_embd.weight") -> the
    type those matrices are written in (one the `gguf` package quantizes: Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0); every other tensor stays F32.
    """
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    hf_ckpt_dir, out_path = Path(hf_ckpt_dir), Path(out_path)
    cfg = json.loads((hf_ckpt_dir / "config.json").read_text())
    model_arch = _ARCHS[arch]
    n_layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    n_head = cfg["num_attention_heads"]
    n_kv_head = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or hidden // n_head

    writer = gguf.GGUFWriter(str(out_path), general_architecture or gguf.MODEL_ARCH_NAMES[model_arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(hf_ckpt_dir.name)
    # TextModel.set_gguf_parameters
    writer.add_block_count(n_layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv_head)
    writer.add_rope_freq_base(_rope_theta(cfg))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if cfg.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    scaling = rope_scaling if rope_scaling is not None else _rope_scaling(cfg)
    if scaling:
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(scaling["factor"])
        elif kind == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(scaling["factor"])
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        else:
            raise ValueError(f"rope scaling {kind!r} is not written by this helper")

    # TextModel._set_vocab_gpt2 / get_vocab_base, from tokenizer.json
    tok = Tokenizer.from_file(str(hf_ckpt_dir / "tokenizer.json"))
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(cfg["vocab_size"]):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(hf_ckpt_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)

    # ModelBase.prepare_tensors / LlamaModel.modify_tensors
    tmap = gguf.get_tensor_name_map(model_arch, n_layers)
    state = {}
    for f in sorted(hf_ckpt_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    for name, w in state.items():
        w = np.ascontiguousarray(w, dtype=np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _permute(w, n_head)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _permute(w, n_kv_head)
        new_name = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise KeyError(f"no GGUF name for {name!r}")
        qtype = next((t for suffix, t in (qtypes or {}).items() if new_name.endswith(suffix)), None)
        if qtype is not None and w.ndim == 2:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(new_name, gguf.quants.quantize(w, kind), raw_dtype=kind)
            continue
        writer.add_tensor(new_name, np.ascontiguousarray(w))
    if rope_freqs:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                          np.ones(head_dim // 2, dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def llama3_tokenizer_variant(ckpt_dir: Path, bos_token: str = "<|im_start|>") -> Path:
    """Rewrite `ckpt_dir`'s tokenizer the way Meta's Llama 3 tokenizer.json is built:
    Split(Llama 3 regex, isolated) + ByteLevel(use_regex=False), `ignore_merges`, and a BOS
    prepended by a TemplateProcessing post-processor (`bos_token` also set in
    tokenizer_config.json and config.json). Same vocab and merges; HF's tokenizer from the
    rewritten tokenizer.json is the reference for pre "llama-bpe". The BOS is not the pad
    token (id 0): `hf_greedy` passes pad_token_id=0 and transformers would mask it out."""
    ckpt_dir = Path(ckpt_dir)
    tok_path = ckpt_dir / "tokenizer.json"
    tj = json.loads(tok_path.read_text())
    bos_id = next(t["id"] for t in tj["added_tokens"] if t["content"] == bos_token)
    tj["normalizer"] = None
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ]}
    tj["model"]["ignore_merges"] = True
    tj["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": bos_token, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {bos_token: {"id": bos_token, "ids": [bos_id], "tokens": [bos_token]}}},
    ]}
    tok_path.write_text(json.dumps(tj, ensure_ascii=False))
    for name, key, value in (("tokenizer_config.json", "bos_token", bos_token),
                             ("config.json", "bos_token_id", bos_id)):
        path = ckpt_dir / name
        data = json.loads(path.read_text())
        data[key] = value
        path.write_text(json.dumps(data))
    return ckpt_dir
