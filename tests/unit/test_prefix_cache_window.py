"""The prefix cache for sliding-window labels: a windowed label is keyed as a full-attention
one is, its pages released behind the window (and at the end) stay cached, and a hit takes
only the pages covering the last `window` rows before the hit point (pages wholly behind
it may have been evicted). The footprint from the hit on stays tight, the conductor
promises exactly what the worker reserves, and the debug checks (conservation after every
operation) hold throughout."""

from __future__ import annotations

import logging
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.conductor.conductor import Conductor, WorkerState
from services.gpu_worker.kv_manager import KVManager
from shared.config import Deployment
from shared.frames import NewRequest, SamplingParams
from shared.layout import KVLabel, KVReqConfig, LabelLayout, PagedKVConfig, Span, hit_pages, label_footprint
from shared.specs.decoder_lm import DecoderLMSpec

PS = 4
W = 6
A = list(range(100, 130))  # 30 rows: 7 full pages and 2 rows; a hit shares 7 pages (28 rows)


def _manager(text_pages: int = 64, window_pages: int = 64, window: int = W, page_size: int = PS,
             text: bool = True) -> KVManager:
    pools = {"kv_window": PagedKVConfig("kv_window", 1, 1, 1, "float32", page_size, window_pages, 4096)}
    labels = [KVLabel("window", "kv_window", keys=True, window=window, grows_on="decode_loop")]
    if text:
        pools["kv"] = PagedKVConfig("kv", 1, 1, 1, "float32", page_size, text_pages, 4096)
        labels.insert(0, KVLabel("text", "kv", keys=True, grows_on="decode_loop"))
    kv = KVManager(pools, tuple(labels))
    kv.debug = True
    return kv


def _ingest(kv: KVManager, rid: str, ids: list[int], max_tokens: int = 2):
    layout = LabelLayout(spans=(Span.ids(ids),), growth={"decode_loop": 1})
    return kv.ingest_request(NewRequest(rid, "", {}, SamplingParams(), "", len(ids), max_tokens,
                                        {name: layout for name in kv.labels}, {"decode_loop": max_tokens - 1}))


def _run(kv: KVManager, rid: str, ids: list[int], max_tokens: int = 2, chunk: int | None = None,
         peaks: dict[str, int] | None = None):
    """Admit, prefill in chunks of `chunk` rows (the rest at once by default) and decode to
    the caps; returns the rows shared, or None when it does not fit now."""
    state = _ingest(kv, rid, ids, max_tokens)
    if not kv.can_admit(state):
        return None
    hit = kv.admit(state)
    peaks = {} if peaks is None else peaks

    def step(n: int, loop: str | None) -> None:
        for name in kv.labels:
            pages = kv.reserve_rows(rid, name, n)
            peaks[name] = max(peaks.get(name, 0), len(pages))
            kv.commit(rid, name, n, loop)

    done = hit
    while done < len(ids):
        n = min(chunk or len(ids), len(ids) - done)
        step(n, None)
        done += n
    for _ in range(max_tokens - 1):
        step(1, "decode_loop")
    return hit


def _drained(kv: KVManager) -> None:
    for pool in kv.pools.values():
        assert pool.used == 0 and pool.reserved == 0 and not pool.refs


def test_a_repeated_prompt_hits_on_the_windowed_label_with_exactly_the_windows_pages():
    kv = _manager()
    assert _run(kv, "a", A) == 0
    a_window = kv.requests["a"].labels["window"]
    # retention released the pages wholly behind the window; they stay cached (keyed)
    wpool = kv.pools["kv_window"]
    assert a_window.first_page == (len(A) + 1 - W) // PS and len(wpool.index) == 7
    assert _run(kv, "b", A) == 28
    b_window, b_text = kv.requests["b"].labels["window"], kv.requests["b"].labels["text"]
    assert b_text.first_page == 0 and b_text.rows == len(A) + 1
    # b ran on past the hit: its window is where a's is, on the same cached page 6
    assert b_window.first_page == a_window.first_page and b_window.pages[0] == a_window.pages[0]
    assert wpool.refs[a_window.pages[0]] == 2
    # the hit took only label pages [(28 - 6) // 4, 7) = 5 and 6 of the window label
    assert kv.requests["b"].hit_rows == 28
    assert hit_pages(PS, W, 28) == (5, 7)
    for rid in "ab":
        kv.remove(rid)
    _drained(kv)
    assert kv.prefix_hit_tokens == 28


