"""One typed config for the decoder-only families, read once from a checkpoint's config.json.

Checkpoints carry their settings in more than one form: transformers 4.x writes a top-level
`rope_theta` beside `rope_scaling`, transformers 5.x writes `rope_parameters` (per layer
type for Gemma 3), Phi-3 keeps `original_max_position_embeddings` at the top level, Gemma 3
keeps its local base frequency in `rope_local_base_freq`. `read_model_config` is the one
place that knows those forms; every service uses the `ModelConfig` it returns, never the
raw dict, so a form it does not read cannot be silently decoded as another.

Every key a supported architecture's config may carry is classified here: read (it is a
field below), harmless (it does not change what the model computes: dropout, ids, labels),
or accepted only at the values implemented (anything else is refused by name and value,
before any worker loads weights). A key in none of these is logged as unknown.
tests/unit/test_model_config.py walks every key of transformers' own config classes, so a
transformers upgrade that adds a field fails a test instead of decoding wrongly for a user.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import msgspec

from shared.specs.base import DeploymentError

log = logging.getLogger("mstar.model_config")

FULL, SLIDING = "full_attention", "sliding_attention"

#: architecture (config.json `architectures[0]`) -> model_type it must be
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
    "MixtralForCausalLM": "mixtral",
}

MODEL_TYPES = frozenset(ARCHITECTURES.values())

#: "freq_factors": llama.cpp's per-frequency divisors (a GGUF file's `rope_freqs` tensor,
#: Llama 3.1-style scaling as the converter precomputes it)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "freq_factors")

#: activations implemented, per what the MLP computes: silu(gate) * up or gelu_tanh(gate) * up
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

#: keys that do not change what the model computes at inference
HARMLESS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "id2label", "label2id", "problem_type",
    "initializer_range", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "attention_dropout", "embd_pdrop", "resid_pdrop",
    "pretraining_tp",  # slices the same matmuls in training; the sum is the same product
    "cache_implementation",  # Gemma 2's "hybrid" cache: how transformers stores KV, not what it is
    "tokenizer_class", "auto_map", "use_return_dict", "max_length", "num_labels",
    "_sliding_window_pattern", "sliding_window_pattern",  # read through layer_types
    "sliding_window_size",  # old Gemma 2 duplicate of sliding_window
    "output_router_logits", "router_aux_loss_coef",  # a mixture of experts' training loss
    "router_jitter_noise",  # Mixtral's router noise, applied in training only
})

#: keys that are fields of ModelConfig (read, checked where they have a range)
READ = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "hidden_activation", "rms_norm_eps",
    "max_position_embeddings", "original_max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
    "rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq", "partial_rotary_factor",
    "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
    "use_bidirectional_attention",
    # mixture of experts (Qwen3-MoE, Mixtral; transformers 5 writes Qwen3-MoE's num_experts as
    # num_local_experts, Mixtral's own name)
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers",
    "swiglu_alpha", "swiglu_limit",  # gpt-oss's clamped SwiGLU experts
})

#: keys that make a checkpoint one this engine cannot compute, whatever their value
REFUSED = frozenset({"quantization_config"})

#: which families each switch applies to
GEMMA = ("gemma2", "gemma3_text")
QWEN3 = ("qwen3", "qwen3_moe")
#: families whose layers may be a mixture of experts in place of the MLP
MOE = ("qwen3_moe", "gpt_oss", "mixtral")


class RopeConfig(msgspec.Struct, frozen=True):
    """One rotary embedding, as transformers' `rope_parameters` describes it."""

    rope_type: str = "default"
    theta: float = 10000.0
    #: linear, dynamic, llama3, yarn: the scaling factor; longrope/yarn: derived when absent
    factor: float = 1.0
    #: context length the model was pretrained at (llama3, yarn, longrope, dynamic)
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    #: cos and sin are multiplied by it (yarn, longrope); None: derived as transformers does
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    #: freq_factors: each inverse frequency is divided by its factor
    freq_factors: tuple[float, ...] = ()


