"""The one config reader: every key transformers' config classes write is read, harmless or
refused (so a transformers upgrade that adds a field fails here, not for a user); both
config forms give the same ModelConfig; what cannot be honoured is refused by name and value."""

from __future__ import annotations

import pytest
import transformers

from shared.model_config import (
    ARCHITECTURES,
    FULL,
    HARMLESS,
    READ,
    REFUSED,
    SLIDING,
    read_model_config,
)
from shared.specs.base import DeploymentError
from shared.specs.decoder_lm import DecoderLMSpec

CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig",
    "phi3": "Phi3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "gpt_oss": "GptOssConfig",
    "mixtral": "MixtralConfig",
}

#: every key a rope_parameters / rope_scaling dict may carry
ROPE_KEYS = {
    "rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
    "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    "attention_factor", "truncate", "short_factor", "long_factor",
}

ROPE_FORMS = [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
     "mscale": 1.0, "mscale_all_dim": 1.0, "attention_factor": 1.1, "truncate": True},
]


def test_every_supported_architecture_has_its_config_class():
    assert set(CONFIG_CLASSES) == set(ARCHITECTURES.values())


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_every_key_of_transformers_config_is_classified(model_type):
    cls = getattr(transformers, CONFIG_CLASSES[model_type])
    configs = [cls()]
    if model_type not in ("gemma3_text", "phi3"):
        configs += [cls(rope_parameters={**form, "rope_theta": 10000.0}) for form in ROPE_FORMS]
    for config in configs:
        d = config.to_dict()
        unclassified = sorted(set(d) - READ - HARMLESS - REFUSED)
        assert not unclassified, (f"{cls.__name__} writes keys mstar neither reads, lists as harmless, "
                                  f"nor refuses: {unclassified}")
        params = d.get("rope_parameters") or {}
        nested = [params[k] for k in (FULL, SLIDING) if k in params] or [params]
        for p in nested:
            assert not set(p) - ROPE_KEYS, f"{cls.__name__} rope keys {sorted(set(p) - ROPE_KEYS)}"
        read_model_config({**d, "architectures": [next(a for a, t in ARCHITECTURES.items() if t == model_type)]})


def _llama(**kw) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 128,
            "max_position_embeddings": 512, **kw}


def test_both_forms_read_the_same():
    classic = _llama(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64})
    v5 = _llama(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64, "rope_theta": 500000.0})
    assert read_model_config(classic) == read_model_config(v5)
    assert read_model_config(v5).rope.theta == 500000.0


def test_transformers5_rope_theta_is_read():
    """The bug this reader fixes: theta only inside rope_parameters was read as 10000."""
    cfg = read_model_config(_llama(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                                   rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}))
    assert cfg.rope.theta == 1000000.0 and cfg.qkv_bias and not cfg.o_bias


def test_gemma3_classic_form_has_two_ropes():
    raw = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
           "num_attention_heads": 4, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8,
           "sliding_window_pattern": 2, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 24}
    cfg = read_model_config(raw)
    assert cfg.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("linear", 1e6, 8.0)
    assert (cfg.rope_local.rope_type, cfg.rope_local.theta) == ("default", 1e4)
    assert cfg.attn_scale == 24**-0.5 and cfg.norm_offset == 1.0 and cfg.embed_scale == 8.0 and cfg.tie_word_embeddings


def test_qwen2_window_only_with_use_sliding_window():
    base = _llama(model_type="qwen2", architectures=["Qwen2ForCausalLM"], sliding_window=32, max_window_layers=1)
    assert read_model_config(base).layer_types == (FULL, FULL)
    assert read_model_config({**base, "use_sliding_window": True}).layer_types == (FULL, SLIDING)


def test_context_length_follows_rope_scaling_as_vllm():
    assert read_model_config(_llama(rope_scaling={"type": "linear", "factor": 4.0})).max_position_embeddings == 2048
    yarn = _llama(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512})
    assert read_model_config(yarn).max_position_embeddings == 2048
    assert DecoderLMSpec(yarn, page_size=16).max_seq_len == 2048


@pytest.mark.parametrize(("raw", "field", "value"), [
    (_llama(rope_scaling={"rope_type": "mrope", "factor": 2.0}), "rope_type", "mrope"),
    (_llama(hidden_act="relu2"), "hidden_act", "relu2"),
    (_llama(partial_rotary_factor=0.5), "partial_rotary_factor", "0.5"),
    (_llama(attn_logit_softcapping=30.0), "attn_logit_softcapping", "30.0"),
    (_llama(final_logit_softcapping=30.0), "final_logit_softcapping", "30.0"),
    (_llama(quantization_config={"quant_method": "awq"}), "quantization_config", "awq"),
    (_llama(model_type="mixtral"), "model_type", "mixtral"),
    (_llama(layer_types=["full_attention", "chunked_attention"]), "layer_types", "chunked_attention"),
    ({**_llama(), "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
      "use_bidirectional_attention": True},
     "use_bidirectional_attention", "True"),
])
def test_unsupported_fields_are_refused_by_name_and_value(raw, field, value):
    with pytest.raises(DeploymentError) as exc:
        read_model_config(raw)
    message = str(exc.value)
    assert f"config.json {field}=" in message and value in message, message


def test_unknown_architecture_is_refused_by_the_registry():
    from shared.specs.registry import MODEL_REGISTRY

    assert set(ARCHITECTURES) <= set(MODEL_REGISTRY)


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    raw = _llama(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                 rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert transformers.LlamaConfig(**raw).rope_parameters["rope_type"] == "linear"
    assert read_model_config(raw).rope.rope_type == "linear"