def test_the_hit_pages_are_the_cold_runs_pages_of_the_window():
    kv = _manager()
    _run(kv, "a", A)
    wpool = kv.pools["kv_window"]
    chain = wpool.index.walk([tuple(A[i * PS:(i + 1) * PS]) for i in range(7)], wpool.index.root("window"))
    assert len(chain) == 7 and all(page is not None for _, page in chain)
    state = _ingest(kv, "b", A)
    assert kv.can_admit(state)
    assert [page for _, page in state.hits["window"]] == [page for _, page in chain[5:7]]
    assert len(state.hits["text"]) == 7
    kv.admit(state)
    st = state.labels["window"]
    assert st.first_page == 5 and st.rows == 28 and st.keyed_pages == 7
    assert st.pages == [page for _, page in chain[5:7]]
    kv.remove("b")
    kv.remove("a")
    _drained(kv)


def test_pages_behind_the_window_are_never_required():
    """Evict every window page wholly behind the window: the hit is as long as before."""
    kv = _manager(window_pages=10)
    _run(kv, "a", A)
    kv.remove("a")
    wpool = kv.pools["kv_window"]
    chain = wpool.index.walk([tuple(A[i * PS:(i + 1) * PS]) for i in range(7)], wpool.index.root("window"))
    behind = [page for _, page in chain[:5]]
    # a different prompt takes the two fresh pages and then the least recently released
    # cached ones: those behind a's window (released first, by retention)
    assert _run(kv, "c", list(range(300, 318))) == 0
    after = wpool.index.walk([tuple(A[i * PS:(i + 1) * PS]) for i in range(7)], wpool.index.root("window"))
    assert len(after) == 7  # the entries stay: later pages chain from them
    evicted = [i for i, (_, page) in enumerate(after) if page is None]
    assert evicted and all(chain[i][1] in behind for i in evicted)
    assert _run(kv, "b", A) == 28
    for rid in "cb":
        kv.remove(rid)
    _drained(kv)


def test_a_missing_page_inside_the_window_shortens_the_hit():
    kv = _manager()
    _run(kv, "a", A)
    kv.remove("a")
    wpool = kv.pools["kv_window"]
    chain = wpool.index.walk([tuple(A[i * PS:(i + 1) * PS]) for i in range(7)], wpool.index.root("window"))
    # evict the window label's page 6: a hit at 28 needs pages 5 and 6, at 24 pages 4 and 5
    wpool.index.evictable.move_to_end(chain[6][1], last=False)
    assert wpool.index.evict_lru() == chain[6][1]
    wpool.free.append(chain[6][1])  # as `Pool.take` would, then given back
    assert _run(kv, "b", A) == 24
    # b computed page 6 again and refilled its entry: a third request hits at 28
    assert _run(kv, "c", A) == 28
    for rid in "bc":
        kv.remove(rid)
    _drained(kv)


def test_eviction_prunes_entries_with_neither_page_nor_child():
    kv = _manager(text=False)
    _run(kv, "a", A)
    kv.remove("a")
    pool = kv.pools["kv_window"]
    index = pool.index
    assert len(index) == 7
    evicted = [index.evict_lru() for _ in range(len(index.evictable))]
    pool.free.extend(p for p in evicted if p is not None)  # as `Pool.take` would, then given back
    assert len(index) == 0 and not index._entries and not index._children and not index._key_of
    assert _run(kv, "b", A) == 0
    kv.remove("b")
    _drained(kv)


def test_a_window_only_model_hits():
    kv = _manager(text=False)
    assert _run(kv, "a", A) == 0
    kv.remove("a")
    assert _run(kv, "b", A, max_tokens=9) == 28
    kv.remove("b", ran_to_caps=True)
    _drained(kv)


def test_the_footprint_from_the_hit_on_is_tight(caplog):
    """A request that runs to its caps after a hit holds exactly its (lowered) footprint
    at its peak, on both labels, and the debug checks log nothing."""
    caplog.set_level(logging.ERROR, logger="mstar.kv")
    for window in (1, 3, 4, 6, 9, 40):
        kv = _manager(window=window)
        _run(kv, "a", A, max_tokens=7)
        kv.remove("a", ran_to_caps=True)
        full = _ingest(kv, "probe", A, max_tokens=7).labels["window"].footprint
        peaks: dict[str, int] = {}
        assert _run(kv, "b", A, max_tokens=7, peaks=peaks) == 28
        state = kv.requests["b"]
        st = state.labels["window"]
        assert st.footprint == label_footprint(st.layout, state.caps, PS, window, 28) <= full
        assert peaks["window"] == st.footprint and peaks["text"] == state.labels["text"].footprint
        kv.remove("b", ran_to_caps=True)
        _drained(kv)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), pages=st.integers(12, 40), window=st.integers(1, 12),
       page_size=st.sampled_from([2, 4, 8]))
