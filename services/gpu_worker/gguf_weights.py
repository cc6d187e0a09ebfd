"""Reading a GGUF file's weights into the tensors a Hugging Face checkpoint of the same model
holds (the gpu worker's job; `shared.gguf_source` reads the config, the tokenizer and the
tensor table every service needs): llama.cpp's names mapped back, the llama q/k row
permutation undone, Gemma's stored (1 + w) norms taken back to w, Qwen3.5's tensors in
transformers' form again (`services.gpu_worker.gguf_qwen35`), and the matrices of the types
the C kernel computes on kept as their raw blocks (`QuantTensor`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm

from services.gpu_worker.gguf_qwen35 import Qwen35Tensors
from shared.gguf_source import GEMMA_ARCHS, HYBRID_ARCHS, config_and_tensors, gguf_arch

# GGUF per-layer tensor name -> HF parameter name (after "model.layers.N.").
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
    "attn_q_norm": "self_attn.q_norm",  # qwen3, gemma3
    "attn_k_norm": "self_attn.k_norm",  # qwen3, gemma3
    # a mixture of experts (qwen3moe; Mixtral's llama files): the router, and each projection
    # of every expert as one 3-D tensor [experts, rows, columns] (layers/moe.py's
    # `stack_experts` joins gate and up)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
#: where an architecture names a layer tensor otherwise: Gemma's four norms (its
#: `ffn_norm` is the norm before the MLP), Phi-3's fused q/k/v and gate/up projections
_ARCH_LAYER_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # gpt-oss: its norm before the MLP, its router's name (its attention sinks: `_hf_name`)
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``llama`` architecture only).

    llama.cpp's converter interleaves each head's two rotary halves (for its
    GPT-J-style RoPE); HF's ``rotate_half`` expects them split. This is the
    inverse of ``w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)``; it
    applies to the q/k weights and to q/k biases alike (rows are rows).
    qwen2/qwen3 use NEOX-style RoPE and are stored unpermuted.
    """
    head_dim = w.shape[0] // n_head
    return (
        w.reshape(n_head, head_dim // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    if parts[0] == "blk" and len(parts) == 3 and parts[2] == "attn_sinks" and arch == "gpt-oss":
        return f"model.layers.{parts[1]}.self_attn.sinks"  # a bare parameter in HF, `.weight` in the file
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise KeyError(f"unknown GGUF tensor {gguf_name!r}")


@dataclass(frozen=True)
class QuantTensor:
    """A GGUF weight as stored: ``data`` [rows, bytes per row] of ``qtype`` blocks (a
    ``gguf.GGMLQuantizationType`` name), ``shape`` (rows, columns) as torch sees it. The
    llama q/k row permutation is already undone (it moves whole rows)."""

    qtype: str
    data: np.ndarray
    shape: tuple[int, int]


def load_gguf_weights(
    path: str | Path | gguf.GGUFReader, progress: bool = True, keep_quantized: frozenset[str] = frozenset()
) -> tuple[dict[str, Any], dict[str, np.ndarray | QuantTensor]]:
    """Return ``(config_dict, weights)`` as the HF checkpoint would, the weights
    as writable, C-contiguous float32 numpy arrays under HF names.

    Weights are dequantized to float32 so downstream code can cast to any
    dtype, except 2-D ones whose type is named in `keep_quantized`: those come as
    `QuantTensor`s, their blocks as the file has them (a view of the mapped file).
    As in HF checkpoints with tied embeddings, ``lm_head.weight`` is
    absent when ``config["tie_word_embeddings"]`` is true.
    """
    config, tensors = config_and_tensors(path)
    if gguf_arch(config) in HYBRID_ARCHS:
        return config, _qwen35_weights(tensors, Qwen35Tensors(config), progress, keep_quantized)
    n_head = config["num_attention_heads"]
    n_kv_head = config["num_key_value_heads"]
    arch = gguf_arch(config)
    permuted = arch == "llama"  # (a Mixtral's file too: arch llama)

    state: dict[str, np.ndarray | QuantTensor] = {}
    for name, qtype, shape, data in tqdm(
        tensors,
        desc="dequantizing GGUF",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    ):
        if name == "rope_freqs.weight":
            continue  # read into the config's rope_scaling (`_rope_scaling`)
        if qtype.name in keep_quantized and len(shape) == 3 and name.endswith("_exps.weight"):
            state.update(_expert_blocks(_hf_name(name, arch), qtype.name, data, shape))
            continue
        if qtype.name in keep_quantized and len(shape) == 2:
            w = data.reshape(shape[0], -1)
        else:
            w = gguf.quants.dequantize(data, qtype).reshape(shape)
        if permuted and name.startswith("blk.") and ".attn_q." in name:
            w = _unpermute_rotary(w, n_head)
        elif permuted and name.startswith("blk.") and ".attn_k." in name:
            w = _unpermute_rotary(w, n_kv_head)
        if w.dtype == np.uint8:  # kept quantized: the raw blocks, rows permuted if need be
            state[_hf_name(name, arch)] = QuantTensor(qtype.name, w, shape)
            continue
        if arch in GEMMA_ARCHS and name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # the converter's (1 + w): transformers' Gemma norms add the 1
        # Copy only when needed: F32 tensors are read-only views of the mmap.
        w = np.require(w, dtype=np.float32, requirements=["C", "W"])
        state[_hf_name(name, arch)] = w
    if arch == "gpt-oss":
        state = _gpt_oss_experts(state)
    return config, state


def _gpt_oss_experts(state: dict[str, np.ndarray | QuantTensor]) -> dict[str, np.ndarray | QuantTensor]:
    """A gpt-oss file's experts in transformers' layout (`GptOssExperts`): gate and up, which
    the converter split, interleaved again (gate = [..., ::2], up = [..., 1::2]) in
    `gate_up_proj` [E, hidden, 2 x inter] and its bias [E, 2 x inter]; `down_proj` [E, inter,
    hidden] transposed back; the biases named `*_proj_bias`. Experts kept quantized stay one
    `QuantTensor` per expert and projection (`_expert_blocks`); only their biases move."""
    out: dict[str, np.ndarray | QuantTensor] = {}
    experts: dict[str, dict[str, np.ndarray]] = {}
    for name, w in state.items():
        prefix, sep, leaf = name.partition(".mlp.experts.")
        if sep and leaf in ("gate_proj.weight", "up_proj.weight", "down_proj.weight", "gate_proj.bias",
                            "up_proj.bias", "down_proj.bias") and isinstance(w, np.ndarray):
            experts.setdefault(prefix + ".mlp.experts.", {})[leaf] = w
        else:
            out[name] = w
    for prefix, parts in experts.items():
        if "gate_proj.weight" in parts:  # dequantized: [E, inter, hidden] each
            gate, up = parts["gate_proj.weight"], parts["up_proj.weight"]
            fused = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), dtype=np.float32)
            fused[:, 0::2], fused[:, 1::2] = gate, up
            out[prefix + "gate_up_proj"] = np.ascontiguousarray(fused.transpose(0, 2, 1))
            out[prefix + "down_proj"] = np.ascontiguousarray(parts["down_proj.weight"].transpose(0, 2, 1))
        gate_b, up_b = parts["gate_proj.bias"], parts["up_proj.bias"]
        bias = np.empty((gate_b.shape[0], 2 * gate_b.shape[1]), dtype=np.float32)
        bias[:, 0::2], bias[:, 1::2] = gate_b, up_b
        out[prefix + "gate_up_proj_bias"] = bias
        out[prefix + "down_proj_bias"] = np.ascontiguousarray(parts["down_proj.bias"], dtype=np.float32)
    return out


