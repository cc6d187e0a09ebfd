"""Load a model's torch implementation and weights from its `ModelSource`: local
safetensors files or the dequantized GGUF. Nothing is downloaded.

The torch class comes from the explicit spec -> model table
(`services.gpu_worker.modeling.registry`), and every hook the loader runs is a method of
`ModelBase` (services/gpu_worker/modeling/base.py), whose defaults do nothing."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from tqdm import tqdm

from services.gpu_worker.gguf_weights import QuantTensor, load_gguf_weights
from services.gpu_worker.layers import quant, repack_cache
from services.gpu_worker.layers.moe import ExpertMixture
from services.gpu_worker.modeling.base import ModelBase
from services.gpu_worker.modeling.registry import torch_model_for
from services.gpu_worker.mxfp4_weights import is_mxfp4, split_experts
from services.gpu_worker.threads import torch_threads
from shared.diffusers_folder import component_weights, is_diffusers_folder
from shared.model_source import ModelSource
from shared.specs.base import ModelSpec

log = logging.getLogger("mstar.weights")

_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@functools.cache
def _cpu_flags() -> str:
    """/proc/cpuinfo's text ("" where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_computes_bf16() -> bool:
    """The CPU has bf16 dot-product instructions (AVX-512 BF16 or AMX), which oneDNN uses."""
    return "avx512_bf16" in _cpu_flags() or "amx_bf16" in _cpu_flags()


def cpu_has_amx_bf16() -> bool:
    """The CPU has AMX's bfloat16 tiles (where oneDNN's bfloat16 GEMM outruns the VNNI
    kernel at every prompt chunk size, not only at whole long prompts)."""
    return "amx_bf16" in _cpu_flags()


def weight_dtype(name: str, source: ModelSource, device: torch.device | str) -> tuple[torch.dtype, bool]:
    """`--dtype` -> (the dtype the model computes in, whether GGUF weights stay quantized).
    "auto": a GGUF file stays quantized on the CPU (computing in float32 around the
    quantized GEMMs), and so do a gpt-oss checkpoint's MXFP4 experts; a checkpoint keeps
    its dtype where the device computes it natively (bfloat16: CUDA, or a CPU with bf16
    instructions; float16: CUDA), else float32."""
    if name != "auto":
        return _TORCH[name], False
    cuda = torch.device(device).type == "cuda"
    if source.kind == "gguf" or is_mxfp4(source.config):  # (gpt-oss as released: MXFP4 experts)
        return torch.float32, not cuda
    stored = source.config.get("torch_dtype") or source.config.get("dtype") or "float32"
    if stored == "bfloat16" and (cuda or cpu_computes_bf16()):
        return torch.bfloat16, False
    if stored == "float16" and cuda:
        return torch.float16, False
    return torch.float32, False


