"""The pieces of the hybrid mixtures of experts (Qwen3.5-MoE, Qwen3-Next) against
transformers: the sparse block with its gated shared expert (bit for bit on torch's GEMMs,
to rounding on the C kernels, where a row's bits do not depend on its batch), Qwen3-Next's
fused per-key-head projections split into Qwen3.5's, the sparse layers and routing read from
the config, and the parameter counts equal to transformers' models' numel."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_35moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from services.gpu_worker.layers import linear
from services.gpu_worker.layers.moe import SparseMoE
from services.gpu_worker.modeling.hybrid.qwen3_5_moe import Qwen35MoeLM
from services.gpu_worker.modeling.hybrid.qwen3_next import split_projections
from shared.hybrid_config import hybrid_parameter_counts, read_hybrid_config

HIDDEN = 64
#: the linear layers' shape (grouped value heads: 2 per key head; Dk != Dv)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread, as a CPU worker runs by default: the C GEMM kernel's condition."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _next_config(**kw) -> transformers.Qwen3NextConfig:
    shape = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
                 intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                 num_experts_per_tok=2, vocab_size=300, pad_token_id=0, experts_implementation="eager", **LINEAR)
    return transformers.Qwen3NextConfig(**{**shape, **kw})


def _moe_config(**kw) -> transformers.Qwen3_5MoeTextConfig:
    shape = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
                 moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                 vocab_size=300, pad_token_id=0, experts_implementation="eager", **LINEAR)
    return transformers.Qwen3_5MoeTextConfig(**{**shape, **kw})


def _ours(hf_cfg, arch: str) -> dict:
    return {**hf_cfg.to_dict(), "architectures": [arch]}


#: (transformers' block class, its config, architecture)
BLOCKS = {
    "qwen3_next": (hf_next.Qwen3NextSparseMoeBlock, _next_config, "Qwen3NextForCausalLM"),
    "qwen3_next_unnormalized": (hf_next.Qwen3NextSparseMoeBlock, lambda **kw: _next_config(norm_topk_prob=False, **kw),
                                "Qwen3NextForCausalLM"),
    "qwen3_5_moe": (hf_35moe.Qwen3_5MoeSparseMoeBlock, _moe_config, "Qwen3_5MoeForCausalLM"),
}


def _blocks(kind: str, experts: int = 8, top_k: int = 2, seed: int = 0) -> tuple[torch.nn.Module, SparseMoE]:
    """transformers' sparse block (with its shared expert) with random weights, and ours
    (as the model builds it) holding the same tensors."""
    block, make_cfg, arch = BLOCKS[kind]
    hf_cfg = make_cfg(num_experts=experts, num_experts_per_tok=top_k)
    torch.manual_seed(seed)
    ref = block(hf_cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    mine = Qwen35MoeLM.make_mlp(read_hybrid_config(_ours(hf_cfg, arch)), 0)
    assert isinstance(mine, SparseMoE) and mine.shared_expert is not None
    mine.load_state_dict(ref.state_dict())
    return ref, mine


@pytest.mark.parametrize("kind", sorted(BLOCKS))
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (16, 4), (8, 1), (64, 8)])
@torch.inference_mode()
def test_shared_expert_block_is_transformers_bit_for_bit(kind, experts, top_k):
    ref, mine = _blocks(kind, experts, top_k)
    x = torch.randn(2, 19, HIDDEN)
    assert torch.equal(mine(x.view(-1, HIDDEN)), ref(x).view(-1, HIDDEN))
    # the shared expert's gate is not decorative: without it the sum differs
    gate = mine.shared_expert_gate
    assert gate is not None
    with torch.no_grad():
        gate.weight.zero_()  # sigmoid(0) = 1/2 of the shared expert
    assert not torch.allclose(mine(x.view(-1, HIDDEN)), ref(x).view(-1, HIDDEN))


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize(("experts", "top_k"), [(16, 4), (64, 8)])
@torch.inference_mode()
def test_packed_block_matches_transformers_and_each_row_is_batch_invariant(kind, experts, top_k):
    """As a CPU worker runs it: experts packed for the C GEMM, the shared expert's gate and up
    fused, every linear on the C GEMM; each row's bits whatever rows share its step."""
    if not linear.kernel_available():
        pytest.skip("no C GEMM kernel here")
    ref, mine = _blocks(kind, experts, top_k)
    model = Qwen35MoeLM.__new__(Qwen35MoeLM)
    torch.nn.Module.__init__(model)
    model.prepare_mlp(mine)
    assert mine.gate_up_packed is not None
    assert linear.pack_linears(mine) == 4  # the router, the shared expert's gate/up and down, its gate
    x = torch.randn(41, HIDDEN)
    together = mine(x)
    torch.testing.assert_close(together, ref(x[None])[0], rtol=1e-5, atol=1e-5)
    alone = torch.cat([mine(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(alone, together)
    shuffled = torch.randperm(len(x))
    assert torch.equal(mine(x[shuffled]), together[shuffled])


@pytest.mark.parametrize("linear_shape", [LINEAR, dict(linear_num_key_heads=2, linear_num_value_heads=2,
                                                      linear_key_head_dim=16, linear_value_head_dim=8),
                                          dict(linear_num_key_heads=1, linear_num_value_heads=4,
                                               linear_key_head_dim=8, linear_value_head_dim=8)])
@torch.inference_mode()
def test_fused_projections_split_as_transformers_orders_them(linear_shape):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba rows (per key head: q, k, v, z; b, a) reordered
    into Qwen3.5's in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b, in_proj_a are the
    columns transformers' `fix_query_key_value_ordering` gives q, k, v, z, b, a: applied to
    the weights themselves (the identity's projections), the same values exactly, and on
    inputs the same outputs."""
    hf_cfg = _next_config(**linear_shape)
    torch.manual_seed(0)
    net = hf_next.Qwen3NextGatedDeltaNet(hf_cfg, 0).eval()
    prefix = "model.layers.0.linear_attn."
    norm = torch.ones(HIDDEN)
    state = split_projections({prefix + "in_proj_qkvz.weight": net.in_proj_qkvz.weight,
                               prefix + "in_proj_ba.weight": net.in_proj_ba.weight, "model.norm.weight": norm},
                              read_hybrid_config(_ours(hf_cfg, "Qwen3NextForCausalLM")))
    assert sorted(state) == [prefix + f"in_proj_{p}.weight" for p in ("a", "b", "qkv", "z")] + ["model.norm.weight"]
    # the projections of the hidden size's unit vectors: row i of each part is column i of its weight
    q, k, v, z, b, a = net.fix_query_key_value_ordering(net.in_proj_qkvz.weight.T[None], net.in_proj_ba.weight.T[None])
    flat = [t.reshape(HIDDEN, -1).T for t in (q, k, v, z, b, a)]
    assert torch.equal(state[prefix + "in_proj_qkv.weight"], torch.cat(flat[:3]))
    for name, want in zip(("z", "b", "a"), flat[3:]):
        assert torch.equal(state[prefix + f"in_proj_{name}.weight"], want)
    x = torch.randn(1, 7, HIDDEN)
    q, k, v, z, b, a = net.fix_query_key_value_ordering(net.in_proj_qkvz(x), net.in_proj_ba(x))
    qkv = torch.cat([t.reshape(1, 7, -1) for t in (q, k, v)], dim=-1)
    torch.testing.assert_close(x @ state[prefix + "in_proj_qkv.weight"].T, qkv)
    torch.testing.assert_close(x @ state[prefix + "in_proj_b.weight"].T, b)


@pytest.mark.parametrize("kw", [{}, dict(decoder_sparse_step=2), dict(mlp_only_layers=[0, 3]),
                                dict(decoder_sparse_step=3, mlp_only_layers=[2]), dict(num_experts=0)])
def test_qwen3_next_sparse_layers_are_transformers(kw):
    hf_cfg = _next_config(num_hidden_layers=6, **kw)
    want = tuple(isinstance(hf_next.Qwen3NextDecoderLayer(hf_cfg, i).mlp, hf_next.Qwen3NextSparseMoeBlock)
                 for i in range(6))
    a = read_hybrid_config(_ours(hf_cfg, "Qwen3NextForCausalLM")).attention
    assert a.sparse_layers == want
    assert (a.num_experts, a.num_experts_per_tok, a.norm_topk_prob) == (hf_cfg.num_experts, 2, True)
    assert a.shared_expert_intermediate_size == 48 and a.model_type == "qwen3_next"


def test_qwen3_5_moe_routes_every_layer_renormalized():
    """Qwen3.5-MoE's decoder layers all take the sparse block, and its router divides the k
    weights by their sum whatever the config says (it has no norm_topk_prob)."""
    a = read_hybrid_config(_ours(_moe_config(), "Qwen3_5MoeForCausalLM")).attention
    assert a.sparse_layers == (True,) * 4 and a.norm_topk_prob and a.model_type == "qwen3_5_moe_text"
    image_text = transformers.Qwen3_5MoeConfig(text_config=_moe_config().to_dict()).to_dict()
    b = read_hybrid_config({**image_text, "architectures": ["Qwen3_5MoeForConditionalGeneration"]}).attention
    assert b.sparse_layers == a.sparse_layers and b.num_experts == 8 and b.shared_expert_intermediate_size == 48


@pytest.mark.parametrize(("model", "make_cfg", "kw"), [
    ("Qwen3_5ForCausalLM", None, {}),
    ("Qwen3_5MoeForCausalLM", _moe_config, {}),
    ("Qwen3_5MoeForCausalLM", _moe_config, dict(tie_word_embeddings=True, num_experts=16, num_experts_per_tok=4)),
    ("Qwen3NextForCausalLM", _next_config, dict(mlp_only_layers=[1])),
    ("Qwen3NextForCausalLM", _next_config, dict(decoder_sparse_step=2, num_experts=16)),
])
def test_parameter_counts_are_transformers_numel(model, make_cfg, kw):
    """Every parameter transformers' model holds, counted from the config alone; the active
    count leaves out each sparse layer's idle experts."""
    if make_cfg is None:
        hf_cfg = transformers.Qwen3_5TextConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=16, num_hidden_layers=4, intermediate_size=96,
                                                vocab_size=300, pad_token_id=0, **LINEAR)
    else:
        hf_cfg = make_cfg(**kw)
    torch.manual_seed(0)
    ref = getattr(transformers, model)(hf_cfg)
    cfg = read_hybrid_config(_ours(hf_cfg, model))
    counts = hybrid_parameter_counts(cfg)
    assert counts.total == sum(p.numel() for p in ref.parameters())
    a = cfg.attention
    idle = sum(a.is_sparse(i) for i in range(a.num_hidden_layers)) * (a.num_experts - a.num_experts_per_tok)
    assert counts.total - counts.active == idle * 3 * HIDDEN * 32


#: Qwen3-Next-80B-A3B-Instruct's config.json (transformers 4.x's classic form: rope_theta,
#: partial_rotary_factor and rope_scaling at the top level)
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": False,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_qwen3_next_80b_a3b_reads_and_counts_as_its_name(caplog):
    """The release's config.json is read without an unknown key (its classic RoPE keys
    included), three linear layers to one full, every layer sparse, RoPE on a quarter of
    each 256-wide head; it counts as "80B-A3B" (79.7B, 3.9B active with the embeddings);
    a rope_scaling this engine does not compute is refused by name."""
    from shared.specs.base import DeploymentError
    from shared.specs.hybrid_lm import Qwen3NextSpec

    cfg = read_hybrid_config(QWEN3_NEXT_80B)
    assert "not known" not in caplog.text
    assert cfg.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert all(cfg.attention.sparse_layers) and cfg.rotary_dim == 64 and cfg.attention.rope.theta == 1e7
    total, active = Qwen3NextSpec(QWEN3_NEXT_80B, page_size=16).parameter_counts() or (0, 0)
    assert (round(total / 1e9, 1), round(active / 1e9, 1)) == (79.7, 3.9)
    with pytest.raises(DeploymentError, match="rope_type"):
        read_hybrid_config({**QWEN3_NEXT_80B, "rope_scaling": {"type": "yarn", "factor": 4.0}})
