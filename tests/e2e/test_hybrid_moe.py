"""The hybrid mixtures of experts through the real services, beyond their greedy parity rows
(Qwen3.5-MoE and Qwen3-Next shapes, whole and in 32-row chunks, the prefix cache's resume from
a state snapshot: tests/e2e/test_family_parity.py): Qwen3-Next's logprobs independent of the
batch, and Qwen3.5-MoE with images (`Qwen3_5MoeForConditionalGeneration`) equal to
transformers."""

from __future__ import annotations

import asyncio

import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e import test_hybrid, test_hybrid_vision
from tests.e2e.test_hybrid import DEBUG
from tests.hybrid_vlm_checkpoints import make_qwen35_vl_checkpoint
from tests.servers import MstarServer


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("next") / "ckpt", "qwen3_next")


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
