"""The conductor's placement, in-process with real (unconnected) sockets: admission by
footprint less the pages a worker's prefix cache will share, and cache-aware routing."""

from __future__ import annotations

import numpy as np

from services.conductor.conductor import AFFINITY_SLACK, Conductor, WorkerState, plan_request
from shared.config import Deployment
from shared.frames import NewRequest, SamplingParams, pack_tensors
from shared.specs.base import PromptRequest
from shared.specs.decoder_lm import DecoderLMSpec

CONFIG = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 16,
          "max_position_embeddings": 1024}


def _setup(tmp_path):
    spec = DecoderLMSpec(CONFIG, page_size=16)
    addrs = {"conductor": f"ipc://{tmp_path}/c.sock", "conductor_control": f"ipc://{tmp_path}/cc.sock"}
    cond = Conductor(Deployment(), spec, addrs)
    pools = spec.paged_pools(64)
    for i in range(2):
        cond.workers[f"w{i}"] = WorkerState(f"w{i}", f"ipc://{tmp_path}/w{i}.sock", pools, f"inc{i}")
    return spec, cond, pools


def _request(spec, pools, rid: str, ids: list[int], max_tokens: int = 10) -> NewRequest:
    ppo = spec.process_prompt(PromptRequest(ids))
    refs, _ = pack_tensors({"input_ids": np.asarray(ids, dtype=np.int32)})
    req = NewRequest(rid, "", refs, SamplingParams(), f"ipc:///nonexistent/{rid}", len(ids), max_tokens, ppo.kv_layout)
    return plan_request(spec, req, pools)


async def test_repeat_goes_to_the_worker_holding_its_prefix(tmp_path):
    spec, cond, pools = _setup(tmp_path)
    prompt = list(range(3, 203))  # 200 rows: 12 full shareable pages
    first = _request(spec, pools, "a", prompt)
    cond.queue.append((first, []))
    await cond._drain_queue()
    assert cond.placement["a"] == "w0"
    assert cond.workers["w0"].requests["a"][0] == {"kv": 14}  # ceil((200 + 9) / 16), nothing shared yet
    # w1 now has more free pages, but w0 holds the prefix: the repeat goes there and is
    # promised only the pages it must newly take.
    cond.queue.append((_request(spec, pools, "b", prompt), []))
    await cond._drain_queue()
    assert cond.placement["b"] == "w0"
    assert cond.workers["w0"].requests["b"][0] == {"kv": 2}  # 14 less 12 shared
    # A different prompt goes to the freer worker.
    cond.queue.append((_request(spec, pools, "c", list(range(300, 500))), []))
    await cond._drain_queue()
    assert cond.placement["c"] == "w1"
    cond.pushers.close()
    cond.ctx.term()


async def test_queue_is_served_oldest_first(tmp_path):
    spec, cond, pools = _setup(tmp_path)
    for w in cond.workers.values():
        w.promised["kv"] = 60  # 4 free pages each
    big = _request(spec, pools, "big", list(range(3, 100)), 10)  # 7 pages: fits nowhere yet
    small = _request(spec, pools, "small", [5, 6, 7], 5)  # 1 page: would fit
    cond.queue.extend([(big, []), (small, [])])
    await cond._drain_queue()
    assert not cond.placement, "the small request must not overtake the big one"
    cond.workers["w1"].promised["kv"] = 0
    await cond._drain_queue()
    # big first; then small goes to the worker with less in flight
    assert cond.placement == {"big": "w1", "small": "w0"}
    cond.pushers.close()
    cond.ctx.term()


async def test_load_is_spread_over_workers_whatever_their_pool_sizes(tmp_path):
    """Placement by requests in flight, not free pages: a pool 60% bigger takes no more."""
    spec, cond, pools = _setup(tmp_path)
    cond.workers["w1"].pools = spec.paged_pools(100)  # w0 has 64 pages
    for i in range(16):
        cond.queue.append((_request(spec, pools, f"r{i}", list(range(100 + 10 * i, 108 + 10 * i)), 4), []))
    await cond._drain_queue()
    placed = list(cond.placement.values())
    assert placed.count("w0") == placed.count("w1") == 8
    assert placed[:4] == ["w0", "w1", "w0", "w1"]  # equals take turns
    # w0's requests finish: the next ones go there until the loads are even again
    for rid in [r for r, w in cond.placement.items() if w == "w0"][:4]:
        cond._release("w0", rid)
    for i in range(16, 20):
        cond.queue.append((_request(spec, pools, f"r{i}", list(range(400 + 10 * i, 408 + 10 * i)), 4), []))
    await cond._drain_queue()
    assert [cond.placement[f"r{i}"] for i in range(16, 20)] == ["w0"] * 4
    assert cond.status().dispatched == {"w0": 12, "w1": 8}
    cond.pushers.close()
    cond.ctx.term()


async def test_a_prefix_holder_is_preferred_only_within_the_affinity_slack(tmp_path):
    spec, cond, pools = _setup(tmp_path)
    prompt = list(range(3, 203))
    cond.queue.append((_request(spec, pools, "a", prompt), []))
    await cond._drain_queue()
    assert cond.placement["a"] == "w0"
    for i in range(AFFINITY_SLACK):  # w0 holds the prefix and AFFINITY_SLACK more in flight
        cond.queue.append((_request(spec, pools, f"rep{i}", prompt), []))
        await cond._drain_queue()
        assert cond.placement[f"rep{i}"] == "w0"
    cond.queue.append((_request(spec, pools, "late", prompt), []))
    await cond._drain_queue()
    assert cond.placement["late"] == "w1"  # past the slack: load wins over the cache
    cond.pushers.close()
    cond.ctx.term()
