"""`mstar serve --tensor-parallel-size 2` (issue 57): one gpu worker as two rank processes
over gloo, each holding half of the model, stepping in lockstep from rank 0's plan.

On random float32 checkpoints (a tied Llama with 2 KV heads split one a rank, a Qwen3 with
q/k norms and 1 KV head replicated on both ranks, and a Qwen2 GGUF file with q/k/v biases;
tests/unit/test_tp_shard.py checks every family's shards, Phi-3's packed projections too), prompts prefilled in 16-row
chunks, 8 requests at once: greedy tokens equal transformers' and the one-rank server's; a
request's logprobs are bitwise the same alone and among the 8; each rank's log line says it
holds half the weight bytes, and each rank's RSS is below the one-rank worker's by more than
0.3 of the weights; a model the ranks cannot share is refused by name before
any rank starts; killing rank 1 fails the requests in flight with 503 and the group serves
again. Pages back to zero under the layout debug checks."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf
from tests.reference import hf_greedy, hf_ids
from tests.servers import MstarServer, serve_until_exit

DEBUG = {"MSTAR_KV_DEBUG_ASSERTS": "1"}
TP2 = ("--tensor-parallel-size", "2", "--num-kv-pages", "256", "--max-batch-tokens", "16")
PROMPTS = [
    "The quick brown fox",
    "What is the capital of France?",
    "def add(a, b):\n    return",
    "Hello world! Hello again, world. Goodbye, world. " * 5,  # chunked: ~60 rows in 16-row chunks
    "Numbers like 12345 and 67890",
    "Once upon a time in a land far away",
    "Serving engines batch requests",
    "A B C D E F G H I J K L M N O P Q R S T",  # > 16 rows: chunked
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (HF folder for the reference, model the server loads)."""
    root = tmp_path_factory.mktemp("tp")
    # wide enough (54 MB of float32 weights) that half of them shows in a process's RSS
    llama = make_checkpoint(root / "llama", "llama", hidden_size=256, intermediate_size=4096, num_hidden_layers=4,
                            max_position_embeddings=4096)
    qwen3 = make_checkpoint(root / "qwen3", "qwen3", num_key_value_heads=1)  # replicated on both ranks
    qwen2 = make_checkpoint(root / "qwen2", "qwen2", seed=3)
    gguf = write_gguf(qwen2, root / "qwen2.gguf", "qwen2", "qwen2")
    return {"llama": (llama, str(llama)), "qwen3": (qwen3, str(qwen3)),
            "qwen2_gguf": (qwen2, str(gguf))}


@pytest.fixture(scope="module")
def servers(ckpts, tmp_path_factory) -> dict[str, MstarServer]:
    """Every server of the module, started together (their start-ups overlap): each family at
    TP 2, and the Llama at one rank too ("llama_1")."""
    root = tmp_path_factory.mktemp("tp-servers")
    started = {name: MstarServer(model, root / f"{name}.log", *TP2, env=DEBUG).launch()
               for name, (_, model) in ckpts.items()}
    started["llama_1"] = MstarServer(ckpts["llama"][1], root / "llama_1.log", *TP2[2:], env=DEBUG).launch()
    try:
        yield {name: srv.wait_ready() for name, srv in started.items()}
    finally:
        for srv in started.values():
            srv.stop()


async def _batch(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        replies = await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))
    for r in replies:
        assert r.status_code == 200, r.text
    return [r.json() for r in replies]


def _bodies(ref: Path) -> list[dict]:
    return [{"input_ids": hf_ids(ref, p), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
             "logprobs": 1} for p in PROMPTS]


def _check_family(srv: MstarServer, ref: Path) -> list[dict]:
    """8 at once equal transformers'; the first request alone has bitwise the same logprobs."""
    bodies = _bodies(ref)
    alone = asyncio.run(_batch(srv.url, bodies[:1]))[0]
    batched = asyncio.run(_batch(srv.url, bodies))
    for body, got in zip(bodies, batched):
        assert got["token_ids"] == hf_greedy(ref, body["input_ids"], MAX_TOKENS)
    assert batched[0]["token_ids"] == alone["token_ids"]
    assert batched[0]["logprobs"] == alone["logprobs"]  # batch invariant at TP 2
    assert srv.wait_pages_free() == 0
    assert "footprint overrun" not in srv.log() and "not tight" not in srv.log()
    return batched


