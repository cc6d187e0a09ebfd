"""The layout contract through real processes: footprints hold under debug asserts,
limits are refused with the field and the numbers, model bugs (an undeclared label or
pool, an under-stated growth) are caught where DESIGN.md says, and a two-label model
(keyed ids + windowed rows) drives the KV manager through the real worker."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from tests.checkpoints import make_checkpoint, with_architecture
from tests.reference import hf_greedy, hf_ids
from tests.servers import MstarServer, serve_until_exit

PLUGINS = {"MSTAR_MODEL_PLUGINS": "tests.plugins.models"}
DEBUG = {"MSTAR_KV_DEBUG_ASSERTS": "1"}


def _gen(server, **body) -> httpx.Response:
    body.setdefault("temperature", 0)
    return httpx.post(server.url + "/generate", json=body, timeout=120)


@pytest.fixture(scope="module")
def debug_server(llama_ckpt, tmp_path_factory):
    server = MstarServer(str(llama_ckpt), tmp_path_factory.mktemp("logs") / "debug.log", "--num-kv-pages", "128",
                         "--page-size", "4", "--max-seq-len", "160", "--max-batch-tokens", "24", env=DEBUG).start()
    yield server
    server.stop()


async def test_many_lengths_emit_exactly_max_tokens_under_debug_asserts(debug_server):
    words = "Hello world! The quick brown fox jumps over the lazy dog. " * 8
    cases = [(n, m) for n in (1, 3, 4, 5, 16, 17, 33) for m in (1, 2, 3, 4, 5, 9, 16)]
    async with httpx.AsyncClient(base_url=debug_server.url, timeout=120) as client:
        async def one(n, m):
            ids = list(range(5, 5 + n))
            r = await client.post("/generate", json={"input_ids": ids, "max_tokens": m, "temperature": 0,
                                                     "ignore_eos": True})
            assert r.status_code == 200, r.text
            return len(r.json()["token_ids"]), r.json()["finish_reason"]
        results = await asyncio.gather(*(one(n, m) for n, m in cases))
    assert results == [(m, "length") for _, m in cases]
    r = _gen(debug_server, prompt=words, max_tokens=7, ignore_eos=True)
    assert len(r.json()["token_ids"]) == 7
    assert debug_server.metric("mstar_kv_footprint_overruns_total") == 0
    assert debug_server.wait_pages_free() == 0
    log = debug_server.log()
    # nothing overran, nothing loose, and no request failed (a layout violation fails its request)
    assert "footprint overrun" not in log and "not tight" not in log and "failed (error_id=" not in log


@pytest.mark.parametrize(("value", "message"), [
    (0, "max_tokens must be an integer >= 1, got 0"),
    (-1, "max_tokens must be an integer >= 1, got -1"),
    (True, "max_tokens must be an integer >= 1, got true"),
    ("5", 'max_tokens must be an integer >= 1, got "5"'),
    (10**9, "max_tokens - 1 = 999999999 exceeds the decode loop's max_iters 159"),
])
def test_max_tokens_refusals(debug_server, value, message):
    r = _gen(debug_server, prompt="Hello", max_tokens=value)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and err["message"] == message


def test_prompt_plus_max_tokens_past_max_seq_len(debug_server):
    r = _gen(debug_server, input_ids=list(range(5, 105)), max_tokens=61)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "prompt (100 tokens) + max_tokens (61) = 161 exceeds max_seq_len 160",
                                 "type": "invalid_request_error", "param": "max_tokens", "error_id": None, "code": None}
    assert _gen(debug_server, input_ids=list(range(5, 105)), max_tokens=60, ignore_eos=True).status_code == 200


def test_prompt_alone_too_long(debug_server):
    r = _gen(debug_server, input_ids=[5] * 160, max_tokens=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "exceeds max_seq_len 160" in r.json()["error"]["message"]


def test_no_max_tokens_runs_to_the_sequence_limit(debug_server):
    r = _gen(debug_server, input_ids=list(range(5, 15)), ignore_eos=True)
    assert r.status_code == 200
    assert len(r.json()["token_ids"]) == 150 and r.json()["finish_reason"] == "length"


def test_undeclared_label_is_a_500_with_error_id(llama_ckpt, tmp_path):
    ckpt = with_architecture(llama_ckpt, tmp_path / "ghost", "OddGhostLabelLlamaForCausalLM")
    server = MstarServer(str(ckpt), tmp_path / "log.txt", "--num-kv-pages", "32", env=PLUGINS).start()
    try:
        r = _gen(server, input_ids=[5, 6, 7], max_tokens=3)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["message"] == "internal error" and re.fullmatch(r"err-[0-9a-f]{32}", err["error_id"])
        assert "ghost" not in r.text
        line = next(ln for ln in server.log().splitlines() if err["error_id"] in ln)
        assert "undeclared KV label(s) ['ghost']" in line
        assert server.wait_pages_free() == 0
    finally:
        server.stop()


def test_a_model_that_always_names_an_undeclared_label_fails_at_start(llama_ckpt, tmp_path):
    """Warm-up runs the model's own layout: a ghost label stops the worker before /ready."""
    ckpt = with_architecture(llama_ckpt, tmp_path / "ghost", "GhostLabelLlamaForCausalLM")
    r = serve_until_exit("--model", str(ckpt), env=PLUGINS)
    assert r.returncode != 0
    assert "layout names undeclared KV label(s) ['ghost']" in r.stderr
    assert "gpu_worker-0 failed to start" in r.stderr and "mstar: ready" not in r.stderr


