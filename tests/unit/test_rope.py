"""Every RoPE type's frequencies equal transformers' own (`ROPE_INIT_FUNCTIONS`), read from
the config both forms checkpoints carry, and the per-position tables follow transformers'
run-time switch for dynamic NTK and LongRoPE."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from services.gpu_worker.layers.rope import Rotary, attention_factor, inv_freq
from shared.model_config import read_model_config

pytestmark = pytest.mark.kernels

HEAD_DIM = 16
LONG = [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)]
SHORT = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]

#: (config class, rope parameters as transformers 5 writes them, extra top-level keys)
CASES = {
    "linear": ("LlamaConfig", {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}, {}),
    "dynamic": ("LlamaConfig", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, {}),
    "llama3": ("LlamaConfig", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64, "rope_theta": 500000.0}, {}),
    "yarn": ("Qwen2Config", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                             "rope_theta": 1000000.0}, {}),
    "yarn-mscale": ("LlamaConfig", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                                    "truncate": False, "rope_theta": 10000.0}, {}),
    "longrope": ("Phi3Config", {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                "rope_theta": 10000.0},
                 {"original_max_position_embeddings": 64}),
}


def _hf_config(name: str, params: dict, extra: dict):
    cls = getattr(transformers, name)
    return cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, num_hidden_layers=2,
               max_position_embeddings=256, rope_parameters=dict(params), **extra)


def _classic(d: dict) -> dict:
    """The config.json dict as transformers 4.x wrote it (top-level rope_theta + rope_scaling)."""
    d = dict(d)
    params = dict(d.pop("rope_parameters"))
    d["rope_theta"] = params.pop("rope_theta")
    params.pop("partial_rotary_factor", None)
    d["rope_scaling"] = {**params, "type": params["rope_type"]}
    return d


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("form", ["transformers5", "classic"])
def test_frequencies_equal_transformers(case, form):
    name, params, extra = CASES[case]
    hf = _hf_config(name, params, extra)
    raw = hf.to_dict() if form == "transformers5" else _classic(hf.to_dict())
    rope = read_model_config(raw).rope
    ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
    assert rope.rope_type == params["rope_type"]
    assert torch.equal(inv_freq(rope, HEAD_DIM), ref)
    assert attention_factor(rope) == pytest.approx(ref_scale, rel=1e-12)
    for seq_len in (100, 257, 1000):  # the run-time variants at lengths past the pretrained context
        ref_at, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu", seq_len=torch.tensor(seq_len))
        assert torch.equal(inv_freq(rope, HEAD_DIM, seq_len), ref_at), seq_len


def test_default_rope_equals_transformers_initial_frequencies():
    hf = transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    rope = read_model_config(hf.to_dict()).rope
    ref, scale = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding.compute_default_rope_parameters(hf)
    assert rope.theta == 1000000.0 and torch.equal(inv_freq(rope, HEAD_DIM), ref) and scale == 1.0


@pytest.mark.parametrize("case", ["dynamic", "longrope"])
def test_tables_switch_where_transformers_does(case):
    """Row p uses the frequencies transformers uses when p is the newest position: the
    pretrained ones up to the original context, the long-sequence ones after it."""
    name, params, extra = CASES[case]
    hf = _hf_config(name, params, extra)
    rope = read_model_config(hf.to_dict()).rope
    orig = rope.original_max_position_embeddings
    rot = Rotary(rope, HEAD_DIM, 4 * orig)
    cos, _ = rot.tables(torch.tensor([orig - 1, orig, 3 * orig]), torch.float32)
    for row, p in zip(cos[:, 0], (orig - 1, orig, 3 * orig)):
        seq_len = p + 1
        ref, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu",
                                                              seq_len=torch.tensor(seq_len) if seq_len > orig else None)
        if case == "longrope" and seq_len <= orig:
            ref, scale = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
        freqs = torch.tensor([float(p)]).unsqueeze(1) * ref
        want = torch.cat((freqs, freqs), dim=-1).cos()[0] * scale
        assert torch.equal(row, want), p


def test_tables_grow_on_demand():
    rope = read_model_config(_hf_config(*CASES["linear"]).to_dict()).rope
    rot = Rotary(rope, HEAD_DIM, 10_000)
    first = rot.cos.shape[0]
    cos, _ = rot.tables(torch.tensor([9_999]), torch.float32)
    assert first < 10_000 == rot.cos.shape[0]
    full = Rotary(rope, HEAD_DIM, 10_000)
    full.ensure(10_000)
    assert torch.equal(cos[0, 0], full.cos[9_999])
