"""A decode step's layer stack in one C call (kernels/decode_stack.c) on the CPU.

On a small model (the default SmolLM2, quantized) a one-row decode step runs ~13 kernels per
layer; through the torch modules each is a module call, a ctypes call and a fresh tensor,
and that Python was about half of the step. `CpuDecodeStack` hands the kernel the layers'
weight pointers once (at `prepare`) and each decode step's metadata pointers, and the C
side calls the very kernels the modules call, in their order, on the same inputs: the
result is bitwise the modules' (tests/unit/test_cpu_stack.py), and nothing about the
model's math lives here.

It applies only where the modules' path would run exactly those kernels: a Llama-shaped
decoder (silu MLP, no soft-cap; Qwen3's q/k norms) or Gemma 3's layer (q/k norms, sandwich
norms, gelu_tanh MLP), full-attention and sliding-window layers (each kind its own label
and RoPE tables), whose
four GEMMs per layer are C kernels (q/k/v and gate/up fused, or `QuantParts` of GEMMs apart
where their GGUF types' forms do not concatenate): `QuantLinear` (GGUF weights
kept quantized) or `KernelLinear` / `KernelGateUpSilu` (float32 in gemm.c's panels), float32
activations, float32, bfloat16 or int8 KV pages, and a step whose every row is a decode
query row of each label (no prefill chunk). Anything else (a prefill, a float16 pool, Gemma
2's soft-caps) takes the modules' path. A hybrid's Gated DeltaNet and gated attention layers
are modeling/hybrid/cpu_stack.py's subclass (the layer structs here carry them).
`MSTAR_CPU_STACK=0` turns it off (to compare).
On Gemma 3 270M (18 layers) the modules' path cost ~9 ms of a ~22 ms decode step.

The runner's steps go further (`run_step`): the embedding, the final norm and the head run
in the same call, from plain ints and into a kept logits buffer, with no torch op on the
way; and plain causal prompt chunks beside the decode rows (steps of up to
`MAX_CHUNK_ROWS`, a longer step in pieces of that many) run there too, through the prefill
kernel. After the step's weights have
streamed through the caches every torch op costs 20-40 us (10 warm): a SmolLM2 decode step
spent ~0.6 ms of its ~4.5 ms in a dozen of them, and a step through the modules costs ~3 ms
more than one call on an 8-layer model, ~8 ms on SmolLM2's 30 layers.
"""

from __future__ import annotations

import ctypes
import os
from typing import cast

import numpy as np
import torch

from services.gpu_worker import cpu_kernels
from services.gpu_worker.attention import HostStep, KernelDecode, _decode_scratch, _kernel_pages, head_dim_of
from services.gpu_worker.layers import quant
from services.gpu_worker.layers.gpt_oss_moe import GptOssMoE
from services.gpu_worker.layers.linear import KernelGateUpSilu, KernelHead, KernelLinear
from services.gpu_worker.layers.moe import (
    MAX_KERNEL_EXPERTS,
    SOFTMAX_TOPK,
    SOFTMAX_TOPK_NORM,
    TOPK_SOFTMAX,
    ExpertMixture,
    SparseMoE,
)
from services.gpu_worker.layers.norm import RMSNorm
from services.gpu_worker.layers.quant import QuantEmbedding, QuantLinear, QuantParts
from services.gpu_worker.layers.rope import Rotary
from shared.model_config import FULL, SLIDING

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _QWeight(ctypes.Structure):
    _fields_ = [("form", _i64), ("k", _i64), ("n", _i64), ("w", _ptr), ("d", _ptr), ("m", _ptr), ("bias", _ptr)]


class _MoE(ctypes.Structure):
    _fields_ = [("n_experts", _i64), ("top_k", _i64), ("inter", _i64), ("route", _i64), ("clamped", _i64),
                ("alpha", _f32), ("limit", _f32), ("router", _QWeight), ("gate_up", _ptr), ("down", _ptr),
                ("shared_inter", _i64), ("shared_gate_up", _QWeight * 2), ("shared_down", _QWeight),
                ("shared_gate", _QWeight)]