class ModelConfig(msgspec.Struct, frozen=True):
    """What the decoder computes, with every form and default already resolved."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    #: the longest sequence the model serves (RoPE scaling extends it as vLLM derives it)
    max_position_embeddings: int
    hidden_act: str
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    #: RoPE of full-attention layers, and of sliding-window layers (differs only for Gemma 3)
    rope: RopeConfig
    rope_local: RopeConfig
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    #: per-head RMSNorm of q and k before RoPE (Qwen3, Qwen3-MoE, Gemma 3)
    qk_norm: bool = False
    #: RMSNorm scales by (offset + weight): 1 for Gemma, whose weights are stored around 0
    norm_offset: float = 0.0
    #: the embedding output is multiplied by it (Gemma: sqrt(hidden_size))
    embed_scale: float = 1.0
    #: Gemma 2/3: norms after attention and around the MLP too (four per layer)
    sandwich_norm: bool = False
    #: softmax scale of q.k (head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)
    attn_scale: float = 0.0
    #: tanh soft-capping of attention scores and of the final logits (Gemma 2)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    #: the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3)
    packed_projections: bool = False
    #: mixture of experts (Qwen3-MoE, Mixtral): which layers replace the MLP by a routed block, its
    #: experts, how many each token takes, each expert's width, and whether the k routing
    #: weights are renormalized to sum to 1. No layer is sparse where `sparse_layers` is all False.
    sparse_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    #: gpt-oss: a learned logit per query head in every softmax's denominator (attention
    #: sinks), biases on the router and on every expert's two projections, and experts whose
    #: SwiGLU clamps gate and up to `swiglu_limit` (0: plain silu(gate) * up) with sigmoid
    #: gain `swiglu_alpha`
    attn_sinks: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    #: a dense expert every token of a sparse layer takes beside its k routed ones, scaled by
    #: sigmoid(shared_expert_gate(x)) (Qwen3-Next, Qwen3.5-MoE: shared/hybrid_config.py); 0: none
    shared_expert_intermediate_size: int = 0

    def layer_rope(self, layer_type: str) -> RopeConfig:
        return self.rope_local if layer_type == SLIDING else self.rope

    def is_sparse(self, layer: int) -> bool:
        """Layer `layer`'s MLP is a mixture of experts."""
        return bool(self.sparse_layers) and self.sparse_layers[layer]

    @property
    def has_experts(self) -> bool:
        return any(self.sparse_layers)


class ParameterCounts(msgspec.Struct, frozen=True):
    """A model's parameters (every expert's) and those one token computes with (its top-k
    experts' and the router's, besides everything dense), as a mixture of experts'
    "30B-A3B" names them; the two are equal for a dense model."""

    total: int
    active: int


def parameter_counts(cfg: ModelConfig) -> ParameterCounts:
    """The parameters `cfg` describes (norms and biases counted; the LM head once when tied
    to the embedding), from the config alone: what /v1/models and the worker's start-up log
    state, before or without the weights."""
    hidden, heads, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attn = hidden * hd * (heads + 2 * kv) + heads * hd * hidden
    attn += hd * (heads + 2 * kv) * cfg.qkv_bias + hidden * cfg.o_bias + 2 * hd * cfg.qk_norm
    norms = hidden * (4 if cfg.sandwich_norm else 2)
    dense = 3 * hidden * cfg.intermediate_size + (2 * cfg.intermediate_size + hidden) * cfg.mlp_bias
    attn += heads * cfg.attn_sinks
    expert = 3 * hidden * cfg.moe_intermediate_size + (2 * cfg.moe_intermediate_size + hidden) * cfg.expert_bias
    router = cfg.num_experts * (hidden + cfg.expert_bias)
    total = active = cfg.vocab_size * hidden * (1 if cfg.tie_word_embeddings else 2) + hidden  # + the final norm
    for layer in range(cfg.num_hidden_layers):
        base = attn + norms
        if cfg.is_sparse(layer):  # the router, then every expert / the token's k
            total += base + router + cfg.num_experts * expert
            active += base + router + cfg.num_experts_per_tok * expert
        else:
            total += base + dense
            active += base + dense
    return ParameterCounts(total, active)


def _refuse(key: str, value: Any, why: str) -> DeploymentError:
    return DeploymentError(f"config.json {key}={value!r} is not supported: {why}")


def _mxfp4_gpt_oss(raw: Mapping[str, Any], model_type: str) -> bool:
    """gpt-oss as released: its experts in MXFP4 (services/gpu_worker/mxfp4_weights.py reads
    them), everything else unquantized (the quantization's `modules_to_not_convert`)."""
    quant = raw.get("quantization_config") or {}
    return model_type == "gpt_oss" and isinstance(quant, Mapping) and quant.get("quant_method") == "mxfp4"


