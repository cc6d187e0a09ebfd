"""Liveness that measures liveness (issue 26), through real processes: the gpu worker beats
from a thread of its own, so a step three times longer than the heartbeat timeout fails
nothing, and only a step past the step watchdog is treated as a hang."""

from __future__ import annotations

import time

import httpx

from tests.checkpoints import with_architecture
from tests.plugins.slow_step import SLOW_ROWS
from tests.servers import MstarServer

PLUGIN = {"MSTAR_MODEL_PLUGINS": "tests.plugins.slow_step"}
SLOW = [5 + i % 200 for i in range(SLOW_ROWS)]  # a prompt of SLOW_ROWS ids: its prefill is the slow step


def test_a_step_3x_the_heartbeat_timeout_is_not_a_dead_worker(llama_ckpt, tmp_path):
    ckpt = with_architecture(llama_ckpt, tmp_path / "slow", "SlowStepLlamaForCausalLM")
    server = MstarServer(str(ckpt), tmp_path / "log.txt", "--num-kv-pages", "64",
                         env={**PLUGIN, "MSTAR_HEARTBEAT_TIMEOUT": "2", "MSTAR_TEST_SLOW_STEP_S": "6"}).start()
    try:
        t0 = time.monotonic()
        r = httpx.post(server.url + "/generate", json={"input_ids": SLOW, "max_tokens": 4, "ignore_eos": True},
                       timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert len(r.json()["token_ids"]) == 4
        assert took >= 6, took  # the slow step did run
        log = server.log()
        assert "no heartbeat" not in log and "failing its" not in log  # the conductor never failed the worker
        assert server.wait_pages_free() == 0
    finally:
        server.stop()


def test_a_step_past_the_watchdog_is_logged_and_the_worker_restarted(llama_ckpt, tmp_path):
    ckpt = with_architecture(llama_ckpt, tmp_path / "slow", "SlowStepLlamaForCausalLM")
    server = MstarServer(str(ckpt), tmp_path / "log.txt", "--num-kv-pages", "64",
                         env={**PLUGIN, "MSTAR_HEARTBEAT_TIMEOUT": "2", "MSTAR_STEP_WATCHDOG_S": "2",
                              "MSTAR_TEST_SLOW_STEP_S": "30"}).start()
    try:
        t0 = time.monotonic()
        r = httpx.post(server.url + "/generate", json={"input_ids": SLOW, "max_tokens": 4, "request_id": "stuck-1"},
                       timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "worker_failed"
        assert took < 15, took  # the watchdog, not the 30 s step, ended it
        log = server.log()
        assert "past the step watchdog" in log and "stuck-1" in log
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        r = httpx.post(server.url + "/generate", json={"prompt": "after", "max_tokens": 3, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert server.wait_pages_free() == 0
    finally:
        server.stop()
