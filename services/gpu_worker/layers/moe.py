"""A mixture-of-experts block in place of a decoder layer's MLP (Qwen3-MoE, Mixtral).

What it computes is transformers' `Qwen3MoeSparseMoeBlock` and `MixtralSparseMoeBlock` (the
same arithmetic: Mixtral's router always renormalizes, so its config reads as
`norm_topk_prob`): the router's linear, a softmax in float32, `torch.topk` (so ties go where
transformers' go), the k weights renormalized to sum to 1 where `norm_topk_prob`, each token's
k experts' silu(gate) * up -> down, weighted and summed in ascending expert order (as
transformers' `index_add_` loop adds them).

How it computes it: the step's (token, expert) pairs are sorted by expert, and each active
expert runs one GEMM over all of its tokens, not one per token, so an expert's weights are
read once a step and only by the rows routed to it (a decode row reads only its k experts'
bytes). The results go back to their rows by `index_add_`, weighted by the routing weight.

A row's result never depends on which rows share its step (shared/DESIGN.md): the router,
softmax and top-k are per row, and on the CPU each expert's two GEMMs are the C kernels
(kernels/gemm.c, one weight packed per expert), which give every row the same bits whatever
rows share the call; torch's matmul does not (oneDNN/MKL block by the row count). Without
those kernels (CUDA, or several torch threads on the CPU) the experts run through torch's
`F.linear` on the stacked weights.

Weights are stacked per layer, as transformers 5 keeps them: `experts.gate_up_proj`
[E, 2 x inter, hidden] (gate rows, then up rows) and `experts.down_proj` [E, hidden, inter];
a checkpoint's per-expert tensors (`experts.{e}.gate_proj.weight`, ...: what Hugging Face
checkpoints and transformers' `save_pretrained` write; Mixtral's are
`block_sparse_moe.experts.{e}.w1` / `w3` / `w2`, gate / up / down, renamed as transformers'
conversion mapping does) are stacked into them by `stack_experts` at load.

A shared expert (Qwen3-Next, Qwen3.5-MoE: `shared_expert`, `shared_expert_gate`) is a dense
MLP every row takes beside its routed experts: transformers' `Qwen3NextSparseMoeBlock` adds
sigmoid(shared_expert_gate(x)) * shared_expert(x) to the routed sum, and so does `forward`.
The caller builds the MLP (a decoder MLP of `shared_expert_intermediate_size`, fused and
packed as the model's other MLPs), so this module imports no model.
"""

from __future__ import annotations

import re
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker import cpu_kernels
from services.gpu_worker.layers.fused import silu_mul
from services.gpu_worker.layers.linear import (
    kernel_available,
    kernel_gate_up_silu,
    kernel_gate_up_size,
    kernel_linear,
    kernel_pack,
    kernel_pack_gate_up,
    kernel_packed_size,
)
from services.gpu_worker.layers.quant import QuantLinear
from shared.model_config import ModelConfig


class Experts(nn.Module):
    """The experts' weights stacked, under transformers 5's names."""

    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter), requires_grad=False)


class QuantExperts(nn.Module):
    """Each expert's gate and up (one GEMM: `QuantLinear.concat`) and down kept in a GGUF
    file's blocks (`QuantLinear`): a decode row reads only its k experts' quantized bytes,
    as llama.cpp's experts do, and the model's memory is the file's."""

    def __init__(self, gate_up: list[QuantLinear], down: list[QuantLinear]) -> None:
        super().__init__()
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)


