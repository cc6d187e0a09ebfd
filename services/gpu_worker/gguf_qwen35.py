"""A ``qwen35`` GGUF file's tensors back in the form of the Hugging Face ``Qwen3_5ForCausalLM``
they were converted from, so `Qwen35LM.load_weights` reads a GGUF file as it reads the
folder (`services.gpu_worker.gguf_weights` calls `hf_tensor` for each tensor).

llama.cpp's converter (`conversion/qwen.py`: `Qwen3_5TextModel` over
`_LinearAttentionVReorderBase` and `Qwen3NextModel`) changes these, undone here:

- names: the linear layers' projections become ``attn_qkv`` / ``attn_gate`` / ``ssm_alpha``
  / ``ssm_beta`` / ``ssm_out``, the post-attention norm ``post_attention_norm``;
- every norm but the linear layers' gated one is stored as (1 + w), the factor llama.cpp
  multiplies by (transformers adds the 1 itself): the 1 is taken off. a - 1 is exact in
  float32 for a = fl(1 + w) (Sterbenz where a >= 0.5; where w <= -0.5, 1 + w was exact and
  a - 1 is w), so `load_weights` adding the 1 back gives a, the fl(1 + w) transformers
  multiplies by, bit for bit;
- ``A_log`` is stored as A = -exp(A_log) (``ssm_a``): A_log is log(-A), nudged to the float32
  whose torch exp gives -A back exactly, so the model's -exp(A_log) is the file's A;
- ``dt_bias`` is ``ssm_dt.bias``; the depthwise convolution's weight [C, 1, K] is squeezed
  to [C, K];
- where there are more value heads than key heads, the value heads are reordered from
  grouped by key head (HF: k0's v0..v(r-1), k1's ...) to tiled (llama.cpp: every key head's
  v0, then every one's v1, ...), for ggml's broadcast: in the value rows of ``attn_qkv``,
  the rows of ``attn_gate``, ``ssm_alpha``, ``ssm_beta``, ``ssm_a``, ``ssm_dt``, the value
  channels of ``ssm_conv1d`` and the columns of ``ssm_out``. Rows move as whole rows, also
  as a quantized matrix's raw blocks; ``ssm_out``'s columns move as whole blocks where a
  value head is a whole number of blocks (Qwen3.5's 128-wide heads in 32-wide blocks),
  else the matrix is dequantized first.

``qwen35moe`` files (`Qwen3_5MoeTextModel`, the same base) add the experts as ``qwen3moe``
files hold them (the router ``ffn_gate_inp``, each projection of every expert as one 3-D
tensor ``ffn_{gate,up,down}_exps``, which `moe.stack_experts` joins) and the shared expert
(``ffn_{gate,up,down}_shexp``, its gate ``ffn_gate_inp_shexp``). ``qwen3next`` files
(`Qwen3NextModel`, without the value-head reordering) hold the same but for the linear
layers' input projections: the converter splits Qwen3-Next's ``in_proj_qkvz`` into
Qwen3.5's q/k/v and z (``attn_qkv``, ``attn_gate``) and keeps ``in_proj_ba`` as it is
(``ssm_ba``, per key head: its value heads' b rows, then their a rows), which `parts` splits
into Qwen3.5's ``in_proj_b`` and ``in_proj_a`` by whole rows (raw blocks too), so a kept
quantized file needs no module of its own for it.

The multi-token prediction layers the converter appends after the model's own (``blk.N``
for N >= num_hidden_layers, with ``nextn`` tensors) are not run, so not read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import torch

#: GGUF per-layer tensor name -> HF parameter name (after "model.layers.N.")
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_out": "linear_attn.out_proj",
    "ssm_norm": "linear_attn.norm",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_ba": "linear_attn.in_proj_ba",  # qwen3next
    # qwen35moe, qwen3next: the router, the experts [E, rows, columns], the shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
#: per-layer tensors whose HF name is not the mapped name plus the GGUF suffix
_WHOLE_NAMES = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

#: a tensor as the loader holds it: float32 values, or a quantized matrix's raw blocks
#: [rows, bytes per row] (uint8)
Array = np.ndarray


def hf_name(gguf_name: str, layers: int) -> str | None:
    """The HF name of a ``qwen35`` tensor; None for the multi-token prediction layers."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        if int(parts[1]) >= layers:
            return None  # a multi-token prediction layer (not run)
        rest = ".".join(parts[2:])
        if rest in _WHOLE_NAMES:
            return f"model.layers.{parts[1]}.{_WHOLE_NAMES[rest]}"
        if len(parts) == 4 and parts[2] in LAYER_NAMES:
            return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    elif base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    raise KeyError(f"unknown qwen35 GGUF tensor {gguf_name!r}")


