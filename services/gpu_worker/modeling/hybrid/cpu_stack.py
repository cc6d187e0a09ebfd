"""A hybrid's (Qwen3.5's) decode step in one C call: the decoder's stack
(modeling/decoder/cpu_stack.py, kernels/decode_stack.c) with Gated DeltaNet layers and
Qwen3.5's gated attention layers.

Why: a Qwen3.5 decode step through the torch modules is ~25 ops a linear layer (the conv,
the gates, the delta rule and the gated norm each a module call, a ctypes call and fresh
tensors), and on a small model that Python was most of the step: slower than llama-server
at one request (issue 50's c1 goal). Here the C side calls the kernels the modules call
(`GatedDeltaNet.forward`, `GatedAttention.forward` on the CPU: the conv, the gates, the
delta rule and the gated norm of kernels/delta_rule.c and elementwise.c, the partial RoPE
and the output gate), in their order, on the same inputs, so the logits, the KV pages and
the state slots are bitwise the modules' (tests/unit/test_cpu_stack_hybrid.py). Each
linear layer reads and writes its requests' state slots in place (the state pool's pages:
which slot a request's rows use comes with the step, as `StateBatch.meta` lays it out).

It applies where the modules would run exactly those kernels: float32 activations, the
layers' GEMMs C kernels (GGUF weights kept quantized, or float32 in gemm.c's panels), each
linear layer's four input projections fused (`GatedDeltaNet.fuse`), dense MLPs or mixtures
of experts the decoder's stack takes (not yet Qwen3.5-MoE's shared expert: those models run
the modules). Anything else runs the modules.
"""

from __future__ import annotations

import ctypes
import os
from typing import NamedTuple, cast

import torch

from services.gpu_worker.attention import HostStep, _kernel_pages, head_dim_of
from services.gpu_worker.layers.moe import ExpertMixture
from services.gpu_worker.layers.quant import QuantLinear
from services.gpu_worker.modeling.decoder.cpu_stack import (
    KINDS,
    STEPS,
    CpuDecodeStack,
    _gemm_parts,
    _Layer,
    _library,
    _MoE,
    _moe,
    _plain_f32,
    _QWeight,
    _qweight,
    _Shape,
)
from shared.hybrid_config import LINEAR, HybridConfig
from shared.model_config import FULL

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
#: the step struct the linear layers read (after the attention kinds')
LINEAR_STEP = STEPS - 1


class _Gdn(ctypes.Structure):
    _fields_ = [("hk", _i64), ("hv", _i64), ("dk", _i64), ("dv", _i64), ("conv_k", _i64), ("conv_dim", _i64),
                ("z_at", _i64), ("b_at", _i64), ("a_at", _i64), ("width", _i64), ("slot_stride", _i64),
                ("in_proj", _QWeight * 4), ("out", _QWeight), ("conv_w", _ptr), ("dt_bias", _ptr), ("neg_a", _ptr),
                ("norm_w", _ptr)]


class StateHost(NamedTuple):
    """A step's linear layers' metadata as plain ints: per request (first row, end row, slot,
    fresh), as `StateBatch.meta` holds them; `n_slots` the rows they cover."""

    ints: list[int]
    n_slots: int
    n_states: int
    n_chunks: int = 0


def state_host(rows: list) -> StateHost:
    """`hybrid.state_batch`'s description of the step (each request's rows, its slot: its state
    label's one page, fresh where none of its rows was computed before), as plain ints."""
    ints: list[int] = []
    at = 0
    for r in rows:
        ints += (at, at + r.new, r.pages[0], int(r.cached == 0))
        at += r.new
    return StateHost(ints, at, len(rows))


