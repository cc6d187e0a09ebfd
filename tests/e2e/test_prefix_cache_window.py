"""The prefix cache for sliding-window models through the real services: the windowed label
is keyed, so a repeated prompt hits on every label (the window's pages only those covering
its last `window` rows) with greedy tokens and logprobs equal to the cold run, under the KV
debug checks, and every page comes back."""

from __future__ import annotations

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.servers import MstarServer

PAGE = 16


def _gen(server, ids, n=12):
    r = httpx.post(server.url + "/generate",
                   json={"input_ids": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 1},
                   timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["token_ids"], [e["logprob"] for e in out["logprobs"]]


# gemma2: sliding and global layers, a window wider than a page (the hit takes two of its
# pages, the first partly behind it); gemma3: a window inside one page; mistral: every
# layer windowed (the window label alone); gpt-oss: sliding and full layers, with attention sinks
CASES = {"gemma2": ("gemma2", 24), "gemma3": ("gemma3", 8), "mistral": ("mistral", 8), "gpt_oss": ("gpt_oss", 24)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_repeated_prompt_hits_on_a_sliding_window_model(case, tmp_path):
    family, window = CASES[case]
    ckpt = make_checkpoint(tmp_path / f"tiny-{case}", family, sliding_window=window)
    args = ("--num-kv-pages", "128", "--page-size", str(PAGE))
    server = MstarServer(str(ckpt), tmp_path / "log.txt", *args, env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    cold_server = MstarServer(str(ckpt), tmp_path / "cold.txt", *args, "--no-prefix-cache").start()
    try:
        ids = [(i * 37) % 250 + 3 for i in range(100)]  # 6 full pages + 4 rows: a hit shares 96
        cold = _gen(server, ids)
        assert server.wait_metric("mstar_prefix_cache_queries_total", 1) == 1
        assert server.metric("mstar_prefix_cache_hit_tokens_total") == 0
        warm = _gen(server, ids)
        assert server.wait_metric("mstar_prefix_cache_hit_tokens_total", 96) == 96
        assert warm[0] == cold[0]
        assert warm[1] == pytest.approx(cold[1], abs=1e-4)
        assert _gen(cold_server, ids)[0] == cold[0]
        # a longer prompt with the same start shares the same pages; its output is the cold run's
        longer = [*ids, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
        got, want = _gen(server, longer), _gen(cold_server, longer)
        assert server.wait_metric("mstar_prefix_cache_hit_tokens_total", 192) == 192
        assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-4)
        assert cold_server.metric("mstar_prefix_cache_hit_tokens_total") == 0
        assert server.wait_pages_free() == 0 and cold_server.wait_pages_free() == 0
        assert "footprint" not in server.log() and "Traceback" not in server.log()
    finally:
        server.stop()
        cold_server.stop()
