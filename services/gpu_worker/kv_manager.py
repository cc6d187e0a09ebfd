"""The KV manager: pages of each pool, each request's per-label page lists and footprints.

`ingest_request` is the only way in (from a `NewRequest`); it computes every label's
footprint once. Admission reserves the footprint, so a request that keeps to its layout
can never find the pool empty mid-run and nothing ever needs preempting. `_alloc` serves
a page past the footprint (never corrupting another request) but logs it once per request
and label and counts it: that is a model bug the layout contract exists to catch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import accumulate

from services.gpu_worker.kv_checks import LayoutChecker, LayoutViolation
from services.gpu_worker.kv_state import LabelState, RequestKV
from services.gpu_worker.prefix_cache import PrefixIndex
from shared.frames import NewRequest, PoolStats
from shared.layout import (
    KVLabel,
    LabelLayout,
    PagedKVConfig,
    bidirectional_blocks,
    block_boundary,
    hit_pages,
    label_footprint,
    leading_keys,
    prompt_pages,
    shareable_count,
)
from shared.pages import pages_for

log = logging.getLogger("mstar.kv")

__all__ = ["DoesNotFit", "FootprintOverrun", "KVManager", "LabelState", "LayoutViolation", "RequestKV"]


class DoesNotFit(ValueError):
    """A request whose footprint exceeds a whole pool: no wait would ever admit it."""


class FootprintOverrun(Exception):
    """A label needs a page past its footprint and every free page is reserved by other
    requests: only the overrunning request may fail for it, never one that kept its word."""


def max_seq_len_pages(pool: PagedKVConfig) -> int:
    return pages_for(pool.max_seq_len, pool.page_size)


def debug_asserts_enabled() -> bool:
    return os.environ.get("MSTAR_KV_DEBUG_ASSERTS", "0") not in ("", "0", "false")


#: resident pages the prefix cache may keep however few the running requests have held
MIN_RESIDENT_PAGES = 64
#: rows between a hybrid prompt's state snapshots (`state_snapshot_rows`)
SNAPSHOT_INTERVAL = 256


def state_snapshot_rows(keyed: LabelLayout, page_size: int, interval: int) -> tuple[int, ...]:
    """The prompt rows after which a hybrid request keeps a copy of its recurrent state for
    the prefix cache: each page boundary of its shareable keyed prefix (`shareable_count`
    pages of its keyed attention label) that is a multiple of `interval` rows, and the last
    one. A later prompt sharing a prefix resumes at the longest such boundary within it (a
    repeated prompt at its last page, a shared system prompt at its last multiple of
    `interval`); each snapshot costs one state slot, so they are few (a 2,048-row prompt
    keeps at most nine at the default 256)."""
    last = shareable_count(keyed, page_size) * page_size
    step = max(page_size, interval // page_size * page_size)
    return tuple(sorted({*range(step, last + 1, step), *([last] if last else [])}))


def snapshot_cut(rows: tuple[int, ...], computed: int, n: int) -> int:
    """A prompt chunk of `n` rows from row `computed`, cut to end at the first snapshot row
    inside it (the state is whole only at a chunk's end)."""
    for r in rows:
        if computed < r < computed + n:
            return r - computed
    return n


class Pool:
    """Pages of one pool: free, held (reference-counted: shared prefix pages have several
    holders) or cached-but-evictable (indexed, held by nobody; allocatable).

    Free pages are of two kinds. On the CPU a page's memory is first made resident when it
    is written, so the pool hands out pages given back before (`free`, last in first out)
    before fresh ones (`fresh` onwards, never taken), and once the pages ever taken reach the
    most the requests have held at once (at least `MIN_RESIDENT_PAGES`), it reuses the
    least recently used cached page before touching a fresh one: the prefix cache lives in
    memory the load has already made resident, and the worker's memory follows its peak
    load, not the pool's size (a pool sized to 10% of memory would otherwise become resident
    page by page as distinct prompts are cached)."""

    def __init__(self, config: PagedKVConfig) -> None:
        self.config = config
        self.free: list[int] = []  # given back, reused first (the last one given back first)
        self.fresh = 0  # pages [fresh, num_pages) were never taken; low ids go out first
        self.refs: dict[int, int] = {}
        self.index = PrefixIndex()
        self.reserved = 0
        self.peak_used = 0
        self.peak_held = 0  # the most pages held at once, ever (the warm-up's too): the cache's budget

    @property
    def available(self) -> int:
        return len(self.free) + (self.config.num_pages - self.fresh) + len(self.index.evictable)

    @property
    def used(self) -> int:
        return self.config.num_pages - self.available

    def free_pages(self) -> list[int]:
        """Every page nobody holds and the cache does not index."""
        return [*self.free, *range(self.fresh, self.config.num_pages)]

    def stats(self) -> PoolStats:
        return PoolStats(self.config.name, self.config.num_pages, self.available, self.reserved, self.peak_used,
                         len(self.index))

    def take(self) -> int:
        """A page given back before; else, past the resident budget, the least recently used
        cached one; else a fresh one; else a cached one."""
        page: int | None
        if self.free:
            page = self.free.pop()
        elif self.index.evictable and self.fresh >= max(self.peak_held, MIN_RESIDENT_PAGES):
            page = self.index.evict_lru()
        elif self.fresh < self.config.num_pages:
            page, self.fresh = self.fresh, self.fresh + 1
        else:
            page = self.index.evict_lru()
        if page is None:
            raise MemoryError(f"pool {self.config.name!r} has no free page")
        self.refs[page] = 1
        self.peak_held = max(self.peak_held, len(self.refs))
        return page

    def hold(self, page: int) -> None:
        """One more holder of a cached page (a prefix hit)."""
        if self.refs.get(page, 0) == 0:
            del self.index.evictable[page]
        self.refs[page] = self.refs.get(page, 0) + 1

    def drop(self, page: int) -> None:
        left = self.refs[page] - 1
        if left:
            self.refs[page] = left
            return
        del self.refs[page]
        if self.index.is_indexed(page):
            self.index.evictable[page] = None  # most recently released last
        else:
            self.free.append(page)


def _merged_blocks(per_label: Iterable[tuple[tuple[int, int], ...]]) -> tuple[tuple[int, int], ...]:
    """The blocks of every label as one ordered list, overlapping ones merged (labels of a
    decoder declare the same blocks; merging keeps any rule about one of them whole)."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(b for blocks in per_label for b in blocks):
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return tuple(merged)


def _whole_blocks(rows: int, blocks: tuple[tuple[int, int], ...], page_sizes: list[int]) -> int:
    """The most rows, at most `rows` and whole pages of every label, of a prefix hit that
    ends inside no bidirectional block: a block's rows are computed in one forward in this
    request, as transformers computes them (cutting back to a block's start may land
    inside an earlier block: cut again)."""
    while True:
        start = block_boundary(rows, blocks)
        if start == rows:
            return rows
        rows = min((start // size) * size for size in page_sizes)


class KVManager:
    def __init__(self, pools: dict[str, PagedKVConfig], labels: tuple[KVLabel, ...], reserve_max_seq_len: bool = False,
                 prefix_cache: bool = True, snapshot_interval: int = SNAPSHOT_INTERVAL) -> None:
        self.pools = {name: Pool(cfg) for name, cfg in pools.items()}
        #: a hybrid's prompt keeps its state at every multiple of this many rows (and at its
        #: last shareable page boundary): where a later prompt sharing its prefix may resume
        self.snapshot_interval = snapshot_interval
        self.reserve_max_seq_len = reserve_max_seq_len
        self.prefix_cache = prefix_cache
        self.prefix_queries = 0
        self.prefix_hit_tokens = 0
        self.labels = {lab.name: lab for lab in labels}
        self.requests: dict[str, RequestKV] = {}
        self.footprint_overruns = 0
        #: the debug checks, only while debugging (`debug`)
        self.checker: LayoutChecker | None = LayoutChecker() if debug_asserts_enabled() else None

    @property
    def debug(self) -> bool:
        return self.checker is not None

    @debug.setter
    def debug(self, on: bool) -> None:
        if on != self.debug:
            self.checker = LayoutChecker() if on else None

    # -- intake -------------------------------------------------------------------------

    def ingest_request(self, req: NewRequest) -> RequestKV:
        """Compute each label's footprint once, from the layout and the clamped caps."""
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id!r} is already in the KV manager")
        states: dict[str, LabelState] = {}
        for name, layout in req.kv_layout.items():
            lab = self.labels.get(name)
            if lab is None:
                raise ValueError(f"layout names undeclared KV label {name!r}")
            page_size = self.pools[lab.pool].config.page_size
            fp = label_footprint(layout, req.loop_caps, page_size, lab.window)
            states[name] = LabelState(lab, layout, fp, page_size,
                                      row_keys=leading_keys(layout) if lab.keys else (),
                                      key_pages=prompt_pages(layout, page_size) if lab.keys else [],
                                      key_parent=self.pools[lab.pool].index.root(name))
        kv = RequestKV(req.request_id, dict(req.loop_caps), dict(req.kv_configs), states,
                       blocks=_merged_blocks(bidirectional_blocks(layout) for layout in req.kv_layout.values()))
        keyed = self._keyed_attention(kv)
        if keyed is not None and any(self._is_state(st) for st in states.values()):
            kv.snapshot_rows = state_snapshot_rows(keyed.layout, keyed.page_size, self.snapshot_interval)
        if self.reserve_max_seq_len:
            kv.extra = {name: max(0, max_seq_len_pages(pool.config)
                                  * sum(1 for s in states.values() if s.label.pool == name)
                                  - kv.footprint(name))
                        for name, pool in self.pools.items()}
        for cfg in kv.configs.values():
            for name, fp in cfg.footprints.items():
                if name in states and states[name].footprint != fp:
                    raise ValueError(f"label {name!r}: conductor footprint {fp} "
                                     f"!= worker footprint {states[name].footprint}")
        return kv

    def _is_state(self, st: LabelState) -> bool:
        return self.pools[st.label.pool].config.is_state

    def _keyed_attention(self, kv: RequestKV) -> LabelState | None:
        """The label whose prefix-cache chain names a hybrid's state snapshots: its keyed
        full-attention label (a page boundary there is a row of the prompt)."""
        return next((st for st in kv.labels.values() if st.row_keys and st.label.window is None
                     and not self._is_state(st)), None)

    def can_admit(self, kv: RequestKV) -> bool:
        """Its reservation, less the pages it will share from the prefix cache, fits the
        pages neither held nor reserved (cached pages it shares are not free for it)."""
        self._plan_hits(kv)
        for name, p in self.pools.items():
            shared = [page for label, hits in kv.hits.items() if kv.labels[label].label.pool == name
                      for _, page in hits]
            revived = sum(1 for page in shared if p.refs.get(page, 0) == 0)
            # a state snapshot is copied into the request's own slot (its footprint), so it
            # spares nothing: it only must not be a page someone else counts on
            spared = 0 if p.config.is_state else len(shared)
            if p.available - revived - p.reserved < kv.reservation(name) - spared:
                return False
        return True

    def fits_at_all(self, kv: RequestKV) -> bool:
        return all(kv.reservation(name) <= p.config.num_pages for name, p in self.pools.items())

    def _plan_hits(self, kv: RequestKV) -> None:
        """Longest cached prefix every label the prompt writes shares. Rows computed once
        feed every such label, so one that cannot share (not keyed, a rows span) means no
        hit; a label the prompt does not write (no spans: a depth decoder's scratch, rewritten
        every frame) holds no prompt rows to share and does not stand in the way.
        A full-attention label needs every page before the hit point; a windowed label only
        those covering the window's rows before it (`hit_pages`), the earlier ones may be
        evicted: its footprint is then the walk's from the hit on (`label_footprint`).
        The last prompt row is always recomputed: its logits pick the first token."""
        kv.hits, kv.hit_rows = {}, 0
        for st in kv.labels.values():
            st.footprint = st.full_footprint
        written = {name: st for name, st in kv.labels.items() if st.layout.span_rows}
        # A hybrid's state labels share no pages: a hit resumes from the state snapshot taken
        # at the hit's row, which the keyed attention label's chain names (`take_snapshots`)
        states = {name: st for name, st in written.items() if self._is_state(st)}
        written = {name: st for name, st in written.items() if name not in states}
        keyed = self._keyed_attention(kv) if states else None
        if (not self.prefix_cache or not written or not all(st.row_keys for st in written.values())
                or (states and keyed is None)):
            return
        walks = {}
        for name, st in written.items():
            index = self.pools[st.label.pool].index
            walks[name] = index.walk(st.key_pages[: shareable_count(st.layout, st.page_size)], index.root(name))

        # evicted pages along each walk, as prefix counts: a hit needs none in its pages
        gaps = {name: list(accumulate((page is None for _, page in walk), initial=0)) for name, walk in walks.items()}

        def covered(name: str, rows: int) -> bool:
            first, end = hit_pages(written[name].page_size, written[name].label.window, rows)
            return end <= len(walks[name]) and gaps[name][end] == gaps[name][first]

        def snapshots(rows: int) -> dict[str, tuple[int, int]] | None:
            if keyed is None:
                return {}
            return self._snapshots_at(states, walks[keyed.label.name][rows // keyed.page_size - 1][0])

        rows = min(len(w) * written[n].page_size for n, w in walks.items())
        snaps: dict[str, tuple[int, int]] | None = {}
        while rows > 0:
            aligned = _whole_blocks(min((rows // st.page_size) * st.page_size for st in written.values()),
                                    kv.blocks, [st.page_size for st in written.values()])
            if aligned != rows:
                rows = aligned
            elif all(covered(n, rows) for n in written) and (snaps := snapshots(rows)) is not None:
                break
            else:
                rows -= 1
        if rows <= 0 or snaps is None:
            return
        for name, st in written.items():
            first, end = hit_pages(st.page_size, st.label.window, rows)
            kv.hits[name] = [(entry, page) for entry, page in walks[name][first:end] if page is not None]
            st.footprint = label_footprint(st.layout, kv.caps, st.page_size, st.label.window, rows)
        for name, hit in snaps.items():
            kv.hits[name] = [hit]
        kv.hit_rows = rows

    def _snapshots_at(self, states: dict[str, LabelState], entry: int) -> dict[str, tuple[int, int]] | None:
        """(entry, page) of each state label's snapshot taken where the attention chain's
        entry `entry` ends; None where one of them has none."""
        found = {}
        for name, st in states.items():
            index = self.pools[st.label.pool].index
            match = index.match([(entry,)], index.root(name))
            if not match:
                return None
            found[name] = match[0]
        return found

    def admit(self, kv: RequestKV) -> int:
        """Reserve the footprint (what this request may take later is set aside now) and
        attach its prefix-cache hits; returns the rows it need not compute."""
        for name, pool in self.pools.items():
            pool.reserved += kv.reservation(name)
        self.requests[kv.request_id] = kv
        if any(st.row_keys for st in kv.labels.values()):
            self.prefix_queries += 1
        for name, hits in kv.hits.items():
            st = kv.labels[name]
            pool = self.pools[st.label.pool]
            if pool.config.is_state:  # a snapshot: held until the runner copies it into the request's slot
                (_, page), = hits
                pool.hold(page)
                kv.holds.append((pool.config.name, page))
                kv.restores[name] = page
                st.rows = kv.hit_rows
                if self.checker is not None:
                    self.checker.shared(kv, st, kv.hit_rows)
                continue
            for entry, page in hits:
                pool.hold(page)
                st.pages.append(page)
                pool.reserved -= 1  # a held page within the footprint is no longer reserved
                st.key_parent = entry
            st.first_page, st.keyed_pages = hit_pages(st.page_size, st.label.window, kv.hit_rows)
            st.rows = kv.hit_rows
            if self.checker is not None:
                self.checker.shared(kv, st, kv.hit_rows)
        self.prefix_hit_tokens += kv.hit_rows
        self._check_conservation()
        return kv.hit_rows

    # -- the step ----------------------------------------------------------------------

    def reserve_rows(self, request_id: str, label: str, n: int) -> list[int]:
        """Make sure pages exist for the next `n` rows; returns the label's live pages.

        Rows are written by the forward before `commit` advances the count, so pages are
        taken here, one `_alloc` per page boundary crossed."""
        kv = self.requests[request_id]
        st = kv.labels[label]
        need = pages_for(st.rows + n, st.page_size) - st.first_page
        while len(st.pages) < need:
            st.pages.append(self._alloc(kv, st))
        if self.checker is not None:
            self.checker.held(kv, st)
        return st.pages

    def _alloc(self, kv: RequestKV, st: LabelState) -> int:
        pool = self.pools[st.label.pool]
        held = len(st.pages) + 1
        if held > st.footprint:
            # A page past the footprint comes only from pages nobody has reserved: the
            # requests that declared their pages truthfully keep every one of them.
            unreserved = pool.available - pool.reserved
            if not st.overrun_logged:
                st.overrun_logged = True
                self.footprint_overruns += 1
                log.error(
                    "KV footprint overrun: request %s label %r takes page %d past its footprint of %d "
                    "(layout under-states what it writes; %s)", kv.request_id, st.label.name, held, st.footprint,
                    "served from unreserved pages" if unreserved > 0 else "no unreserved page: the request fails",
                )
            if unreserved <= 0:
                raise FootprintOverrun(f"request {kv.request_id} label {st.label.name!r} needs page {held} past its "
                                       f"footprint of {st.footprint}, and every free page of pool "
                                       f"{pool.config.name!r} is reserved by other requests")
        else:
            pool.reserved -= 1  # this page was set aside at admission
        page = pool.take()
        pool.peak_used = max(pool.peak_used, pool.used)
        return page

    def commit(self, request_id: str, label: str, n: int, loop: str | None = None) -> None:
        """Advance the label by `n` rows written this step; `loop` names the loop when the
        rows are growth (None while committing spans). Then apply window retention."""
        kv = self.requests[request_id]
        st = kv.labels[label]
        if self.checker is not None:
            self.checker.commit(kv, st, n, loop)
        st.rows += n
        if st.row_keys and self.prefix_cache:
            self._index_full_pages(st)
        if st.label.window is not None:
            self._retain(kv, st, st.label.window)
        self._check_conservation()

    def _index_full_pages(self, st: LabelState) -> None:
        """Key every page that is now full of declared row keys (`prompt_pages`), chained from
        the first row."""
        index = self.pools[st.label.pool].index
        while (st.keyed_pages < len(st.key_pages) and (st.keyed_pages + 1) * st.page_size <= st.rows
               and st.keyed_pages >= st.first_page):
            i = st.keyed_pages
            st.key_parent = index.insert(st.key_parent, st.key_pages[i], st.pages[i - st.first_page])
            st.keyed_pages += 1

    def _retain(self, kv: RequestKV, st: LabelState, window: int) -> None:
        """Release pages wholly behind the label's `window`; drop them from its page list so
        the footprint check compares live pages with the windowed footprint."""
        first_kept = max(0, st.rows - window) // st.page_size
        while st.first_page < first_kept and st.pages:
            self._release(st, st.pages.pop(0))
            st.first_page += 1

    def drop_scratch(self, request_id: str, label: str) -> None:
        """After a non-committing step wrote rows past the committed ones (a probe,
        rejected drafts), return the pages that hold no committed row."""
        kv = self.requests[request_id]
        st = kv.labels[label]
        if self.checker is not None:
            self.checker.scratch(kv, st)
        keep = pages_for(st.rows, st.page_size) - st.first_page
        while len(st.pages) > keep:
            self._release(st, st.pages.pop())
        self._check_conservation()

    def _release(self, st: LabelState, page: int) -> None:
        pool = self.pools[st.label.pool]
        pool.drop(page)
        # A page within the footprint goes back to this request's reservation; one taken
        # past it (an overrun) was never reserved.
        if len(st.pages) < st.footprint:
            pool.reserved += 1

    # -- state snapshots (hybrid models' prefix cache) ------------------------------------

    def end_restores(self, request_id: str) -> None:
        """The runner copied the request's snapshots into its slots: let them go (they stay
        cached for the next prompt that shares the prefix)."""
        kv = self.requests[request_id]
        for pool, page in kv.holds:
            self.pools[pool].drop(page)
        kv.holds.clear()
        kv.restores.clear()
        self._check_conservation()

    def take_snapshots(self, request_id: str) -> list[tuple[str, int, int]]:
        """After a commit: where the request's prompt rows reached one of its snapshot rows,
        a copy of each state label's slot is due; returns (pool, its slot, the snapshot's
        page) for the runner to copy now. A snapshot takes only a page nobody has reserved
        (it never costs a request its footprint), is indexed under the keyed attention
        label's chain at that row, and is at once evictable like any cached page. None where
        the prefix is already snapshotted, the cache is off or no page is spare."""
        kv = self.requests[request_id]
        keyed = self._keyed_attention(kv)
        if not self.prefix_cache or keyed is None or not kv.snapshot_rows:
            return []
        copies = []
        for name, st in kv.labels.items():
            if not self._is_state(st) or st.rows not in kv.snapshot_rows or not st.pages:
                continue
            if keyed.keyed_pages * keyed.page_size != st.rows or keyed.keyed_pages < 1:
                continue  # its attention pages are not all indexed up to here (a shared page)
            pool = self.pools[st.label.pool]
            root = pool.index.root(name)
            if pool.index.match([(keyed.key_parent,)], root) or pool.available - pool.reserved <= 0:
                continue
            page = pool.take()
            pool.index.insert(root, (keyed.key_parent,), page)
            pool.drop(page)  # indexed, held by nobody: evictable
            pool.peak_used = max(pool.peak_used, pool.used)
            copies.append((pool.config.name, st.pages[0], page))
        self._check_conservation()
        return copies

    # -- removal -------------------------------------------------------------------------

    def remove(self, request_id: str, ran_to_caps: bool = False) -> int:
        """Return every page the request holds and its unused reservation; pages released."""
        kv = self.requests.pop(request_id, None)
        if kv is None:
            return 0
        if self.checker is not None:
            self.checker.removed(kv, ran_to_caps)
        released = 0
        for st in kv.labels.values():
            released += len(st.pages)
            while st.pages:
                self._release(st, st.pages.pop())
            # What the request never took of its footprint is unreserved too.
            self.pools[st.label.pool].reserved -= st.footprint
        for name, extra in kv.extra.items():
            self.pools[name].reserved -= extra
        for pool, page in kv.holds:
            self.pools[pool].drop(page)
        kv.holds.clear()
        self._check_conservation()
        return released

    # -- accounting ----------------------------------------------------------------------

    def stats(self) -> list[PoolStats]:
        return [p.stats() for p in self.pools.values()]

    @contextmanager
    def untracked(self) -> Iterator[None]:
        """Requests run inside leave no trace: nothing enters the prefix cache, and its
        query counter and the pools' peaks are as before (the worker's warm-up)."""
        caching, queries = self.prefix_cache, self.prefix_queries
        peaks = {name: pool.peak_used for name, pool in self.pools.items()}
        self.prefix_cache = False
        try:
            yield
        finally:
            self.prefix_cache, self.prefix_queries = caching, queries
            for name, pool in self.pools.items():
                pool.peak_used = peaks[name]
        if self.used_pages():
            raise RuntimeError(f"{self.used_pages()} KV pages left behind by untracked requests")

    def used_pages(self) -> int:
        return sum(p.used for p in self.pools.values())

    def _check_conservation(self) -> None:
        """Under the debug checks, every page is exactly one of free, cached or held."""
        if self.checker is not None:
            self.checker.conservation(self.pools, self.requests.values())
