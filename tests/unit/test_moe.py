"""The mixture-of-experts block (layers/moe.py) computes transformers' Qwen3MoeSparseMoeBlock:
bit for bit on torch's GEMMs (router, softmax, top-k ties, renormalization, the weighted sum
in expert order), to rounding on the C kernels, where every row's bits are the same whatever
rows share its step; one expert call per active expert, not per token; checkpoint tensors
per expert stacked as transformers 5 keeps them; the config's sparse layers are
transformers'; and a served Qwen3-MoE model skips the C decode stack and the MLP fusions."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe

from services.gpu_worker.layers import linear
from services.gpu_worker.layers.moe import SparseMoE, stack_experts
from shared.model_config import parameter_counts, read_model_config

HIDDEN = 64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread, as a CPU worker runs by default: the C GEMM kernel's condition."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: (experts, top-k, norm_topk_prob)
SHAPES = [(8, 1, False), (8, 2, False), (8, 2, True), (16, 4, True), (16, 4, False), (16, 1, True)]


def _config(experts: int, top_k: int, norm: bool, **kw) -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                                       num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm,
                                       moe_intermediate_size=32, experts_implementation="eager", **kw)


def _blocks(experts: int, top_k: int, norm: bool, seed: int = 0) -> tuple[torch.nn.Module, SparseMoE]:
    """transformers' block with random weights, and ours holding the same tensors."""
    hf_cfg = _config(experts, top_k, norm)
    torch.manual_seed(seed)
    ref = hf_moe.Qwen3MoeSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    mine = SparseMoE(read_model_config({**hf_cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}))
    mine.load_state_dict(ref.state_dict())
    return ref, mine


def _pack(mine: SparseMoE) -> None:
    """The block as a CPU worker runs it: experts and router on the C GEMM."""
    if not linear.kernel_available():
        pytest.skip("no C GEMM kernel here")
    assert mine.pack()
    assert linear.pack_linears(mine) == 1  # the router


@pytest.mark.parametrize(("experts", "top_k", "norm"), SHAPES)
@torch.inference_mode()
def test_torch_path_is_transformers_bit_for_bit(experts, top_k, norm):
    ref, mine = _blocks(experts, top_k, norm)
    x = torch.randn(2, 19, HIDDEN)
    assert torch.equal(mine(x.view(-1, HIDDEN)), ref(x).view(-1, HIDDEN))
    _, hf_weights, hf_ids = ref.gate(x.view(-1, HIDDEN))
    weights, ids = mine.route(x.view(-1, HIDDEN))
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


@pytest.mark.parametrize(("experts", "top_k", "norm"), [(8, 2, True), (16, 4, False), (16, 1, False)])
@torch.inference_mode()
def test_ties_go_where_transformers_puts_them(experts, top_k, norm):
    """Router rows repeated: several experts get exactly the same probability for every
    token, and the top-k picks among them in torch.topk's order, as transformers does."""
    ref, mine = _blocks(experts, top_k, norm, seed=1)
    w = ref.gate.weight
    w[1::2] = w[0::2]  # experts 2i and 2i+1 tie, for every token
    w[4:8] = w[0]  # and 0..7 tie, as a block
    mine.gate.weight.copy_(w)
    x = torch.randn(33, HIDDEN)
    x[5] = 0.0  # a row whose logits are all zero: every expert ties
    _, hf_weights, hf_ids = ref.gate(x)
    weights, ids = mine.route(x)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    assert torch.equal(mine(x), ref(x[None])[0])
    _pack(mine)  # the router on the C GEMM ties the same experts (each column sums the same way)
    packed_weights, packed_ids = mine.route(x)
    assert torch.equal(packed_ids, hf_ids)
    torch.testing.assert_close(packed_weights, hf_weights)


