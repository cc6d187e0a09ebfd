"""Placement and waiting with real processes, started one per service as compose.yaml runs
them (issue 27): load goes to both of two workers whose pools differ by 50%, and with no
worker left a request gets a 503 naming the reason after the queue timeout, not a hang."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.servers import ServiceStack

BURST = 16


async def test_a_burst_is_spread_over_two_workers_whose_pools_differ(llama_ckpt, tmp_path):
    stack = ServiceStack(str(llama_ckpt), tmp_path, {"small": ["--num-kv-pages", "64"],
                                                     "big": ["--num-kv-pages", "96"]}).start()
    try:
        stack.wait_ready(workers=2)
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
            async def one(i: int) -> None:
                r = await client.post("/generate", json={"prompt": f"request {i}", "max_tokens": 24,
                                                         "ignore_eos": True, "seed": i})
                assert r.status_code == 200, r.text

            await asyncio.gather(*(one(i) for i in range(BURST)))
        deadline = time.monotonic() + 5  # /metrics reads the conductor's status at most every 0.25 s
        while True:
            placed = {w: stack.metric("mstar_worker_requests_dispatched_total", f'worker_id="{w}"')
                      for w in ("small", "big")}
            if sum(placed.values()) == BURST or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert sum(placed.values()) == BURST, (placed, httpx.get(stack.url + "/metrics").text[-3000:])
        assert all(0.4 * BURST <= n <= 0.6 * BURST for n in placed.values()), placed
    finally:
        stack.stop()


def test_with_no_worker_a_request_gets_503_after_the_queue_timeout(llama_ckpt, tmp_path):
    stack = ServiceStack(str(llama_ckpt), tmp_path, {"w0": ["--num-kv-pages", "64"]},
                         conductor_args=("--queue-timeout-s", "2")).start()
    try:
        stack.wait_ready(workers=1)
        stack.kill("w0")
        deadline = time.monotonic() + 15
        while httpx.get(stack.url + "/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        t0 = time.monotonic()
        r = httpx.post(stack.url + "/generate", json={"prompt": "anyone?", "max_tokens": 4}, timeout=30)
        waited = time.monotonic() - t0
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert "no gpu worker is ready" in err["message"] and "--queue-timeout-s" in err["message"], err
        assert err["error_id"]
        assert 2 <= waited < 5, waited
        # a worker comes back: served again
        stack.start("w0")
        stack.wait_ready(workers=1)
        r = httpx.post(stack.url + "/generate", json={"prompt": "back", "max_tokens": 4, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
    finally:
        stack.stop()
