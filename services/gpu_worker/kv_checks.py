"""The KV manager's debug checks (`MSTAR_KV_DEBUG_ASSERTS=1`, or `KVManager.debug = True`):
every commit against the declared layout, the pages' conservation after every change, and
a removed request's under-use of its footprint.

They exist only while debugging: the KV manager holds a `LayoutChecker` then, and `None`
otherwise, and what the checks need to remember of each label's walk (which span a commit
continues, iterations per loop, when scratch was written, the most pages held) lives here,
not in the allocation state every request carries.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from services.gpu_worker.kv_state import LabelState, RequestKV
from shared.layout import PagedKVConfig, label_footprint, pages_in

log = logging.getLogger("mstar.kv")


class PagePool(Protocol):
    """What the conservation check reads of a `kv_manager.Pool`."""

    config: PagedKVConfig
    refs: dict[int, int]
    index: Any  # its PrefixIndex: `evictable`, the pages cached and held by nobody

    def free_pages(self) -> list[int]: ...


class LayoutViolation(Exception):
    """Under MSTAR_KV_DEBUG_ASSERTS=1, a commit that does not match the declared layout."""


@dataclass
class Walk:
    """What one label of one request has done so far, as its layout is checked."""

    span_cursor: int = 0  # which span the next commit continues
    span_done: int = 0  # rows of that span already committed
    span_rows_done: int = 0
    split_spans: bool = False  # a span committed in chunks (chunked prefill)
    loop_commits: dict[str, int] = field(default_factory=dict)
    scratch_before: bool = False  # scratch was written before the first commit (a probe)
    scratch_after: bool = False  # ... after a commit (rejected drafts)
    peak_pages: int = 0


def _advance(w: Walk, spans, rows: int) -> None:
    """Move the walk `rows` span rows on, through as many spans as they cover; a span
    entered or left part-way was committed in chunks."""
    w.span_rows_done += rows
    while rows:
        while spans[w.span_cursor].length == w.span_done:
            w.span_cursor, w.span_done = w.span_cursor + 1, 0
        step = min(spans[w.span_cursor].length - w.span_done, rows)
        w.split_spans |= step < spans[w.span_cursor].length
        w.span_done += step
        rows -= step


class LayoutChecker:
    def __init__(self) -> None:
        self.walks: dict[tuple[str, str], Walk] = {}

    def walk(self, request_id: str, label: str) -> Walk:
        return self.walks.setdefault((request_id, label), Walk())

    # -- the hooks the KV manager calls ---------------------------------------------------

    def held(self, kv: RequestKV, st: LabelState) -> None:
        w = self.walk(kv.request_id, st.label.name)
        w.peak_pages = max(w.peak_pages, len(st.pages))

    def shared(self, kv: RequestKV, st: LabelState, rows: int) -> None:
        """Rows shared from the prefix cache count as committed span rows."""
        w = self.walk(kv.request_id, st.label.name)
        w.peak_pages = max(w.peak_pages, len(st.pages))
        _advance(w, st.layout.spans, rows)

    def commit(self, kv: RequestKV, st: LabelState, n: int, loop: str | None) -> None:
        """Span commits continue the declared spans in order (a prefill chunk may be part of
        one span or run across several: text, an image's rows, text);
        growth comes only after every span, at the declared rows per iteration, never past
        the loop's cap."""
        w = self.walk(kv.request_id, st.label.name)
        spans = st.layout.spans
        if loop is None:
            left = st.layout.span_rows - w.span_rows_done
            if n > left:
                raise LayoutViolation(f"label {st.label.name!r} commits {n} span rows past its declared spans "
                                      f"({left} left)")
            _advance(w, spans, n)
            return
        if w.span_rows_done != st.layout.span_rows:
            raise LayoutViolation(f"label {st.label.name!r} grows on {loop!r} before its spans are committed")
        want = st.layout.growth.get(loop, 0)
        if n != want:
            raise LayoutViolation(f"label {st.label.name!r} commits {n} rows on {loop!r}; "
                                  f"its layout grows {want} per iteration")
        count = w.loop_commits.get(loop, 0) + 1
        if count > kv.caps.get(loop, 0):
            raise LayoutViolation(f"label {st.label.name!r} runs {loop!r} past its cap {kv.caps.get(loop, 0)}")
        w.loop_commits[loop] = count

    def scratch(self, kv: RequestKV, st: LabelState) -> None:
        w = self.walk(kv.request_id, st.label.name)
        if st.rows:
            w.scratch_after = True
        else:
            w.scratch_before = True

    def removed(self, kv: RequestKV, ran_to_caps: bool) -> None:
        """A request that ran to its caps must have held its whole footprint at its peak
        (the footprint is tight): log each label that held fewer pages."""
        for st in kv.labels.values():
            w = self.walks.pop((kv.request_id, st.label.name), Walk())
            # A windowed label whose spans were committed in chunks never holds a whole span
            # at once, so it may peak below the footprint (which bounds every chunking).
            chunked_window = w.split_spans and st.label.window is not None
            if ran_to_caps and w.peak_pages < _walk_peak(kv, st, w) and not chunked_window:
                log.error(
                    "request %s label %r ran to its caps but held at most %d of its %d footprint pages "
                    "(footprint not tight)",
                    kv.request_id, st.label.name, w.peak_pages, st.footprint,
                )

    def conservation(self, pools: Mapping[str, PagePool], requests: Iterable[RequestKV]) -> None:
        """Every page is exactly one of: free, cached-evictable, held; holders match refs."""
        requests = list(requests)
        for name, pool in pools.items():
            held: dict[int, int] = {}
            for kv in requests:
                for st in kv.labels.values():
                    if st.label.pool == name:
                        for pg in st.pages:
                            held[pg] = held.get(pg, 0) + 1
                for hold_pool, pg in kv.holds:
                    if hold_pool == name:
                        held[pg] = held.get(pg, 0) + 1
            free, cached = set(pool.free_pages()), set(pool.index.evictable)
            if len(free) != len(pool.free_pages()) or free & cached or (free | cached) & set(held):
                raise AssertionError(f"pool {name!r}: a page is both free (or cached) and owned")
            if held != pool.refs:
                raise AssertionError(f"pool {name!r}: page holders {held} != reference counts {pool.refs}")
            if len(free) + len(cached) + len(held) != pool.config.num_pages:
                raise AssertionError(f"pool {name!r}: {len(free)} free + {len(cached)} cached + {len(held)} held "
                                     f"!= {pool.config.num_pages}")


def _walk_peak(kv: RequestKV, st: LabelState, w: Walk) -> int:
    """The pages a label that ran to its caps must have held at its peak: its footprint,
    except for a label whose scratch was written only before its first commit (Whisper's
    language probe). The footprint lets scratch follow any commit, the last one too, so
    it may be above such a walk's true peak (by a page at most for Whisper's one-row
    probe): the larger of the probe's pages and the footprint without scratch."""
    if not (st.layout.scratch and w.scratch_before and not w.scratch_after):
        return st.footprint
    bare = label_footprint(msgspec.structs.replace(st.layout, scratch=0), kv.caps, st.page_size, st.label.window)
    return max(pages_in(0, st.layout.scratch, st.page_size), bare)
