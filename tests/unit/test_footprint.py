"""Footprints are tight: a walk that runs every loop to its cap peaks at exactly the
footprint, never above, for random layouts, caps, windows and page sizes. The walk is
driven through the real KVManager (reserve_rows / commit / drop_scratch), and checked
against an independent page-by-page simulation."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gpu_worker.kv_checks import _walk_peak
from services.gpu_worker.kv_manager import KVManager
from shared.frames import NewRequest, SamplingParams
from shared.layout import KVLabel, LabelLayout, PagedKVConfig, Span, label_footprint


def simulate_peak(layout: LabelLayout, caps: dict[str, int], page_size: int, window: int | None) -> int:
    """Independent model of the walk: a set of live page numbers, row by row."""
    held: set[int] = set()
    rows = peak = 0
    sizes = [0] + [s.length for s in layout.spans if s.length]  # a probe may run before any commit
    for loop, g in layout.growth.items():
        sizes += [g] * caps.get(loop, 0) if g else []
    for c in sizes:
        for r in range(rows, rows + c + layout.scratch):
            held.add(r // page_size)
        peak = max(peak, len(held))
        rows += c
        held = {p for p in held if p * page_size < rows}  # scratch-only pages go back
        if window is not None:
            held = {p for p in held if (p + 1) * page_size > rows - window}
    return peak


layouts = st.builds(
    lambda spans, scratch, growth: LabelLayout(spans=tuple(spans), scratch=scratch, growth=growth),
    st.lists(st.one_of(st.integers(0, 40).map(Span.rows), st.lists(st.integers(0, 9), max_size=40).map(Span.ids)),
             max_size=3),
    st.integers(0, 6),
    st.dictionaries(st.sampled_from(["decode_loop", "probe_loop"]), st.integers(0, 4), max_size=2),
)


@settings(max_examples=400, deadline=None)
@given(layout=layouts, caps=st.dictionaries(st.sampled_from(["decode_loop", "probe_loop"]), st.integers(0, 30)),
       page_size=st.sampled_from([1, 2, 4, 8, 16]), window=st.one_of(st.none(), st.integers(1, 64)))
def test_footprint_equals_simulated_peak(layout, caps, page_size, window):
    assert label_footprint(layout, caps, page_size, window) == simulate_peak(layout, caps, page_size, window)


def _walk_kv_manager(layout: LabelLayout, caps: dict[str, int], page_size: int,
                     window: int | None) -> tuple[int, KVManager]:
    label = KVLabel("a", "kv", window=window, grows_on="decode_loop")
    pools = {"kv": PagedKVConfig("kv", 1, 1, 1, "float32", page_size, 4096, 10**6)}
    kv = KVManager(pools, (label,))
    kv.debug = True  # every commit checked against the layout, pages conserved throughout
    req = NewRequest("r", "", {}, SamplingParams(), "", layout.span_rows, 1, {"a": layout}, caps)
    state = kv.ingest_request(req)
    kv.admit(state)
    peak = 0
    steps = [(0, None)] + [(s.length, None) for s in layout.spans if s.length]
    for loop, g in layout.growth.items():
        steps += [(g, loop)] * caps.get(loop, 0) if g else []
    for n, loop in steps:
        pages = kv.reserve_rows("r", "a", n + layout.scratch)
        peak = max(peak, len(pages))
        if n:
            kv.commit("r", "a", n, loop)
        kv.drop_scratch("r", "a")
    return peak, kv


@settings(max_examples=300, deadline=None)
@given(layout=layouts, caps=st.dictionaries(st.just("decode_loop"), st.integers(0, 30)),
       page_size=st.sampled_from([1, 2, 4, 16]), window=st.one_of(st.none(), st.integers(1, 64)))
def test_kv_manager_walk_peaks_at_footprint(layout, caps, page_size, window):
    layout = LabelLayout(spans=layout.spans, scratch=layout.scratch,
                         growth={k: v for k, v in layout.growth.items() if k == "decode_loop"})
    peak, kv = _walk_kv_manager(layout, caps, page_size, window)
    fp = kv.requests["r"].labels["a"].footprint
    assert peak == fp
    assert kv.footprint_overruns == 0
    kv.remove("r", ran_to_caps=True)
    pool = kv.pools["kv"]
    assert pool.used == 0 and pool.reserved == 0


def test_understated_growth_overruns_once(caplog, monkeypatch):
    """A layout that under-states growth takes pages past its footprint: one error per
    request and label, counted once, and the page is still served."""
    layout = LabelLayout(spans=(Span.ids([1, 2, 3, 4]),), growth={"decode_loop": 1})
    label = KVLabel("a", "kv", grows_on="decode_loop")
    kv = KVManager({"kv": PagedKVConfig("kv", 1, 1, 1, "float32", 4, 64, 4096)}, (label,))
    kv.debug = False  # with debug asserts the first wrong commit would fail the request instead
    state = kv.ingest_request(NewRequest("r", "", {}, SamplingParams(), "", 4, 3, {"a": layout}, {"decode_loop": 2}))
    kv.admit(state)
    assert state.labels["a"].footprint == 2  # ceil((4 + 2) / 4)
    with caplog.at_level(logging.ERROR, "mstar.kv"):
        kv.reserve_rows("r", "a", 4)
        kv.commit("r", "a", 4)
        for _ in range(8):  # writes 2 rows per iteration while declaring 1
            kv.reserve_rows("r", "a", 2)
            kv.commit("r", "a", 2, "decode_loop")
    overruns = [r for r in caplog.records if "footprint overrun" in r.message]
    assert len(overruns) == 1 and kv.footprint_overruns == 1
    assert len(kv.requests["r"].labels["a"].pages) == 5
    assert kv.remove("r") == 5
    assert kv.pools["kv"].used == 0 and kv.pools["kv"].reserved == 0


@pytest.mark.parametrize("bad", [dict(scratch=-1), dict(growth={"decode_loop": -2})])
def test_layout_validation(bad):
    with pytest.raises(ValueError):
        LabelLayout(**bad)


def test_span_validation():
    with pytest.raises(ValueError):
        Span.rows(-1)
    with pytest.raises(ValueError):
        Span("ids", 3, (1, 2))


def _probe_walk(layout: LabelLayout, caps: dict[str, int], page_size: int, window: int | None,
                probe: bool) -> tuple[int, KVManager]:
    """A walk whose scratch is written once, before the first commit (Whisper's language
    probe), or never; commits as `_walk_kv_manager`'s."""
    label = KVLabel("a", "kv", window=window, grows_on="decode_loop")
    kv = KVManager({"kv": PagedKVConfig("kv", 1, 1, 1, "float32", page_size, 4096, 10**6)}, (label,))
    kv.debug = True
    kv.admit(kv.ingest_request(NewRequest("r", "", {}, SamplingParams(), "", layout.span_rows, 1, {"a": layout}, caps)))
    peak = 0
    if probe:
        peak = len(kv.reserve_rows("r", "a", layout.scratch))
        kv.drop_scratch("r", "a")
    steps = [(s.length, None) for s in layout.spans if s.length]
    for loop, g in layout.growth.items():
        steps += [(g, loop)] * caps.get(loop, 0) if g else []
    for n, loop in steps:
        peak = max(peak, len(kv.reserve_rows("r", "a", n)))
        kv.commit("r", "a", n, loop)
    return peak, kv