def _refuse_quantized(raw: Mapping[str, Any], model_type: str) -> None:
    """DeploymentError for a quantized checkpoint, but gpt-oss's MXFP4 experts."""
    for key in sorted(REFUSED & set(raw)):
        if raw[key] is not None and not _mxfp4_gpt_oss(raw, model_type):
            raise _refuse(key, raw[key], "quantized Hugging Face checkpoints are not supported (use a GGUF file); "
                          "gpt-oss's MXFP4 experts are")


def read_model_config(raw: Mapping[str, Any]) -> ModelConfig:
    """The `ModelConfig` of a config.json dict; DeploymentError names any field it cannot honour."""
    arch, model_type = _architecture(raw)
    _refuse_quantized(raw, model_type)
    unknown = sorted(set(raw) - HARMLESS - READ - REFUSED)
    if unknown:
        log.warning("config.json keys not known to mstar (ignored): %s", unknown)
    heads = int(raw.get("num_attention_heads", 32))
    hidden = int(raw.get("hidden_size", 4096))
    head_dim = int(raw.get("head_dim") or hidden // heads)
    layers = int(raw.get("num_hidden_layers", 32))
    act = (raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh") if model_type in GEMMA \
        else raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise _refuse("hidden_act", act, f"implemented activations are {list(ACTIVATIONS)}")
    if raw.get("use_bidirectional_attention"):
        raise _refuse("use_bidirectional_attention", raw["use_bidirectional_attention"],
                      "only causal attention is implemented")
    types, window = _layer_types(raw, model_type, layers)
    rope, rope_local = _ropes(raw, model_type, types)
    for r in {rope, rope_local}:
        _check_factor_lengths(r, head_dim)
    context = _context_length(int(raw.get("max_position_embeddings", 2048)), rope)
    gemma = model_type in GEMMA
    attn_bias = bool(raw.get("attention_bias", False))
    scalar = raw.get("query_pre_attn_scalar") if gemma else None
    moe = _experts(raw, model_type, layers)
    return ModelConfig(
        architecture=arch,
        model_type=model_type,
        vocab_size=int(raw.get("vocab_size", 32000)),
        hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size", 4 * hidden)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5 if model_type == "phi3" else 1e-6)),
        max_position_embeddings=context,
        hidden_act=act,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        layer_types=types,
        sliding_window=window,
        rope=rope,
        rope_local=rope_local,
        qkv_bias=attn_bias or model_type == "qwen2",
        o_bias=attn_bias and model_type != "qwen2",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=model_type in (*QWEN3, "gemma3_text"),
        norm_offset=1.0 if gemma else 0.0,
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
        sandwich_norm=gemma,
        attn_scale=float(scalar if scalar is not None else head_dim) ** -0.5,
        attn_softcap=_softcap(raw, "attn_logit_softcapping", model_type),
        final_softcap=_softcap(raw, "final_logit_softcapping", model_type),
        packed_projections=model_type == "phi3",
        **moe,
    )


def _experts(raw: Mapping[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields, as transformers' Qwen3MoeDecoderLayer picks its sparse
    layers: not in `mlp_only_layers`, experts > 0, and (i + 1) a multiple of
    `decoder_sparse_step`; Mixtral's every layer (`_mixtral_experts`). Empty for a dense family."""
    if model_type not in MOE:
        return {}
    if model_type == "gpt_oss":
        return _gpt_oss_experts(raw, layers)
    if model_type == "mixtral":
        return _mixtral_experts(raw, layers)
    experts = int(raw.get("num_experts", raw.get("num_local_experts", 128)) or 0)
    top_k = int(raw.get("num_experts_per_tok", 8))
    step = int(raw.get("decoder_sparse_step", 1))
    dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
    if step < 1:
        raise _refuse("decoder_sparse_step", step, "must be at least 1")
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    if any(sparse) and not 1 <= top_k <= experts:
        raise _refuse("num_experts_per_tok", top_k, f"each token takes 1 to num_experts={experts} experts")
    return dict(sparse_layers=sparse, num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(raw.get("moe_intermediate_size", 768)),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)))


def _gpt_oss_experts(raw: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """gpt-oss: every layer a mixture of experts of width `intermediate_size` (its config has
    no moe_intermediate_size), with biases and the clamped SwiGLU, and attention sinks. Its
    router's softmax is over the top-k logits (the block's own routing), so there is no
    renormalization to read."""
    experts = int(raw.get("num_local_experts", raw.get("num_experts", 128)) or 0)
    top_k = int(raw.get("num_experts_per_tok", 4))
    if not 1 <= top_k <= experts:
        raise _refuse("num_experts_per_tok", top_k, f"each token takes 1 to num_local_experts={experts} experts")
    limit = float(raw.get("swiglu_limit", 7.0))
    if not limit > 0:
        raise _refuse("swiglu_limit", limit, "the clamped SwiGLU needs a positive limit")
    return dict(sparse_layers=(True,) * layers, num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(raw.get("intermediate_size", 2880)), attn_sinks=True, expert_bias=True,
                swiglu_limit=limit, swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)))


def _mixtral_experts(raw: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """Mixtral's mixture: every layer sparse (MixtralDecoderLayer has no dense MLP), each expert
    `intermediate_size` wide, the top-k weights always renormalized (MixtralTopKRouter divides
    by their sum; the config has no norm_topk_prob)."""
    experts = int(raw.get("num_local_experts", raw.get("num_experts", 8)) or 0)
    top_k = int(raw.get("num_experts_per_tok", 2))
    if experts < 1:
        raise _refuse("num_local_experts", experts, "Mixtral's layers are all mixtures of experts")
    if not 1 <= top_k <= experts:
        raise _refuse("num_experts_per_tok", top_k, f"each token takes 1 to num_local_experts={experts} experts")
    return dict(sparse_layers=(True,) * layers, num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(raw.get("intermediate_size", 14336)), norm_topk_prob=True)


def _check_factor_lengths(r: RopeConfig, head_dim: int) -> None:
    """Per-frequency factors (longrope's, llama.cpp's rope_freqs) come one per rotary pair."""
    for kind, name, values in (("freq_factors", "freq_factors", r.freq_factors),
                               ("longrope", "short_factor", r.short_factor)):
        if r.rope_type == kind and len(values) != head_dim // 2:
            raise _refuse(f"rope_parameters.{name}", f"{len(values)} values", f"{kind} needs head_dim / 2 = "
                                                                              f"{head_dim // 2}")


def _architecture(raw: Mapping[str, Any]) -> tuple[str, str]:
    """The architecture name and the family (model_type) whose math applies. The name
    itself is the model registry's business (plugins register subclasses under names of
    their own); the family must be one implemented here."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else ""
    model_type = raw.get("model_type") or ARCHITECTURES.get(arch) or "llama"
    if model_type not in MODEL_TYPES:
        raise _refuse("model_type", model_type, f"implemented families are {sorted(MODEL_TYPES)}")
    if arch in ARCHITECTURES and ARCHITECTURES[arch] != model_type:
        raise _refuse("model_type", model_type, f"architecture {arch} has model_type {ARCHITECTURES[arch]!r}")
    return arch, model_type


def _softcap(raw: Mapping[str, Any], key: str, model_type: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if model_type != "gemma2":
        raise _refuse(key, value, f"soft-capping is implemented for Gemma 2 only, not {model_type}")
    return float(value)


def _layer_types(raw: Mapping[str, Any], model_type: str, n: int) -> tuple[tuple[str, ...], int | None]:
    """Each layer's attention kind and the sliding window, as transformers derives them."""
    window = raw.get("sliding_window")
    if model_type in ("qwen2", *QWEN3) and not raw.get("use_sliding_window", False):
        window = None  # transformers drops the window unless use_sliding_window is set
    if raw.get("layer_types"):
        types = tuple(raw["layer_types"])
    elif model_type in ("gemma2", "gpt_oss"):  # gpt-oss: sliding first, as GptOssConfig derives them
        types = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))
    elif model_type == "gemma3_text":
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))
    elif window and model_type in ("qwen2", "qwen3"):
        first = int(raw.get("max_window_layers", 0))
        types = tuple(SLIDING if i >= first else FULL for i in range(n))
    elif window and model_type in ("mistral", "mixtral", "phi3", "qwen3_moe"):  # Qwen3-MoE: no max_window_layers
        types = (SLIDING,) * n
    else:
        types = (FULL,) * n
    if len(types) != n or set(types) - {FULL, SLIDING}:
        raise _refuse("layer_types", list(types), f"need {n} entries of {FULL!r} or {SLIDING!r}")
    if SLIDING in types and not window:
        raise _refuse("sliding_window", window, "sliding-attention layers need a window")
    return types, (int(window) if SLIDING in types and window else None)  # checked above: SLIDING needs a window


