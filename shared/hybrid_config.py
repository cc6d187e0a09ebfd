"""The config of a hybrid linear-attention LM (Qwen3.5's text model), read once.

Qwen3.5 interleaves Gated DeltaNet layers (`linear_attention`: a causal convolution and a
recurrent state per request, no KV rows) with gated full-attention layers
(`full_attention`: paged KV as every decoder's). Its full-attention layers differ from
Qwen3's in three ways the `ModelConfig` below carries through `HybridConfig`: q_proj writes
an output gate beside q (`sigmoid(gate) * attention`), RoPE covers only the first
`partial_rotary_factor` of each head, and every RMSNorm scales by (1 + w).

Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, and the language model of a
`Qwen3_5MoeForConditionalGeneration`) and Qwen3-Next (`Qwen3NextForCausalLM`) are the same
hybrid with a mixture of experts in place of the MLP, plus a shared expert every token takes
(scaled by a sigmoid gate): the `ModelConfig`'s expert fields (`sparse_layers`, ..., `shared_expert_intermediate_size`)
say which layers and how. Qwen3.5-MoE routes every layer and always renormalizes its top-k
weights (its router has no `norm_topk_prob`); Qwen3-Next picks its sparse layers as Qwen3-MoE
does (`decoder_sparse_step`, `mlp_only_layers`) and renormalizes where `norm_topk_prob`.

`read_hybrid_config` takes config.json's dict (a `Qwen3_5ForCausalLM`'s flat one, or a
`Qwen3_5ForConditionalGeneration`'s `text_config`) and refuses by name what it cannot honour,
before any worker loads weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from shared.model_config import FULL, ModelConfig, ParameterCounts, RopeConfig
from shared.specs.base import DeploymentError

log = logging.getLogger("mstar.hybrid_config")

LINEAR = "linear_attention"

#: architecture -> model_type of the hybrid families served
ARCHITECTURES = {"Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5ForConditionalGeneration": "qwen3_5"}
#: the hybrid families with a mixture of experts (architecture -> model_type)
MOE_ARCHITECTURES = {"Qwen3_5MoeForCausalLM": "qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
                     "Qwen3NextForCausalLM": "qwen3_next"}
#: an image-text folder's model_type -> its language model's
TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}

#: keys that change nothing this engine computes (multi-token prediction heads are not
#: run: their `mtp.*` weights are skipped at load)
HARMLESS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "attention_dropout",
    "output_attentions", "output_hidden_states", "return_dict", "tokenizer_class", "auto_map",
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "full_attention_interval", "layer_types",
    "id2label", "label2id", "problem_type",
    "output_router_logits", "router_aux_loss_coef",  # a mixture of experts' training loss
    "use_sliding_window",  # Qwen3-Next's config.json (false; its model has no sliding window)
})
READ = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "rope_parameters", "rope_theta", "partial_rotary_factor", "attention_bias",
    "attn_output_gate", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
    "rope_scaling",  # the classic form's (Qwen3-Next's config.json: null)
})


class HybridConfig(msgspec.Struct, frozen=True):
    """What the hybrid model computes: `attention` describes the full-attention layers and
    the shared parts (embedding, MLP, norms: `norm_offset` 1), the rest the DeltaNet layers."""

    attention: ModelConfig
    #: the rotary part of each full-attention head (the first `rotary_dim` of head_dim)
    rotary_dim: int
    #: Qwen3.5's interleaved multimodal RoPE sections (temporal, height, width pairs)
    mrope_section: tuple[int, ...]
    conv_kernel: int
    key_heads: int
    key_head_dim: int
    value_heads: int
    value_head_dim: int

    @property
    def layer_types(self) -> tuple[str, ...]:
        return self.attention.layer_types

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def state_floats(self) -> int:
        """float32 values of one request's state in one linear layer: the convolution's
        last `conv_kernel - 1` inputs and the recurrent matrix [value_heads, key_head_dim,
        value_head_dim]."""
        return (self.conv_kernel - 1) * self.conv_dim + self.value_heads * self.key_head_dim * self.value_head_dim


def _refuse(key: str, value: Any, why: str) -> DeploymentError:
    return DeploymentError(f"config.json {key}={value!r} is not supported: {why}")


def is_hybrid(raw: Mapping[str, Any]) -> bool:
    archs = raw.get("architectures") or []
    return bool(archs) and (archs[0] in ARCHITECTURES or archs[0] in MOE_ARCHITECTURES)


def read_hybrid_config(raw: Mapping[str, Any]) -> HybridConfig:
    """The `HybridConfig` of a config.json dict; DeploymentError names a field it cannot honour."""
    raw, arch = _text_config(raw)
    model_type = raw["model_type"]
    _refuse_unsupported(raw)
    hidden = int(raw.get("hidden_size", 4096))
    heads = int(raw.get("num_attention_heads", 16))
    head_dim = int(raw.get("head_dim") or hidden // heads)
    layers = int(raw.get("num_hidden_layers", 32))
    types = _layer_types(raw, layers)
    theta, rotary_dim, section = _rope(raw, head_dim)
    attention = ModelConfig(
        architecture=arch,
        model_type=model_type,
        vocab_size=int(raw.get("vocab_size", 248320)),
        hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size", 4 * hidden)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        hidden_act="silu",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        layer_types=types,
        sliding_window=None,
        rope=RopeConfig(theta=theta),
        rope_local=RopeConfig(theta=theta),
        qk_norm=True,
        norm_offset=1.0,
        attn_scale=head_dim ** -0.5,
        **_experts(raw, model_type, layers),
    )
    cfg = HybridConfig(
        attention=attention,
        rotary_dim=rotary_dim,
        mrope_section=section,
        conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
        key_heads=int(raw.get("linear_num_key_heads", 16)),
        key_head_dim=int(raw.get("linear_key_head_dim", 128)),
        value_heads=int(raw.get("linear_num_value_heads", 32)),
        value_head_dim=int(raw.get("linear_value_head_dim", 128)),
    )
    if cfg.conv_kernel < 2:
        raise _refuse("linear_conv_kernel_dim", cfg.conv_kernel, "the convolution needs a kernel of at least 2")
    if cfg.value_heads % cfg.key_heads:
        raise _refuse("linear_num_value_heads", cfg.value_heads,
                      f"must be a multiple of linear_num_key_heads ({cfg.key_heads})")
    return cfg


def _text_config(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """(the language model's config, the architecture): an image-text folder's is its
    `text_config` (with the top-level `tie_word_embeddings`)."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else "Qwen3_5ForCausalLM"
    model_type = raw.get("model_type") or ARCHITECTURES.get(arch) or MOE_ARCHITECTURES.get(arch, "")
    if model_type in TEXT_TYPES:
        text = dict(raw.get("text_config") or {})
        if "tie_word_embeddings" in raw:
            text["tie_word_embeddings"] = raw["tie_word_embeddings"]
        return {**text, "architectures": [arch], "model_type": TEXT_TYPES[model_type]}, arch
    if model_type not in (*TEXT_TYPES.values(), "qwen3_next"):
        raise _refuse("model_type", model_type, "the hybrid families served are qwen3_5_text, qwen3_5_moe_text "
                                                "and qwen3_next")
    return {**raw, "model_type": model_type}, arch


def _refuse_unsupported(raw: Mapping[str, Any]) -> None:
    unknown = sorted(set(raw) - HARMLESS - READ)
    if unknown:
        log.warning("config.json keys not known to mstar (ignored): %s", unknown)
    if raw.get("quantization_config") is not None:
        raise _refuse("quantization_config", raw["quantization_config"],
                      "quantized Hugging Face checkpoints are not supported (use a GGUF file)")
    if raw.get("attn_output_gate", True) is not True:
        raise _refuse("attn_output_gate", raw["attn_output_gate"], "Qwen3.5's attention always has its output gate")
    if raw.get("attention_bias"):
        raise _refuse("attention_bias", raw["attention_bias"], "Qwen3.5's projections have no biases")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "Qwen3.5's MLP and convolution use silu")


