"""Qwen3.5 (hybrid: Gated DeltaNet layers beside gated full attention) through the real
services: greedy tokens equal transformers' `Qwen3_5ForCausalLM` (float32) on random
checkpoints of several shapes, with prompts whole, cut into 32-row prefill chunks (and so at
any row of the convolution window when several share a step's budget) and eight at once;
every KV page and state slot back to zero under the layout debug checks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.checkpoints import make_checkpoint, make_tokenizer
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


def make_image_text_checkpoint(path):
    """A `Qwen3_5ForConditionalGeneration` folder (the form Qwen3.5 is released in: the
    language model's config under `text_config`, its weights under
    `model.language_model.`, a vision tower beside it), served here as text."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path, family="qwen3_5")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                linear_value_head_dim=8, linear_num_key_heads=1, linear_num_value_heads=4,
                max_position_embeddings=512, initializer_range=0.2, eos_token_id=tok.token_to_id("<|im_end|>"),
                pad_token_id=0, layer_types=["full_attention", "linear_attention", "linear_attention",
                                             "full_attention"])
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=[*sorted(SHAPES), "image-text folder"])
def hybrid(request, tmp_path_factory):
    name = request.param
    folder = tmp_path_factory.mktemp(name.replace(" ", "-")) / "ckpt"
    if name == "image-text folder":
        return make_image_text_checkpoint(folder)
    return make_checkpoint(folder, "qwen3_5", **SHAPES[name])


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


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("prefix") / "ckpt", "qwen3_5", **SHAPES["grouped"])


def test_prefix_cache_resumes_from_a_state_snapshot(grouped, tmp_path):
    """A prompt sharing a 300-token prefix with an earlier one takes the prefix's KV pages and
    the recurrent state snapshotted at row 256 (the last multiple of the snapshot interval
    inside the shared part), computes only its tail and answers as transformers does cold; a
    repeated 40-token prompt resumes at its last page boundary (row 32). Pages and state
    slots back to zero after, under the layout debug checks."""
    server = MstarServer(str(grouped), tmp_path / "log.txt", "--num-kv-pages", "128", "--page-size", "16",
                         env=DEBUG).start()
    try:
        prefix = [5 + (i * 7) % 300 for i in range(300)]
        first, second = prefix + list(range(10, 40)), prefix + list(range(50, 70))
        short = list(range(60, 100))
        want = {name: hf_greedy(grouped, ids, MAX_TOKENS) for name, ids in
                (("first", first), ("second", second), ("short", short))}
        assert _generate(server.url, first) == want["first"]
        assert server.wait_metric("mstar_prefix_cache_queries_total", 1) == 1
        assert server.metric("mstar_prefix_cache_hit_tokens_total") == 0
        assert _generate(server.url, second) == want["second"]
        assert server.wait_metric("mstar_prefix_cache_hit_tokens_total", 256) == 256
        assert _generate(server.url, short) == want["short"]
        assert _generate(server.url, short) == want["short"]
        assert server.wait_metric("mstar_prefix_cache_hit_tokens_total", 256 + 32) == 256 + 32
        assert server.wait_pages_free() == 0
        assert "footprint overrun" not in server.log().lower()
    finally:
        server.stop()


@pytest.mark.kernels  # the C kernels' path (also run on the AVX2 build: scripts/test)
def test_a_rows_logprobs_do_not_depend_on_its_batch(grouped, tmp_path):
    """The same greedy request with logprobs gives bitwise the same tokens and logprobs alone
    and among eight other streams (its prompt cut into other chunks, its decode rows beside
    other requests' prefill and decode): the delta rule and the convolution run each request
    on its own state, token by token, and the GEMMs give a row the same bits in any batch."""
    # no prefix cache: the probe's prompt is computed every time, cut where the budget ends
    server = MstarServer(str(grouped), tmp_path / "log.txt", "--num-kv-pages", "128",
                         "--max-batch-tokens", "48", "--no-prefix-cache").start()
    probe = {"input_ids": [7 + (i * 5) % 200 for i in range(90)], "max_tokens": 16, "temperature": 0,
             "logprobs": 2, "ignore_eos": True}

    async def run(others: int) -> tuple[list[int], list]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            streams = [asyncio.create_task(client.post("/generate", json={
                "input_ids": [3 + (i * j) % 250 for j in range(20 + 9 * i)], "max_tokens": 12 + i,
                "temperature": 0.8, "seed": i, "ignore_eos": True})) for i in range(others)]
            await asyncio.sleep(0.05 * others)
            r = await client.post("/generate", json=probe)
            assert all(s.status_code == 200 for s in await asyncio.gather(*streams))
        assert r.status_code == 200, r.text
        return r.json()["token_ids"], r.json()["logprobs"]

    try:
        alone = asyncio.run(run(0))
        assert asyncio.run(run(8)) == alone
        assert asyncio.run(run(4)) == alone
        assert server.wait_pages_free() == 0
    finally:
        server.stop()


def test_requests_past_the_state_slots_wait_and_n_shares_the_prompt(grouped, tmp_path):
    """Two running requests at most (`--max-num-seqs 2`: four state slots, two of them for
    snapshots): eight sent at once all answer as transformers does, the six without a slot
    waiting for one, none failed; then `n: 3` greedy samples of one prompt (the later ones
    resume from the first's prefix and state snapshot, or run cold: exact either way) are
    three copies of transformers' answer. Every page and slot back to zero."""
    import transformers

    server = MstarServer(str(grouped), tmp_path / "log.txt", "--num-kv-pages", "128", "--page-size", "16",
                         "--max-num-seqs", "2", env=DEBUG).start()
    try:
        prompts = [hf_ids(grouped, p) for p in PROMPTS + MORE]
        want = [hf_greedy(grouped, ids, MAX_TOKENS) for ids in prompts]

        async def together():
            async with httpx.AsyncClient(timeout=300) as client:
                rs = await asyncio.gather(*(client.post(server.url + "/generate", json={
                    "input_ids": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
                    for ids in prompts))
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
            return [r.json()["token_ids"] for r in rs]

        assert asyncio.run(together()) == want
        ids = prompts[-2] * 3  # long enough for a page boundary and its snapshot
        r = httpx.post(server.url + "/v1/completions", timeout=300, json={
            "prompt": ids, "n": 3, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        text = transformers.AutoTokenizer.from_pretrained(grouped).decode(hf_greedy(grouped, ids, MAX_TOKENS))
        assert [c["text"] for c in r.json()["choices"]] == [text] * 3
        assert server.wait_pages_free() == 0
        log = server.log()
        assert "footprint overrun" not in log.lower() and "failed (error_id=" not in log
    finally:
        server.stop()
