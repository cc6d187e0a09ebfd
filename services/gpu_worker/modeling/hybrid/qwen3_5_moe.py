"""Qwen3.5-MoE's text model (`Qwen3_5MoeForCausalLM`, and the language model of a
`Qwen3_5MoeForConditionalGeneration`, beside the tower: `qwen3_5_vision.Qwen35VLModel`): Qwen3.5's hybrid layers
(`qwen3_5.Qwen35LM`, unchanged) with a mixture of experts in place of each MLP.

The sparse block is `layers/moe.SparseMoE` with its shared expert: the router's softmax and
top-k as transformers' (Qwen3.5-MoE always renormalizes the k weights), the step's rows
grouped by expert (one GEMM pair per active expert), then sigmoid(shared_expert_gate(x)) *
shared_expert(x) added, as `Qwen3_5MoeSparseMoeBlock` adds it. The shared expert is the
dense MLP of `shared_expert_intermediate_size`, fused and packed as the dense ones are.
Qwen3-Next (`qwen3_next.py`) is this model with its checkpoint's projections reordered.

Experts load from either form a checkpoint holds them in: per expert
(`mlp.experts.<e>.gate_proj.weight`, what transformers' `save_pretrained` writes) or fused
(`mlp.experts.gate_up_proj` [E, 2 x inter, hidden], `mlp.experts.down_proj`), both stacked
by `moe.stack_experts`.
"""

from __future__ import annotations

from typing import cast

import msgspec
import torch
from torch import nn

from services.gpu_worker.layers.moe import SparseMoE, stack_experts
from services.gpu_worker.modeling.decoder.lm import MLP
from services.gpu_worker.modeling.hybrid.qwen3_5 import Qwen35LM
from shared.hybrid_config import HybridConfig


class Qwen35MoeLM(Qwen35LM):
    """`Qwen35LM` whose sparse layers' MLP is a `SparseMoE` with a gated shared expert."""

    @staticmethod
    def make_mlp(cfg: HybridConfig, layer: int) -> nn.Module | None:
        """A sparse layer's block (a dense layer keeps the MLP: Qwen3-Next's `mlp_only_layers`)."""
        a = cfg.attention
        if not a.is_sparse(layer):
            return None
        shared = None
        if a.shared_expert_intermediate_size:
            shared = MLP(msgspec.structs.replace(a, intermediate_size=a.shared_expert_intermediate_size))
        return SparseMoE(a, shared)

    def checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Qwen3.5's names, and the experts stacked per layer (`moe.stack_experts`)."""
        return stack_experts(super().checkpoint_state(state), self.config.attention.num_experts)

    def prepare_mlp(self, mlp: nn.Module) -> None:
        """A sparse block's experts packed for the C GEMM (`SparseMoE.pack`) and its shared
        expert's gate and up fused as a dense MLP's; the router and the shared expert's
        linears go to the C GEMM with every other linear (`pack_linears`)."""
        if not isinstance(mlp, SparseMoE):
            super().prepare_mlp(mlp)
            return
        mlp.pack()
        if mlp.shared_expert is not None:
            cast("MLP", mlp.shared_expert).fuse()