def _expert_blocks(hf: str, qtype: str, data: np.ndarray, shape: tuple) -> dict[str, QuantTensor]:
    """A 3-D expert tensor kept quantized (`<layer>.mlp.experts.<proj>.weight` [E, rows,
    columns]) as one `QuantTensor` per expert, under the per-expert names a checkpoint has
    (`<layer>.mlp.experts.<e>.<proj>.weight`): each expert's rows are whole blocks of the
    file, a view of the mapped file, no copy."""
    prefix, proj, _ = hf.rsplit(".", 2)
    blocks = data.reshape(shape[0], shape[1], -1)
    return {f"{prefix}.{e}.{proj}.weight": QuantTensor(qtype, blocks[e], (shape[1], shape[2]))
            for e in range(shape[0])}


def _qwen35_weights(tensors: list[tuple], qwen35: Qwen35Tensors, progress: bool,
                    keep_quantized: frozenset[str]) -> dict[str, np.ndarray | QuantTensor]:
    """`load_gguf_weights` for a ``qwen35`` file: each tensor through `Qwen35Tensors`, which
    undoes what llama.cpp's converter did to it (names, (1 + w) norms, -exp(A_log), the
    value heads' order; a qwen3next file's ``ssm_ba`` split into b and a); matrices of a
    kept type stay their raw blocks, and so do experts (one `QuantTensor` per expert and
    projection, as `load_gguf_weights` keeps a qwen3moe file's)."""
    state: dict[str, np.ndarray | QuantTensor] = {}
    for name, qtype, shape, data in tqdm(tensors, desc="dequantizing GGUF", unit="tensor", file=sys.stderr,
                                         disable=not progress):
        def dequantize(data: Any = data, qtype: Any = qtype, shape: tuple = shape) -> np.ndarray:
            return gguf.quants.dequantize(data, qtype).reshape(shape)

        if qtype.name in keep_quantized and len(shape) == 3 and name.endswith("_exps.weight"):
            named = qwen35.hf_tensor(name, data, qtype, dequantize)  # (experts: renamed, never reordered)
            if named is not None:
                state.update(_expert_blocks(named[0], qtype.name, data, shape))
                continue
        kept = qtype.name in keep_quantized and len(shape) == 2
        got = qwen35.hf_tensor(name, data.reshape(shape[0], -1) if kept else dequantize(), qtype, dequantize)
        if got is None:
            continue
        for hf, w in qwen35.parts(*got):
            if w.dtype == np.uint8:  # moved rows: a copy
                state[hf] = QuantTensor(qtype.name, np.ascontiguousarray(w), (w.shape[0], *shape[1:]))
            else:
                state[hf] = np.require(w, dtype=np.float32, requirements=["C", "W"])
    return state