@settings(max_examples=200, deadline=None)
@given(layout=layouts, caps=st.dictionaries(st.just("decode_loop"), st.integers(0, 30)),
       page_size=st.sampled_from([1, 2, 4, 16]), window=st.one_of(st.none(), st.integers(1, 64)),
       probe=st.booleans())
def test_a_probe_before_the_first_commit_is_judged_by_its_own_peak(layout, caps, page_size, window, probe):
    """The footprint lets scratch follow any commit, so a walk whose only scratch is a
    probe before the first commit may peak below it. The debug tightness check judges
    such a label by that walk's exact peak (`_walk_peak`), and every other label (scratch
    declared but never written, or none) by its footprint."""
    layout = LabelLayout(spans=layout.spans, scratch=layout.scratch,
                         growth={k: v for k, v in layout.growth.items() if k == "decode_loop"})
    probe = probe and layout.scratch > 0
    peak, kv = _probe_walk(layout, caps, page_size, window, probe)
    req = kv.requests["r"]
    state = req.labels["a"]
    assert peak <= state.footprint and kv.footprint_overruns == 0
    walk = kv.checker.walk("r", "a")
    assert _walk_peak(req, state, walk) == (peak if probe else state.footprint)
    kv.remove("r", ran_to_caps=True)
    assert kv.pools["kv"].used == 0 and kv.pools["kv"].reserved == 0