class _Layer(ctypes.Structure):
    _fields_ = [("ln1", _ptr), ("ln2", _ptr), ("qkv", _QWeight * 3), ("o", _QWeight), ("gate_up", _QWeight * 2),
                ("down", _QWeight), ("cache", _ptr), ("q_norm", _ptr), ("k_norm", _ptr), ("ln3", _ptr), ("ln4", _ptr),
                ("step", _i64), ("moe", _ptr), ("sinks", _ptr), ("gdn", _ptr), ("rotary", _i64)]


class _Shape(ctypes.Structure):
    _fields_ = [("n_layers", _i64), ("hidden", _i64), ("hq", _i64), ("hkv", _i64), ("d", _i64), ("inter", _i64),
                ("page_size", _i64), ("kv_kind", _i64), ("eps", _f32), ("scale", _f32), ("gelu", _i64),
                ("n_experts", _i64), ("top_k", _i64), ("extra", _i64)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _i64), ("cos", _ptr), ("sin_signed", _ptr), ("slot_pages", _ptr), ("slot_offsets", _ptr),
                ("pages", _ptr), ("width", _i64), ("qrow", _ptr), ("entry", _ptr), ("lo", _ptr), ("hi", _ptr),
                ("n_query", _i64), ("max_keys", _i64), ("positions", _ptr), ("chunks", _ptr), ("chunk_pages", _ptr),
                ("n_chunks", _i64), ("window", _i64), ("states", _ptr), ("n_states", _i64)]


class _Ends(ctypes.Structure):
    _fields_ = [("embed", _QWeight), ("embed_scale", _f32), ("ids", _ptr), ("norm", _ptr), ("head", _QWeight),
                ("sample_rows", _ptr), ("n_sample", _i64), ("logits", _ptr)]


#: decode_stack.c's kinds of float32 GEMM (beside the quantized forms 4, 5, 6, 8, 9 and 16)
GEMM_F32, GEMM_F32_SILU = 32, 33
#: the layer kinds a stack step serves, in the order of its steps
KINDS = (FULL, SLIDING)
#: the step structs a call takes: one per kind, and a hybrid's linear layers' (the last)
STEPS = len(KINDS) + 1
#: the most rows of a step with prompt chunks `run_step` takes (its workspace grows with the
#: rows, its attention scratch with rows x keys); the runner calls it on a longer step in
#: pieces of at most this many rows (runners/base.py `host_pieces`), which took 12-17% less
#: time than the modules' path on an 896-row prefill of the bench's Q8_0 hybrid and MoE
MAX_CHUNK_ROWS = 256


def _gemm_parts(layer, parts: int) -> list[_QWeight | None]:
    """A fused GEMM's C structs: `parts` of them, the first its whole weight, or for
    `QuantParts` each part's (the rest empty)."""
    if isinstance(layer, QuantParts):
        if len(layer.layers) > parts:
            return [None]
        return [_qweight(p) for p in layer.layers] + [_QWeight()] * (parts - len(layer.layers))
    return [_qweight(layer)] + [_QWeight()] * (parts - 1)


def _qweight(layer) -> _QWeight | None:
    """The C struct of one of a layer's GEMMs, or None for a kind the stack does not run."""
    ptr = (lambda t: None if t is None else t.data_ptr())  # noqa: E731
    if isinstance(layer, QuantLinear):
        return _QWeight(layer.form, layer.in_features, layer.out_features, layer.w.data_ptr(), layer.d.data_ptr(),
                        ptr(layer.m), ptr(layer.bias))
    if isinstance(layer, KernelLinear):
        return _QWeight(GEMM_F32, layer.in_features, layer.out_features, layer.packed.data_ptr(), None, None,
                        ptr(layer.bias))
    if isinstance(layer, KernelGateUpSilu):
        return _QWeight(GEMM_F32_SILU, layer.in_features, layer.inter, layer.packed.data_ptr(), None, None, None)
    return None


