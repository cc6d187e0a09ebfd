"""A decode step's layer stack in one C call (kernels/decode_stack.c) on the CPU.

On a small model (the default SmolLM2, quantized) a one-row decode step runs ~13 kernels per
layer; through the torch modules each is a module call, a ctypes call and a fresh tensor,
and that Python was about half of the step. `CpuDecodeStack` hands the kernel the layers'
weight pointers once (at `prepare`) and each decode step's metadata pointers, and the C
side calls the very kernels the modules call, in their order, on the same inputs: the
result is bitwise the modules' (tests/unit/test_cpu_stack.py), and nothing about the
model's math lives here.

It applies only where the modules' path would run exactly those kernels: a Llama-shaped
decoder (no q/k norm, no sandwich norms, silu MLP, no soft-cap, one RoPE, full attention
on every layer) whose four GEMMs per layer are C kernels (q/k/v and gate/up fused):
`QuantLinear` (GGUF weights kept quantized) or `KernelLinear` / `KernelGateUpSilu` (float32
in gemm.c's panels), float32 activations, float32, bfloat16 or int8 KV pages, and a step whose
every row is a decode query row of the one label (no prefill chunk). Anything else (a
prefill, a float16 pool, a Gemma) takes the modules' path. `MSTAR_CPU_STACK=0` turns it off (to compare).
"""

from __future__ import annotations

import ctypes
import os

import torch

from services.gpu_worker import cpu_kernels
from services.gpu_worker.attention import KernelDecode, _decode_scratch, _kernel_pages, head_dim_of
from services.gpu_worker.layers import quant
from services.gpu_worker.layers.linear import KernelGateUpSilu, KernelLinear
from services.gpu_worker.layers.quant import QuantLinear
from shared.model_config import FULL

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _QWeight(ctypes.Structure):
    _fields_ = [("form", _i64), ("k", _i64), ("n", _i64), ("w", _ptr), ("d", _ptr), ("m", _ptr), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("ln1", _ptr), ("ln2", _ptr), ("qkv", _QWeight), ("o", _QWeight), ("gate_up", _QWeight),
                ("down", _QWeight), ("cache", _ptr)]


class _Shape(ctypes.Structure):
    _fields_ = [("n_layers", _i64), ("hidden", _i64), ("hq", _i64), ("hkv", _i64), ("d", _i64), ("inter", _i64),
                ("page_size", _i64), ("kv_kind", _i64), ("eps", _f32), ("scale", _f32)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _i64), ("cos", _ptr), ("sin_signed", _ptr), ("slot_pages", _ptr), ("slot_offsets", _ptr),
                ("pages", _ptr), ("width", _i64), ("qrow", _ptr), ("entry", _ptr), ("lo", _ptr), ("hi", _ptr),
                ("n_query", _i64), ("max_keys", _i64)]


#: decode_stack.c's kinds of float32 GEMM (beside the quantized forms 4 and 8)
GEMM_F32, GEMM_F32_SILU = 32, 33


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


def _library():
    lib = cpu_kernels.library()
    if lib is None or not hasattr(lib, "mstar_decode_stack") or not quant.available():
        return None
    lib.mstar_decode_stack.restype = ctypes.c_int
    lib.mstar_decode_stack.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int]
    lib.mstar_stack_workspace.restype = _i64
    lib.mstar_stack_workspace.argtypes = [_ptr, _i64]
    return lib