def _layer_types(raw: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's kind: `layer_types`, else three linear layers to one full (or
    `full_attention_interval`), as transformers derives them."""
    types = raw.get("layer_types")
    if not types:
        interval = int(raw.get("full_attention_interval", 4))
        types = [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
    if len(types) != layers or set(types) - {FULL, LINEAR}:
        raise _refuse("layer_types", list(types), f"need {layers} entries of {FULL!r} or {LINEAR!r}")
    return tuple(types)


def _rope(raw: Mapping[str, Any], head_dim: int) -> tuple[float, int, tuple[int, ...]]:
    """(theta, the rotary part of a head, the M-RoPE sections) of the full-attention layers."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise _refuse("rope_parameters.rope_type", kind, "Qwen3.5's RoPE is the default one")
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise _refuse("partial_rotary_factor", partial, f"gives a rotary dim of {rotary_dim} of head_dim {head_dim}")
    return theta, rotary_dim, tuple(int(x) for x in rope.get("mrope_section") or (11, 11, 10))


def _experts(raw: Mapping[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelConfig` ({} for Qwen3.5): Qwen3.5-MoE's
    decoder layers all take the sparse block and its router always renormalizes
    (transformers' Qwen3_5MoeTopKRouter); Qwen3-Next's sparse layers are those not in
    `mlp_only_layers` with (i + 1) a multiple of `decoder_sparse_step` (the others keep a
    dense MLP of `intermediate_size`), renormalized where `norm_topk_prob`."""
    if model_type == "qwen3_5_text":
        return {}
    experts = int(raw.get("num_experts", 512 if model_type == "qwen3_next" else 256) or 0)
    top_k = int(raw.get("num_experts_per_tok", 10 if model_type == "qwen3_next" else 8))
    if model_type == "qwen3_next":
        step = int(raw.get("decoder_sparse_step", 1))
        if step < 1:
            raise _refuse("decoder_sparse_step", step, "must be at least 1")
        dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
        renormalize = bool(raw.get("norm_topk_prob", True))
    else:
        if experts < 1:
            raise _refuse("num_experts", experts, "every Qwen3.5-MoE layer routes to experts")
        sparse, renormalize = (True,) * layers, True
    if any(sparse) and not 1 <= top_k <= experts:
        raise _refuse("num_experts_per_tok", top_k, f"each token takes 1 to num_experts={experts} experts")
    return dict(sparse_layers=sparse, num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(raw.get("moe_intermediate_size", 512)),
                shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size", 512)),
                norm_topk_prob=renormalize)


def hybrid_parameter_counts(cfg: HybridConfig) -> ParameterCounts:
    """Every parameter transformers' model of `cfg` holds (the LM head once when tied; the
    multi-token prediction layers, which are not run, left out), and those one token
    computes with: a sparse layer's router, shared expert and gate, and its top-k experts."""
    a = cfg.attention
    hidden, hd = a.hidden_size, a.head_dim
    full = hidden * hd * (2 * a.num_attention_heads + 2 * a.num_key_value_heads) \
        + a.num_attention_heads * hd * hidden + 2 * hd
    linear = hidden * (cfg.conv_dim + cfg.value_dim + 2 * cfg.value_heads) + cfg.conv_dim * cfg.conv_kernel \
        + 2 * cfg.value_heads + cfg.value_head_dim + cfg.value_dim * hidden
    expert = 3 * hidden * a.moe_intermediate_size
    routed = a.num_experts * hidden + 3 * hidden * a.shared_expert_intermediate_size + hidden
    total = active = a.vocab_size * hidden * (1 if a.tie_word_embeddings else 2) + hidden
    for layer, kind in enumerate(cfg.layer_types):
        base = (linear if kind == LINEAR else full) + 2 * hidden
        if a.is_sparse(layer):
            total += base + routed + a.num_experts * expert
            active += base + routed + a.num_experts_per_tok * expert
        else:
            total += base + 3 * hidden * a.intermediate_size
            active += base + 3 * hidden * a.intermediate_size
    return ParameterCounts(total, active)
