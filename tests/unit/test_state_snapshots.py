"""A hybrid's prefix cache in the KV manager: a prompt keeps its recurrent state at its
snapshot rows (a page nobody reserved, indexed under the attention label's chain, at once
evictable); a later prompt sharing the prefix resumes at the longest snapshotted boundary it
covers, holding the snapshot until its slot is a copy of it; pages are conserved throughout
(debug checks) and every counter returns to zero."""

from __future__ import annotations

from services.gpu_worker.kv_manager import KVManager, snapshot_cut, state_snapshot_rows
from shared.frames import NewRequest, SamplingParams
from shared.layout import KVLabel, LabelLayout, PagedKVConfig, Span

PS = 4
MAX = 4096


def test_snapshot_rows_are_interval_multiples_and_the_last_shareable_page():
    def rows(n: int, interval: int) -> tuple[int, ...]:
        return state_snapshot_rows(LabelLayout(spans=(Span.ids(list(range(n))),)), 16, interval)

    assert rows(40, 256) == (32,)  # a short prompt: its last page boundary before the last row
    assert rows(330, 256) == (256, 320)
    assert rows(513, 256) == (256, 512)
    assert rows(512, 256) == (256, 496)  # the last row is computed: its page is not shared
    assert rows(100, 40) == (32, 64, 96)  # an interval not a page multiple rounds down to one
    assert rows(10, 256) == ()
    assert snapshot_cut((256, 320), 0, 300) == 256
    assert snapshot_cut((256, 320), 256, 300) == 64
    assert snapshot_cut((256, 320), 320, 10) == 10
    assert snapshot_cut((), 0, 7) == 7


def _manager(state_slots: int) -> KVManager:
    kv = KVManager({"kv": PagedKVConfig("kv", 1, 1, 1, "float32", PS, 64, MAX),
                    "state": PagedKVConfig("state", 2, 1, 1, "float32", MAX, state_slots, MAX, state_floats=8)},
                   (KVLabel("text", "kv", keys=True, grows_on="decode_loop"),
                    KVLabel("state", "state", grows_on="decode_loop")), snapshot_interval=8)
    kv.debug = True
    return kv


def _ingest(kv: KVManager, rid: str, ids: list[int]):
    layouts = {"text": LabelLayout(spans=(Span.ids(ids),), growth={"decode_loop": 1}),
               "state": LabelLayout(spans=(Span.rows(len(ids)),), growth={"decode_loop": 1})}
    return kv.ingest_request(NewRequest(rid, "", {}, SamplingParams(), "", len(ids), 2, layouts, {"decode_loop": 1}))


def _prefill(kv: KVManager, rid: str, ids: list[int]) -> tuple[int, list[tuple[str, int, int]]]:
    """Admit and prefill in chunks cut at the snapshot rows, as the scheduler does; returns
    (rows shared, the copies the commits asked for)."""
    req = _ingest(kv, rid, ids)
    assert kv.can_admit(req)
    done = kv.admit(req)
    copies = []
    while done < len(ids):
        n = snapshot_cut(req.snapshot_rows, done, len(ids) - done)
        for label in ("text", "state"):
            kv.reserve_rows(rid, label, n)
        if req.restores:
            kv.end_restores(rid)
        for label in ("text", "state"):
            kv.commit(rid, label, n)
        copies += kv.take_snapshots(rid)
        done += n
    return req.hit_rows, copies


def test_a_shared_prefix_resumes_from_the_snapshot_at_its_longest_boundary():
    kv = _manager(state_slots=5)  # a request and its snapshots, and a slot to spare
    prefix = list(range(100, 118))  # 18 rows
    hit, copies = _prefill(kv, "a", [*prefix, 1, 2, 3])  # 21 rows: snapshots at 8, 16 and 20
    assert hit == 0 and [c[0] for c in copies] == ["state"] * 3
    slot_a = kv.requests["a"].labels["state"].pages
    assert len(slot_a) == 1 and all(src == slot_a[0] for _, src, _ in copies)
    state = kv.pools["state"]
    assert len(state.index) == 3 and len(state.index.evictable) == 3  # cached, held by nobody
    kv.remove("a")
    hit, copies = _prefill(kv, "b", [*prefix, 7, 7, 7, 7])  # shares 18 rows: resumes at 16
    assert hit == 16 and copies == [("state", kv.requests["b"].labels["state"].pages[0], copies[0][2])]
    hit, _ = _prefill(kv, "c", prefix[:9] + [9] * 12)  # shares 9 rows: resumes at 8
    assert hit == 8
    for rid in ("b", "c"):
        kv.remove(rid)
    for pool in kv.pools.values():
        assert pool.used == 0 and pool.reserved == 0 and not pool.refs


def test_snapshots_take_only_unreserved_slots_and_a_hit_holds_its_snapshot():
    kv = _manager(state_slots=2)
    ids = list(range(100, 121))
    _prefill(kv, "a", ids)  # one slot its own, one spare: each snapshot evicts the one before (LRU)
    state = kv.pools["state"]
    assert len(state.index) == 1
    kv.remove("a")
    b = _ingest(kv, "b", ids)
    assert kv.can_admit(b) and kv.admit(b) == 20
    snapshot = b.restores["state"]
    assert state.refs == {snapshot: 1} and b.holds == [("state", snapshot)]
    # while b holds it, the snapshot is not evictable: a third request needing the last slot waits
    c = _ingest(kv, "c", [5] * 21)
    kv.reserve_rows("b", "state", 1)
    assert not kv.can_admit(c)
    kv.end_restores("b")
    assert snapshot not in state.refs and snapshot in state.index.evictable  # cached again, held by nobody
    kv.remove("b")
    assert kv.can_admit(c)
    kv.admit(c)
    kv.remove("c")
    assert all(p.used == 0 and p.reserved == 0 for p in kv.pools.values())
