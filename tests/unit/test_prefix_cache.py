"""The prefix cache in the KV manager: keyed ids spans share full pages by reference,
rows spans never do, the last prompt row is always recomputed, and eviction takes only
pages nobody holds (debug asserts check page conservation after every operation)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from services.gpu_worker.kv_manager import KVManager
from shared.frames import NewRequest, SamplingParams
from shared.layout import KVLabel, LabelLayout, PagedKVConfig, Span

PS = 4


def _manager(pages: int, keys: bool = True) -> KVManager:
    kv = KVManager({"kv": PagedKVConfig("kv", 1, 1, 1, "float32", PS, pages, 4096)},
                   (KVLabel("text", "kv", keys=keys, grows_on="decode_loop"),))
    kv.debug = True
    return kv


def _run_prefill(kv: KVManager, rid: str, span: Span, max_tokens: int = 2):
    layout = LabelLayout(spans=(span,), growth={"decode_loop": 1})
    state = kv.ingest_request(NewRequest(rid, "", {}, SamplingParams(), "", span.length, max_tokens, {"text": layout},
                                         {"decode_loop": max_tokens - 1}))
    if not kv.can_admit(state):
        return None
    hit = kv.admit(state)
    kv.reserve_rows(rid, "text", span.length - hit)
    kv.commit(rid, "text", span.length - hit)
    return hit


def test_repeated_prompt_shares_full_pages_and_recomputes_the_last_row():
    kv = _manager(64)
    ids = list(range(100, 118))  # 18 rows: 4 full pages + 2 rows
    assert _run_prefill(kv, "a", Span.ids(ids)) == 0
    assert _run_prefill(kv, "b", Span.ids(ids)) == 16
    a, b = kv.requests["a"].labels["text"].pages, kv.requests["b"].labels["text"].pages
    assert a[:4] == b[:4] and a[4] != b[4]
    assert all(kv.pools["kv"].refs[p] == 2 for p in a[:4])
    # A prompt of exactly 4 pages shares 3: its last row must be computed for its logits.
    assert _run_prefill(kv, "c", Span.ids(ids[:16])) == 12
    for rid in "abc":
        kv.remove(rid)
    pool = kv.pools["kv"]
    assert pool.used == 0 and pool.reserved == 0 and len(pool.index.evictable) == 4
    assert kv.prefix_queries == 3 and kv.prefix_hit_tokens == 28


def test_different_prefix_shares_nothing_after_the_divergence():
    kv = _manager(64)
    _run_prefill(kv, "a", Span.ids(list(range(100, 117))))
    assert _run_prefill(kv, "b", Span.ids([*range(100, 108), 1, *range(109, 117)])) == 8


def test_rows_spans_are_never_reused():
    kv = _manager(64)
    assert _run_prefill(kv, "a", Span.rows(17)) == 0
    assert _run_prefill(kv, "b", Span.rows(17)) == 0
    assert len(kv.pools["kv"].index) == 0


def test_unkeyed_label_is_never_reused():
    kv = _manager(64, keys=False)
    _run_prefill(kv, "a", Span.ids(list(range(17))))
    assert _run_prefill(kv, "b", Span.ids(list(range(17)))) == 0


def test_eviction_under_a_small_pool_takes_only_pages_nobody_holds():
    kv = _manager(8)
    _run_prefill(kv, "held", Span.ids(list(range(100, 113))))  # 4 pages, 3 keyed, held
    _run_prefill(kv, "gone", Span.ids(list(range(200, 209))))  # 3 pages, 2 keyed
    kv.remove("gone")  # its 2 keyed pages become evictable, 1 free
    pool = kv.pools["kv"]
    held = list(kv.requests["held"].labels["text"].pages)
    assert len(pool.index.evictable) == 2 and pool.available == 4
    # A newcomer needing 4 pages must evict both cached pages, never a held one.
    assert _run_prefill(kv, "new", Span.ids(list(range(300, 315)))) == 0
    assert kv.requests["held"].labels["text"].pages == held
    assert all(pool.refs[p] == 1 for p in held)
    assert len(pool.index.evictable) == 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), pages=st.integers(6, 40))
def test_random_traffic_conserves_pages(seed, pages):
    """Random requests over a few shared prefixes on a small pool: the conservation check
    (run after every admit/commit/remove) never fires and everything returns."""
    rng = random.Random(seed)
    kv = _manager(pages)
    prefixes = [[rng.randint(0, 5) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    live: list[str] = []
    for i in range(60):
        if live and rng.random() < 0.4:
            kv.remove(live.pop(rng.randrange(len(live))))
            continue
        ids = rng.choice(prefixes) + [rng.randint(0, 5) for _ in range(rng.randint(0, 6))]
        if _run_prefill(kv, f"r{i}", Span.ids(ids)) is not None:
            live.append(f"r{i}")
    for rid in live:
        kv.remove(rid)
    pool = kv.pools["kv"]
    assert pool.used == 0 and pool.reserved == 0 and not pool.refs


def test_cached_pages_stay_within_the_resident_budget():
    """Distinct prompts one after another on a large pool: pages given back are reused
    first, and past the most pages ever held at once (at least MIN_RESIDENT_PAGES) the
    least recently used cached page is reused before a fresh page is touched, so the pages
    ever taken (resident memory on the CPU) stop growing while the cache keeps hitting on
    what it still holds."""
    from services.gpu_worker.kv_manager import MIN_RESIDENT_PAGES

    kv = _manager(4096)
    pool = kv.pools["kv"]
    for i in range(200):  # 200 distinct prompts of 10 full pages, one at a time
        assert _run_prefill(kv, f"r{i}", Span.ids([1000 * i + j for j in range(41)])) == 0
        kv.remove(f"r{i}")
    assert pool.peak_held == 11 and pool.fresh == MIN_RESIDENT_PAGES  # 11 pages a request, 64 ever taken
    assert pool.used == 0 and len(pool.index.evictable) + len(pool.free) == MIN_RESIDENT_PAGES
    # the most recent prompt is still cached; the first was evicted long ago
    assert _run_prefill(kv, "again", Span.ids([1000 * 199 + j for j in range(41)])) == 40
    assert _run_prefill(kv, "first", Span.ids(list(range(41)))) == 0
    for rid in ("again", "first"):
        kv.remove(rid)
    # a load that holds more at once raises the budget to its peak
    for i in range(8):
        assert _run_prefill(kv, f"w{i}", Span.ids([7 * 10**6 + 1000 * i + j for j in range(41)])) == 0
    assert pool.peak_held == 88 and pool.fresh == 88
    for i in range(8):
        kv.remove(f"w{i}")
    assert pool.used == 0 and pool.available == 4096


def _run_spans(kv: KVManager, rid: str, spans: tuple[Span, ...], max_tokens: int = 2):
    """Prefill a prompt of several spans (text, an image's rows, text) in one commit."""
    rows = sum(s.length for s in spans)
    layout = LabelLayout(spans=spans, growth={"decode_loop": 1})
    state = kv.ingest_request(NewRequest(rid, "", {}, SamplingParams(), "", rows, max_tokens, {"text": layout},
                                         {"decode_loop": max_tokens - 1}))
    assert kv.can_admit(state)
    hit = kv.admit(state)
    kv.reserve_rows(rid, "text", rows - hit)
    kv.commit(rid, "text", rows - hit)
    return hit


def _image_prompt(key: str) -> tuple[Span, ...]:
    # 6 ids, 8 image rows, 6 ids: the image spans pages 1-3, the text after it pages 3-4
    return Span.ids(range(100, 106)), Span.rows(8, key), Span.ids(range(106, 112))


def test_image_rows_are_shared_by_their_content_key_never_by_placeholder_ids():
    """The same text with another image shares only the pages before the image; the same
    image shares the image's pages and the text after it (chained through its key)."""
    kv = _manager(64)
    assert _run_spans(kv, "a", _image_prompt("sha:aaa")) == 0
    assert _run_spans(kv, "b", _image_prompt("sha:bbb")) == 4  # page 0: ids only
    assert _run_spans(kv, "c", _image_prompt("sha:aaa")) == 16  # all full pages but the last row's
    a, b, c = (kv.requests[r].labels["text"].pages for r in "abc")
    assert a[0] == b[0] and a[1] != b[1] and a[:4] == c[:4]
    for rid in "abc":
        kv.remove(rid)
    assert kv.pools["kv"].used == 0 and kv.pools["kv"].reserved == 0


def test_unkeyed_rows_end_what_the_prefix_cache_may_share():
    kv = _manager(64)
    spans = (Span.ids(range(100, 106)), Span.rows(8), Span.ids(range(106, 112)))
    assert _run_spans(kv, "a", spans) == 0
    assert _run_spans(kv, "b", spans) == 4  # the ids page before the unkeyed rows only
    for rid in "ab":
        kv.remove(rid)


def test_row_keys_of_a_keyed_rows_span_are_negative_and_differ_by_key():
    a, b = Span.rows(3, "sha:aaa").row_keys(), Span.rows(3, "sha:bbb").row_keys()
    assert len(a) == 3 and len(set(a)) == 1 and a[0] < 0 and a != b
    try:
        Span("ids", 1, (5,), "sha:x")
    except ValueError as exc:
        assert "content key is for rows spans" in str(exc)
    else:
        raise AssertionError("an ids span with a content key was accepted")


def test_a_hit_never_ends_inside_a_bidirectional_block():
    """A block's rows attend to each other both ways, so a request computes a block in one
    forward: a cached prefix that would end inside one is cut back to whole pages before
    it (the block spans rows 6-13: a match of 12 rows becomes 4, page 1 starts at row 4)."""
    kv = _manager(64)
    image = Span.rows(8, "sha:img", bidirectional=True)
    assert _run_spans(kv, "a", (Span.ids(range(100, 106)), image, Span.ids(range(106, 120)))) == 0
    assert kv.requests["a"].blocks == ((6, 14),)
    assert _run_spans(kv, "b", (Span.ids(range(100, 106)), image, Span.ids(range(106, 120)))) == 24  # past it
    assert _run_spans(kv, "e", (Span.ids(range(100, 106)), image, Span.ids(range(300, 314)))) == 4  # in it
    plain = _manager(64)  # the same prompts without the block: the match as it was
    assert _run_spans(plain, "a", (Span.ids(range(100, 106)), Span.rows(8, "sha:img"), Span.ids(range(106, 120)))) == 0
    assert _run_spans(plain, "e", (Span.ids(range(100, 106)), Span.rows(8, "sha:img"), Span.ids(range(300, 314)))) == 12
    # a match that ends where a block ends (rows 4-11, pages 1-2) is kept whole
    two = Span.rows(8, "sha:two", bidirectional=True)
    assert _run_spans(kv, "c", (Span.ids(range(200, 204)), two, Span.ids(range(204, 214)))) == 0
    assert _run_spans(kv, "d", (Span.ids(range(200, 204)), two, Span.ids(range(400, 410)))) == 12
    for rid in "abcde":
        kv.remove(rid)
    assert kv.pools["kv"].used == 0 and kv.pools["kv"].reserved == 0