def _moe(mlp: ExpertMixture) -> tuple[_MoE, list] | None:
    """A mixture-of-experts block as the C stack's struct (and the arrays its pointers are
    into), where the stack computes it as the module does: Qwen3-MoE's or Mixtral's, a
    hybrid's with its gated shared expert (Qwen3.5-MoE, Qwen3-Next: `_shared`) or gpt-oss's,
    its router a C GEMM, its experts packed (`pack`) or kept quantized (`keep_quantized`),
    the C routing (`kernel_route`: at most MAX_KERNEL_EXPERTS); None otherwise."""
    oss = isinstance(mlp, GptOssMoE)
    router = _qweight(mlp.router if oss else mlp.gate)
    shared = None if oss or type(mlp) is not SparseMoE else _shared(mlp)
    if not (oss or shared is not None) or router is None or not (
            1 <= mlp.top_k <= mlp.num_experts <= MAX_KERNEL_EXPERTS):
        return None
    n = mlp.num_experts
    if mlp.quant is not None:
        gate_up = [_qweight(q) for q in mlp.quant.gate_up]
        down = [_qweight(q) for q in mlp.quant.down]
    elif mlp.gate_up_packed is not None and mlp.down_packed is not None:
        gate_up, down = _packed_experts(mlp)
    else:
        return None
    weights = [w for w in gate_up + down if w is not None]
    if len(weights) != 2 * n:
        return None
    gu, dn = (_QWeight * n)(*weights[:n]), (_QWeight * n)(*weights[n:])
    route = TOPK_SOFTMAX if oss else SOFTMAX_TOPK_NORM if mlp.norm_topk_prob else SOFTMAX_TOPK
    alpha, limit = (mlp.alpha, mlp.limit) if oss else (0.0, 0.0)
    struct = _MoE(n, mlp.top_k, mlp.inter, route, int(oss), alpha, limit, router, ctypes.addressof(gu),
                  ctypes.addressof(dn), *(shared or ()))
    return struct, [gu, dn]


def _shared(mlp: SparseMoE) -> tuple | None:
    """A `SparseMoE`'s shared expert as `_MoE`'s last fields (its width, gate/up parts, down
    and gate GEMMs; all empty where it has none), or None where some GEMM is not a C kernel's."""
    if mlp.shared_expert is None:
        return 0, (_QWeight * 2)(), _QWeight(), _QWeight()
    dense = mlp.shared_expert
    gate_up = dense.gate_up_silu if dense.gate_up_silu is not None else dense.gate_up_proj
    parts, down = _gemm_parts(gate_up, 2), _qweight(getattr(dense, "down_proj", None))
    gate = _qweight(mlp.shared_expert_gate)
    if any(p is None for p in parts) or down is None or gate is None or gate.n != 1:
        return None
    return down.k, (_QWeight * 2)(*cast("list[_QWeight]", parts)), down, gate


def _packed_experts(mlp: ExpertMixture) -> tuple[list[_QWeight | None], list[_QWeight | None]]:
    """The packed experts' weights (`pack`): Qwen3-MoE's gate/up with silu * up in the GEMM,
    gpt-oss's gate/up and down with their biases (gate half, then up half)."""
    assert mlp.gate_up_packed is not None and mlp.down_packed is not None
    n, h, i = mlp.num_experts, mlp.hidden, mlp.inter
    if isinstance(mlp, GptOssMoE):
        assert mlp.gate_up_bias is not None and mlp.down_bias is not None
        return ([_QWeight(GEMM_F32, h, 2 * i, mlp.gate_up_packed[e].data_ptr(), None, None,
                          mlp.gate_up_bias[e].data_ptr()) for e in range(n)],
                [_QWeight(GEMM_F32, i, h, mlp.down_packed[e].data_ptr(), None, None, mlp.down_bias[e].data_ptr())
                 for e in range(n)])
    return ([_QWeight(GEMM_F32_SILU, h, i, mlp.gate_up_packed[e].data_ptr(), None, None, None) for e in range(n)],
            [_QWeight(GEMM_F32, i, h, mlp.down_packed[e].data_ptr(), None, None, None) for e in range(n)])


def _plain_f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _library():
    lib = cpu_kernels.library()
    if lib is None or not hasattr(lib, "mstar_decode_stack") or not quant.available():
        return None
    lib.mstar_decode_stack.restype = ctypes.c_int
    lib.mstar_decode_stack.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int]
    lib.mstar_stack_workspace.restype = _i64
    lib.mstar_stack_workspace.argtypes = [_ptr, _i64]
    lib.mstar_decode_model.restype = ctypes.c_int
    lib.mstar_decode_model.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int]
    lib.mstar_model_workspace.restype = _i64
    lib.mstar_model_workspace.argtypes = [_ptr, _i64, _i64]
    return lib