def build_model(source: ModelSource, spec: ModelSpec, dtype: torch.dtype,
                device: torch.device | str = "cpu", quantized: bool = False) -> ModelBase:
    """The model with its weights, in `dtype` on `device`, ready to serve: its `prepare`
    (fused and prepacked GEMMs, where a family has them) runs once its weights are in place.

    `quantized` (a GGUF file on the CPU, where the quantized GEMM kernel is built): the
    linear layers and the embedding whose GGUF type `layers.quant` computes on stay
    quantized (`QuantLinear`, `QuantEmbedding`); every other tensor is dequantized to
    float32 as without it. A gpt-oss folder's MXFP4 experts likewise (`mxfp4_weights`)."""
    cls = torch_model_for(spec)
    quant_state: dict[str, QuantTensor] = {}
    if source.kind == "gguf":
        keep = quant.KEPT_TYPES if quantized and quant.available() and torch.device(device).type == "cpu" else None
        config, arrays = load_gguf_weights(source.path, progress=True, keep_quantized=keep or frozenset())
        quant_state = {name: a for name, a in arrays.items() if isinstance(a, QuantTensor)}
        state = {name: torch.from_numpy(a) for name, a in arrays.items() if name not in quant_state}  # no copy
    else:
        config = source.config
        state = {}
        if is_diffusers_folder(source.path):  # a pipeline: each component's tensors under its name
            for component, f in component_weights(source.path, getattr(cls, "components", ())):
                state.update({f"{component}.{k}": v for k, v in _load_safetensors(f, ()).items()
                              if not f"{component}.{k}".startswith(cls.skip_prefixes)})
        else:
            files = sorted(source.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"model folder {source.path} has no *.safetensors files")
            for f in tqdm(files, desc="loading safetensors", unit="file", file=sys.stderr):
                state.update(_load_safetensors(f, cls.skip_prefixes))
        if is_mxfp4(config):  # kept in their blocks where the kernels run, else dequantized
            keep_mx = quantized and quant.available() and torch.device(device).type == "cpu"
            state, quant_state = split_experts(state, keep_mx)
    # Build on the meta device (no random init of weights about to be overwritten).
    with torch.device("meta"), _no_init():
        model = cls(config)
    if quant_state:
        state.update(_install_quantized(model, quant_state, state, source.path if source.kind == "gguf" else None))
    if not cls.assigns_weights:
        model = model.to_empty(device="cpu")  # its load_weights copies into real tensors
    model.load_weights(state)
    model.reset_buffers()
    model = model.to(dtype).to(device).eval()
    # a quantized model's `prepare` is copies (torch.cat of the repacked weights, ~100 MB for
    # SmolLM2-135M), which one thread does in ~0.1 s, while two OpenMP threads on a two-core
    # machine other processes also use took 0.9-2.4 s (each small cat waits at a barrier for
    # a descheduled thread). Exact either way.
    with torch_threads(1) if quant_state else contextlib.nullcontext():
        model.prepare()
    if torch.device(device).type == "cpu":  # the C GEMMs' pool (kernels/pool.c), quantized or float32
        n = quant.default_threads()
        quant.set_threads(n)
        log.info("CPU GEMMs on %d thread%s (MSTAR_COMPUTE_THREADS to set)", n, "s" * (n > 1))
    return model