class ExpertMixture(nn.Module):
    """What every mixture-of-experts block shares: `routed(x [T, hidden])` -> [T, hidden],
    each row through its top-k experts (`route` picks them, `_expert` runs one expert on its
    rows: each family's own), and experts kept in a GGUF file's blocks (`keep_quantized`).
    `experts` is the family's module of stacked weights until `pack` or `keep_quantized`
    replaces it."""

    #: what a decode step streams, once packed (huge_pages.place puts them on 2 MB pages)
    hot_tensors = ("gate_up_packed", "down_packed")
    experts: nn.Module

    def __init__(self, cfg: ModelConfig, norm_topk_prob: bool) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.hidden = cfg.hidden_size
        self.inter = cfg.moe_intermediate_size
        #: each expert's weights in the C GEMM's panels, [E, packed] (set by `pack`, which
        #: then drops the stacked weights)
        self.gate_up_packed: torch.Tensor | None = None
        self.down_packed: torch.Tensor | None = None
        #: the experts kept in a GGUF file's blocks (`keep_quantized`, in place of `experts`)
        self.quant: QuantExperts | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k])."""
        raise NotImplementedError

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Expert `e` on its rows `h` [n, hidden]."""
        raise NotImplementedError

    def pack(self) -> bool:
        """The experts in the C GEMM's layout where it runs; whether it packed."""
        return False

    def keep_quantized(self, parts: dict[int, dict[str, QuantLinear]]) -> bool:
        """Compute with a GGUF file's experts as its blocks: `parts` maps each expert to its
        gate_proj, up_proj and down_proj `QuantLinear`s. False (nothing changed: the caller
        dequantizes them) where an expert lacks one or its gate and up cannot be joined."""
        gate_up, down = [], []
        for e in range(self.num_experts):
            got = parts.get(e, {})
            if set(got) != {"gate_proj", "up_proj", "down_proj"}:
                return False
            joined = QuantLinear.concat([got["gate_proj"], got["up_proj"]])
            if joined is None:
                return False
            gate_up.append(joined)
            down.append(got["down_proj"])
        self.quant = QuantExperts(gate_up, down)
        del self.experts
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The rows' routed experts' sum [T, hidden]."""
        weights, ids = self.route(x)
        # the (row, expert) pairs grouped by expert, ascending; within an expert by top-k
        # place, then row, as transformers' `torch.where` lists them (the same rows in the
        # same order: torch's GEMM on the same matrix, the same bits)
        flat = ids.t().reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order % x.shape[0]
        pair_weights = weights.t().reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            idx = rows[start : start + n]
            y = self._expert(expert, x[idx])
            # weighted, then added in ascending expert order: transformers' sum, bit for bit
            out.index_add_(0, idx, y * pair_weights[start : start + n, None])
            start += n
        return out


class SparseMoE(ExpertMixture):
    """`forward(x [T, hidden])` -> [T, hidden]: each row through its top-k experts, plus the
    shared expert where there is one (Qwen3-MoE, Mixtral, Qwen3.5-MoE, Qwen3-Next)."""

    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__(cfg, cfg.norm_topk_prob)
        if cfg.hidden_act != "silu":  # Qwen3-MoE's and Mixtral's experts are silu; nothing else is checked
            raise ValueError(f"mixture-of-experts layers compute silu experts, not {cfg.hidden_act}")
        #: the router (HF `mlp.gate.weight` [E, hidden]); `pack_linears` may swap it for the C GEMM
        self.gate = nn.Linear(self.hidden, self.num_experts, bias=False)
        self.experts = Experts(self.num_experts, self.hidden, self.inter)
        #: the dense expert every row takes, and its gate's linear (HF `shared_expert_gate.weight`
        #: [1, hidden]), or None (Qwen3-MoE)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(self.hidden, 1, bias=False) if shared_expert is not None else None

    def pack(self) -> bool:
        """Put each expert's weights in the C GEMM kernel's layout, where that kernel runs
        (float32 on the CPU, one torch thread): the experts then give every row the same bits
        whatever rows share its step. The stacked weights are dropped (the packed copies are
        the only ones kept). Returns whether it packed (never for quantized experts)."""
        if self.quant is not None:
            return False
        experts = cast("Experts", self.experts)
        w, down = experts.gate_up_proj, experts.down_proj
        if w.device.type != "cpu" or w.dtype != torch.float32 or not kernel_available():
            return False
        # each expert packed straight into its row (no second copy of every expert on the way)
        self.gate_up_packed = torch.empty(self.num_experts, kernel_gate_up_size(self.inter, self.hidden))
        self.down_packed = torch.empty(self.num_experts, kernel_packed_size(self.hidden, self.inter))
        for e in range(self.num_experts):
            kernel_pack_gate_up(w[e], self.gate_up_packed[e])
            kernel_pack(down[e], self.down_packed[e])
        del self.experts
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) as transformers' Qwen3MoeTopKRouter
        and MixtralTopKRouter pick them: softmax in float32, `torch.topk` (its order among ties), renormalized
        to sum to 1 where `norm_topk_prob`. Where the experts are the C kernels' (packed or kept
        quantized), the C routing (`kernel_route`) instead: the one the C decode stack runs, so
        both paths pick the same experts with the same weights bit for bit."""
        logits = self.gate(x)
        if self.gate_up_packed is not None or self.quant is not None:
            got = kernel_route(logits, self.top_k, SOFTMAX_TOPK_NORM if self.norm_topk_prob else SOFTMAX_TOPK)
            if got is not None:
                return got[0].to(x.dtype), got[1]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        shared, gate = self.shared_expert, self.shared_expert_gate
        if shared is not None and gate is not None:
            # transformers: routed + sigmoid(gate(x)) * shared(x), in that order
            out = out + self._shared_scale(gate(x)) * shared(x)
        return out

    def _shared_scale(self, g: torch.Tensor) -> torch.Tensor:
        """sigmoid(g) [T, 1]. torch's CPU sigmoid runs its vector op over whole pairs of
        vectors of a tensor and a scalar op over the tail, whose bits differ, so a row's value
        would depend on how many rows share the step: packed (the batch-invariant path), each
        value is spread over a row of 64 (whole pairs of vectors up to AVX-512) and taken back
        from column 0. Unpacked, transformers' own call on [T, 1], bit for bit. Where the experts
        are the C kernels' (packed or kept quantized) and the kernels are built, their sigmoid
        (`mstar_sigmoid`): the one the C decode stack runs, so both agree bitwise."""
        if self.gate_up_packed is None and self.quant is None:
            return torch.sigmoid(g)
        lib = cpu_kernels.library()
        if lib is not None and g.dtype == torch.float32 and g.is_contiguous() and g.device.type == "cpu":
            out = torch.empty_like(g)  # the C kernel the decode stack calls (each value on its own)
            lib.mstar_sigmoid(g.data_ptr(), g.numel(), out.data_ptr())
            return out
        if self.gate_up_packed is None:
            return torch.sigmoid(g)
        return torch.sigmoid(g.expand(-1, 64).contiguous())[:, :1]

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Expert `e` on its rows `h` [n, hidden]: one GEMM for gate and up, one for down."""
        if self.quant is not None:
            gate_up = self.quant.gate_up[e](h)
            act = silu_mul(gate_up)  # the C kernel: a row's bits whatever rows share the call
            if act is None:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            return self.quant.down[e](act)
        if self.gate_up_packed is not None and self.down_packed is not None:
            act = kernel_gate_up_silu(h, self.gate_up_packed[e], self.inter)
            return kernel_linear(act, self.down_packed[e], self.hidden, None)
        experts = cast("Experts", self.experts)
        gate, up = F.linear(h, experts.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, experts.down_proj[e])


#: the most experts `kernel_route` (kernels/moe_route.c MOE_MAX_EXPERTS) takes
MAX_KERNEL_EXPERTS = 1024


#: `kernel_route`'s kinds (kernels/moe_route.c): softmax then top-k; the same renormalized;
#: top-k of the logits, then their softmax (gpt-oss)
SOFTMAX_TOPK, SOFTMAX_TOPK_NORM, TOPK_SOFTMAX = 0, 1, 2


def kernel_route(logits: torch.Tensor, top_k: int, kind: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weights [T, k] float32, ids [T, k]) of router logits [T, E] by the C kernel
    (`mstar_moe_route`: softmax in float32 through its own exp, the k largest in torch.topk's
    order among equals, `kind` one of SOFTMAX_TOPK, SOFTMAX_TOPK_NORM, TOPK_SOFTMAX), each row
    on its own; None where the kernel is not there or does not take the logits (then the
    caller's torch path routes)."""
    lib = cpu_kernels.library()
    if (lib is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2
            or not logits.is_contiguous() or not 1 <= top_k <= logits.shape[1] <= MAX_KERNEL_EXPERTS):
        return None
    t = logits.shape[0]
    weights, ids = torch.empty(t, top_k), torch.empty(t, top_k, dtype=torch.int64)
    if t and lib.mstar_moe_route(logits.data_ptr(), t, logits.shape[1], top_k, kind, weights.data_ptr(),
                                 ids.data_ptr()):
        return None
    return weights, ids


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
#: Mixtral's expert names (transformers' "mixtral" conversion: w1 and w3 into gate_up_proj, w2 down)
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
#: a GGUF file's form (services/gpu_worker/gguf_weights.py): each projection of every expert
#: as one 3-D tensor [E, rows, columns]
_PER_PROJECTION = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """`state` with per-expert tensors (`<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight`)
    stacked into `<layer>.mlp.experts.gate_up_proj` [E, 2 x inter, hidden] and
    `.down_proj` [E, hidden, inter], as transformers 5 keeps them; a checkpoint already
    in the stacked form passes through, and a GGUF file's 3-D tensor per projection
    (`<layer>.mlp.experts.{gate,up,down}_proj.weight` [E, rows, columns]) is joined the same
    way. Mixtral's `block_sparse_moe` is `mlp` and its experts' w1 / w3 / w2 are gate / up /
    down. A layer missing some expert's tensor is an error naming it."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in state.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _PER_EXPERT.match(name)
        whole = _PER_PROJECTION.match(name)
        if m is not None:
            parts.setdefault(m[1], {}).setdefault(_MIXTRAL_NAMES.get(m[3], m[3]), {})[int(m[2])] = t
        elif whole is not None and t.dim() == 3:
            parts.setdefault(whole[1], {})[whole[2]] = dict(enumerate(t.unbind(0)))
        else:
            out[name] = t
    for prefix, kinds in parts.items():
        for kind in ("gate_proj", "up_proj", "down_proj"):
            have = kinds.get(kind, {})
            if sorted(have) != list(range(num_experts)):
                missing = sorted(set(range(num_experts)) - set(have))[:5]
                raise ValueError(f"checkpoint lacks {prefix}.<e>.{kind}.weight for experts {missing} "
                                 f"(or has ids past num_experts={num_experts})")
        gate, up, down = ([kinds[k][e] for e in range(num_experts)] for k in ("gate_proj", "up_proj", "down_proj"))
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat((g, u)) for g, u in zip(gate, up)])
        out[f"{prefix}.down_proj"] = torch.stack(down)
    return out