def test_undeclared_pool_refused_at_start(llama_ckpt, tmp_path):
    ckpt = with_architecture(llama_ckpt, tmp_path / "orphan", "OrphanPoolLlamaForCausalLM")
    r = serve_until_exit("--model", str(ckpt), env=PLUGINS)
    assert r.returncode != 0
    # refused by the launcher's own deployment check, before any service starts
    assert r.stderr.strip() == ("mstar: deployment refused: paged KV pool(s) ['orphan'] are used by no KV label; "
                                "declare a KVLabel for each pool or drop the pool")


@pytest.mark.parametrize("debug", [False, True])
async def test_understated_growth_overruns(llama_ckpt, tmp_path, debug):
    """Odd-length prompts under-state their growth. Without debug asserts the overrun is
    logged exactly once and counted, and the page is served; with them, only those
    requests fail, the others finish."""
    ckpt = with_architecture(llama_ckpt, tmp_path / "under", "UnderstatedGrowthLlamaForCausalLM")
    env = {**PLUGINS, **(DEBUG if debug else {})}
    server = MstarServer(str(ckpt), tmp_path / "log.txt", "--num-kv-pages", "64", "--page-size", "4", env=env).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            bad, good = await asyncio.gather(
                client.post("/generate", json={"input_ids": [5, 6, 7], "max_tokens": 12, "temperature": 0,
                                               "ignore_eos": True}),
                client.post("/generate", json={"input_ids": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0,
                                               "ignore_eos": True}),
            )
        assert good.status_code == 200 and len(good.json()["token_ids"]) == 12
        overruns = [ln for ln in server.log().splitlines() if "footprint overrun" in ln]
        if debug:
            assert bad.status_code == 500 and bad.json()["error"]["error_id"]
            assert any(bad.json()["error"]["error_id"] in ln and "grows 0 per iteration" in ln
                       for ln in server.log().splitlines())
        else:
            assert bad.status_code == 200 and len(bad.json()["token_ids"]) == 12
            assert len(overruns) == 1 and "label 'text'" in overruns[0]
            assert server.wait_metric("mstar_kv_footprint_overruns_total", 1) == 1
        assert server.wait_pages_free() == 0
    finally:
        server.stop()