class CpuDecodeStack:
    """The layers of a `DecoderLM` as the C stack's structs; `run` does a decode step's
    layer loop in one call, or declines (False) and the modules run it."""

    def __init__(self, lib, shape: _Shape, layers: list, norms: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.lib = lib
        self.shape = shape
        self.layers = (_Layer * len(layers))(*layers)
        self._norms = norms  # kept alive: the structs hold their pointers
        self._caches: list[torch.Tensor] | None = None  # the KV tensors the structs point at
        self._refused: list[torch.Tensor] | None = None  # KV tensors it does not take
        self._work = torch.empty(0)
        self._step = _Step()

    @classmethod
    def build(cls, model) -> CpuDecodeStack | None:
        """The stack for `model` (a prepared `DecoderLM`), or None where it does not apply."""
        if os.environ.get("MSTAR_CPU_STACK", "1").lower() in ("0", "false", "no"):
            return None
        cfg = model.config
        if (cfg.qk_norm or cfg.sandwich_norm or cfg.hidden_act != "silu" or cfg.attn_softcap is not None
                or any(t != FULL for t in cfg.layer_types) or len(model.rotaries) != 1
                or cfg.head_dim % 2 or cfg.num_attention_heads > 128
                or cfg.num_attention_heads % cfg.num_key_value_heads):
            return None
        lib = _library()
        if lib is None:
            return None
        layers, norms = [], []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            gate_up = mlp.gate_up_silu if mlp.gate_up_silu is not None else mlp.gate_up_proj
            gemms = [_qweight(g) for g in (attn.qkv_proj, attn.o_proj, gate_up, getattr(mlp, "down_proj", None))]
            ln1, ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            if (any(g is None for g in gemms)
                    or any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous()
                           for w in (ln1, ln2))
                    or layer.input_layernorm.eps != cfg.rms_norm_eps
                    or layer.post_attention_layernorm.eps != cfg.rms_norm_eps):
                return None
            norms.append((ln1, ln2))
            layers.append(_Layer(ln1.data_ptr(), ln2.data_ptr(), *gemms, None))
        shape = _Shape(len(layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                       cfg.intermediate_size, 0, 0, cfg.rms_norm_eps, cfg.attn_scale)
        return cls(lib, shape, layers, norms)

    def _bind(self, kv_caches: list[torch.Tensor]) -> bool:
        """Point the layers at the pool's KV tensors (once: the runner passes the same list
        every step); False where the pages are not ones the attention's C kernels take
        (float32, or bfloat16 or int8 where attention.py has their kernels), all alike."""
        s = self.shape
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

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_caches: list[torch.Tensor],
            metas: list) -> bool:
        """x [T, hidden] (float32, contiguous) through every layer, in place, if this step
        is one the stack takes; False (x untouched) otherwise."""
        meta = metas[0]
        t = x.shape[0]
        dec = meta.decode
        if (not isinstance(dec, KernelDecode) or meta.prefills or dec.query.shape[1] != t or t == 0
                or x.dtype != torch.float32 or not x.is_contiguous() or any(m is not meta for m in metas)):
            return False
        if kv_caches is not self._caches and (kv_caches is self._refused or not self._bind(kv_caches)):
            self._refused = kv_caches  # asked once per pool list, not every step
            return False
        cos, sin = rope
        if cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
            return False
        s, st, lib = self.shape, self._step, self.lib
        pages, dq = dec.pages, dec.query
        max_keys = pages.shape[1] * s.page_size
        attn_scratch = int(_decode_scratch(lib)(t, s.hq, s.d, max_keys))
        need = int(lib.mstar_stack_workspace(ctypes.byref(s), t)) + attn_scratch
        if self._work.numel() < need:
            self._work = torch.empty(max(need, 2 * self._work.numel()))
        work = self._work.data_ptr()
        base, step = dq.data_ptr(), dq.stride(0) * 8
        st.rows, st.cos, st.sin_signed = t, cos.data_ptr(), sin.data_ptr()
        st.slot_pages, st.slot_offsets = meta.slot_pages.data_ptr(), meta.slot_offsets.data_ptr()
        st.pages, st.width = pages.data_ptr(), pages.shape[1]
        st.qrow, st.entry, st.lo, st.hi = base, base + step, base + 2 * step, base + 3 * step
        st.n_query, st.max_keys = t, max_keys
        k_max = max(s.hidden, s.inter, s.hq * s.d)
        qscratch = quant._scratch(lib, t, k_max)
        ascratch = work + 4 * (need - attn_scratch)
        rc = lib.mstar_decode_stack(ctypes.byref(s), self.layers, ctypes.byref(st), x.data_ptr(), work, qscratch,
                                    ascratch, quant.threads())
        if rc:
            raise RuntimeError(f"the CPU decode stack failed (code {rc})")
        return True
