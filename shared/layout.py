"""KV layout types: what a request declares, before it runs, about the rows it will write.

These are the contract of DESIGN.md section 3. Every type is a msgspec Struct so it travels
in `NewRequest` as-is and is validated on construction (msgspec runs `__post_init__`
on decode too), so a malformed layout fails at the boundary, not deep in the KV manager.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from shared.pages import ceil_div, pages_for

#: bytes per element of each float KV dtype a pool may hold (the one table; specs import it)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: every KV dtype: the float ones, and int8 (each head's values quantized, and its scale)
KV_DTYPES = (*DTYPE_BYTES, "int8")
#: bytes of the float32 scale stored after each (row, KV head) vector of an int8 pool
INT8_SCALE_BYTES = 4


def kv_head_bytes(dtype: str, head_dim: int) -> int:
    """Bytes one (row, KV head) vector of K or V takes in a `dtype` pool: head_dim values,
    and in an int8 pool its float32 scale too (so pool sizing and footprints count it)."""
    if dtype == "int8":
        return head_dim + INT8_SCALE_BYTES
    return head_dim * DTYPE_BYTES[dtype]


class KVLabel(msgspec.Struct, frozen=True):
    """One named stream of KV rows living in a paged pool.

    `keys=True` lets `ids` spans of this label be keyed in the prefix cache; `window`
    is a sliding window in rows (pages wholly behind it are released); `grows_on` names
    the loop that appends rows to it.
    """

    name: str
    pool: str
    keys: bool = False
    window: int | None = None
    grows_on: str | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.pool:
            raise ValueError("KVLabel needs a name and a pool")
        if self.window is not None and self.window < 1:
            raise ValueError(f"KVLabel {self.name!r}: window must be >= 1, got {self.window}")


class Span(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """A run of committed rows. `ids` spans are keyable (the ids determine the KV);
    `rows` spans are never keyed by ids (their ids, if any, do not determine the KV).

    A rows span may carry a content `key` the data worker computed from the input itself
    (an image's bytes and its preprocessing settings): only such a rows span may be shared
    by the prefix cache, and every key after it chains through it. Placeholder ids never
    key anything.

    `bidirectional`: the span's rows attend to each other both ways in prefill (Gemma 3's
    image tokens), so a row may need rows after it: the engine never ends a prefill chunk
    or a prefix-cache hit inside it, and adjacent such spans form one block (transformers'
    block is a maximal run). A trailing defaulted field, so frames written without it
    (four-element arrays) decode as before, as False."""

    kind: Literal["ids", "rows"]
    length: int
    token_ids: tuple[int, ...] = ()
    key: str = ""
    bidirectional: bool = False

    def __post_init__(self) -> None:
        if self.length < 0:
            raise ValueError(f"Span length must be >= 0, got {self.length}")
        if self.kind == "ids" and len(self.token_ids) != self.length:
            raise ValueError("an ids span's length must equal its number of token ids")
        if self.kind == "rows" and self.token_ids:
            raise ValueError("a rows span carries no token ids")
        if self.kind == "ids" and self.key:
            raise ValueError("an ids span is keyed by its ids; a content key is for rows spans")

    @classmethod
    def ids(cls, token_ids: list[int] | tuple[int, ...]) -> Span:
        ids = tuple(int(t) for t in token_ids)
        return cls("ids", len(ids), ids)

    @classmethod
    def rows(cls, n: int, key: str = "", bidirectional: bool = False) -> Span:
        return cls("rows", int(n), (), key, bidirectional)

    @property
    def keyable(self) -> bool:
        return self.kind == "ids" or bool(self.key)

    def row_keys(self) -> tuple[int, ...]:
        """What keys each row in the prefix cache: an ids span's ids; for a keyed rows span
        one negative number drawn from its content key (no token id is negative, so an
        image's rows never alias text), the same for each row: a page's place in its
        chain already says which rows of the span it holds."""
        if self.kind == "ids":
            return self.token_ids
        if not self.key:
            raise ValueError("an unkeyed rows span has no row keys")
        digest = hashlib.blake2b(self.key.encode(), digest_size=8).digest()
        return (-1 - (int.from_bytes(digest, "little") >> 1),) * self.length


class LabelLayout(msgspec.Struct, frozen=True, omit_defaults=True):
    """What one label of one request writes: committed spans in order, rows a
    non-committing step writes (`scratch`), and rows appended per loop iteration."""

    spans: tuple[Span, ...] = ()
    scratch: int = 0
    growth: dict[str, int] = {}

    def __post_init__(self) -> None:
        if self.scratch < 0:
            raise ValueError(f"LabelLayout scratch must be >= 0, got {self.scratch}")
        for loop, rows in self.growth.items():
            if rows < 0:
                raise ValueError(f"LabelLayout growth[{loop!r}] must be >= 0, got {rows}")

    @property
    def span_rows(self) -> int:
        return sum(s.length for s in self.spans)

    def check_loops(self, loops: set[str] | frozenset[str]) -> None:
        """Refuse growth on a loop the model's graph does not have."""
        unknown = sorted(set(self.growth) - set(loops))
        if unknown:
            raise ValueError(f"LabelLayout grows on unknown loop(s) {unknown}; known: {sorted(loops)}")


class PagedKVConfig(msgspec.Struct, frozen=True):
    """A paged KV pool: pages `[num_pages, 2, page_size, kv_heads, head_dim]` per layer.

    A state pool (`state_floats` > 0: linear attention's recurrent state) holds instead one
    request's fixed-size state per page ("slot"): `state_floats` float32 values per layer.
    Its `page_size` is its `max_seq_len`, so a label living there takes exactly one slot
    whatever its rows (the footprint formula gives 1), and admission, reservation,
    release and the counters are the paged pools' own."""

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    num_pages: int
    max_seq_len: int
    state_floats: int = 0

    def __post_init__(self) -> None:
        for field in ("num_layers", "kv_heads", "head_dim", "page_size", "max_seq_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"PagedKVConfig {self.name!r}: {field} must be >= 1")
        if self.num_pages < 0:
            raise ValueError(f"PagedKVConfig {self.name!r}: num_pages must be >= 0")
        if self.state_floats < 0 or (self.state_floats and self.page_size != self.max_seq_len):
            raise ValueError(f"PagedKVConfig {self.name!r}: a state pool's page is a whole sequence "
                             f"(page_size {self.page_size} must equal max_seq_len {self.max_seq_len})")

    @property
    def is_state(self) -> bool:
        return self.state_floats > 0

    @property
    def bytes_per_page(self) -> int:
        if self.state_floats:
            return self.num_layers * self.state_floats * 4
        return self.num_layers * 2 * self.page_size * self.kv_heads * kv_head_bytes(self.dtype, self.head_dim)


class KVReqConfig(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the conductor tells a worker about one pool for one request: the labels of
    that pool the request opens (possibly none) and their footprints in pages."""

    pool: str
    page_size: int
    footprints: dict[str, int] = {}

    @property
    def total_pages(self) -> int:
        return sum(self.footprints.values())


class ProcessPromptOutput(msgspec.Struct):
    """What `process_prompt` returns: the model's input tensors, one layout per label the
    request opens, and free-form metadata (e.g. prompt length for usage)."""

    new_input_tensors: dict
    kv_layout: dict[str, LabelLayout]
    metadata: dict = {}


def pages_in(start: int, end: int, page_size: int) -> int:
    """Pages touched by rows [start, end)."""
    if end <= start:
        return 0
    return ceil_div(end, page_size) - start // page_size


def label_footprint(
    layout: LabelLayout, caps: dict[str, int], page_size: int, window: int | None = None, hit: int = 0
) -> int:
    """The most pages a label can hold at once over a walk that runs every loop to its cap.

    The walk commits each span, then `growth[l]` rows per iteration of each loop; after
    every commit a non-committing step may write `scratch` rows past the end, and retention
    then releases pages wholly behind the window. Without a window that peak is the formula
    `ceil((spans + scratch + sum(growth * cap)) / page_size)`; with one it is the largest
    count of pages from the first row kept before a commit to the end of its scratch.

    `hit`: the first rows came from the prefix cache (page-aligned): the walk starts there,
    a windowed label holding only the pages from `hit - window` on (`hit_pages`).
    """
    grown = sum(rows * caps.get(loop, 0) for loop, rows in layout.growth.items())
    total = layout.span_rows + grown
    if window is None:
        return pages_for(total + layout.scratch, page_size)
    # a probe may run before any commit
    peak = pages_in(max(0, hit - window) if hit else 0, hit + layout.scratch, page_size)
    start = 0
    for length in commit_sizes(layout, caps):
        end = start + length
        if end > hit:
            kept = max(0, max(start, hit) - window)
            peak = max(peak, pages_in(kept, end + layout.scratch, page_size))
        start = end
    return peak


def hit_pages(page_size: int, window: int | None, hit: int) -> tuple[int, int]:
    """The label pages [first, end) a prefix-cache hit of `hit` rows (page-aligned) takes:
    every page before it, or for a windowed label only those covering its last `window`
    rows (the first may lie partly behind the window; pages wholly behind it are never
    needed: retention would release them)."""
    end = hit // page_size
    return (max(0, hit - window) // page_size if window is not None else 0), end


def commit_sizes(layout: LabelLayout, caps: dict[str, int]):
    """Yield the commit sizes of the walk that runs every loop to its cap, in order."""
    for span in layout.spans:
        if span.length:
            yield span.length
    for loop, rows in layout.growth.items():
        if rows:
            for _ in range(caps.get(loop, 0)):
                yield rows


def bidirectional_blocks(layout: LabelLayout) -> tuple[tuple[int, int], ...]:
    """The row ranges [start, end) of the layout's bidirectional blocks, in order: each a
    maximal run of adjacent `bidirectional` spans (empty ones skipped)."""
    blocks: list[tuple[int, int]] = []
    row = 0
    for span in layout.spans:
        if span.bidirectional and span.length:
            if blocks and blocks[-1][1] == row:
                blocks[-1] = (blocks[-1][0], row + span.length)
            else:
                blocks.append((row, row + span.length))
        row += span.length
    return tuple(blocks)


def block_boundary(rows: int, blocks: tuple[tuple[int, int], ...]) -> int:
    """`rows` if no block has rows on both sides of it, else the start of the block it
    cuts (the most rows of a prefix that leaves every block whole)."""
    for start, end in blocks:
        if start < rows < end:
            return start
    return rows


# ---- the prefix walk: which prompt pages the prefix cache holds and may share ----------


def leading_keys(layout: LabelLayout) -> tuple[int, ...]:
    """The row keys (`Span.row_keys`) of the layout's leading keyable spans (`ids`, and
    `rows` with a content key): the part a prefix key can cover. An unkeyed rows span ends
    it: nothing after it may be shared."""
    keys: list[int] = []
    for span in layout.spans:
        if not span.keyable:
            break
        keys.extend(span.row_keys())
    return tuple(keys)


def prompt_pages(layout: LabelLayout, page_size: int) -> list[tuple[int, ...]]:
    """The row keys of each full page of the layout's leading keyable spans, in order: the
    pages a worker's prefix index holds once the request's prompt is computed."""
    keys = leading_keys(layout)
    return [keys[i * page_size : (i + 1) * page_size] for i in range(len(keys) // page_size)]


def shareable_count(layout: LabelLayout, page_size: int) -> int:
    """How many leading `prompt_pages` a request may take from the prefix cache: never the
    page holding its last prompt row (its logits pick the first token, so it is computed)."""
    return min(len(leading_keys(layout)), layout.span_rows - 1) // page_size


def prefix_chain(pages: list[tuple[int, ...]]) -> list[int]:
    """One key per page naming its row keys and every page before it (a hash chain): equal
    leading keys mean an equal prefix, up to hash collisions, which can only make the
    conductor's estimate wrong (the worker's index compares exact ids)."""
    parent, chain = 0, []
    for page in pages:
        parent = hash((parent, page))
        chain.append(parent)
    return chain
