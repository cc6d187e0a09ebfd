"""The null model through real processes, and a smoke run of `python -m bench` against it.

No timing thresholds: only that the numbers are there and make sense together."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import httpx
import pytest

from shared.specs.null_lm import next_token
from tests.servers import REPO, MstarServer, service_env


@pytest.fixture(scope="module")
def null_server(tmp_path_factory):
    server = MstarServer("null", tmp_path_factory.mktemp("logs") / "null.log", "--num-kv-pages", "512").start()
    yield server
    server.stop()


def test_null_model_request(null_server):
    r = httpx.post(null_server.url + "/generate", json={"input_ids": [72, 105], "max_tokens": 8, "temperature": 0},
                   timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    expect, last = [], 105
    for _ in range(8):
        last = next_token(last)
        expect.append(last)
    assert body["token_ids"] == expect
    assert body["text"] == bytes(expect).decode()
    assert body["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 8}


def test_bench_smoke(null_server, tmp_path):
    out = tmp_path / "results"
    argv = [sys.executable, "-m", "bench", "run", "--url", null_server.url, "--concurrency", "2", "--num-requests", "6",
            "--prompt-len", "12", "--output-len", "9", "--random-ratio", "0.5", "--out", str(out)]
    proc = subprocess.run(argv, cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "out tok/s" in proc.stdout
    assert (out / "plot.png").stat().st_size > 1000
    data = json.loads((out / "results.json").read_text())
    assert data["mode"] == "run" and data["machine"]["cpus"] >= 1
    (srv,) = data["servers"].values()
    (lvl,) = srv["levels"]
    assert lvl["concurrency"] == 2
    assert lvl["requests"] == lvl["completed"] == 6 and lvl["num_errors"] == 0
    assert 6 * 4 <= lvl["output_tokens"] <= 6 * 9  # random lengths in [int(9 * 0.5), 9]
    assert lvl["duration_s"] > 0
    assert math.isclose(lvl["output_throughput"], lvl["output_tokens"] / lvl["duration_s"], rel_tol=1e-6)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "latency_ms"):
        stats = lvl[key]
        assert all(math.isfinite(v) and v >= 0 for v in stats.values()), (key, stats)
        assert stats["p50"] <= stats["p99"]
    assert lvl["ttft_ms"]["p50"] <= lvl["latency_ms"]["p99"]
    assert null_server.wait_pages_free() == 0


def test_bench_spec_smoke(tmp_path):
    """`bench spec` on the null model: both servers, three sets, the same tokens on and off."""
    out = tmp_path / "spec"
    argv = [sys.executable, "-m", "bench", "spec", "--model", "null", "-n", "2", "-c", "1", "--output-len", "12",
            "--out", str(out)]
    proc = subprocess.run(argv, cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "speed-up (TPOT)" in proc.stdout
    data = json.loads((out / "results.json").read_text())
    assert set(data["ratios"]) == {"repetitive c1", "open c1", "random c1"}
    assert all(r["identical_tokens"] for r in data["ratios"].values())
    for run in data["runs"].values():
        assert all(s["completed"] == 2 and s["output_tokens"] == 24 for s in run.values())
    assert data["runs"]["k=0"]["repetitive c1"]["drafted"] == 0
    assert (out / "plot.png").stat().st_size > 1000


def _quick_bench(module: str, tmp_path) -> tuple[str, dict]:
    """`python -m MODULE --quick` with its own checkpoint cache: (its stdout, its results.json),
    having asserted it exited 0 and wrote its PNG."""
    out = tmp_path / module
    env = {**service_env(), "MSTAR_BENCH_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", module, "--quick", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "plot.png").stat().st_size > 1000
    return proc.stdout, json.loads((out / "results.json").read_text())


def test_policy_bench_quick(tmp_path):
    """`python -m bench.policy --quick`: a tiny Pi0.5 through /v1/actions against transformers'
    one-at-a-time `sample_actions`; the four figures there for both, the PNG written."""
    stdout, data = _quick_bench("bench.policy", tmp_path)
    assert "c1 actions/s" in stdout and "c16 TTFT (ms)" in stdout
    assert data["mode"] == "policy" and data["shape"]["chunk"] == 5
    for system in ("mstar", "transformers"):
        (run,) = data["runs"][system]
        assert len(run["c1_all_s"]) == 2 and len(run["c16_all_s"]) == 16
        assert run["c1_actions_s"] > 0 and run["c16_actions_s"] > 0 and run["c16_ttft_s"] > 0


def test_world_bench_quick(tmp_path):
    """`python -m bench.world --quick`: the tests' tiny V-JEPA 2-AC through /v1/world/rollout
    against the reference's one-at-a-time rollout; every figure there for both, the clip
    cache's pair for mstar, the PNG written."""
    stdout, data = _quick_bench("bench.world", tmp_path)
    assert "c16 steps/s" in stdout and "8 rollouts of one clip (s)" in stdout
    assert data["mode"] == "world" and data["clip_cache"]["mstar_8_rollouts_8_clips_s"] > 0
    for system in ("mstar", "reference"):
        (run,) = data["runs"][system]
        assert all(run[k] > 0 for k in ("c1_s", "c1_steps_s", "c4_steps_s", "c16_steps_s", "one_clip_8_s"))