@pytest.mark.parametrize(("experts", "top_k", "norm"), SHAPES)
@torch.inference_mode()
def test_kernel_path_matches_transformers_and_each_row_is_batch_invariant(experts, top_k, norm):
    ref, mine = _blocks(experts, top_k, norm)
    _pack(mine)
    x = torch.randn(41, HIDDEN)
    together = mine(x)
    torch.testing.assert_close(together, ref(x[None])[0], rtol=1e-5, atol=1e-5)
    alone = torch.cat([mine(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(alone, together)  # a row's bits whatever rows share its step
    shuffled = torch.randperm(len(x))
    assert torch.equal(mine(x[shuffled]), together[shuffled])
    assert torch.equal(mine(x[7:30]), together[7:30])


@pytest.mark.kernels
@pytest.mark.parametrize(("experts", "top_k"), [(8, 1), (8, 2), (16, 4), (32, 4), (128, 8), (128, 2), (256, 4),
                                                (64, 64), (1000, 3)])
def test_kernel_route_picks_torch_topks_experts_among_ties(experts, top_k):
    """The C routing (kernels/moe_route.c) picks torch.topk's experts in torch.topk's order,
    on rows whose logits take a few values (ties everywhere: equal logits are equal
    probabilities on both sides, distinct ones far apart), on both of topk's paths (partial
    sort where k * 64 <= experts, else nth_element and sort), and weights within rounding of
    torch's softmax (its own exp), renormalized or not."""
    from services.gpu_worker.layers.moe import TOPK_SOFTMAX, kernel_route

    gen = torch.Generator().manual_seed(experts * 100 + top_k)
    # a router's range (exp never near underflow, where the two exps' tails differ)
    rows = [torch.randint(0, levels, (40, experts), generator=gen).float() * (8.0 / levels)
            for levels in (1, 2, 3, 5, 1000)]
    logits = torch.cat(rows).contiguous()
    for norm in (False, True):
        got = kernel_route(logits, top_k, int(norm))  # (SOFTMAX_TOPK, SOFTMAX_TOPK_NORM)
        if got is None:
            pytest.skip("no C kernels here")
        weights, ids = got
        want_w, want_ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
        if norm:
            want_w = want_w / want_w.sum(dim=-1, keepdim=True)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, rtol=2e-6, atol=1e-7)
    got = kernel_route(logits, top_k, TOPK_SOFTMAX)  # gpt-oss's: the k largest logits, then their softmax
    assert got is not None
    top, want_ids = torch.topk(logits, top_k, dim=-1)
    assert torch.equal(got[1], want_ids)
    torch.testing.assert_close(got[0], torch.softmax(top, dim=1), rtol=2e-6, atol=1e-7)


@torch.inference_mode()
def test_one_expert_call_per_active_expert():
    _, mine = _blocks(16, 4, True)
    calls: list[int] = []
    inner = mine._expert
    mine._expert = lambda e, h: (calls.append(len(h)), inner(e, h))[1]  # type: ignore[method-assign]
    x = torch.randn(50, HIDDEN)
    mine(x)
    _, ids = mine.route(x)
    assert len(calls) == len(ids.unique())  # one GEMM pair per expert, over all its rows
    assert sum(calls) == ids.numel()


def test_per_expert_tensors_stack_as_transformers_keeps_them():
    ref, _ = _blocks(8, 2, False)
    prefix = "model.layers.3.mlp.experts"
    fused = ref.experts.gate_up_proj.detach()
    inter = fused.shape[1] // 2
    per_expert = {"model.norm.weight": torch.ones(HIDDEN)}
    for e in range(8):
        per_expert[f"{prefix}.{e}.gate_proj.weight"] = fused[e, :inter]
        per_expert[f"{prefix}.{e}.up_proj.weight"] = fused[e, inter:]
        per_expert[f"{prefix}.{e}.down_proj.weight"] = ref.experts.down_proj.detach()[e]
    stacked = stack_experts(per_expert, 8)
    assert sorted(stacked) == [f"{prefix}.down_proj", f"{prefix}.gate_up_proj", "model.norm.weight"]
    assert torch.equal(stacked[f"{prefix}.gate_up_proj"], fused)
    assert torch.equal(stacked[f"{prefix}.down_proj"], ref.experts.down_proj.detach())
    assert stack_experts(stacked, 8).keys() == stacked.keys()  # the stacked form passes through
    del per_expert[f"{prefix}.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"up_proj.weight for experts \[5\]"):
        stack_experts(per_expert, 8)


@pytest.mark.parametrize("kw", [dict(decoder_sparse_step=2), dict(mlp_only_layers=[0, 3]), dict(num_experts=0),
                                dict(decoder_sparse_step=3, mlp_only_layers=[2])])
def test_sparse_layers_are_transformers(kw):
    hf_cfg = _config(8, 2, True, num_hidden_layers=6, **{k: v for k, v in kw.items() if k != "num_experts"})
    if "num_experts" in kw:
        hf_cfg.num_experts = kw["num_experts"]
    want = tuple(isinstance(hf_moe.Qwen3MoeDecoderLayer(hf_cfg, i).mlp, hf_moe.Qwen3MoeSparseMoeBlock)
                 for i in range(6))
    cfg = read_model_config({**hf_cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    assert cfg.sparse_layers == want
    assert cfg.num_experts == hf_cfg.num_experts and cfg.num_experts_per_tok == 2 and cfg.norm_topk_prob


def test_num_experts_under_either_name():
    base = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 2, "num_experts_per_tok": 2}
    assert read_model_config({**base, "num_experts": 16}).num_experts == 16  # Hugging Face checkpoints
    assert read_model_config({**base, "num_local_experts": 16}).num_experts == 16  # transformers 5's save


def test_served_model_skips_the_dense_fast_paths_and_matches_transformers(tmp_path):
    """A Qwen3-MoE checkpoint with a dense layer among sparse ones, built as the worker
    builds it: the C decode stack takes it (both kinds of layer), the MLP fusions touch only the dense layer,
    and its prompt log-likelihood (paged KV, prompt chunks of 7 rows) is transformers'."""
    from bench.perplexity import load, perplexity
    from services.gpu_worker.modeling.decoder.lm import MLP
    from tests.checkpoints import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "moe", "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1],
                           num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
    model, spec, kv = load(str(ckpt), "float32", "float32")
    assert model.cpu_stack is not None and model.step_stack is model.cpu_stack
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoE, MLP, SparseMoE]
    ids = list(range(3, 60))
    got = perplexity(model, spec, ids, kv, chunk=7)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype="float32").eval()
    with torch.inference_mode():
        want = math.exp(ref(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item())
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mistral"])
def test_parameter_counts_are_transformers_numel(family):
    """Every parameter transformers' model holds, counted from the config alone; a dense
    model's active count is its total."""
    from tests.checkpoints import FAMILIES

    cfg_name, model_name, kw = FAMILIES[family]
    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=0, **kw)
    if family == "qwen3_moe":
        shape.update(mlp_only_layers=[1], num_hidden_layers=3)
    hf_cfg = getattr(transformers, cfg_name)(**shape)
    model = getattr(transformers, model_name)(hf_cfg)
    counts = parameter_counts(read_model_config({**hf_cfg.to_dict(), "architectures": [model_name]}))
    assert counts.total == sum(p.numel() for p in model.parameters())
    if family == "qwen3_moe":  # layers 0 and 2 sparse: 6 of the 8 experts idle for a token in each
        assert counts.total - counts.active == 2 * (8 - 2) * 3 * 64 * 32
    else:
        assert counts.active == counts.total


def test_qwen3_30b_a3b_counts_as_its_name():
    raw = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
               moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
               num_experts_per_tok=8, num_hidden_layers=48, vocab_size=151936, max_position_embeddings=40960)
    counts = parameter_counts(read_model_config(raw))
    assert (round(counts.total / 1e9, 1), round(counts.active / 1e9, 1)) == (30.5, 3.4)  # Qwen: 30.5B, 3.3B active


@pytest.mark.kernels
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@torch.inference_mode()
def test_quantized_experts_read_their_blocks_and_each_row_is_batch_invariant(qtype):
    """A GGUF file's experts kept in their blocks (`keep_quantized`: gate and up joined, down
    apart, `QuantLinear` each) compute what the dequantized experts do within the quantized
    kernel's rounding, and a row's bits do not depend on the rows beside it."""
    import gguf
    import numpy as np

    from services.gpu_worker.layers import quant
    from services.gpu_worker.layers.quant import QuantLinear

    if not quant.available():
        pytest.skip("no quantized GEMM kernel here")
    ref, mine = _blocks(8, 2, True)
    kind = gguf.GGMLQuantizationType[qtype]
    dense = SparseMoE(mine_cfg := read_model_config({**_config(8, 2, True).to_dict(),
                                                     "architectures": ["Qwen3MoeForCausalLM"]}))
    parts: dict[int, dict[str, QuantLinear]] = {}
    stacked = {"gate_up_proj": [], "down_proj": []}
    gate_up, down = ref.experts.gate_up_proj.detach(), ref.experts.down_proj.detach()
    for e in range(8):
        weights = {"gate_proj": gate_up[e, :32], "up_proj": gate_up[e, 32:], "down_proj": down[e]}
        for name, w in weights.items():
            blocks = gguf.quants.quantize(w.numpy(), kind)
            parts.setdefault(e, {})[name] = QuantLinear.from_gguf(qtype, blocks, tuple(w.shape))
            weights[name] = torch.from_numpy(gguf.quants.dequantize(blocks, kind).reshape(w.shape).astype(np.float32))
        stacked["gate_up_proj"].append(torch.cat([weights["gate_proj"], weights["up_proj"]]))
        stacked["down_proj"].append(weights["down_proj"])
    assert mine_cfg.num_experts == 8
    dense.load_state_dict({"gate.weight": ref.gate.weight, "experts.gate_up_proj": torch.stack(stacked["gate_up_proj"]),
                           "experts.down_proj": torch.stack(stacked["down_proj"])})
    assert mine.keep_quantized(parts) and not hasattr(mine, "experts") and not mine.pack()
    if linear.kernel_available():
        assert linear.pack_linears(mine) == 1  # the router on the C GEMM, as a worker runs it
    x = torch.randn(41, HIDDEN)
    together = mine(x)
    torch.testing.assert_close(together, dense(x), rtol=0.05, atol=0.02)
    alone = torch.cat([mine(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(alone, together)
    assert torch.equal(mine(x[7:30]), together[7:30])


def test_an_expert_missing_a_part_is_not_kept_quantized():
    _, mine = _blocks(8, 2, True)
    assert not mine.keep_quantized({e: {} for e in range(8)}) and hasattr(mine, "experts")
