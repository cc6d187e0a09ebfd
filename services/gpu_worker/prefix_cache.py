"""Host-side prefix index over full pages of keyed `ids` spans.

A page is keyed by (its parent's entry id, the page's token ids): a chain from the
label's first row, so a key names the page's ids *and everything before it*. Keys are
exact tuples compared by the dict (no hash collision can alias two prefixes), and they
come only from the ids a layout declares: nothing a client sends can choose a key.

Entries form a tree (each label its own root, `root`), and an entry may outlive its page:
a sliding-window label needs only the pages of the last `window` rows before a hit, so a
page behind them may be evicted while the entries after it, and their pages, stay
(`walk` reports an entry without a page as such). An entry with neither a page nor a
child is dropped at once, so every leaf holds a page.

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
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # entry id -> its key
        self._children: dict[int, int] = {}  # entry id -> entries chained from it
        self._page_of: dict[int, int] = {}  # entry id -> page (absent: evicted, the entry kept)
        self._id_of_page: dict[int, int] = {}
        self._roots: dict[str, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # indexed pages nobody holds
        self._next_id = ROOT + 1

    def __len__(self) -> int:
        return len(self._page_of)

    def root(self, label: str) -> int:
        """The entry a label's chains start from: labels sharing a pool never alias."""
        if label not in self._roots:
            self._roots[label] = self._next_id
            self._next_id += 1
        return self._roots[label]

    def is_indexed(self, page: int) -> bool:
        return page in self._id_of_page

    def walk(self, pages: list[tuple[int, ...]], root: int = ROOT) -> list[tuple[int, int | None]]:
        """(entry id, page or None where it was evicted) of the longest chain of entries
        that starts `pages` (the ids of each page a request may share: its
        `shared.layout.prompt_pages`, cut to `shareable_count`)."""
        found: list[tuple[int, int | None]] = []
        parent = root
        for page_ids in pages:
            entry = self._entries.get((parent, page_ids))
            if entry is None:
                break
            found.append((entry, self._page_of.get(entry)))
            parent = entry
        return found

    def match(self, pages: list[tuple[int, ...]], root: int = ROOT) -> list[tuple[int, int]]:
        """(entry id, page) of the longest chain of cached pages that starts `pages`."""
        found = []
        for entry, page in self.walk(pages, root):
            if page is None:
                break
            found.append((entry, page))
        return found

    def insert(self, parent: int, page_ids: tuple[int, ...], page: int) -> int:
        """Index `page` under its chain key; returns the entry id the chain continues from
        (an existing one when another page already holds the same prefix)."""
        key = (parent, page_ids)
        entry = self._entries.get(key)
        if entry is not None:
            if entry not in self._page_of and page not in self._id_of_page:  # its page was evicted: refill
                self._page_of[entry] = page
                self._id_of_page[page] = entry
            return entry
        if page in self._id_of_page:  # already indexed under another key: leave it
            return self._id_of_page[page]
        entry = self._next_id
        self._next_id += 1
        self._entries[key] = entry
        self._key_of[entry] = key
        self._children[parent] = self._children.get(parent, 0) + 1
        self._page_of[entry] = page
        self._id_of_page[page] = entry
        return entry

    def evict_lru(self) -> int | None:
        """Drop the least recently released evictable page from the index; return it. Its
        entry stays while entries chain from it."""
        if not self.evictable:
            return None
        page, _ = self.evictable.popitem(last=False)
        entry = self._id_of_page.pop(page)
        del self._page_of[entry]
        self._prune(entry)
        return page

    def _prune(self, entry: int) -> None:
        """Drop `entry` and then each ancestor left with neither a page nor a child."""
        while entry in self._key_of and entry not in self._page_of and not self._children.get(entry):
            key = self._key_of.pop(entry)
            del self._entries[key]
            self._children.pop(entry, None)
            parent = key[0]
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
            entry = parent
