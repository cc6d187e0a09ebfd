"""The hybrid mixtures of experts through the real services: Qwen3.5-MoE
(`Qwen3_5MoeForCausalLM`, and a `Qwen3_5MoeForConditionalGeneration` folder served as text)
and Qwen3-Next (`Qwen3NextForCausalLM`: its fused per-key-head projections, a dense layer
among sparse ones, top-k weights renormalized or not). Greedy tokens equal transformers'
(float32) on random checkpoints, with prompts whole, cut into 32-row prefill chunks and
eight at once; every KV page and state slot back to zero under the layout debug checks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.checkpoints import make_checkpoint, make_tokenizer
from tests.e2e import test_hybrid, test_hybrid_vision
from tests.e2e.test_hybrid import DEBUG, MAX_TOKENS, MORE, _generate
from tests.e2e.test_parity import PROMPTS
from tests.hybrid_vlm_checkpoints import make_qwen35_vl_checkpoint
from tests.reference import hf_greedy, hf_ids
from tests.servers import MstarServer

#: name -> (family of tests.checkpoints.FAMILIES, overrides)
SHAPES = {
    # every layer sparse: 8 experts, 2 a token, a shared expert of width 48
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    # linear, full, linear: 16 experts, 4 a token, one value head per key head, tied head
    "qwen3_5_moe_wide": ("qwen3_5_moe", dict(
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_experts=16, num_experts_per_tok=4, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=3, tie_word_embeddings=True)),
    # layer 1 dense (mlp_only_layers), the k weights as the softmax gave them
    "qwen3_next": ("qwen3_next", {}),
    # every second layer sparse (decoder_sparse_step), 16 experts, 1 a token, renormalized
    "qwen3_next_step": ("qwen3_next", dict(decoder_sparse_step=2, mlp_only_layers=[], num_experts=16,
                                           num_experts_per_tok=1, norm_topk_prob=True)),
    # 64 experts, 8 a token, every layer sparse
    "qwen3_next_64": ("qwen3_next", dict(mlp_only_layers=[], num_experts=64, num_experts_per_tok=8)),
}


def make_image_text_checkpoint(path):
    """A `Qwen3_5MoeForConditionalGeneration` folder (the form Qwen3.5-MoE is released in:
    the language model's config under `text_config`, its weights under
    `model.language_model.`, a vision tower beside it), served here as text."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path, family="qwen3_5")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=8,
                linear_num_key_heads=1, linear_num_value_heads=4, max_position_embeddings=512,
                moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                initializer_range=0.2, eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=0,
                layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"])
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=[*SHAPES, "qwen3_5_moe_image_text"])
def hybrid_moe(request, tmp_path_factory):
    name = request.param
    folder = tmp_path_factory.mktemp(name) / "ckpt"
    if name.endswith("image_text"):
        return make_image_text_checkpoint(folder)
    family, overrides = SHAPES[name]
    return make_checkpoint(folder, family, **overrides)


@pytest.mark.parametrize("budget", ["whole", "chunked"])
def test_greedy_tokens_equal_transformers(hybrid_moe, tmp_path, budget):
    chunks = ("--max-batch-tokens", "32") if budget == "chunked" else ()
    server = MstarServer(str(hybrid_moe), tmp_path / "log.txt", "--num-kv-pages", "128", *chunks, env=DEBUG).start()
    try:
        prompts = [hf_ids(hybrid_moe, p) for p in PROMPTS + MORE]
        want = [hf_greedy(hybrid_moe, ids, MAX_TOKENS) for ids in prompts]
        assert [_generate(server.url, ids) for ids in prompts] == want

        async def together():
            async with httpx.AsyncClient(timeout=120) as client:
                rs = await asyncio.gather(*(client.post(server.url + "/generate", json={
                    "input_ids": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
                    for ids in prompts))
            return [r.json()["token_ids"] for r in rs]

        assert asyncio.run(together()) == want
        assert server.wait_pages_free() == 0
        assert "footprint overrun" not in server.log().lower()
        card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    finally:
        server.stop()
    if "image_text" not in hybrid_moe.parent.name:  # (a vision model's count is not stated)
        _assert_counts(hybrid_moe, card)


def _assert_counts(folder, card: dict) -> None:
    """/v1/models: every parameter transformers' model holds, and a token's: all but each
    sparse layer's idle experts."""
    import json

    from shared.hybrid_config import read_hybrid_config
    from tests.reference import hf_model

    a = read_hybrid_config(json.loads((folder / "config.json").read_text())).attention
    total = sum(p.numel() for p in hf_model(str(folder)).parameters())
    sparse = sum(a.is_sparse(i) for i in range(a.num_hidden_layers))
    idle = sparse * (a.num_experts - a.num_experts_per_tok) * 3 * a.hidden_size * a.moe_intermediate_size
    assert (card["parameters"], card["active_parameters"]) == (total, total - idle)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("next") / "ckpt", "qwen3_next")


def test_prefix_cache_resumes_from_a_state_snapshot(qwen3_next, tmp_path):
    """test_hybrid's prefix-cache case on Qwen3-Next: a shared 300-token prefix resumes from
    the state snapshot at row 256, a repeated 40-token prompt at row 32; answers transformers'."""
    test_hybrid.test_prefix_cache_resumes_from_a_state_snapshot(qwen3_next, tmp_path)


@pytest.mark.kernels  # the C kernels' path
def test_a_rows_logprobs_do_not_depend_on_its_batch(qwen3_next, tmp_path):
    """test_hybrid's batch-invariance case on Qwen3-Next: a row's experts, shared expert and
    its gate give the same bits alone and among eight other streams."""
    test_hybrid.test_a_rows_logprobs_do_not_depend_on_its_batch(qwen3_next, tmp_path)


@pytest.fixture(scope="module")
def moe_image_text(tmp_path_factory):
    """test_hybrid_vision's checkpoint (its tower, processor files and template) as
    `Qwen3_5MoeForConditionalGeneration`: served with images, not as text."""
    return make_qwen35_vl_checkpoint(tmp_path_factory.mktemp("qwen35moe-vl") / "ckpt", moe=True)


def test_images_equal_transformers(moe_image_text, tmp_path):
    """test_hybrid_vision's cases on Qwen3.5-MoE with images: /generate and the chat route
    give transformers' greedy tokens and prompt lengths (one image, two of different sizes,
    text; one at a time and together, in 32-row chunks), the image changes the answer and
    the prefix cache keys images by content; pages and state slots back to zero."""
    server = MstarServer(str(moe_image_text), tmp_path / "log.txt", "--num-kv-pages", "96", "--page-size", "8",
                         "--max-batch-tokens", "32", "--enable-prompt-tokens-details", env=DEBUG).start()
    try:
        asyncio.run(test_hybrid_vision.test_generate_token_ids_equal_transformers(moe_image_text, server))
        asyncio.run(test_hybrid_vision.test_chat_route_equals_transformers(moe_image_text, server))
        asyncio.run(test_hybrid_vision.test_the_prefix_cache_keys_images_by_content(moe_image_text, server))
    finally:
        server.stop()
