"""The decoder-only families in torch (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE,
Gemma 2, Gemma 3, Phi-3), attending over paged KV.

Parameter names follow Hugging Face's checkpoints so `load_state_dict` takes a
safetensors (or dequantized GGUF) state dict as-is. The family differences are fields of
the typed `ModelConfig` (shared/model_config.py), read once: q/k/v and o biases, per-head
q/k RMSNorm, tied embeddings, explicit head_dim, Gemma's (1 + w) norms, embedding scale,
four norms per layer, GELU-tanh MLP and soft-capping, Phi-3's packed projections, and one
RoPE per layer type. Qwen3-MoE's sparse layers and all of Mixtral's take a mixture-of-experts block
(layers/moe.py) in place of the MLP; Qwen3-MoE's dense layers keep the MLP. gpt-oss: every layer's
block is layers/gpt_oss_moe.py's, and its attention has sinks (one learned logit per head).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker import huge_pages
from services.gpu_worker.attention import AttnMetadata, paged_attention, write_kv
from services.gpu_worker.layers import fused, prompt_rows, repack_cache
from services.gpu_worker.layers.gpt_oss_moe import GptOssMoE
from services.gpu_worker.layers.linear import (
    KernelGateUpSilu,
    KernelHead,
    KernelLinear,
    PackedHead,
    make_head,
    pack_linears,
    warm_packed,
)
from services.gpu_worker.layers.moe import ExpertMixture, SparseMoE, stack_experts
from services.gpu_worker.layers.norm import RMSNorm
from services.gpu_worker.layers.quant import QuantEmbedding, QuantLinear, QuantParts
from services.gpu_worker.layers.rope import MRotary, Rotary, apply_rope
from services.gpu_worker.modeling.base import DecoderModel
from services.gpu_worker.modeling.decoder.cpu_stack import CpuDecodeStack
from shared.model_config import FULL, ModelConfig, read_model_config

_apply_rope = apply_rope  # the name the kernel tests compare against

#: rows of a step the MLP runs at once on the C kernels (longer prefills go in slices)
MLP_ROWS = 256


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.layer = layer
        self.layer_type = cfg.layer_types[layer]
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.attn_scale
        self.softcap = cfg.attn_softcap
        #: gpt-oss's attention sinks [heads] (HF `self_attn.sinks`), None elsewhere
        self.sinks = nn.Parameter(torch.empty(self.heads), requires_grad=False) if cfg.attn_sinks else None
        self.qkv_proj: nn.Linear | QuantLinear | QuantParts | None = None

    def fuse(self) -> None:
        """One GEMM for q, k and v (loaded under HF's three names, then concatenated)."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = _concat_linears([q, k, v])
        if self.qkv_proj is not None:
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor, meta: AttnMetadata):
        t = x.shape[0]
        if self.qkv_proj is not None and x.device.type == "cpu" and self._norms_in_place(x):
            # one RoPE pass over q and k: they are adjacent heads of the qkv output. q comes
            # out strided (a view of that pass's output), which the torch path takes as is;
            # CUDA keeps the path below, where q is contiguous for the attention backends.
            # Gemma 3's q and k norms run in place on the same output first (the C kernel).
            qkv = self.qkv_proj(x).view(t, self.heads + 2 * self.kv_heads, self.head_dim)
            if self.qk_norm:
                fused.head_norm_(qkv[:, : self.heads], self.q_norm.weight, self.q_norm.eps)
                fused.head_norm_(qkv[:, self.heads : self.heads + self.kv_heads], self.k_norm.weight,
                                 self.k_norm.eps)
            qk = qkv[:, : self.heads + self.kv_heads]
            if fused.rope_(qk, *rope) is None:  # in place by the C kernel, else torch's ops
                qk = apply_rope(qk, *rope)
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            v = qkv[:, self.heads + self.kv_heads :]
        else:
            if self.qkv_proj is not None:
                qs, ks = self.heads * self.head_dim, self.kv_heads * self.head_dim
                q, k, v = self.qkv_proj(x).split([qs, ks, ks], dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = q.view(t, self.heads, self.head_dim)
            k = k.view(t, self.kv_heads, self.head_dim)
            v = v.view(t, self.kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        write_kv(cache, k, v, meta)
        o = paged_attention(q, cache, meta, self.scale, self.softcap, self.sinks)
        return self.o_proj(o.reshape(t, self.heads * self.head_dim))

    def _norms_in_place(self, x: torch.Tensor) -> bool:
        """No q/k norm, or the C kernel can run them in place on the q/k/v output (float32
        on the CPU with the kernels built: then the decode stack computes the same)."""
        if not self.qk_norm:
            return True
        w = self.q_norm.weight
        return (fused.available() and x.dtype == torch.float32 and w.dtype == torch.float32
                and w.is_contiguous() and self.k_norm.weight.is_contiguous())


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(hidden, inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=cfg.mlp_bias)
        #: silu (the C kernels' activation) or GELU with the tanh approximation (Gemma)
        self.silu = cfg.hidden_act == "silu"

        self.gate_up_proj: nn.Linear | QuantLinear | QuantParts | None = None
        #: gate/up GEMM and silu * up in one C call (CPU, the GEMM kernel's path)
        self.gate_up_silu: KernelGateUpSilu | None = None

    def fuse(self) -> None:
        """One GEMM for gate and up."""
        self.gate_up_proj = _concat_linears([self.gate_proj, self.up_proj])
        if self.gate_up_proj is not None:
            del self.gate_proj, self.up_proj

    def fuse_silu(self) -> None:
        """The gate/up GEMM with silu * up in its epilogue (after `fuse`; bias-free only)."""
        if self.silu and isinstance(self.gate_up_proj, nn.Linear) and self.gate_up_proj.bias is None:
            self.gate_up_silu = KernelGateUpSilu(self.gate_up_proj)
            self.gate_up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > MLP_ROWS and self._rows_independent():
            # a long prefill in slices: the [T, 2 x inter] intermediate is most of a step's
            # memory (25 MB at 2,048 rows of SmolLM2), and these kernels give every row the
            # same bits whatever batch it is in, so the result is the unsliced one
            return torch.cat([self._slice(part, i * MLP_ROWS) for i, part in enumerate(x.split(MLP_ROWS))])
        return self._forward(x)

    def _slice(self, part: torch.Tensor, offset: int) -> torch.Tensor:
        with prompt_rows.shifted(offset):  # which of the slice's rows are prompt rows
            return self._forward(part)

    def _rows_independent(self) -> bool:
        """Every GEMM here is a C kernel whose rows do not depend on each other's (oneDNN's
        blocking, and so its rounding, changes with the row count: not sliced)."""
        kernels = (QuantLinear, QuantParts, KernelLinear, KernelGateUpSilu)
        gate_up = self.gate_up_silu if self.gate_up_silu is not None else self.gate_up_proj
        return isinstance(gate_up, kernels) and isinstance(getattr(self, "down_proj", None), kernels)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_silu is not None:
            return self.down_proj(self.gate_up_silu(x))
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            act = fused.silu_mul(gate_up) if self.silu else fused.gelu_mul(gate_up)  # C kernels, where built
            if act is not None:
                return self.down_proj(act)
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        act = F.silu(gate) if self.silu else F.gelu(gate, approximate="tanh")
        return self.down_proj(act.mul_(up))  # the activation's output is fresh: multiply in place


def _concat_linears(parts: list[nn.Linear | QuantLinear]) -> nn.Linear | QuantLinear | QuantParts | None:
    """One Linear whose output is the parts' outputs side by side (weights concatenated);
    GGUF weights kept quantized in forms that do not concatenate run as `QuantParts` (one
    module, the GEMMs apart); None where some are quantized and some not."""
    quants = [p for p in parts if isinstance(p, QuantLinear)]
    if quants:
        if len(quants) != len(parts):
            return None
        joined = QuantLinear.concat(quants)
        if joined is None:
            return QuantParts(quants)
        repack_cache.release([t for p in quants for t in (p.w, p.d, p.m)])  # the parts' pages: not read again
        return joined
    linears = cast("list[nn.Linear]", parts)  # none is quantized
    w = torch.cat([p.weight.detach() for p in linears], dim=0)
    out = nn.Linear(w.shape[1], w.shape[0], bias=linears[0].bias is not None, device="meta")
    out.weight = nn.Parameter(w, requires_grad=False)
    if linears[0].bias is not None:
        out.bias = nn.Parameter(torch.cat([p.bias.detach() for p in linears]), requires_grad=False)
    return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp: MLP | ExpertMixture = _moe(cfg) if cfg.is_sparse(layer) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        #: Gemma: post_attention_layernorm normalises the attention output, and the MLP has
        #: its own norms before and after
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, cache, meta):
        # residual adds into the sublayers' fresh outputs (a + b == b + a bitwise), never into
        # `x`, which the caller may still hold
        if self.sandwich:
            x = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, cache, meta)).add_(x)
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))).add_(x)
        x = self.self_attn(self.input_layernorm(x), rope, cache, meta).add_(x)
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


