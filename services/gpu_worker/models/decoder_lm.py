"""Llama / Qwen2 / Qwen3 decoder in torch, attending over paged KV.

Parameter names follow Hugging Face's checkpoints so `load_state_dict` takes a
safetensors (or dequantized GGUF) state dict as-is. The family differences are config
switches: Qwen2's q/k/v biases (`attention_bias` or model_type qwen2), Qwen3's per-head
q/k RMSNorm, tied embeddings, explicit head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention import AttnMetadata, paged_attention, write_kv
from services.gpu_worker.models import fused
from services.gpu_worker.models.linear import (
    KernelGateUpSilu,
    KernelHead,
    PackedHead,
    make_head,
    pack_linears,
    warm_packed,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fused.rms_norm(x, self.weight, self.eps)  # the C kernel on the CPU, where built
        if out is not None:
            return out
        # HF's Qwen2RMSNorm op for op (bitwise), with the temporaries updated in place
        # (fewer allocations); `.float()` is no copy for float32 input.
        h = x.float()
        var = h.pow(2).mean(-1, keepdim=True)
        y = (h * var.add_(self.eps).rsqrt_()).to(x.dtype)  # fresh either way
        return y.mul_(self.weight) if y.dtype == self.weight.dtype else y * self.weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin` with the sign of rotate_half's negated half
    folded into the table: (-x2) * s == x2 * (-s) exactly, so the result is bitwise HF's,
    in one cat and two multiplies instead of a neg, a cat and two multiplies."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos).add_(torch.cat((x2, x1), dim=-1).mul_(sin_signed))


class Rotary(nn.Module):
    """HF's rotate_half RoPE, with cos/sin tables precomputed up to max positions. The sin
    table has its first half negated (see `_apply_rope`)."""

    def __init__(self, head_dim: int, base: float, max_pos: int, scaling: dict | None) -> None:
        super().__init__()
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
            raise NotImplementedError(f"rope_scaling {scaling} is not supported yet")
        self.head_dim, self.base, self.max_pos = head_dim, base, max_pos
        self.register_buffer("cos", torch.empty(max_pos, head_dim), persistent=False)
        self.register_buffer("sin_signed", torch.empty(max_pos, head_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the tables; also called after building on the meta device."""
        if self.cos.is_meta:
            self.cos = torch.empty(self.max_pos, self.head_dim)
            self.sin_signed = torch.empty(self.max_pos, self.head_dim)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        freqs = torch.outer(torch.arange(self.max_pos, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos.copy_(emb.cos())
        sin = emb.sin()
        self.sin_signed.copy_(torch.cat((-sin[:, : self.head_dim // 2], sin[:, self.head_dim // 2 :]), dim=-1))

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows [T, 1, D] for this step's positions (once per step, not per layer)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
        return _apply_rope(q, cos, sin_signed), _apply_rope(k, cos, sin_signed)


class Attention(nn.Module):
    def __init__(self, cfg: dict, layer: int) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.heads
        self.head_dim = cfg.get("head_dim") or hidden // self.heads
        self.layer = layer
        qwen2 = cfg.get("model_type") == "qwen2"
        bias = qwen2 or bool(cfg.get("attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias and not qwen2)
        self.qk_norm = cfg.get("model_type") == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
        self.scale = self.head_dim**-0.5
        self.qkv_proj: nn.Linear | None = None

    def fuse(self) -> None:
        """One GEMM for q, k and v (loaded under HF's three names, then concatenated)."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = _concat_linears([q, k, v])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor, meta: AttnMetadata):
        t = x.shape[0]
        if self.qkv_proj is not None and not self.qk_norm and x.device.type == "cpu":
            # one RoPE pass over q and k: they are adjacent heads of the qkv output. q comes
            # out strided (a view of that pass's output), which the torch path takes as is;
            # CUDA keeps the path below, where q is contiguous for the attention backends.
            qkv = self.qkv_proj(x).view(t, self.heads + 2 * self.kv_heads, self.head_dim)
            qk = qkv[:, : self.heads + self.kv_heads]
            if not fused.rope_(qk, *rope):  # in place by the C kernel, else torch's ops
                qk = _apply_rope(qk, *rope)
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
            q, k = Rotary.apply(q, k, *rope)
        write_kv(cache, k, v, meta)
        o = paged_attention(q, cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        bias = bool(cfg.get("mlp_bias", False))
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.get('hidden_act')!r} is not supported")

        self.gate_up_proj: nn.Linear | None = None
        #: gate/up GEMM and silu * up in one C call (CPU, the GEMM kernel's path)
        self.gate_up_silu: KernelGateUpSilu | None = None

    def fuse(self) -> None:
        """One GEMM for gate and up."""
        self.gate_up_proj = _concat_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def fuse_silu(self) -> None:
        """The gate/up GEMM with silu * up in its epilogue (after `fuse`; bias-free only)."""
        if self.gate_up_proj is not None and self.gate_up_proj.bias is None:
            self.gate_up_silu = KernelGateUpSilu(self.gate_up_proj)
            self.gate_up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_silu is not None:
            return self.down_proj(self.gate_up_silu(x))
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            act = fused.silu_mul(gate_up)  # the C kernel on the CPU, where built
            if act is not None:
                return self.down_proj(act)
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate).mul_(up))  # silu's output is fresh: multiply in place


def _concat_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side (weights concatenated)."""
    w = torch.cat([p.weight.detach() for p in parts], dim=0)
    fused = nn.Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(w, requires_grad=False)
    if parts[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x, rope, cache, meta):
        # residual adds into the sublayers' fresh outputs (a + b == b + a bitwise), never into
        # `x`, which the caller may still hold
        x = self.self_attn(self.input_layernorm(x), rope, cache, meta).add_(x)
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


class Backbone(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class DecoderLM(nn.Module):
    """`forward(input_ids [T], positions [T], kv_caches, metas, sample_rows)` -> logits
    [len(sample_rows), vocab] for only the rows that sample (no lm_head on the rest).
    `kv_caches[i]` and `metas[i]` are layer i's pool tensor and its label's metadata."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        self.rotary = Rotary(head_dim, float(cfg.get("rope_theta", 10000.0)), int(cfg.get("max_position_embeddings", 2048)), cfg.get("rope_scaling"))
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    #: load_weights assigns the checkpoint's tensors (no allocation, no copy)
    assigns_weights = True

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = {k: v for k, v in state.items() if "rotary_emb" not in k}
        if self.tied:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    #: the LM head through the C GEMM or oneDNN (CPU float32), set by `prepare`
    head: KernelHead | PackedHead | None = None

    def prepare(self) -> None:
        """After the weights are in place and on their device: fuse q/k/v and gate/up into
        one GEMM each, and on the CPU put every GEMM weight in the C kernel's (else
        oneDNN's) layout."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        self.head = make_head(w.detach())
        if isinstance(self.head, KernelHead):
            for layer in self.model.layers:
                layer.mlp.fuse_silu()
        if self.head is not None:
            pack_linears(self.model.layers)
            if not self.tied:
                del self.lm_head  # the head has its own copy (oneDNN's keeps the plain one too)

    def warm_gemms(self, max_rows: int, max_sample_rows: int) -> int:
        """Build every oneDNN GEMM kernel a step of up to `max_rows` rows (and
        `max_sample_rows` sampled rows) can need, so memory does not grow under load
        (none on the C kernel's path)."""
        if self.head is None:
            return 0
        return warm_packed(self.model.layers, max_rows, self.head, max_sample_rows)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], metas: list[AttnMetadata], sample_rows: torch.Tensor):
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        for layer, cache, meta in zip(self.model.layers, kv_caches, metas):
            x = layer(x, rope, cache, meta)
        x = self.model.norm(x[sample_rows])
        if self.head is not None:
            return self.head(x)
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return F.linear(x, w)