def test_random_traffic_with_a_window_conserves_pages(seed, pages, window, page_size):
    """Random requests over a few shared prefixes, chunked or not, on small pools: the
    conservation check never fires, every hit holds exactly the window's pages, and
    everything returns."""
    rng = random.Random(seed)
    kv = _manager(text_pages=pages, window_pages=pages, window=window, page_size=page_size)
    prefixes = [[rng.randint(0, 5) for _ in range(rng.randint(1, 24))] for _ in range(3)]
    live: list[str] = []
    for i in range(50):
        if live and rng.random() < 0.4:
            kv.remove(live.pop(rng.randrange(len(live))))
            continue
        ids = rng.choice(prefixes) + [rng.randint(0, 5) for _ in range(rng.randint(0, 6))]
        rid = f"r{i}"
        state = _ingest(kv, rid, ids, 3)
        if not kv.can_admit(state):
            continue
        first, end = hit_pages(page_size, window, state.hit_rows)
        if state.hit_rows:
            assert len(state.hits["window"]) == end - first and len(state.hits["text"]) == end
        hit = kv.admit(state)
        done, chunk = hit, rng.choice([1, 3, 100])
        while done < len(ids):
            n = min(chunk, len(ids) - done)
            for name in kv.labels:
                kv.reserve_rows(rid, name, n)
                kv.commit(rid, name, n)
            done += n
        live.append(rid)
    for rid in live:
        kv.remove(rid)
    _drained(kv)


def test_the_conductor_promises_what_the_worker_reserves(tmp_path):
    """After the same prompt, the conductor's pages to promise per pool (footprint less
    what the hit spares) equal the worker's new pages: its reservation less the pages it
    shares (a windowed label's only those of its window)."""
    config = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 16,
              "max_position_embeddings": 1024, "sliding_window": W,
              "layer_types": ["sliding_attention", "full_attention"]}
    spec = DecoderLMSpec(config, page_size=PS)
    assert {lab.name: (lab.keys, lab.window) for lab in spec.kv_labels} == {"text": (True, None),
                                                                            "window": (True, W)}

    def request(rid: str) -> NewRequest:
        layout = LabelLayout(spans=(Span.ids(A),), growth={"decode_loop": 1})
        caps = {"decode_loop": 5}
        configs = {lab.pool: KVReqConfig(lab.pool, PS, {lab.name: label_footprint(layout, caps, PS, lab.window)})
                   for lab in spec.kv_labels}
        return NewRequest(rid, "", {}, SamplingParams(), "", len(A), 6, {"text": layout, "window": layout}, caps,
                          configs)

    kv = KVManager(spec.paged_pools(256), spec.kv_labels)
    kv.debug = True
    first = kv.ingest_request(request("a"))
    assert kv.can_admit(first)
    kv.admit(first)
    for name in ("text", "window"):
        kv.reserve_rows("a", name, len(A))
        kv.commit("a", name, len(A))
    second = kv.ingest_request(request("b"))
    assert kv.can_admit(second) and second.hit_rows == 28
    worker = {st.label.pool: second.reservation(st.label.pool) - len(second.hits.get(name, []))
              for name, st in second.labels.items()}
    addrs = {"conductor": f"ipc://{tmp_path}/c.sock", "conductor_control": f"ipc://{tmp_path}/cc.sock"}
    cond = Conductor(Deployment(page_size=PS), spec, addrs)
    try:
        w = WorkerState("w", f"ipc://{tmp_path}/w.sock", spec.paged_pools(256))
        w.remember(cond._prefix_keys(request("a")))
        keys = cond._prefix_keys(request("b"))
        assert set(keys) == {"kv", "kv_window"}
        hits = w.hit_pages(keys)
        assert hits == 7
        need = cond._hit_need(request("b"), cond._need(request("b")), hits)
    finally:
        cond.pushers.close()
        cond.ctx.term()
    assert need == worker
    assert need["kv_window"] < request("b").kv_configs["kv_window"].total_pages - 1
    kv.remove("a")
    kv.remove("b")


@pytest.mark.parametrize("window", [None, 1, 5, 8, 13])
def test_hit_footprint_is_the_plain_one_without_a_hit(window):
    layout = LabelLayout(spans=(Span.ids(A),), growth={"decode_loop": 2}, scratch=3)
    caps = {"decode_loop": 9}
    assert label_footprint(layout, caps, PS, window, 0) == label_footprint(layout, caps, PS, window)
    if window is None:
        assert label_footprint(layout, caps, PS, window, 28) == label_footprint(layout, caps, PS, window)