def _moe(cfg: ModelConfig) -> ExpertMixture:
    """The family's mixture-of-experts block: gpt-oss's (biases, its router, clamped SwiGLU)
    or Qwen3-MoE's."""
    return GptOssMoE(cfg) if cfg.model_type == "gpt_oss" else SparseMoE(cfg)


#: (row indices [k] of a step's flat rows, their input embeddings [k, hidden]): rows whose
#: input is not a token's embedding (an image's, from the vision tower)
RowEmbeds = tuple[torch.Tensor, torch.Tensor]


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(DecoderModel):
    """`forward(input_ids [T], positions [T], kv_caches, metas, sample_rows)` -> logits
    [len(sample_rows), vocab] for only the rows that sample (no lm_head on the rest).
    `kv_caches[i]` and `metas[i]` are layer i's pool tensor and its label's metadata."""

    def __init__(self, config: Mapping[str, Any] | ModelConfig, mrope_section: tuple[int, ...] = ()) -> None:
        """`mrope_section`: multimodal RoPE (Qwen2.5-VL), whose `forward` then also takes
        positions [3, T] (temporal, height, width per row; `MRotary`)."""
        super().__init__()
        cfg = config if isinstance(config, ModelConfig) else read_model_config(config)
        self.config = cfg
        self.model = Backbone(cfg)
        #: one RoPE per distinct layer type's parameters (Gemma 3's local layers have their own)
        kinds = {FULL: cfg.rope} if cfg.rope == cfg.rope_local else {t: cfg.layer_rope(t) for t in set(cfg.layer_types)}
        ctx = cfg.max_position_embeddings
        self.rotaries = nn.ModuleDict({t: MRotary(r, cfg.head_dim, ctx, mrope_section) if mrope_section
                                       else Rotary(r, cfg.head_dim, ctx) for t, r in kinds.items()})
        self.layer_rope = [t if t in kinds else FULL for t in cfg.layer_types]
        self.tied = cfg.tie_word_embeddings
        if not self.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    #: load_weights assigns the checkpoint's tensors (no allocation, no copy)
    assigns_weights = True

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = {k: v for k, v in state.items() if "rotary_emb" not in k}
        if self.tied:
            state.pop("lm_head.weight", None)
        if self.config.packed_projections:
            state = _unpack_projections(state, self.config)
        if self.config.has_experts:
            state = stack_experts(state, self.config.num_experts)
        if self.config.norm_offset:  # Gemma's norms scale by (1 + w): fold the 1 in once
            state = {k: v + self.config.norm_offset if _is_norm(k) else v for k, v in state.items()}
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def reset_buffers(self) -> None:
        """The RoPE tables (not in any checkpoint), once the model is off the meta device."""
        for rotary in cast("Iterable[Rotary]", self.rotaries.values()):
            rotary.reset_buffers()

    #: the LM head through the C GEMM or oneDNN (CPU float32) or on quantized GGUF weights,
    #: set by `prepare`
    head: KernelHead | PackedHead | QuantLinear | None = None
    #: a decode step's layer loop in one C call (quantized Llama-shaped models on the CPU),
    #: set by `prepare` where it applies
    cpu_stack: CpuDecodeStack | None = None

    def prepare(self) -> None:
        """After the weights are in place and on their device: fuse q/k/v and gate/up into
        one GEMM each, and on the CPU put every GEMM weight in the C kernel's (else
        oneDNN's) layout. A mixture-of-experts layer packs its experts for the C kernel
        itself (`ExpertMixture.pack`); its router goes with the other linears."""
        layers = cast("Iterable[DecoderLayer]", self.model.layers)
        for layer in layers:
            layer.self_attn.fuse()
            if isinstance(layer.mlp, ExpertMixture):
                layer.mlp.pack()
            else:
                layer.mlp.fuse()
        head = self.model.embed_tokens if self.tied else self.lm_head
        if isinstance(head, (QuantEmbedding, QuantLinear)):  # a GGUF head kept quantized
            # a plain attribute, as the other heads (not a second registered submodule)
            object.__setattr__(self, "head", head.table if isinstance(head, QuantEmbedding) else head)
        else:
            self.head = make_head(self._head_rows(head.weight.detach()))
        if isinstance(self.head, KernelHead):
            for layer in layers:
                if isinstance(layer.mlp, MLP):
                    layer.mlp.fuse_silu()
        if self.head is not None:
            pack_linears(self.model.layers)
            if not self.tied:
                del self.lm_head  # the head has its own copy (oneDNN's keeps the plain one too)
        if next(self.parameters()).device.type == "cpu":
            huge_pages.place(huge_pages.hot_slots(self, self.head))  # before the C stack keeps their pointers
            self.cpu_stack = CpuDecodeStack.build(self)

    @property
    def step_stack(self) -> CpuDecodeStack | None:
        """The C stack where a whole step may run in its one call in place of `forward`
        (`CpuDecodeStack.run_step`, which computes this forward): not where a subclass has
        a forward of its own, nor under a final soft-cap."""
        if type(self).forward is not DecoderLM.forward or self.config.final_softcap is not None:
            return None
        return self.cpu_stack

    def _head_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """The LM head's weight as `prepare` packs it (all of it; an embedder has no head)."""
        return weight

    def warm_gemms(self, max_rows: int, max_sample_rows: int) -> int:
        """Build every oneDNN GEMM kernel a step of up to `max_rows` rows (and
        `max_sample_rows` sampled rows) can need, so memory does not grow under load
        (none on the C kernel's path)."""
        if self.head is None:
            return 0
        return warm_packed(self.model.layers, max_rows, self.head, max_sample_rows)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], metas: list[AttnMetadata],
                sample_rows: torch.Tensor, embeds: RowEmbeds | None = None):
        x = self.model.norm(self.hidden(input_ids, positions, kv_caches, metas, embeds)[sample_rows])
        if self.head is not None:
            logits = self.head(x)
        else:
            w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
            logits = F.linear(x, w)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
               metas: list[AttnMetadata], embeds: RowEmbeds | None = None) -> torch.Tensor:
        """Every row's hidden state after the last layer, before the final norm. `embeds`
        (rows, values) puts a vision tower's rows in place of those rows' token embeddings
        (after Gemma's scaling, which transformers applies to text embeddings only)."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:  # Gemma: HF multiplies by sqrt(hidden) in the embedding's dtype
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(x.dtype)
        rotaries = cast("Iterable[tuple[str, Rotary]]", self.rotaries.items())
        ropes = {t: rot.tables(positions, x.dtype) for t, rot in rotaries}
        stack = self.cpu_stack
        if stack is None or not stack.run(x, ropes, kv_caches, metas):
            for layer, cache, meta, kind in zip(self.model.layers, kv_caches, metas, self.layer_rope):
                x = layer(x, ropes[kind], cache, meta)
        return x


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _unpack_projections(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`: split them
    into the names every other family uses (views; `prepare` concatenates them again)."""
    out = {}
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name, t in state.items():
        if ".self_attn.qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv], dim=0)):
                out[name.replace("qkv_proj", part)] = piece
        elif ".mlp.gate_up_proj." in name:
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            out[name] = t
    return out