async def test_an_overrun_on_a_full_pool_fails_only_the_liar(llama_ckpt, tmp_path):
    """Two honest requests whose footprints, with the liar's, fill the pool exactly: the
    page the liar takes past its footprint may come only from pages nobody reserved, and
    there are none, so it fails alone (500, the reason logged under its error id); both
    honest requests get every token, and every page comes back."""
    ckpt = with_architecture(llama_ckpt, tmp_path / "under", "UnderstatedGrowthLlamaForCausalLM")
    # honest: 4 + 300 rows = 76 pages of 4 each; the liar (odd prompt, declares no growth): 1
    server = MstarServer(str(ckpt), tmp_path / "log.txt", "--num-kv-pages", "153", "--page-size", "4",
                         "--no-prefix-cache", env=PLUGINS).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            running = asyncio.Event()
            streamed = 0

            async def honest(ids: list[int]) -> list[int]:
                nonlocal streamed
                body = {"input_ids": ids, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
                events = []
                async with client.stream("POST", "/generate", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            events.append(json.loads(line[5:]))
                            if len(events) == 1:
                                streamed += 1
                                if streamed == 2:
                                    running.set()  # both admitted: their footprints are reserved
                assert events[-1]["type"] == "done", events[-1]
                return events[-1]["token_ids"]

            tasks = [asyncio.ensure_future(honest(ids)) for ids in ([5, 6, 7, 8], [9, 10, 11, 12])]
            await asyncio.wait_for(running.wait(), 60)
            liar = await client.post("/generate", json={"input_ids": [20, 21, 22], "max_tokens": 12, "temperature": 0,
                                                        "ignore_eos": True})
            outputs = await asyncio.gather(*tasks)
        assert [len(o) for o in outputs] == [300, 300]
        assert outputs[0] == hf_greedy(llama_ckpt, [5, 6, 7, 8], 300)
        assert liar.status_code == 500, liar.text
        error_id = liar.json()["error"]["error_id"]
        reason = "every free page of pool 'kv' is reserved"
        assert any(error_id in ln and reason in ln for ln in server.log().splitlines())
        assert server.wait_metric("mstar_kv_footprint_overruns_total", 1) == 1
        assert server.wait_pages_free() == 0
    finally:
        server.stop()


def test_every_loop_is_capped_refused_and_stopped_alike(llama_ckpt, tmp_path):
    """Two loops, both below max_tokens - 1: the request stops ("length") at whichever cap
    binds, with exactly that many tokens, each the model's own; a request whose second
    loop would need more than its max_iters is a 400 naming that loop."""
    ckpt = with_architecture(llama_ckpt, tmp_path / "loops", "TwoLoopLlamaForCausalLM")
    server = MstarServer(str(ckpt), tmp_path / "log.txt", "--num-kv-pages", "64", "--page-size", "4",
                         env={**PLUGINS, **DEBUG}).start()
    try:
        ids = [5, 6, 7, 8]
        # max_tokens -> tokens: 12 -> the decode cap (5) binds: 1 + 5; 6 -> the budget cap (1): 1 + 1
        for max_tokens, want in [(12, 6), (14, 7), (6, 2)]:
            r = _gen(server, input_ids=ids, max_tokens=max_tokens, ignore_eos=True)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["finish_reason"] == "length" and body["token_ids"] == hf_greedy(llama_ckpt, ids, want), body
        r = _gen(server, input_ids=ids, max_tokens=30, ignore_eos=True)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_tokens"
        assert err["message"] == ("the request needs 25 iterations of loop 'budget_loop', "
                                  "which runs at most 10 (its max_iters)")
        assert server.wait_pages_free() == 0
    finally:
        server.stop()


@pytest.fixture(scope="module")
def two_label_ckpt(tmp_path_factory):
    base = make_checkpoint(tmp_path_factory.mktemp("sw") / "qwen2-sw", "qwen2", use_sliding_window=True,
                           sliding_window=8, max_window_layers=1)
    return with_architecture(base, tmp_path_factory.mktemp("sw-rows") / "ckpt", "RowsWindowQwen2ForCausalLM")


async def test_two_label_model_through_the_worker(two_label_ckpt, tmp_path):
    server = MstarServer(str(two_label_ckpt), tmp_path / "log.txt", "--num-kv-pages", "96", "--page-size", "4",
                         "--max-batch-tokens", "16", env={**PLUGINS, **DEBUG}).start()
    try:
        prompts = ["The quick brown fox", "Hello world! Hello again, world. Goodbye, world. Numbers like 12345 and"]
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            rs = await asyncio.gather(*(client.post("/generate", json={"prompt": p, "max_tokens": 24, "temperature": 0,
                                                                       "ignore_eos": True})
                                        for p in prompts))
        for p, r in zip(prompts, rs):
            assert r.status_code == 200, r.text
            assert r.json()["token_ids"] == hf_greedy(two_label_ckpt, hf_ids(two_label_ckpt, p), 24)
        assert server.metric("mstar_kv_pages_total", '{pool="kv"}') == 96
        assert server.metric("mstar_kv_pages_total", '{pool="kv_window"}') == 96
        assert server.wait_pages_free() == 0
        assert server.metric("mstar_kv_footprint_overruns_total") == 0
        assert "not tight" not in server.log() and "overrun" not in server.log()
        # retention: the window label (8 rows) released pages behind its window, so it held
        # fewer at its peak than the full-attention label, which holds whole sequences
        def peak(pool: str) -> float:
            text = httpx.get(server.url + "/metrics", timeout=5).text
            pat = rf'^mstar_kv_pages_peak{{[^}}]*pool="{pool}"[^}}]*}}\s+(\S+)$'
            return max(float(v) for v in re.findall(pat, text, re.M))

        deadline = time.monotonic() + 5  # the worker's stats reach the conductor beside, not before, the replies
        while peak("kv_window") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 0 < peak("kv_window") < peak("kv")
    finally:
        server.stop()