def _held(log: str) -> dict[int, float]:
    """rank -> the percentage of the checkpoint's weight bytes its log line says it holds."""
    return {int(r): float(p) for r, p in re.findall(r"rank (\d) of 2 holds \d+ of the checkpoint's \d+ weight bytes "
                                                    r"\(([\d.]+)%\)", log)}


def _worker_pids(srv: MstarServer) -> list[int]:
    """The gpu worker's process and the ranks it started."""
    pids = []
    for pid in srv.children():
        if b"services.gpu_worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
            pids.append(pid)
            pids += [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                    text=True).stdout.split()]
    return pids


def _rss(pids: list[int]) -> list[int]:
    """Resident bytes of each process."""
    out = []
    for pid in pids:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
        out.append(int(line.split()[1]) * 1024)
    return out


def test_llama_matches_transformers_and_one_rank(servers, ckpts):
    tp, one = servers["llama"], servers["llama_1"]
    weights = int(re.search(r"of the checkpoint's (\d+) weight bytes", tp.log())[1])
    time.sleep(1.5)  # every rank idle past its heap trim (the worker's after 1 s; a rank's at rank 0's heartbeat)
    ranks, (single,) = _rss(_worker_pids(tp)), _rss(_worker_pids(one))  # as loaded, before any request
    assert len(ranks) == 2 and all(r < single - 0.3 * weights for r in ranks), (ranks, single, weights)
    ref = ckpts["llama"][0]
    got = _check_family(tp, ref)
    single = asyncio.run(_batch(one.url, _bodies(ref)))
    assert [g["token_ids"] for g in got] == [s["token_ids"] for s in single]
    for g, s in zip(got, single):  # the all-reduce sums in another order: close, not bitwise
        for a, b in zip(g["logprobs"], s["logprobs"]):
            assert abs(a["logprob"] - b["logprob"]) < 1e-4
    held = _held(tp.log())
    assert sorted(held) == [0, 1] and all(49.0 < p < 51.0 for p in held.values()), held
    assert "one module at a time" in tp.log()


@pytest.mark.parametrize("name", ["qwen3", "qwen2_gguf"])
def test_family_matches_transformers(servers, ckpts, name):
    srv = servers[name]
    _check_family(srv, ckpts[name][0])
    held = _held(srv.log())
    assert sorted(held) == [0, 1] and all(40.0 < p < 60.0 for p in held.values()), held


def test_unsplittable_model_refused_by_name(ckpts, tmp_path):
    """Refused before any rank starts, naming the field and its value."""
    out = serve_until_exit("--model", ckpts["llama"][1], "--tensor-parallel-size", "3", timeout=60)
    assert out.returncode == 2, out.stderr
    assert "num_attention_heads 4 is not a multiple of 3" in out.stderr
    odd = tmp_path / "odd-kv"
    shutil.copytree(ckpts["llama"][0], odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg.update(num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    (odd / "config.json").write_text(json.dumps(cfg))
    out = serve_until_exit("--model", str(odd), "--tensor-parallel-size", "2", timeout=60)
    assert out.returncode == 2, out.stderr
    assert "num_key_value_heads 3" in out.stderr


def _rank1_pid(srv: MstarServer) -> int:
    return int(re.findall(r"tensor-parallel rank 1 of 2 started \(pid (\d+)\)", srv.log())[-1])


async def _long(url: str, ids: list[int], n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return list(await asyncio.gather(*(client.post("/generate", json={
            "input_ids": ids, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}) for _ in range(n))))


def test_killing_rank_1_fails_in_flight_with_503_and_the_group_serves_again(servers, ckpts):
    tp = servers["llama"]
    ref = ckpts["llama"][0]
    ids = hf_ids(ref, PROMPTS[0])
    pid = _rank1_pid(tp)

    async def kill_during() -> list[httpx.Response]:
        task = asyncio.ensure_future(_long(tp.url, ids, 2))
        while tp.metric("mstar_requests_running") < 2 and not task.done():  # both decoding
            await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        return await task

    replies = asyncio.run(kill_during())
    assert [r.status_code for r in replies] == [503] * 2, [r.text for r in replies]
    assert all(r.json()["error"]["type"] == "worker_failed" for r in replies)
    deadline = time.monotonic() + 60
    while tp.log().count("rank 1 of 2 ready") < 2:  # the restarted group's rank 1 has loaded
        assert time.monotonic() < deadline, tp.log()[-3000:]
        time.sleep(0.2)
    r = httpx.post(tp.url + "/generate", json={"input_ids": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                                               "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == hf_greedy(ref, ids, MAX_TOKENS)
    assert tp.wait_pages_free() == 0
