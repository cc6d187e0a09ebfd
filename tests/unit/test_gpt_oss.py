"""gpt-oss's mixture-of-experts block (layers/gpt_oss_moe.py) computes transformers'
`GptOssMLP` (eager experts): bit for bit on torch's path (router with bias, softmax over the
top-k logits, ties, interleaved gate/up columns, biases, the clamped SwiGLU), to rounding on
the C GEMM, where a row's bits do not depend on its neighbours; the config is read as
transformers derives it (alternating layers, YaRN, sinks, the experts' width); parameter
counts are transformers' numel (gpt-oss-20b: 20.91B, 3.61B active besides the embedding); a built model's prompt
log-likelihood is transformers'."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.models.gpt_oss import modeling_gpt_oss as hf_oss

from services.gpu_worker.layers import linear
from services.gpu_worker.layers.gpt_oss_moe import GptOssMoE
from shared.model_config import FULL, SLIDING, parameter_counts, read_model_config

HIDDEN = 64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread, as a CPU worker runs by default: the C GEMM kernel's condition."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SHAPES = [(8, 1), (8, 2), (16, 4), (32, 2), (32, 4)]


def _config(experts: int, top_k: int, **kw) -> transformers.GptOssConfig:
    return transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=48, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, num_local_experts=experts,
                                     num_experts_per_tok=top_k, experts_implementation="eager", **kw)


def _blocks(experts: int, top_k: int, seed: int = 0) -> tuple[torch.nn.Module, GptOssMoE]:
    """transformers' block with random weights (large enough that the clamps bite), and ours
    holding the same tensors."""
    hf_cfg = _config(experts, top_k)
    torch.manual_seed(seed)
    ref = hf_oss.GptOssMLP(hf_cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.5)
    mine = GptOssMoE(read_model_config({**hf_cfg.to_dict(), "architectures": ["GptOssForCausalLM"]}))
    mine.load_state_dict(ref.state_dict())
    return ref, mine


def _x(rows: int) -> torch.Tensor:
    return torch.randn(rows, HIDDEN) * 2


@pytest.mark.parametrize(("experts", "top_k"), SHAPES)
@torch.inference_mode()
def test_torch_path_is_transformers_bit_for_bit(experts, top_k):
    ref, mine = _blocks(experts, top_k)
    x = _x(38)
    assert torch.equal(mine(x), ref(x.view(2, 19, HIDDEN))[0].view(-1, HIDDEN))
    _, hf_weights, hf_ids = ref.router(x)
    weights, ids = mine.route(x)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    gate_up = x @ ref.experts.gate_up_proj[0] + ref.experts.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > 7.0).any() and (gate_up[:, 1::2].abs() > 7.0).any()  # the clamps bite


@torch.inference_mode()
def test_ties_go_where_transformers_puts_them():
    """Router rows repeated (and their biases): experts with equal logits for every token,
    picked in torch.topk's order as transformers picks them."""
    ref, mine = _blocks(16, 4, seed=1)
    with torch.no_grad():
        for w in (ref.router.weight, ref.router.bias):
            w[3], w[9], w[12] = w[5], w[5], w[5]
    mine.load_state_dict(ref.state_dict())
    x = _x(30)
    assert torch.equal(mine(x), ref(x[None])[0][0])


@pytest.mark.parametrize(("experts", "top_k"), SHAPES)
@torch.inference_mode()
def test_kernel_path_matches_transformers_and_each_row_is_batch_invariant(experts, top_k):
    ref, mine = _blocks(experts, top_k)
    if not linear.kernel_available():
        pytest.skip("no C GEMM kernel here")
    assert mine.pack()
    assert linear.pack_linears(mine) == 1  # the router
    x = _x(41)
    together = mine(x)
    torch.testing.assert_close(together, ref(x[None])[0][0], rtol=1e-5, atol=1e-4)
    alone = torch.cat([mine(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(alone, together)  # a row's bits whatever rows share its step
    shuffled = torch.randperm(len(x))
    assert torch.equal(mine(x[shuffled]), together[shuffled])


def test_config_is_read_as_transformers_derives_it():
    hf_cfg = transformers.GptOssConfig(num_hidden_layers=5, num_local_experts=32, num_experts_per_tok=4)
    cfg = read_model_config({**hf_cfg.to_dict(), "architectures": ["GptOssForCausalLM"]})
    assert cfg.layer_types == tuple(hf_cfg.layer_types) == (SLIDING, FULL, SLIDING, FULL, SLIDING)
    assert cfg.sliding_window == 128 and cfg.attn_sinks and cfg.expert_bias and cfg.qkv_bias and cfg.o_bias
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0) and all(cfg.sparse_layers)
    rope = cfg.rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position_embeddings, rope.truncate) == (
        "yarn", 150000.0, 32.0, 4096, False)
    assert cfg.max_position_embeddings == 131072


@pytest.mark.parametrize("kw", [dict(), dict(tie_word_embeddings=True, num_hidden_layers=3)])
def test_parameter_counts_are_transformers_numel(kw):
    hf_cfg = _config(8, 2, **{"vocab_size": 300, "num_hidden_layers": 2, **kw})
    model = transformers.GptOssForCausalLM(hf_cfg)
    counts = parameter_counts(read_model_config({**hf_cfg.to_dict(), "architectures": ["GptOssForCausalLM"]}))
    assert counts.total == sum(p.numel() for p in model.parameters())
    expert = 3 * HIDDEN * 48 + 2 * 48 + HIDDEN  # gate/up and down weights and biases
    assert counts.total - counts.active == hf_cfg.num_hidden_layers * (8 - 2) * expert


def test_gpt_oss_20b_counts_as_its_card():
    """openai/gpt-oss-20b's config: 20.9B parameters, as transformers' numel of the model it
    builds; 4.2B active counting the embedding table as every count here does (as the
    Qwen3-30B-A3B test's), which OpenAI's model card leaves out of its 3.6B active."""
    raw = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
               num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
               num_experts_per_tok=4, num_hidden_layers=24, vocab_size=201088, sliding_window=128,
               max_position_embeddings=131072, attention_bias=True, tie_word_embeddings=False)
    counts = parameter_counts(read_model_config(raw))
    embedding = 201088 * 2880
    assert (round(counts.total / 1e9, 2), round((counts.active - embedding) / 1e9, 2)) == (20.91, 3.61)
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{
            k: v for k, v in raw.items() if k not in ("architectures", "model_type")}))
    assert counts.total == sum(p.numel() for p in model.parameters())


def test_served_model_matches_transformers(tmp_path):
    """A gpt-oss checkpoint built as the worker builds it (experts packed, the C decode stack
    taking its steps): its prompt log-likelihood over paged KV, in prompt chunks of 7 rows past the
    window of 8 (the C prefill kernel with sinks), is transformers'."""
    from bench.perplexity import load, perplexity
    from tests.checkpoints import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "oss", "gpt_oss", num_hidden_layers=3, num_local_experts=16,
                           num_experts_per_tok=4)
    model, spec, kv = load(str(ckpt), "float32", "float32")
    assert model.cpu_stack is not None and model.step_stack is model.cpu_stack  # (sinks and experts in C)
    assert all(isinstance(layer.mlp, GptOssMoE) for layer in model.model.layers)
    ids = list(range(3, 60))
    got = perplexity(model, spec, ids, kv, chunk=7)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype="float32").eval()
    with torch.inference_mode():
        want = math.exp(ref(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item())
    assert got == pytest.approx(want, rel=1e-5)
