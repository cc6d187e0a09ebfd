"""Mixtral's mixture of experts (issue 51) against transformers 5's modeling_mixtral: the
config read (every layer sparse, experts `intermediate_size` wide, the top-k weights always
renormalized), `MixtralSparseMoeBlock` bit for bit on the torch path and within rounding on
the C kernels, the checkpoint's `block_sparse_moe.experts.{e}.w1 / w3 / w2` stacked as
transformers' conversion mapping stacks them, parameter counts, and a built model's prompt
log-likelihood."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.models.mixtral import modeling_mixtral as hf_mixtral

from services.gpu_worker.layers import linear
from services.gpu_worker.layers.moe import SparseMoE, stack_experts
from shared.model_config import SLIDING, parameter_counts, read_model_config

HIDDEN = 64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread, as a CPU worker runs by default: the C GEMM kernel's condition."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(experts: int, top_k: int, **kw) -> transformers.MixtralConfig:
    return transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=48, num_attention_heads=4,
                                      num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=top_k,
                                      experts_implementation="eager", **kw)


def _read(hf_cfg: transformers.MixtralConfig):
    return read_model_config({**hf_cfg.to_dict(), "architectures": ["MixtralForCausalLM"]})


def _blocks(experts: int, top_k: int, seed: int = 0) -> tuple[torch.nn.Module, SparseMoE]:
    """transformers' block with random weights, and ours holding the same tensors."""
    hf_cfg = _config(experts, top_k)
    torch.manual_seed(seed)
    ref = hf_mixtral.MixtralSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    mine = SparseMoE(_read(hf_cfg))
    mine.load_state_dict(ref.state_dict())
    return ref, mine


SHAPES = [(8, 2), (8, 1), (4, 4), (16, 3)]


def test_config_every_layer_sparse_and_renormalized():
    cfg = _read(_config(8, 2, num_hidden_layers=5, sliding_window=None))
    assert cfg.model_type == "mixtral" and cfg.sparse_layers == (True,) * 5
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 48)
    assert cfg.norm_topk_prob and not cfg.qk_norm and not cfg.qkv_bias and cfg.sliding_window is None
    windowed = _read(_config(8, 2, num_hidden_layers=2, sliding_window=8))
    assert windowed.sliding_window == 8 and windowed.layer_types == (SLIDING, SLIDING)  # as Mistral's
    with pytest.raises(Exception, match="num_experts_per_tok"):
        _read(_config(4, 5))


@pytest.mark.parametrize(("experts", "top_k"), SHAPES)
@torch.inference_mode()
def test_torch_path_is_transformers_bit_for_bit(experts, top_k):
    ref, mine = _blocks(experts, top_k)
    x = torch.randn(2, 19, HIDDEN)
    assert torch.equal(mine(x.view(-1, HIDDEN)), ref(x).view(-1, HIDDEN))
    _, hf_weights, hf_ids = ref.gate(x.view(-1, HIDDEN))
    weights, ids = mine.route(x.view(-1, HIDDEN))
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


@pytest.mark.parametrize(("experts", "top_k"), SHAPES)
@torch.inference_mode()
def test_kernel_path_matches_transformers_and_each_row_is_batch_invariant(experts, top_k):
    if not linear.kernel_available():
        pytest.skip("no C GEMM kernel here")
    ref, mine = _blocks(experts, top_k, seed=1)
    x = torch.randn(23, HIDDEN)
    want = ref(x.view(1, -1, HIDDEN)).view(-1, HIDDEN)
    assert mine.pack() and linear.pack_linears(mine) == 1
    got = mine(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for i in (0, 7, 22):
        assert torch.equal(mine(x[i : i + 1]), got[i : i + 1])


def test_mixtral_checkpoint_names_stack_as_transformers_converts_them():
    """What `save_pretrained` writes for Mixtral (transformers reverts its conversion):
    `block_sparse_moe.gate.weight` and `block_sparse_moe.experts.{e}.w1 / w3 / w2`, loaded by
    transformers into `mlp.gate.weight` and `mlp.experts.gate_up_proj` (w1 rows then w3) /
    `down_proj` (w2)."""
    ref, _ = _blocks(4, 2)
    fused, down = ref.experts.gate_up_proj.detach(), ref.experts.down_proj.detach()
    inter = fused.shape[1] // 2
    layer = "model.layers.1"
    saved = {f"{layer}.block_sparse_moe.gate.weight": ref.gate.weight.detach()}
    for e in range(4):
        saved[f"{layer}.block_sparse_moe.experts.{e}.w1.weight"] = fused[e, :inter]
        saved[f"{layer}.block_sparse_moe.experts.{e}.w3.weight"] = fused[e, inter:]
        saved[f"{layer}.block_sparse_moe.experts.{e}.w2.weight"] = down[e]
    stacked = stack_experts(saved, 4)
    assert sorted(stacked) == [f"{layer}.mlp.experts.down_proj", f"{layer}.mlp.experts.gate_up_proj",
                               f"{layer}.mlp.gate.weight"]
    assert torch.equal(stacked[f"{layer}.mlp.experts.gate_up_proj"], fused)
    assert torch.equal(stacked[f"{layer}.mlp.experts.down_proj"], down)
    del saved[f"{layer}.block_sparse_moe.experts.2.w3.weight"]
    with pytest.raises(ValueError, match=r"up_proj.weight for experts \[2\]"):
        stack_experts(saved, 4)


def test_parameter_counts_are_transformers_numel():
    hf_cfg = _config(8, 2, num_hidden_layers=3, vocab_size=300, pad_token_id=0)
    model = transformers.MixtralForCausalLM(hf_cfg)
    counts = parameter_counts(_read(hf_cfg))
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.total - counts.active == 3 * (8 - 2) * 3 * HIDDEN * 48  # 6 of 8 experts idle a token, 3 layers


def test_mixtral_8x7b_counts_as_published():
    """Mixtral-8x7B-v0.1's config.json: 46.7B parameters, 12.9B active a token (Mistral AI's
    figures)."""
    raw = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, num_local_experts=8,
               num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768, sliding_window=None,
               rope_theta=1e6, router_aux_loss_coef=0.02, output_router_logits=False)
    counts = parameter_counts(read_model_config(raw))
    assert (round(counts.total / 1e9, 1), round(counts.active / 1e9, 1)) == (46.7, 12.9)


def test_served_model_matches_transformers(tmp_path):
    """A Mixtral checkpoint as `save_pretrained` writes it, built as the worker builds it: the
    C decode stack takes it (its experts packed), every layer is a SparseMoE, and its prompt log-likelihood
    (paged KV, prompt chunks of 7 rows) is transformers'."""
    from bench.perplexity import load, perplexity
    from tests.checkpoints import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "mixtral", "mixtral", num_hidden_layers=3, num_local_experts=4,
                           num_experts_per_tok=2)
    model, spec, kv = load(str(ckpt), "float32", "float32")
    assert model.cpu_stack is not None and model.step_stack is model.cpu_stack
    assert [type(layer.mlp) for layer in model.model.layers] == [SparseMoE] * 3
    ids = list(range(3, 60))
    got = perplexity(model, spec, ids, kv, chunk=7)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype="float32").eval()
    with torch.inference_mode():
        want = math.exp(ref(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item())
    assert got == pytest.approx(want, rel=1e-5)
