"""Qwen3.5's text model in torch: Gated DeltaNet layers over per-request state slots, gated
full-attention layers over paged KV, as transformers' `Qwen3_5ForCausalLM` computes them.

Layer i's `kv_caches[i]` is its pool's tensor: the "kv" pool's pages for a full-attention
layer, the "state" pool's slots [slots, state_floats] for a linear one (each slot the
convolution's last K-1 inputs, time-major [K-1, conv_dim], then the recurrent matrix
[value_heads, key_head_dim, value_head_dim]); `metas[i]` is the attention metadata of its
label, or for a linear layer the step's `StateBatch` (which slot each request's rows use,
and whether its state starts at zero). Parameter names are transformers', so its
safetensors load as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention import AttnMetadata, paged_attention, write_kv
from services.gpu_worker.layers import delta_rule, fused
from services.gpu_worker.layers.delta_rule import StateBatch
from services.gpu_worker.layers.interleaved_mrope import InterleavedMRotary
from services.gpu_worker.layers.linear import KernelHead, PackedHead, make_head, pack_linears
from services.gpu_worker.layers.norm import RMSNorm
from services.gpu_worker.layers.quant import TILE, QuantEmbedding, QuantLinear
from services.gpu_worker.layers.rope import apply_rope
from services.gpu_worker.modeling.base import DecoderModel
from services.gpu_worker.modeling.decoder.lm import MLP, RowEmbeds, _concat_linears
from services.gpu_worker.modeling.hybrid.cpu_stack import HybridDecodeStack
from shared.hybrid_config import LINEAR, HybridConfig, read_hybrid_config

#: a layer's metadata: paged attention's, or the linear layers' state batch
LayerMeta = AttnMetadata | StateBatch


class GatedAttention(nn.Module):
    """Qwen3.5's full attention: q_proj writes q and an output gate per head, q and k are
    RMS-normed per head, RoPE rotates the first `rotary_dim` of each head, and the output
    is multiplied by sigmoid(gate) before o_proj."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        a = cfg.attention
        self.heads, self.kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.q_proj = nn.Linear(a.hidden_size, self.heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, a.rms_norm_eps)
        self.scale = a.attn_scale
        #: q (with its gate), k and v as one GEMM (`fuse`), or None: the three apart
        self.qkv_proj: nn.Module | None = None

    def fuse(self) -> None:
        """One GEMM for q (with the gate), k and v: a decode step reads the input once and
        makes one call where it made three (their outputs' columns are the same values)."""
        joined = _join([self.q_proj, self.k_proj, self.v_proj])
        if joined is not None:
            self.qkv_proj = joined[0]
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor,
                meta: AttnMetadata) -> torch.Tensor:
        t = x.shape[0]
        qs, ks = 2 * self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            qg, k, v = qkv[:, :qs], qkv[:, qs : qs + ks], qkv[:, qs + ks : qs + 2 * ks]
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, gate = qg.view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.contiguous().view(t, self.kv_heads, self.head_dim))
        v = v.view(t, self.kv_heads, self.head_dim)
        r = self.rotary_dim
        if not fused.rope_partial_((q, k), *rope, r):  # in place by the C kernel (the decode stack's), else torch's
            q = torch.cat((apply_rope(q[..., :r], *rope), q[..., r:]), dim=-1)
            k = torch.cat((apply_rope(k[..., :r], *rope), k[..., r:]), dim=-1)
        write_kv(cache, k, v, meta)
        o = paged_attention(q, cache, meta, self.scale, None).reshape(t, self.heads * self.head_dim)
        if fused.sigmoid_gate_(o, qg, self.heads, self.head_dim) is None:
            o = o * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(o)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer: projections, the causal convolution over q/k/v, the
    gated delta rule over the request's recurrent state, the gated RMSNorm, out_proj."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        hidden = cfg.attention.hidden_size
        self.cfg = cfg
        c, k = cfg.conv_dim, cfg.conv_kernel
        self.conv1d = nn.Conv1d(c, c, k, groups=c, bias=False, padding=k - 1)
        self.dt_bias = nn.Parameter(torch.ones(cfg.value_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.value_heads))
        self.norm = GatedNorm(cfg.value_head_dim, cfg.attention.rms_norm_eps)
        self.out_proj = nn.Linear(cfg.value_dim, hidden, bias=False)
        self.in_proj_qkv = nn.Linear(hidden, c, bias=False)
        self.in_proj_z = nn.Linear(hidden, cfg.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, cfg.value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, cfg.value_heads, bias=False)
        #: in_proj_qkv, in_proj_z, in_proj_b and in_proj_a as one GEMM (`fuse`), or None
        self.in_proj: nn.Module | None = None
        #: where z, b and a start in in_proj's output columns
        self._starts = (0, 0, 0)
        #: -exp(A_log) in float32, made once by `fuse` (the same value the step made each time)
        self._neg_a: torch.Tensor | None = None

    def fuse(self) -> None:
        """One GEMM for the four input projections (a decode step made four calls, two of
        them for 8-column outputs), and the decay's -exp(A_log) made once."""
        self._neg_a = -self.A_log.detach().float().exp()
        joined = _join([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        if joined is not None:
            self.in_proj, starts = joined
            self._starts = (starts[1], starts[2], starts[3])
            del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv, z, b, a) of the step's rows: column views of the fused GEMM's output, or the four GEMMs'."""
        cfg = self.cfg
        if self.in_proj is None:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        out = self.in_proj(x)
        z0, b0, a0 = self._starts
        return (out[:, : cfg.conv_dim], out[:, z0 : z0 + cfg.value_dim], out[:, b0 : b0 + cfg.value_heads],
                out[:, a0 : a0 + cfg.value_heads])

    def forward(self, x: torch.Tensor, slots: torch.Tensor, batch: StateBatch) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        window = (cfg.conv_kernel - 1) * cfg.conv_dim
        conv_state = slots[:, :window].view(-1, cfg.conv_kernel - 1, cfg.conv_dim)
        recurrent = slots[:, window:].view(-1, cfg.value_heads, cfg.key_head_dim, cfg.value_head_dim)
        qkv, z, b, a = self._projections(x)
        mixed = delta_rule.causal_conv(qkv, conv_state, self.conv1d.weight.view(cfg.conv_dim, -1), batch)
        q, k, v = mixed.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        neg_a = self._neg_a if self._neg_a is not None else -self.A_log.float().exp()
        gates = fused.gdn_gates(b, a, self.dt_bias, neg_a)  # the C kernel the decode stack calls
        beta, g = gates if gates is not None else (b.float().sigmoid(), neg_a * F.softplus(a.float() + self.dt_bias))
        o = delta_rule.gated_delta(q.reshape(t, cfg.key_heads, cfg.key_head_dim),
                                   k.reshape(t, cfg.key_heads, cfg.key_head_dim),
                                   v.reshape(t, cfg.value_heads, cfg.value_head_dim), g, beta, recurrent, batch)
        z = z.reshape(t, cfg.value_heads, cfg.value_head_dim)
        o = self.norm(o.to(x.dtype), z)
        return self.out_proj(o.reshape(t, cfg.value_dim))


def _join(parts: list[nn.Module]) -> tuple[nn.Module, list[int]] | None:
    """The parts (Linears on one input, bias-free) as one GEMM whose output holds theirs side
    by side, and where each part's columns start; None where some are quantized and some
    not. Quantized parts stay on the C quantized GEMM (`_concat_linears`); one whose columns
    do not fill its last tile of 16 (in_proj_b's 8) takes the whole tile: the repacked weight
    already holds it, zero weights and zero scales, so the extra columns are zeros that the
    caller skips, and every real column is the value the part alone computes."""
    quants = [p for p in parts if isinstance(p, QuantLinear)]
    if quants and len(quants) != len(parts):
        return None
    if quants:
        widths = [-(-p.out_features // TILE) * TILE for p in quants[:-1]] + [quants[-1].out_features]
        parts = [p if p.out_features == w else QuantLinear(p.form, p.w, p.d, p.m, p.in_features, w)
                 for p, w in zip(quants, widths)]
    else:
        widths = [cast("nn.Linear", p).out_features for p in parts]
    joined = _concat_linears(cast("list[nn.Linear | QuantLinear]", parts))  # QuantParts: the same columns
    return None if joined is None else (joined, [sum(widths[:i]) for i in range(len(widths))])


class GatedNorm(nn.Module):
    """`Qwen3_5RMSNormGated`: rmsnorm(x) * weight * silu(z) over each head."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return delta_rule.gated_rms_norm(x, z, self.weight, self.eps)


class HybridLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, layer: int, mlp: nn.Module | None = None) -> None:
        """`mlp`: what follows the attention (a mixture of experts: `qwen3_5_moe`), else the dense MLP."""
        super().__init__()
        a = cfg.attention
        self.linear = cfg.layer_types[layer] == LINEAR
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = mlp if mlp is not None else MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor,
                meta: LayerMeta) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear:
            x = self.linear_attn(h, cache, cast("StateBatch", meta)).add_(x)
        else:
            x = self.self_attn(h, rope, cache, cast("AttnMetadata", meta)).add_(x)
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


class Backbone(nn.Module):
    def __init__(self, cfg: HybridConfig, make_mlp: Callable[[HybridConfig, int], nn.Module | None]) -> None:
        super().__init__()
        a = cfg.attention
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i, make_mlp(cfg, i)) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


def _offset_norm(name: str) -> bool:
    """Norms that scale by (1 + w) (every one but the linear layers' gated norm)."""
    return name.endswith("norm.weight") and ".linear_attn.norm." not in name


class Qwen35LM(DecoderModel):
    """`forward(input_ids [T], positions [T], kv_caches, metas, sample_rows)` -> logits for
    the sampled rows; see the module docstring for what layer i's cache and meta are."""

    assigns_weights = True

    def __init__(self, config: Mapping[str, Any] | HybridConfig) -> None:
        super().__init__()
        cfg = config if isinstance(config, HybridConfig) else read_hybrid_config(config)
        self.config = cfg
        a = cfg.attention
        self.model = Backbone(cfg, self.make_mlp)
        # positions [T] rotate as plain partial RoPE; [3, T] (images: temporal, height, width)
        # as transformers' interleaved multimodal RoPE over the rotary dim
        self.rotary = InterleavedMRotary(a.rope, cfg.rotary_dim, a.max_position_embeddings, cfg.mrope_section)
        self.tied = a.tie_word_embeddings
        if not self.tied:
            self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)

    @staticmethod
    def make_mlp(cfg: HybridConfig, layer: int) -> nn.Module | None:
        """Layer `layer`'s MLP, or None for the dense one (a family with experts overrides it)."""
        return None

    def checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under this module's names, norms' (1 + w) folded in."""
        # multi-token prediction layers (`mtp.*`) are not run; the vision tower is another model's
        state = {k.removeprefix("model.language_model.").removeprefix("language_model."): v
                 for k, v in state.items() if not k.startswith("mtp.") and "visual." not in k}
        state = {("model." + k if not k.startswith(("model.", "lm_head.")) else k): v for k, v in state.items()}
        if self.tied:
            state.pop("lm_head.weight", None)
        return {k: v + 1.0 if _offset_norm(k) else v for k, v in state.items()}  # fold (1 + w) in once

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = self.checkpoint_state(state)
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def reset_buffers(self) -> None:
        self.rotary.reset_buffers()

    head: KernelHead | PackedHead | QuantLinear | None = None

    def prepare(self) -> None:
        """On the CPU, every float32 GEMM weight in the C kernel's (else oneDNN's) layout."""
        for layer in cast("list[HybridLayer]", list(self.model.layers)):
            self.prepare_mlp(layer.mlp)
            (layer.linear_attn if layer.linear else layer.self_attn).fuse()
        head = self.model.embed_tokens if self.tied else self.lm_head
        if isinstance(head, (QuantEmbedding, QuantLinear)):  # a GGUF head kept quantized (as DecoderLM's)
            object.__setattr__(self, "head", head.table if isinstance(head, QuantEmbedding) else head)
        else:
            self.head = make_head(head.weight.detach())
        if self.head is not None:
            pack_linears(self.model.layers)
            if not self.tied:
                del self.lm_head
        if self.model.norm.weight.device.type == "cpu":
            self.cpu_stack = HybridDecodeStack.build(self)

    #: the whole decode step in one C call (modeling/hybrid/cpu_stack.py), or None: the modules
    cpu_stack: Any = None

    @property
    def step_stack(self) -> Any:
        """The C stack the runner hands whole steps to (`CpuDecodeStack.run_step`), or None."""
        return self.cpu_stack

    def prepare_mlp(self, mlp: nn.Module) -> None:
        """One GEMM for the MLP's gate and up (a family with experts packs those too)."""
        cast("MLP", mlp).fuse()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                kv_caches: list[torch.Tensor], metas: list[LayerMeta], sample_rows: torch.Tensor,
                embeds: RowEmbeds | None = None) -> torch.Tensor:
        """`embeds`: rows of the step (indices, values) that take an image's rows in place of
        their placeholder token's embedding (`qwen3_5_vision.Qwen35VLModel`)."""
        x = self.model.embed_tokens(input_ids)
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(x.dtype)
        rope = self.rotary.tables(positions, x.dtype)
        for layer, cache, meta in zip(self.model.layers, kv_caches, metas):
            x = layer(x, rope, cache, meta)
        x = self.model.norm(x[sample_rows])
        if self.head is not None:
            return self.head(x)
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return F.linear(x, w)