class CpuDecodeStack:
    """The layers of a `DecoderLM` as the C stack's structs. `run_step` does a whole decode
    step (embedding to logits) in one call from the runner's plain ints; `run` does the
    layer loop alone on the modules' tensors (`DecoderLM.hidden`: image rows, a model whose
    ends the C side does not take). Each declines a step it does not take, and the modules
    run it."""

    def __init__(self, lib, shape: _Shape, layers: list, norms: list[list[torch.Tensor | None]], kinds: list[str],
                 ropes: dict[str, str]) -> None:
        self.lib = lib
        self.shape = shape
        self.layers = (_Layer * len(layers))(*layers)
        self._norms = norms  # kept alive: the structs hold their pointers
        self._moe_keep: list = []  # the mixture-of-experts structs and arrays the layers point at
        #: each layer's kind (FULL or SLIDING: its label), the first layer of each kind present,
        #: and the RoPE tables each kind reads (the model's key: one for both where they agree)
        self.kinds = kinds
        self._first = {k: kinds.index(k) for k in KINDS if k in kinds}
        self._rope_of = ropes
        self._caches: list[torch.Tensor] | None = None  # the KV tensors the structs point at
        self._refused: list[torch.Tensor] | None = None  # KV tensors it does not take
        self._work = torch.empty(0)
        self._steps = (_Step * STEPS)()
        #: the widest input of any of the layers' GEMMs (the quantized GEMMs' scratch), where a
        #: subclass's layers have one wider than the hidden size, the MLP's and the attention's
        self.max_k = 0
        #: the embedding, final norm and head as `run_step`'s struct (None: it declines),
        #: the tensors its pointers are into, and the RoPE modules whose tables it reads whole
        self._ends: _Ends | None = None
        self._ends_keep: list[torch.Tensor] = []
        self._rotaries: dict = {}
        #: the layers' quantized GEMMs, and whether they compute prompt rows as decode rows
        #: (no bfloat16 copy, two bytes a value: `weights.prompt_path`, set once at load)
        self._quants: list[QuantLinear] = []
        self._plain_prompts: bool | None = None
        #: per RoPE key, its tables' pointers and the cos table they were taken from
        self._tables: dict[str, tuple[int, int, torch.Tensor]] = {}
        self._io = np.empty(0, dtype=np.int64)
        self._io_ptr = 0
        self._logits = np.empty((0, 0), dtype=np.float32)
        self._shape_ref = ctypes.byref(shape)
        self._ends_ref: object = None  # ctypes.byref(self._ends)
        #: `run_step`'s workspace pointers and what they were for: (rows, sampled rows), the
        #: keys their attention scratch holds, the buffers they point into
        self._ws: tuple | None = None

    @classmethod
    def build(cls, model) -> CpuDecodeStack | None:
        """The stack for `model` (a prepared `DecoderLM`), or None where it does not apply."""
        if os.environ.get("MSTAR_CPU_STACK", "1").lower() in ("0", "false", "no"):
            return None
        cfg = model.config
        if (cfg.hidden_act not in ("silu", "gelu_pytorch_tanh") or cfg.attn_softcap is not None
                or any(t not in KINDS for t in cfg.layer_types)
                or cfg.head_dim % 2 or cfg.num_attention_heads > 128
                or cfg.num_attention_heads % cfg.num_key_value_heads):
            return None
        lib = _library()
        if lib is None:
            return None
        layers, norms, keep = [], [], []
        for layer, kind in zip(model.model.layers, cfg.layer_types, strict=True):
            attn, mlp, moe = layer.self_attn, layer.mlp, None
            gu: list[_QWeight | None]
            down: _QWeight | None
            if isinstance(mlp, ExpertMixture):
                got = _moe(mlp)
                if got is None:
                    return None
                moe = got[0]
                keep += [moe, *got[1]]
                gu, down = [_QWeight(), _QWeight()], _QWeight()  # (the layer's dense MLP: none)
            else:
                gate_up = mlp.gate_up_silu if mlp.gate_up_silu is not None else mlp.gate_up_proj
                gu, down = _gemm_parts(gate_up, 2), _qweight(getattr(mlp, "down_proj", None))
            gemms = [*_gemm_parts(attn.qkv_proj, 3), _qweight(attn.o_proj), *gu, down]
            # ln1, ln2, then q/k norms (Gemma 3, Qwen3) and the MLP's own two (Gemma 3), or None
            mods = [layer.input_layernorm, layer.post_attention_layernorm,
                    *((attn.q_norm, attn.k_norm) if cfg.qk_norm else (None, None)),
                    *((layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm) if cfg.sandwich_norm
                      else (None, None))]
            ws = [None if m is None else m.weight for m in mods]
            sinks = getattr(attn, "sinks", None)  # gpt-oss's, else None
            if sinks is not None and not _plain_f32(sinks):
                return None
            if (any(g is None for g in gemms) or kind not in KINDS
                    or any(w is not None and (w.dtype != torch.float32 or w.device.type != "cpu"
                                              or not w.is_contiguous()) for w in ws)
                    or any(m is not None and m.eps != cfg.rms_norm_eps for m in mods)):
                return None
            norms.append([*ws, sinks])
            ptrs = [None if w is None else w.data_ptr() for w in ws]
            g = cast("list[_QWeight]", gemms)  # q, k, v, o, gate, up, down (k, v, up empty where fused)
            layers.append(_Layer(ptrs[0], ptrs[1], (_QWeight * 3)(*g[:3]), g[3], (_QWeight * 2)(*g[4:6]), g[6], None,
                                 *ptrs[2:], KINDS.index(kind), None if moe is None else ctypes.addressof(moe),
                                 None if sinks is None else sinks.data_ptr()))
        shared = max((m.shared_inter for m in keep if isinstance(m, _MoE)), default=0)
        shape = _Shape(len(layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                       max(cfg.intermediate_size, cfg.moe_intermediate_size if cfg.has_experts else 0, shared), 0, 0,
                       cfg.rms_norm_eps, cfg.attn_scale, int(cfg.hidden_act != "silu"),
                       cfg.num_experts if cfg.has_experts else 0, cfg.num_experts_per_tok if cfg.has_experts else 0)
        rope_of = {k: r for k, r in zip(cfg.layer_types, model.layer_rope, strict=True)}
        stack = cls(lib, shape, layers, norms, list(cfg.layer_types), rope_of)
        stack._moe_keep = keep
        stack._take_ends(model)
        stack._quants = [m for m in model.model.layers.modules() if isinstance(m, QuantLinear)]
        return stack

    def _plain_prompt_rows(self) -> bool:
        """Prompt rows go through the layers' GEMMs as decode rows do, as the C side runs
        them (no bfloat16 copy, two-byte values); asked at the first step with a prompt chunk,
        after `weights.prompt_path` set them at load."""
        if self._plain_prompts is None:
            self._plain_prompts = all(m.wide is None and m.prompt_bytes == 2 for m in self._quants)
        return self._plain_prompts

    def _take_ends(self, model, rotaries: dict | None = None) -> None:
        """`run_step`'s embedding, final norm and head, where each is one the C side runs
        as the modules do: a float32 or quantized embedding (a form `mstar_qrows` takes), the
        model's RMSNorm in float32 with the layers' eps, a quantized or C-kernel float32
        head, and plain RoPE (one position a row). Otherwise `run_step` declines."""
        cfg, lib, s = getattr(model.config, "attention", model.config), self.lib, self.shape
        embed, norm, head = model.model.embed_tokens, model.model.norm, model.head
        if rotaries is None:  # (a subclass passes its own: RoPE modules whose one-position rows are Rotary's)
            rotaries = {key: model.rotaries[key] for key in set(self._rope_of.values())}
            if any(type(r) is not Rotary for r in rotaries.values()):
                return
        if (not isinstance(norm, RMSNorm)
                or norm.eps != cfg.rms_norm_eps or not _plain_f32(norm.weight)):
            return
        keep: list[torch.Tensor] = [norm.weight]
        if isinstance(embed, QuantEmbedding):
            em = _qweight(embed.table)
            probe, row = torch.zeros(1, dtype=torch.int64), torch.empty(embed.embedding_dim)
            if em is None or lib.mstar_qrows(em.form, em.w, em.d, em.m, em.n, em.k, probe.data_ptr(), 1,
                                             row.data_ptr(), em.k) != 0:
                return  # a form whose rows torch dequantizes
        elif type(embed) is torch.nn.Embedding and _plain_f32(embed.weight):
            em = _QWeight(0, embed.embedding_dim, embed.num_embeddings, embed.weight.data_ptr(), None, None, None)
            keep.append(embed.weight)
        else:
            return
        if isinstance(head, QuantLinear):
            hw = _qweight(head)
        elif isinstance(head, KernelHead):
            hw = _QWeight(GEMM_F32, s.hidden, head.vocab, head.packed.data_ptr(), None, None, None)
        else:
            return
        if hw is None or em.k != s.hidden or hw.k != s.hidden:
            return
        scale = float(torch.tensor(cfg.embed_scale, dtype=torch.float32))  # as the modules multiply
        self._ends = _Ends(em, scale, None, norm.weight.data_ptr(), hw, None, 0, None)
        self._ends_ref = ctypes.byref(self._ends)
        self._ends_keep = keep
        self._rotaries = rotaries

    def _bind(self, kv_caches: list[torch.Tensor]) -> bool:
        """Point the layers at the pool's KV tensors (once: the runner passes the same list
        every step); False where the pages are not ones the attention's C kernels take
        (float32, or bfloat16 or int8 where attention.py has their kernels), all alike."""
        s = self.shape
        if len(kv_caches) != len(self.layers):
            return False
        first = kv_caches[0]
        page_size, kind = first.shape[2], _kernel_pages(first)
        if kind is None:
            return False
        for c in kv_caches:
            if (c.dtype != first.dtype or _kernel_pages(c) != kind or c.dim() != 5 or c.shape[1] != 2
                    or c.shape[2] != page_size or c.shape[3] != s.hkv or head_dim_of(c) != s.d):
                return False
        s.kv_kind = kind
        for lay, c in zip(self.layers, kv_caches):
            lay.cache = c.data_ptr()
        s.page_size = page_size
        self._caches = kv_caches
        return True

    def run(self, x: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
            kv_caches: list[torch.Tensor], metas: list) -> bool:
        """x [T, hidden] (float32, contiguous) through every layer, in place, if this step
        is one the stack takes; False (x untouched) otherwise. `ropes`: each layer kind's
        RoPE tables by the model's key; `metas[i]` layer i's label's metadata (one per kind)."""
        t = x.shape[0]
        if t == 0 or x.dtype != torch.float32 or not x.is_contiguous():
            return False
        for cos, sin in ropes.values():
            if cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
                return False
        max_keys = self._set_steps(t, metas, kv_caches, ropes)
        if max_keys is None:
            return False
        s, lib = self.shape, self.lib
        work, qscratch, ascratch = self._workspace(t, int(lib.mstar_stack_workspace(ctypes.byref(s), t)), max_keys)
        rc = lib.mstar_decode_stack(ctypes.byref(s), self.layers, self._steps, x.data_ptr(), work, qscratch, ascratch,
                                    quant.threads())
        if rc:
            raise RuntimeError(f"the CPU decode stack failed (code {rc})")
        return True

    def run_step(self, ids: list[int], positions: list[int], sample_rows: list[int], metas: list[HostStep | None],
                 kv_caches: list[torch.Tensor]) -> np.ndarray | None:
        """A step's whole forward in one call, from plain ints: the embedding of `ids`,
        every layer (`metas[i]`: layer i's label's `KernelBuilder.host` metadata, one per
        kind: decode rows, and plain prompt chunks in a step of up to `MAX_CHUNK_ROWS`), the
        final norm of `sample_rows` and the LM head. Returns their logits [S, vocab] (before
        any final soft-cap; valid until the next call), or None where the stack does not take
        the step or the model's ends (`_take_ends`), and the modules run it. Nothing here is
        a torch op: each costs tens of microseconds with the caches cold from the step's
        weights, which made ~0.5 ms of a ~4 ms SmolLM2 decode step."""
        ends, t, n_sample = self._ends, len(ids), len(sample_rows)
        if ends is None or t == 0 or len(positions) != t:
            return None
        kind_meta = self._kind_metas(t, metas, kv_caches)
        if kind_meta is None or not self._rope_tables(max(positions) + 1):
            return None
        flat = ids + positions + sample_rows
        starts = {}
        for k, meta in kind_meta.items():
            starts[k] = len(flat)
            flat += meta.ints
        if len(flat) > len(self._io) or n_sample > len(self._logits):
            self._grow_io(len(flat), n_sample)
        self._io[: len(flat)] = flat
        io = self._io_ptr
        ends.ids, ends.sample_rows, ends.n_sample = io, io + 16 * t, n_sample
        max_keys = self._host_steps(t, kind_meta, {k: io + 8 * at for k, at in starts.items()}, io + 8 * t)
        lib, ws = self.lib, self._ws
        if (ws is None or ws[0] != (t, n_sample) or max_keys > ws[1] or ws[2] is not self._work
                or ws[3] is not quant._scratch_buf):  # else the last step's buffers still fit
            floats = int(lib.mstar_model_workspace(self._shape_ref, t, n_sample))
            ptrs = self._workspace(t, floats, max_keys)
            ws = self._ws = ((t, n_sample), max_keys, self._work, quant._scratch_buf, ptrs)
        work, qscratch, ascratch = ws[4]
        rc = lib.mstar_decode_model(self._shape_ref, self.layers, self._steps, self._ends_ref, work, qscratch,
                                    ascratch, quant.threads())
        if rc == -2:  # as torch's embedding refuses it
            raise IndexError(f"a token id outside [0, {ends.embed.n})")
        if -30000 - len(self.layers) < rc <= -30000:  # a chunk the prefill kernel refused: the modules
            return None  # run the step (the K/V rows written here are the ones they write)
        if rc:
            raise RuntimeError(f"the CPU decode stack failed (code {rc})")
        return self._logits[:n_sample]

    def _kind_metas(self, t: int, metas: list[HostStep | None], kv_caches: list[torch.Tensor]
                    ) -> dict[str, HostStep] | None:
        """Each layer kind's metadata, where `run_step` takes the step (every row of each
        label a decode row or a plain chunk's, the chunks' rows computed as decode rows are,
        the KV tensors ones it binds); else None."""
        kind_meta = self._per_kind(metas, kv_caches)
        if kind_meta is None:
            return None
        for meta in kind_meta.values():
            if meta is None or meta.n_slots != t:
                return None
            if meta.n_chunks and (t > MAX_CHUNK_ROWS or not self._plain_prompt_rows()):
                return None
        return kind_meta

    def _per_kind(self, metas: list, kv_caches: list[torch.Tensor]) -> dict | None:
        """Each layer kind's metadata (its first layer's), where every layer of the kind has
        that same one and the KV tensors are ones the structs bind; else None."""
        kind_meta = {k: metas[i] for k, i in self._first.items()}
        if any(m is not kind_meta[k] for m, k in zip(metas, self.kinds)):
            return None
        if kv_caches is not self._caches and (kv_caches is self._refused or not self._bind(kv_caches)):
            self._refused = kv_caches  # asked once per pool list, not every step
            return None
        return kind_meta

    def _rope_tables(self, high: int) -> bool:
        """The RoPE tables hold positions below `high` (grown where needed), their pointers
        in `_tables`; False past the model's positions (the modules' indexing refuses it)."""
        tables = self._tables
        for key, rot in self._rotaries.items():
            if rot.rows < high:
                rot.ensure(high)
                if rot.rows < high:
                    return False
            cos = rot.cos
            if key not in tables or tables[key][2] is not cos:  # grown (here or by a prefill): new tensors
                tables[key] = (cos.data_ptr(), rot.sin_signed.data_ptr(), cos)
        return True

    def _host_steps(self, t: int, kind_meta: dict[str, HostStep], bases: dict[str, int], positions: int) -> int:
        """Point each kind's step struct into the host buffer (`bases[kind]`: where its
        metadata's ints are, `positions`: the rows' positions); the most keys a decode row
        may read."""
        s, max_keys = self.shape, 0
        for st in self._steps:
            st.rows = t
        for k, meta in kind_meta.items():
            st, base = self._steps[KINDS.index(k)], bases[k]
            st.cos, st.sin_signed, _ = self._tables[self._rope_of[k]]
            st.positions = positions
            st.slot_pages, st.slot_offsets = base, base + 8 * meta.n_slots
            q, n = base + 16 * meta.n_slots, meta.n_query
            st.qrow, st.entry, st.lo, st.hi = q, q + 8 * n, q + 16 * n, q + 24 * n
            st.pages, st.width = base + 8 * meta.pages_at, meta.width
            st.n_query, st.max_keys = meta.n_query, meta.width * s.page_size
            st.chunks, st.chunk_pages = base + 8 * meta.chunks_at, base + 8 * meta.chunk_pages_at
            st.n_chunks, st.window = meta.n_chunks, meta.window
            max_keys = max(max_keys, st.max_keys)
        return max_keys

    def _grow_io(self, ints: int, rows: int) -> None:
        """`run_step`'s host buffers (kept: their addresses go into the structs once a step,
        where a fresh array's pointer is itself a cold call): the step's ints, and the logits,
        grown to exactly the most rows a step has sampled (the warm-up's steps come close to
        the most the limits allow: what the modules' path holds during such a step)."""
        ends = self._ends
        assert ends is not None
        self._io = np.empty(max(ints, 2 * len(self._io)), dtype=np.int64)
        self._io_ptr = self._io.ctypes.data
        if rows > len(self._logits):
            self._logits = np.empty((rows, ends.head.n), dtype=np.float32)
            ends.logits = self._logits.ctypes.data

    def _set_steps(self, t: int, metas: list, kv_caches: list[torch.Tensor],
                   ropes: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int | None:
        """Fill the call's step structs from a step's metadata (one per layer kind) and each
        kind's RoPE rows; the longest row's keys, or None where the stack does not take the
        step."""
        kind_meta = self._per_kind(metas, kv_caches)
        if kind_meta is None:
            return None
        for meta in kind_meta.values():
            dec = meta.decode
            if not isinstance(dec, KernelDecode) or meta.prefills or dec.query.shape[1] != t:
                return None
        s = self.shape
        for st in self._steps:  # (the C side reads the rows from the first)
            st.rows = t
        max_keys = 0
        for k, meta in kind_meta.items():
            st, dec, (cos, sin) = self._steps[KINDS.index(k)], meta.decode, ropes[self._rope_of[k]]
            base, step = dec.query.data_ptr(), dec.query.stride(0) * 8
            st.cos, st.sin_signed, st.positions = cos.data_ptr(), sin.data_ptr(), None
            st.n_chunks = 0  # (a `run_step` before may have left its chunks: pointers into a buffer since reused)
            st.slot_pages, st.slot_offsets = meta.slot_pages.data_ptr(), meta.slot_offsets.data_ptr()
            st.pages, st.width = dec.pages.data_ptr(), dec.pages.shape[1]
            st.qrow, st.entry, st.lo, st.hi = base, base + step, base + 2 * step, base + 3 * step
            st.n_query, st.max_keys = t, dec.pages.shape[1] * s.page_size
            max_keys = max(max_keys, st.max_keys)
        return max_keys

    def _workspace(self, t: int, floats: int, max_keys: int) -> tuple[int, int, int]:
        """(work, the quantized GEMMs' scratch, the attention's scratch) pointers for a step
        of `t` rows whose own workspace is `floats` floats."""
        s, lib = self.shape, self.lib
        attn_scratch = int(_decode_scratch(lib)(t, s.hq, s.d, max_keys))
        need = floats + attn_scratch
        if self._work.numel() < need:
            self._work = torch.empty(max(need, 2 * self._work.numel()))
        work = self._work.data_ptr()
        qscratch = quant._scratch(lib, t, max(s.hidden, s.inter, s.hq * s.d, self.max_k))
        return work, qscratch, work + 4 * floats
