"""Qwen3-Next's model (`Qwen3NextForCausalLM`): Qwen3.5-MoE's computation
(`qwen3_5_moe.Qwen35MoeLM`) on a checkpoint that lays out the Gated DeltaNet's input
projections another way.

Checked against transformers' `modeling_qwen3_next` op for op, the only difference from
Qwen3.5 that changes a weight's meaning is the linear layers' input projections. Qwen3-Next
stores two fused ones, in an order grouped by key head (`fix_query_key_value_ordering`):

- `in_proj_qkvz` [2 x key_dim + 2 x value_dim, hidden]: for each key head g, its q rows
  (key_head_dim), its k rows (key_head_dim), then the v rows and the z rows of the r =
  value_heads / key_heads value heads it serves (r x value_head_dim each);
- `in_proj_ba` [2 x value_heads, hidden]: for each key head, its r value heads' b rows,
  then their a rows.

Qwen3.5 splits them (`in_proj_qkv` = all q, all k, all v; `in_proj_z`; `in_proj_b`;
`in_proj_a`), value head g x r + j in both. `checkpoint_state` reorders the rows into
Qwen3.5's four projections once at load, so the model is Qwen3.5's (and `GatedDeltaNet.fuse`
joins them into one GEMM as for Qwen3.5). Everything else is the same: (1 + w) RMSNorms
(`Qwen3NextRMSNorm`: zeros-initialized, output * (1 + w)), the gated norm's plain w, the
attention's q_proj writing q and its gate per head ([q_h, gate_h] for head h), q/k RMSNorm
per head, RoPE on the first `partial_rotary_factor` of each head (transformers' plain
rotate-half over the rotary part, which is `InterleavedMRotary` on 1-D positions), the
router (float32 softmax, top-k, renormalized where `norm_topk_prob`), the shared expert
and its sigmoid gate, and dense layers where `mlp_only_layers` / `decoder_sparse_step` say.
"""

from __future__ import annotations

import torch

from services.gpu_worker.modeling.hybrid.qwen3_5_moe import Qwen35MoeLM
from shared.hybrid_config import HybridConfig


def split_projections(state: dict[str, torch.Tensor], cfg: HybridConfig) -> dict[str, torch.Tensor]:
    """`state` with each `linear_attn.in_proj_qkvz.weight` / `in_proj_ba.weight` (Qwen3-Next's
    per-key-head order) as Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a`."""
    nk, dk, dv = cfg.key_heads, cfg.key_head_dim, cfg.value_head_dim
    r = cfg.value_heads // nk
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(".linear_attn.in_proj_qkvz.weight"):
            prefix = name.removesuffix("in_proj_qkvz.weight")
            groups = t.reshape(nk, 2 * dk + 2 * r * dv, t.shape[-1])
            q, k, v, z = groups.split([dk, dk, r * dv, r * dv], dim=1)
            out[prefix + "in_proj_qkv.weight"] = torch.cat([p.reshape(-1, t.shape[-1]) for p in (q, k, v)])
            out[prefix + "in_proj_z.weight"] = z.reshape(-1, t.shape[-1]).contiguous()
        elif name.endswith(".linear_attn.in_proj_ba.weight"):
            prefix = name.removesuffix("in_proj_ba.weight")
            b, a = t.reshape(nk, 2 * r, t.shape[-1]).split([r, r], dim=1)
            out[prefix + "in_proj_b.weight"] = b.reshape(-1, t.shape[-1]).contiguous()
            out[prefix + "in_proj_a.weight"] = a.reshape(-1, t.shape[-1]).contiguous()
        else:
            out[name] = t
    return out


class Qwen3NextLM(Qwen35MoeLM):
    """`Qwen35MoeLM` reading Qwen3-Next's fused input projections (`split_projections`)."""

    def checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return super().checkpoint_state(split_projections(state, self.config))
