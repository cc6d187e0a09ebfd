"""Host-side prefix index over full pages of keyed `ids` spans.

A page is keyed by (its parent's entry id, the page's token ids): a chain from the
label's first row, so a key names the page's ids *and everything before it*. Keys are
exact tuples compared by the dict (no hash collision can alias two prefixes), and they
come only from the ids a layout declares: nothing a client sends can choose a key.

Pages whose last holder left stay indexed as *evictable*, in LRU order; they count as
free for allocation and are evicted only when no free page is left. A page some request
holds is never evictable, so it is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict

ROOT = 0


class PrefixIndex:
    def __init__(self) -> None:
        self._entries: dict[tuple[int, tuple[int, ...]], int] = {}
        self._page_of: dict[int, int] = {}  # entry id -> page
        self._entry_of_page: dict[int, tuple[int, tuple[int, ...]]] = {}  # page -> its key
        self._id_of_page: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # indexed pages nobody holds
        self._next_id = ROOT + 1

    def __len__(self) -> int:
        return len(self._page_of)

    def is_indexed(self, page: int) -> bool:
        return page in self._entry_of_page

    def match(self, pages: list[tuple[int, ...]]) -> list[tuple[int, int]]:
        """(entry id, page) of the longest chain of cached pages that starts `pages` (the
        ids of each page a request may share: its `shared.layout.prompt_pages`, cut to
        `shareable_count`)."""
        found = []
        parent = ROOT
        for page_ids in pages:
            entry = self._entries.get((parent, page_ids))
            if entry is None:
                break
            found.append((entry, self._page_of[entry]))
            parent = entry
        return found

    def insert(self, parent: int, page_ids: tuple[int, ...], page: int) -> int:
        """Index `page` under its chain key; returns the entry id the chain continues from
        (an existing one when another page already holds the same prefix)."""
        key = (parent, page_ids)
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        if page in self._entry_of_page:  # already indexed under another key: leave it
            return self._id_of_page[page]
        entry = self._next_id
        self._next_id += 1
        self._entries[key] = entry
        self._page_of[entry] = page
        self._entry_of_page[page] = key
        self._id_of_page[page] = entry
        return entry

    def evict_lru(self) -> int | None:
        """Drop the least recently released evictable page from the index; return it."""
        if not self.evictable:
            return None
        page, _ = self.evictable.popitem(last=False)
        key = self._entry_of_page.pop(page)
        entry = self._id_of_page.pop(page)
        del self._entries[key]
        del self._page_of[entry]
        return page
