"""gpt-oss checkpoints as the Hub ships them: each layer's experts in MXFP4
(`mlp.experts.{gate_up,down}_proj_blocks` [E, rows, K/32, 16] bytes and `_scales` [E, rows,
K/32], a `quantization_config` of quant_method "mxfp4"), read without dequantizing.

transformers' layout (its `convert_moe_packed_tensors`): a block of 32 values along the
input dimension, each byte two consecutive values (the first in the low nibble), a nibble an
index into E2M1's 16 values, the block's scale byte s giving 2^(s - 127). gate_up's rows
interleave gate and up (even rows gate, odd up). GGUF's MXFP4 block (what llama.cpp's
converter writes from the same bytes) is the scale byte then 16 bytes whose low nibbles are
values 0-15 and high nibbles 16-31, indexing E2M1's values doubled with the scale halved: the
same numbers. So each expert's projection becomes a GGUF MXFP4 `QuantTensor` (nibbles moved,
scale bytes kept), kept in its blocks on the CPU's kernels (qgemm.c's form 17) as a GGUF
file's experts are; elsewhere (no kernel, CUDA) they are dequantized to transformers' float
layout (`gate_up_proj` [E, hidden, 2 x inter], `down_proj` [E, inter, hidden]), exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from services.gpu_worker.gguf_weights import QuantTensor

#: E2M1's values (transformers.integrations.mxfp4.FP4_VALUES)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4(config: dict[str, Any]) -> bool:
    """A gpt-oss checkpoint whose experts are MXFP4 blocks (the release's form)."""
    quant = config.get("quantization_config") or {}
    return config.get("model_type") == "gpt_oss" and quant.get("quant_method") == "mxfp4"


def _gguf_rows(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """[rows, K/32, 16] bytes and [rows, K/32] scales in transformers' packing -> [rows,
    K/32 * 17] bytes of GGUF MXFP4 blocks."""
    b = blocks.numpy()
    idx = np.stack((b & 0x0F, b >> 4), axis=-1).reshape(*b.shape[:-1], 32)  # value j's index
    ggml = idx[..., :16] | (idx[..., 16:] << 4)
    out = np.concatenate((scales.numpy()[..., None], ggml.astype(np.uint8)), axis=-1)
    return np.ascontiguousarray(out.reshape(b.shape[0], -1))


def decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' dequantization in float32: [..., rows, K/32, 16] -> [..., rows, K]."""
    table = torch.tensor(FP4_VALUES)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1).flatten(-2)
    return torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127).flatten(-2)


def split_experts(state: dict[str, torch.Tensor], keep: bool) -> tuple[dict[str, torch.Tensor],
                                                                         dict[str, QuantTensor]]:
    """(`state` without its MXFP4 tensors, the experts as per-expert GGUF MXFP4 `QuantTensor`s
    named as a GGUF file's are, `<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight`), or
    with `keep` False, `state` with the experts dequantized in transformers' layout and no
    `QuantTensor`s."""
    out: dict[str, torch.Tensor] = {}
    quant: dict[str, QuantTensor] = {}
    for name, t in state.items():
        if name.endswith("_scales"):
            continue
        if not name.endswith("_blocks"):
            out[name] = t
            continue
        base = name.removesuffix("_blocks")  # <layer>.mlp.experts.gate_up_proj / .down_proj
        scales = state[base + "_scales"]
        if not keep:
            out[base] = decode(t, scales).transpose(1, 2).contiguous()
            continue
        prefix, proj = base.rsplit(".", 1)
        k = t.shape[2] * 32
        for e in range(t.shape[0]):
            if proj == "gate_up_proj":
                for part, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                    raw = _gguf_rows(t[e, rows], scales[e, rows])
                    quant[f"{prefix}.{e}.{part}.weight"] = QuantTensor("MXFP4", raw, (raw.shape[0], k))
            else:
                raw = _gguf_rows(t[e], scales[e])
                quant[f"{prefix}.{e}.down_proj.weight"] = QuantTensor("MXFP4", raw, (raw.shape[0], k))
    return out, quant
