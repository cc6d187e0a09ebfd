"""Qwen3.5 (hybrid: Gated DeltaNet layers beside gated full attention) through the real
services, on the flags its greedy parity rows do not cover (those, and the prefix cache's
resume from a state snapshot, are tests/e2e/test_family_parity.py's): a row's logprobs
independent of its batch, and requests past the state slots waiting for one."""

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

def _generate(url: str, ids: list[int]) -> list[int]:
    r = httpx.post(url + "/generate", json={"input_ids": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                                            "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """tests.checkpoints' Qwen3.5: three linear layers then a full one; grouped value heads, Dk != Dv."""
    return make_checkpoint(tmp_path_factory.mktemp("grouped") / "ckpt", "qwen3_5")


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