def _load_safetensors(path: Path, skip: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, those under a `skip` prefix left unread."""
    if not skip:
        return load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if not k.startswith(skip)}  # noqa: SIM118 (not iterable)


def prompt_path(model: nn.Module, prefill_dtype: str) -> int:
    """How each decoder layer's `QuantLinear` computes prompt rows, as `prefill_dtype` asks
    ("auto": bfloat16 where the CPU has AMX tiles, else quantized):

    - bfloat16: on a bfloat16 copy of the weight (`QuantLinear.widen`), oneDNN's GEMM. With
      AMX several times the VNNI kernel. With AVX512-BF16 dot products alone (a Zen 4) it
      beats the two-byte VNNI kernel only on chunks of ~512 rows and more, and by ~15% at
      2,048 (353 against 300 GFLOP/s on two threads). A chunk beside decode rows is tens to
      a few hundred rows, where it is 1.3-2.9x slower (84 against 242 GFLOP/s at 20 rows:
      each call streams the 2-byte copy). The copy costs 2 bytes a weight (212 MB for
      SmolLM2-135M); docs/benchmarks.md has the table. Without AVX512-BF16 it is emulated.
    - int8 (opt-in): the VNNI kernel with each prompt row's values rounded to one byte per
      block of 32 (`prompt_bytes` 1: llama.cpp's Q8_1 rounding, which its prompt and decode
      rows both use), half the kernel's dot products: ~1.5x the two-byte kernel's GEMMs on a
      2,048-token prompt, no copy. Not the default: on SmolLM2-135M the perplexity is within
      the 1% quality rule (20.14 against 20.06 in float32, bench/perplexity.py) but the greedy
      text of 6 of the bench's 12 prompts leaves the float32 path's (10 of 12 for the other
      two paths) and the e2e test's Paris answer changes.
    - quantized: as decode rows (two bytes a value).

    The LM head and the embedding table stay as they are: they never see more than the
    step's sampled rows; so do experts kept quantized (a bfloat16 copy of every expert would
    cost 2 bytes a weight of the whole model, and each expert sees only its share of a
    prompt's rows). Returns the bfloat16 copies' bytes (logged: the memory this costs)."""
    if prefill_dtype == "auto":
        prefill_dtype = "bfloat16" if cpu_has_amx_bf16() else "quantized"
    experts = {id(q) for mix in model.modules() if isinstance(mix, ExpertMixture) for q in mix.modules()}
    layers = [m for name, m in model.named_modules()
              if isinstance(m, quant.QuantLinear) and ".layers." in f".{name}" and id(m) not in experts]
    if prefill_dtype == "int8":
        for m in layers:
            m.prompt_bytes = 1
        return 0
    if prefill_dtype != "bfloat16":
        return 0
    total = sum(m.widen() for m in layers)
    if layers:
        log.info("prompt rows on a bfloat16 copy of %d quantized layers: %.0f MB (--prefill-dtype quantized: none)",
                 len(layers), total / 1e6)
    return total


#: the `nn.init` fills a module's constructor may call
_INIT_FILLS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
               "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def _no_init():
    """`nn.init`'s fills do nothing while the model is built on the meta device, where they
    have no values to fill anyway: torch's meta `normal_` (nn.Embedding's init) runs a
    Python reference wrapped to disable dynamo, whose first call imports torch._dynamo
    (~1.4 s of a worker's start-up, for nothing). Only the main thread builds models."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FILLS if hasattr(nn.init, name)}
    try:
        for name in saved:
            setattr(nn.init, name, _keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)




def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def _install_quantized(model: nn.Module, quant_state: dict[str, QuantTensor],
                       state: dict[str, torch.Tensor], gguf_path=None) -> dict[str, torch.Tensor]:
    """Put a `QuantLinear` (`QuantEmbedding`) in place of each `nn.Linear` (`nn.Embedding`)
    whose weight is in `quant_state` (its bias, if any, popped from `state`); returns the
    weights it could not keep quantized (another module type), dequantized. The repacked
    forms come from the cache of the GGUF file at `gguf_path` (`repack_cache`), made and kept
    there on a miss."""
    repacked = repack_cache.repacked(gguf_path, quant_state)
    rest: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, quant.QuantLinear]]] = {}
    for name, qt in quant_state.items():
        expert = _EXPERT.match(name)
        if expert is not None:  # one expert's projection: its mixture block takes them all at once
            layer = repack_cache.layer(repacked[name], qt.shape)
            if layer is not None:
                experts.setdefault(expert[1], {}).setdefault(int(expert[2]), {})[expert[3]] = layer
                continue
        path = name.removesuffix(".weight")
        parent_name, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, leaf, None)
        layer = repack_cache.layer(repacked[name], qt.shape)
        if layer is not None and isinstance(old, nn.Linear):
            bias = state.pop(f"{path}.bias", None)
            layer.bias = None if bias is None else bias.float().contiguous()
            setattr(parent, leaf, layer)
        elif layer is not None and isinstance(old, nn.Embedding):
            setattr(parent, leaf, quant.QuantEmbedding(layer))
        else:
            rest[name] = _dequantized(qt)
    kept = 0
    for block, parts in experts.items():
        moe = model.get_submodule(block.removesuffix(".experts"))
        if isinstance(moe, ExpertMixture) and moe.keep_quantized(parts):
            kept += 1
        else:  # (dequantized: stacked at load)
            rest.update({name: _dequantized(qt) for name, qt in quant_state.items()
                         if name.startswith(block + ".") and _EXPERT.match(name)})
    if kept:
        types = sorted({qt.qtype for name, qt in quant_state.items() if _EXPERT.match(name)})
        log.info("experts kept quantized (%s) in %d of %d mixture-of-experts layers", ", ".join(types), kept,
                 len(experts))
    return rest


#: one expert's projection of a GGUF file (`gguf_weights._expert_blocks`' names)
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _dequantized(qt: QuantTensor) -> torch.Tensor:
    deq = gguf.quants.dequantize(qt.data, gguf.GGMLQuantizationType[qt.qtype]).reshape(qt.shape)
    return torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