def _gdn(mixer, cfg: HybridConfig, keep: list) -> _Gdn | None:
    """A Gated DeltaNet layer's struct, where its input projections are one fused GEMM (or
    its QuantParts) and every GEMM a C kernel's; None otherwise."""
    if mixer.in_proj is None or mixer._neg_a is None:
        return None
    parts, out = _gemm_parts(mixer.in_proj, 4), _qweight(mixer.out_proj)
    conv = mixer.conv1d.weight.detach().reshape(cfg.conv_dim, cfg.conv_kernel)
    vecs = [conv, mixer.dt_bias.detach(), mixer._neg_a, mixer.norm.weight.detach()]
    if (out is None or any(p is None for p in parts) or not all(_plain_f32(v) for v in vecs)
            or mixer.norm.eps != cfg.attention.rms_norm_eps):
        return None
    keep += vecs
    width = sum(p.n for p in parts if p is not None and p.w)
    z0, b0, a0 = mixer._starts
    return _Gdn(cfg.key_heads, cfg.value_heads, cfg.key_head_dim, cfg.value_head_dim, cfg.conv_kernel, cfg.conv_dim,
                z0, b0, a0, width, cfg.state_floats, (_QWeight * 4)(*cast("list[_QWeight]", parts)), out,
                *(v.data_ptr() for v in vecs))


def _mlp(mlp, keep: list) -> tuple[list, _QWeight | None, ctypes.Structure | None] | None:
    """(gate/up structs, down's, the mixture's struct or None) of a layer's MLP; None where
    the stack does not take it."""
    if isinstance(mlp, ExpertMixture):
        got = _moe(mlp)
        if got is None:
            return None
        keep += [got[0], *got[1]]
        return [_QWeight(), _QWeight()], _QWeight(), got[0]
    gate_up = mlp.gate_up_silu if mlp.gate_up_silu is not None else mlp.gate_up_proj
    return _gemm_parts(gate_up, 2), _qweight(getattr(mlp, "down_proj", None)), None


class HybridDecodeStack(CpuDecodeStack):
    """`CpuDecodeStack` over a `Qwen35LM`'s layers: its linear layers read the step's
    `StateHost` (the last step struct) and their state pool's tensors; its attention layers
    (the full-attention label) are Qwen3.5's gated attention."""

    @classmethod
    def build(cls, model) -> HybridDecodeStack | None:
        """The stack for `model` (a prepared `Qwen35LM` on the CPU), or None where it does not apply."""
        if os.environ.get("MSTAR_CPU_STACK", "1").lower() in ("0", "false", "no"):
            return None
        cfg: HybridConfig = model.config
        a = cfg.attention
        if (a.hidden_act != "silu" or a.head_dim % 2 or cfg.rotary_dim % 2 or a.num_attention_heads > 128
                or a.num_attention_heads % a.num_key_value_heads):
            return None
        lib = _library()
        if lib is None or not hasattr(lib, "mstar_gdn_gates"):
            return None
        built = _layers(model, cfg)
        if built is None:
            return None
        layers, norms, keep, kinds = built
        shared = max((m.shared_inter for m in keep if isinstance(m, _MoE)), default=0)
        inter = max(a.intermediate_size, a.moe_intermediate_size if a.has_experts else 0, shared)
        vd = cfg.value_dim
        width = max((g.width for g in keep if isinstance(g, _Gdn)), default=0)
        hq, hkv, d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        extra = max(width + cfg.conv_dim + 2 * cfg.value_heads + 2 * vd, 2 * (hq + hkv) * d + hq * d)
        experts, top_k = (a.num_experts, a.num_experts_per_tok) if a.has_experts else (0, 0)
        shape = _Shape(len(layers), a.hidden_size, hq, hkv, d, inter, 0, 0, a.rms_norm_eps, a.attn_scale, 0, experts,
                       top_k, extra)
        stack = cls(lib, shape, layers, norms, kinds, {FULL: FULL})
        stack._first = {k: kinds.index(k) for k in (*KINDS, LINEAR) if k in kinds}
        stack._moe_keep = keep
        stack.max_k = vd
        stack._state_floats = cfg.state_floats
        stack._take_ends(model, {FULL: model.rotary})
        stack._quants = [m for m in model.model.layers.modules() if isinstance(m, QuantLinear)]
        return stack

    _state_floats = 0

    def _bind(self, kv_caches: list[torch.Tensor]) -> bool:
        """The attention layers on their KV pages (all of one kind the C kernels take), the
        linear layers on their state pool's [slots, state_floats] float32 tensors."""
        s = self.shape
        if len(kv_caches) != len(self.layers):
            return False
        attn = [c for c, k in zip(kv_caches, self.kinds) if k != LINEAR]
        states = [c for c, k in zip(kv_caches, self.kinds) if k == LINEAR]
        if not attn or any(not _plain_f32(c) or c.dim() != 2 or c.shape[1] != self._state_floats for c in states):
            return False
        first = attn[0]
        page_size, kind = first.shape[2], _kernel_pages(first)
        if kind is None or any(c.dtype != first.dtype or _kernel_pages(c) != kind or c.dim() != 5 or c.shape[1] != 2
                               or c.shape[2] != page_size or c.shape[3] != s.hkv or head_dim_of(c) != s.d
                               for c in attn):
            return False
        s.kv_kind, s.page_size = kind, page_size
        for lay, c in zip(self.layers, kv_caches):
            lay.cache = c.data_ptr()
        self._caches = kv_caches
        return True

    def _host_steps(self, t: int, kind_meta: dict, bases: dict[str, int], positions: int) -> int:
        """The attention kinds' step structs as the decoder's, and the linear layers' states."""
        state = kind_meta.get(LINEAR)
        if state is not None:
            st = self._steps[LINEAR_STEP]
            st.states, st.n_states = bases[LINEAR], state.n_states
        return super()._host_steps(t, {k: m for k, m in kind_meta.items() if k != LINEAR},
                                   {k: b for k, b in bases.items() if k != LINEAR}, positions)

    def _kind_metas(self, t: int, metas: list, kv_caches: list[torch.Tensor]) -> dict | None:
        """The decoder's checks; the linear layers' rows must be the step's every row."""
        kind_meta = super()._kind_metas(t, metas, kv_caches)
        if kind_meta is None or (LINEAR in kind_meta and not isinstance(kind_meta[LINEAR], StateHost)):
            return None
        if any(k != LINEAR and not isinstance(m, HostStep) for k, m in kind_meta.items()):
            return None
        return kind_meta

    def run(self, x, ropes, kv_caches, metas) -> bool:
        """The modules' layer loop is `Qwen35LM.forward`'s own: only whole steps (`run_step`)."""
        return False


