"""gpt-oss checkpoints as the Hub ships them: experts in MXFP4 (`*_blocks` / `*_scales`, a
`quantization_config` of quant_method "mxfp4"), made from a tiny random float checkpoint.

`mxfp4_folders` writes two folders of one model: the MXFP4 one (what llama.cpp's converter
reads, writing the experts as GGUF MXFP4 blocks, bit for bit), and a float one holding the
very values the MXFP4 experts decode to (what transformers' float32 reference runs: MXFP4
values times powers of two are exact in float32, so the two folders are one model).

Packing as transformers' `convert_moe_packed_tensors` reads it: a byte holds two consecutive
values of a block of 32, the first in its low nibble; a nibble indexes FP4_VALUES (E2M1); a
block's scale byte e makes the values v * 2^(e - 127). Each block's e is gguf's MXFP4
choice (floor(log2(amax)) - 2 + 127) and each value the nearest of the table's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

#: E2M1's 16 values (transformers.integrations.mxfp4.FP4_VALUES)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8)."""
    *lead, k = w.shape
    blocks = w.float().reshape(*lead, k // 32, 32)
    amax = blocks.abs().amax(dim=-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-30))) - 2 + 127, torch.zeros_like(amax))
    e = e.clamp(0, 254)
    scale = torch.exp2(e - 127).unsqueeze(-1)
    table = torch.tensor(FP4_VALUES)
    idx = (blocks.unsqueeze(-1) - scale.unsqueeze(-1) * table).abs().argmin(dim=-1).to(torch.uint8)
    packed = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return packed.contiguous(), e.to(torch.uint8)


def decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse of `encode` (transformers' dequantization, in float32): [..., K]."""
    table = torch.tensor(FP4_VALUES)
    lo, hi = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., K/32, 32]
    out = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return out.flatten(-2)


def mxfp4_folders(ckpt: Path, mx: Path, rounded: Path) -> tuple[Path, Path]:
    """From the float gpt-oss checkpoint `ckpt`: `mx` with every expert matrix in MXFP4 (the
    Hub's form), and `rounded`, `ckpt` with those matrices replaced by their MXFP4 values."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(ckpt / "model.safetensors"))
    packed, exact = {}, dict(state)
    for name in [n for n in state if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        w = state.pop(name)  # [E, in, out], as GptOssExperts keeps it; MXFP4 blocks run along `in`
        blocks, scales = encode(w.transpose(1, 2))
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        exact[name] = decode(blocks, scales).transpose(1, 2).contiguous()
    for folder, tensors in ((mx, {**state, **packed}), (rounded, exact)):
        shutil.copytree(ckpt, folder)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((mx / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mx / "config.json").write_text(json.dumps(cfg, indent=2))
    return mx, rounded