def _rope_dicts(raw: Mapping[str, Any], model_type: str, types: tuple[str, ...]) -> dict[str, dict]:
    """The raw RoPE parameters of each layer type, whichever form the checkpoint uses."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")  # where both are present, transformers lets rope_scaling win
    if params and any(k in (FULL, SLIDING) for k in params):  # transformers 5, per layer type
        nested = {k: dict(v or {}) for k, v in params.items()}
        if scaling:  # Gemma 3: rope_scaling is for the global layers
            nested.setdefault(FULL, {}).update(scaling)
    else:
        flat = dict(scaling or params or {})
        nested = {FULL: flat, SLIDING: dict(flat)}
        if model_type == "gemma3_text":  # classic Gemma 3: rope_scaling is for the global layers only
            nested[SLIDING] = {"rope_type": "default"} if not params else dict(flat)
    top_theta = raw.get("rope_theta")
    local_theta = raw.get("rope_local_base_freq")
    for kind, d in nested.items():
        if "rope_theta" not in d:
            if model_type == "gemma3_text":
                d["rope_theta"] = (local_theta or 10000.0) if kind == SLIDING else (top_theta or 1_000_000.0)
            else:
                d["rope_theta"] = top_theta if top_theta is not None else 10000.0
        if "partial_rotary_factor" in raw and "partial_rotary_factor" not in d:
            d["partial_rotary_factor"] = raw["partial_rotary_factor"]
        if model_type == "phi3" and raw.get("original_max_position_embeddings"):
            d["original_max_position_embeddings"] = raw["original_max_position_embeddings"]  # Phi-3's takes priority
    for kind in (FULL, SLIDING):
        nested.setdefault(kind, nested.get(FULL if kind == SLIDING else SLIDING, {"rope_theta": 10000.0}))
    return nested


def _ropes(raw: Mapping[str, Any], model_type: str, types: tuple[str, ...]) -> tuple[RopeConfig, RopeConfig]:
    nested = _rope_dicts(raw, model_type, types)
    full = _rope(nested[FULL], raw, model_type)
    local = _rope(nested[SLIDING], raw, model_type) if model_type == "gemma3_text" else full
    return full, local


_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
             "original_max_position_embeddings"},
    "longrope": {"factor", "short_factor", "long_factor", "attention_factor", "original_max_position_embeddings"},
    "freq_factors": {"freq_factors"},
}


def _rope(d: dict, raw: Mapping[str, Any], model_type: str) -> RopeConfig:
    kind = d.get("rope_type") or d.get("type") or "default"
    if model_type == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # transformers' Phi3Config reads both as LongRoPE
    if kind not in ROPE_TYPES:
        raise _refuse("rope_type", kind, f"implemented RoPE types are {list(ROPE_TYPES)}")
    partial = float(d.get("partial_rotary_factor", 1.0) or 1.0)
    if partial != 1.0:
        raise _refuse("partial_rotary_factor", partial, "only rotary over the whole head (1.0) is implemented")
    extra = set(d) - _ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if extra:
        log.warning("RoPE type %s does not use %s (ignored, as transformers does)", kind, sorted(extra))
    context = int(raw.get("max_position_embeddings", 2048))
    original = context if kind == "dynamic" else int(d.get("original_max_position_embeddings") or context)
    factor = d.get("factor")
    if factor is None:
        if kind in ("linear", "dynamic", "llama3"):
            raise _refuse("rope_parameters.factor", None, f"RoPE type {kind} needs a factor")
        factor = context / original if kind in ("yarn", "longrope") else 1.0
    attention_factor = d.get("attention_factor")
    return RopeConfig(
        rope_type=kind,
        theta=float(d["rope_theta"]),
        factor=float(factor),
        original_max_position_embeddings=original,
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        beta_fast=float(d.get("beta_fast") or 32.0),
        beta_slow=float(d.get("beta_slow") or 1.0),
        mscale=float(d.get("mscale") or 0.0),
        mscale_all_dim=float(d.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(d.get("truncate", True)),
        short_factor=tuple(float(x) for x in d.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in d.get("long_factor") or ()),
        freq_factors=tuple(float(x) for x in d.get("freq_factors") or ()),
    )


def _context_length(max_pos: int, rope: RopeConfig) -> int:
    """The longest sequence served: RoPE scaling that stretches positions extends it, as
    vLLM derives max_model_len (llama3 and longrope configs already state the long one)."""
    if rope.rope_type in ("linear", "dynamic"):
        return int(max_pos * rope.factor)
    if rope.rope_type == "yarn":
        return max(max_pos, int(rope.original_max_position_embeddings * rope.factor))
    return max_pos
