"""The prefix cache through the real services: a repeated long prompt reuses its pages
(hit tokens counted) with greedy output identical to the cold run; a model whose second
label is a rows span never reuses anything."""

from __future__ import annotations

import httpx

from tests.servers import MstarServer


def _gen(server, ids, n=16):
    r = httpx.post(server.url + "/generate",
                   json={"input_ids": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def test_repeated_prompt_hits_and_matches_cold(llama_ckpt, tmp_path):
    server = MstarServer(str(llama_ckpt), tmp_path / "log.txt", "--num-kv-pages", "256", "--page-size", "16",
                         env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    cold_server = MstarServer(str(llama_ckpt), tmp_path / "cold.txt", "--num-kv-pages", "256", "--page-size", "16",
                              "--no-prefix-cache").start()
    try:
        ids = [(i * 37) % 250 + 3 for i in range(300)]
        cold = _gen(server, ids)
        before_hits = server.wait_metric("mstar_prefix_cache_queries_total", 1)
        assert before_hits == 1 and server.metric("mstar_prefix_cache_hit_tokens_total") == 0
        warm = _gen(server, ids)
        assert warm == cold
        # 18 full pages of 16, last row recomputed
        assert server.wait_metric("mstar_prefix_cache_hit_tokens_total", 288) == 288
        assert server.metric("mstar_prefix_cache_queries_total") == 2
        # A longer prompt with the same start shares its first pages too.
        assert _gen(server, [*ids, 7, 8, 9]) == _gen(cold_server, [*ids, 7, 8, 9])
        assert server.wait_metric("mstar_prefix_cache_hit_tokens_total", 288 + 288) == 576
        assert _gen(cold_server, ids) == cold
        assert cold_server.metric("mstar_prefix_cache_hit_tokens_total") == 0
        assert server.metric("mstar_prefix_cache_pages") >= 18
        assert server.wait_pages_free() == 0 and cold_server.wait_pages_free() == 0
    finally:
        server.stop()
        cold_server.stop()