def _tiled_order(key_heads: int, per_key: int, head: int) -> np.ndarray:
    """The converter's `_reorder_v_heads` as an index: the file's i-th value row is HF's
    row `order[i]`."""
    return np.arange(key_heads * per_key * head).reshape(key_heads, per_key, head).swapaxes(0, 1).reshape(-1)


def _grouped(order: np.ndarray) -> np.ndarray:
    """The index that takes the file's order back to HF's (the inverse permutation)."""
    return np.argsort(order, kind="stable")


def a_log(a: np.ndarray) -> np.ndarray:
    """float32 A_log whose torch float32 exp is exactly -`a` (the converter's -exp(A_log));
    log(-a) itself where no float32 within a few ulps gives it back."""
    target = torch.from_numpy(np.ascontiguousarray(-a, dtype=np.float32))
    out = np.log(-a.astype(np.float64)).astype(np.float32)
    best = out.copy()
    found = torch.exp(torch.from_numpy(out)) == target
    for step in (1, 2, 3):
        for direction in (np.inf, -np.inf):
            cand = out
            for _ in range(step):
                cand = np.nextafter(cand, np.float32(direction)).astype(np.float32)
            hit = (torch.exp(torch.from_numpy(cand)) == target) & ~found
            best[hit.numpy()] = cand[hit.numpy()]
            found |= hit
    return best


class Qwen35Tensors:
    """Turns each ``qwen35`` tensor into HF's (`hf_tensor`); built from the config that
    `shared.gguf_source` read from the same file."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.layers = int(config["num_hidden_layers"])
        key_heads, value_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
        self.key_dim = key_heads * int(config["linear_key_head_dim"])
        self.value_head_dim = int(config["linear_value_head_dim"])
        per_key = value_heads // key_heads
        self.key_heads = key_heads
        #: whether the file's value heads need taking back to HF's grouped order (not with
        #: one value head per key head, which the converter leaves alone, nor in a qwen3next
        #: file, which it never reorders)
        self.reordered = value_heads != key_heads and config.get("model_type") != "qwen3_next"
        self.rows = _grouped(_tiled_order(key_heads, per_key, self.value_head_dim))
        self.heads = _grouped(_tiled_order(key_heads, per_key, 1))

    def parts(self, hf: str, w: Array) -> list[tuple[str, Array]]:
        """`hf_tensor`'s result as the model's tensors: a qwen3next ``in_proj_ba`` [per key head:
        r b rows, r a rows] as ``in_proj_b`` and ``in_proj_a`` (rows picked, values or raw
        blocks alike, as transformers' `fix_query_key_value_ordering` orders them); any
        other tensor as it is."""
        if not hf.endswith(".linear_attn.in_proj_ba.weight"):
            return [(hf, w)]
        prefix = hf.removesuffix("in_proj_ba.weight")
        rows = np.arange(w.shape[0]).reshape(self.key_heads, 2, -1)
        return [(prefix + "in_proj_b.weight", w[rows[:, 0].reshape(-1)]),
                (prefix + "in_proj_a.weight", w[rows[:, 1].reshape(-1)])]

    def hf_tensor(self, name: str, w: Array, qtype: gguf.GGMLQuantizationType,
                  dequantize: Callable[[], np.ndarray]) -> tuple[str, Array] | None:
        """(HF name, tensor in HF's form) of the file's tensor `name` (`w`: float32 values,
        or raw blocks of `qtype` where the loader keeps it quantized; `dequantize` gives its
        float32 values), or None for a tensor not read."""
        hf = hf_name(name, self.layers)
        if hf is None:
            return None
        if self.reordered:
            w = self._grouped(name, w, qtype, dequantize)
        if w.dtype == np.uint8:
            return hf, w
        if name.endswith("norm.weight") and not name.endswith(".ssm_norm.weight"):
            w = w - np.float32(1.0)
        elif name.endswith(".ssm_a"):
            w = a_log(w)
        elif name.endswith(".ssm_conv1d.weight"):
            w = w.reshape(w.shape[0], 1, w.shape[1])
        return hf, w

    def _grouped(self, name: str, w: Array, qtype: gguf.GGMLQuantizationType,
                 dequantize: Callable[[], np.ndarray]) -> Array:
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if kind in ("attn_qkv", "ssm_conv1d"):  # q and k rows (channels) stay, the value ones move
            return np.concatenate([w[: 2 * self.key_dim], w[2 * self.key_dim :][self.rows]])
        if kind == "attn_gate":
            return w[self.rows]
        if kind in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
            return w[self.heads]
        if kind == "ssm_out":  # the value heads are its input columns
            if w.dtype != np.uint8:
                return w[:, self.rows]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            if self.value_head_dim % block:
                return dequantize()[:, self.rows]
            blocks = self.rows[::block] // block
            return w.reshape(w.shape[0], -1, size)[:, blocks].reshape(w.shape[0], -1)
        return w