def _layers(model, cfg: HybridConfig) -> tuple[list, list, list, list[str]] | None:
    """Each layer's struct, the norm weights they point at, the structs and tensors to keep
    alive, and each layer's kind (FULL or LINEAR); None where some layer is not one the stack takes."""
    a = cfg.attention
    layers: list[_Layer] = []
    norms: list[list[torch.Tensor]] = []
    keep: list = []
    kinds: list[str] = []
    for layer in model.model.layers:
        mlp = _mlp(layer.mlp, keep)
        if mlp is None or mlp[1] is None or any(g is None for g in mlp[0]):
            return None
        gu, down, moe = mlp
        mods = [layer.input_layernorm, layer.post_attention_layernorm]
        if layer.linear:
            gdn = _gdn(layer.linear_attn, cfg, keep)
            if gdn is None:
                return None
            keep.append(gdn)
            qkv: list[_QWeight | None] = [_QWeight()] * 3
            o: _QWeight | None = _QWeight()
            qk, rotary, step = [None, None], 0, LINEAR_STEP
        else:
            attn = layer.self_attn
            if attn.qkv_proj is None:
                return None
            qkv, o = _gemm_parts(attn.qkv_proj, 3), _qweight(attn.o_proj)
            mods += [attn.q_norm, attn.k_norm]
            qk, rotary, step, gdn = [attn.q_norm.weight, attn.k_norm.weight], cfg.rotary_dim, KINDS.index(FULL), None
        ws = [m.weight for m in mods[:2]] + [w for w in qk if w is not None]
        if (o is None or any(g is None for g in qkv) or not all(_plain_f32(w) for w in ws)
                or any(m.eps != a.rms_norm_eps for m in mods)):
            return None
        norms.append(ws)
        ptr = (lambda w: None if w is None else w.data_ptr())  # noqa: E731
        addr = (lambda c: None if c is None else ctypes.addressof(c))  # noqa: E731
        layers.append(_Layer(ptr(ws[0]), ptr(ws[1]), (_QWeight * 3)(*cast("list[_QWeight]", qkv)), o,
                             (_QWeight * 2)(*gu), down, None, ptr(qk[0]), ptr(qk[1]), None, None, step, addr(moe),
                             None, addr(gdn), rotary))
        kinds.append(LINEAR if layer.linear else FULL)
    return layers, norms, keep, kinds
