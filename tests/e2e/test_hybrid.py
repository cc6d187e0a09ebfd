"""Qwen3.5 (hybrid: Gated DeltaNet layers beside gated full attention) through the real
services: greedy tokens equal transformers' `Qwen3_5ForCausalLM` (float32) on random
checkpoints of several shapes, with prompts whole, cut into 32-row prefill chunks (and so at
any row of the convolution window when several share a step's budget) and eight at once;
every KV page and state slot back to zero under the layout debug checks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.test_parity import PROMPTS
from tests.reference import hf_greedy, hf_ids
from tests.servers import MstarServer

MAX_TOKENS = 10
DEBUG = {"MSTAR_KV_DEBUG_ASSERTS": "1"}
MORE = ["Serving engines batch requests and page their KV cache. " * 3, "12345 " * 9, "Paris is"]

#: shape -> overrides of tests.checkpoints.FAMILIES["qwen3_5"]
SHAPES = {
    # three linear layers then a full one; grouped value heads, Dk != Dv
    "grouped": {},
    # linear, full, linear; one value head per key head, a 3-wide convolution, tied head
    "alternating": dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=3, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def hybrid(request, tmp_path_factory):
    name = request.param
    return make_checkpoint(tmp_path_factory.mktemp(name) / name, "qwen3_5", **SHAPES[name])


def _generate(url: str, ids: list[int]) -> list[int]:
    r = httpx.post(url + "/generate", json={"input_ids": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                                            "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


@pytest.mark.parametrize("budget", ["whole", "chunked"])
def test_greedy_tokens_equal_transformers(hybrid, tmp_path, budget):
    chunks = ("--max-batch-tokens", "32") if budget == "chunked" else ()
    server = MstarServer(str(hybrid), tmp_path / "log.txt", "--num-kv-pages", "128", *chunks, env=DEBUG).start()
    try:
        prompts = [hf_ids(hybrid, p) for p in PROMPTS + MORE]
        want = [hf_greedy(hybrid, ids, MAX_TOKENS) for ids in prompts]
        # one at a time, then all eight at once (rows of several requests in one step, each
        # request's chunks cut where the shared budget ends)
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
    finally:
        server.stop()
