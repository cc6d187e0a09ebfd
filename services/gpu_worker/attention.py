"""Paged attention over FlashInfer's page layout on the CPU: decode rows and plain causal
prefill chunks through C kernels that read the pages in place (`cpu_kernels`, where they
build), else torch.

Pages are `[num_pages, 2, page_size, kv_heads, head_dim]` per layer; a request's KV is the
pages in `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, the last one filled to
`kv_last_page_len[b]`. `AttnMetadata` is built once per step and shared by every layer,
by the builder of the backend the runner picked (`BUILDERS`: the C kernels, torch, or
FlashInfer on CUDA), with that backend's view of the batch only, so layers do no Python
work per request beyond one SDPA call per prefill chunk; all decode rows of a step go
through one kernel call (or, on the torch path, one batched SDPA call over a gathered copy
of their pages).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from services.gpu_worker import cpu_kernels
from shared.layout import INT8_SCALE_BYTES
from shared.pages import pages_for


def _bf16_kernels() -> tuple[Any, Any] | None:
    """(`mstar_write_kv_bf16`, `mstar_paged_decode_bf16`): the bfloat16-page variants of
    the float32 kernels (kernels/paged_attention.c), same arguments; None where the
    kernels are not built (or an older build lacks them)."""
    lib = cpu_kernels.library()
    return None if lib is None else _page_functions(lib, "bf16")


def _i8_kernels() -> tuple[Any, Any] | None:
    """(`mstar_write_kv_i8`, `mstar_paged_decode_i8`): the int8-page kernels
    (kernels/paged_attention.c; the write takes head_dim as one more argument before
    page_size); None where the kernels are not built."""
    lib = cpu_kernels.library()
    return None if lib is None else _page_functions(lib, "i8")


@functools.cache
def _page_functions(lib: ctypes.CDLL, kind: str) -> tuple[Any, Any] | None:
    """`lib`'s write and decode kernels for `kind` pages ("bf16", "i8") with their argument
    types declared (once per library and kind)."""
    try:
        write, decode = getattr(lib, f"mstar_write_kv_{kind}"), getattr(lib, f"mstar_paged_decode_{kind}")
    except AttributeError:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    write.restype = None
    write.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, *([i64] if kind == "i8" else []), i64]
    decode.restype = ctypes.c_int
    decode.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr,
                       ptr, i64]
    return write, decode


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a pool holds: its last dim, less the scale's bytes in an int8 pool
    ([P, 2, ps, H, D + 4]: each head's D values, then its float32 scale)."""
    return cache.shape[-1] - INT8_SCALE_BYTES if cache.dtype == torch.int8 else cache.shape[-1]


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> int8 [..., D + 4]: symmetric per vector, scale = absmax / 127 (float32,
    stored in the last 4 bytes), q = round-half-even(x / scale) clamped to +-127; an all-zero
    vector gets scale 0. Why per (row, head) and not per 32-value block as llama.cpp's q8_0:
    one scale per head vector keeps a row's values one run of int8 the decode kernel widens
    16 at a time, and measured perplexity (bench/perplexity.py) stayed within the budget.
    The C write (`mstar_write_kv_i8`) stores the same bytes."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, x / scale, 0.0).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 [..., D + 4] (`quantize_kv`'s layout) -> [..., D] of `dtype`: q * scale in float32
    (how the C kernels read a value: the same bits), then cast."""
    d = x.shape[-1] - INT8_SCALE_BYTES
    scale = x[..., d:].contiguous().view(torch.float32)
    out = x[..., :d].float() * scale
    return out if dtype == torch.float32 else out.to(dtype)


def _read_pages(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered pages in the queries' dtype (int8 pages dequantized)."""
    return dequantize_kv(x, dtype) if x.dtype == torch.int8 else x.to(dtype)


def _kernel_pages(cache: torch.Tensor) -> int | None:
    """Which C kernels take `cache`'s pages: 0 float32, 1 bfloat16, 2 int8, None (torch's path)."""
    if cache.device.type != "cpu" or not cache.is_contiguous():
        return None
    if cache.dtype == torch.float32:
        return 0
    if cache.dtype == torch.bfloat16 and _bf16_kernels() is not None:
        return 1
    if cache.dtype == torch.int8 and _i8_kernels() is not None:
        return 2
    return None


class AttnRows(NamedTuple):
    """One request's rows of one label in a step."""

    pages: list[int]  # its live pages, in order
    first_page: int  # the label page index of pages[0] (pages before it were released behind the window)
    cached: int  # rows already in KV before this step
    new: int  # rows this step writes
    decode: bool  # a decode entry (its last token, and any speculative drafts)
    #: bidirectional blocks among the new rows, label row ranges [start, end): a query row
    #: of one also sees the block's rows after it (Gemma 3's image tokens in prefill)
    blocks: tuple[tuple[int, int], ...] = ()


class CrossRows(NamedTuple):
    """One request's rows of a label written earlier, read whole (cross attention)."""

    pages: list[int]
    held: int  # rows held
    queries: int  # query rows this step


@dataclass
class PrefillChunk:
    """Query rows [q_start, q_end) of one request, at the end of its `kv_len` keys."""

    q_start: int
    q_end: int
    pages: torch.Tensor  # int32 [n_pages]
    kv_len: int
    mask: torch.Tensor | None  # bool [q, kv_len] or None when plain causal (no cached rows), or not causal
    causal: bool = True  # False: every query row sees every held row (an encoder's attention)
    #: the rows see keys by the bottom-right causal rule under the metadata's window alone (no
    #: bidirectional blocks): the C prefill kernel computes that from q and kv_len, so `mask`
    #: is only the torch path's
    plain: bool = False
    #: (cached, first_row, window, blocks) of a plain chunk whose mask is built only if the
    #: torch path runs it (`attn_mask`): the kernel needs none, and a 2,048 x 4,096 mask
    #: costs ~10 ms a step
    lazy_mask: tuple | None = None
    #: the absolute row of the chunk's first live key (rows before it released behind a window)
    first_row: int = 0

    def attn_mask(self) -> torch.Tensor | None:
        """`mask`, made from `lazy_mask` at the first call that needs it."""
        if self.mask is None and self.lazy_mask is not None:
            cached, first_row, window, blocks = self.lazy_mask
            self.mask = window_mask(torch.arange(cached, cached + self.q_end - self.q_start),
                                    torch.arange(first_row, first_row + self.kv_len), window, blocks)
            self.lazy_mask = None
        return self.mask


@dataclass
class KernelDecode:
    """The C decode kernel's view of a step's decode entries (`kernels/paged_attention.c`)."""

    pages: torch.Tensor  # long [B, max_pages]: each entry's live pages (padded with page 0)
    #: long [4, N] per decode query row: its row of T, its entry (row of `pages`), and the
    #: held rows [lo, hi) it sees
    query: torch.Tensor


@dataclass
class TorchDecode:
    """The torch path's view of a step's decode entries: one batched SDPA call over their
    gathered pages, under a key mask."""

    pages: torch.Tensor  # long [B, max_pages] (padded with page 0, masked)
    #: long [B]: rows of T that are single-token decodes; or long [B, Q] when some decode
    #: entries carry speculative drafts (Q rows each, short entries padded with their last)
    rows: torch.Tensor
    mask: torch.Tensor  # bool [B, 1, 1 or Q, max_pages * page_size]
    keep: torch.Tensor | None = None  # long [N]: with [B, Q] rows, the real ones of B * Q
    out: torch.Tensor | None = None  # long [N]: the rows of T they are


@dataclass
class FlashInferView:
    """FlashInfer's CSR page table of the whole batch, and the wrapper planned from it."""

    kv_indptr: torch.Tensor  # int32 [B + 1]
    kv_indices: torch.Tensor  # int32: every request's live pages, in order
    kv_last_page_len: torch.Tensor  # int32 [B]
    qo_indptr: torch.Tensor  # int32 [B + 1]: each request's rows of T
    wrapper: Any = None  # the planned `BatchPrefillWithPagedKVCacheWrapper` (flashinfer is untyped)


@dataclass
class AttnMetadata:
    """One step's attention metadata for one label, shared by the label's layers: where the
    new rows go (slots), and the view of the batch that the backend which built it reads.
    `decode` is the kernel's or the torch path's; `flashinfer` is set by that backend alone
    (it takes every row, so no prefill chunks or decode view are built beside it)."""

    slot_pages: torch.Tensor  # long [T]: page each new row is written to
    slot_offsets: torch.Tensor  # long [T]: row inside that page
    window: int | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode: KernelDecode | TorchDecode | None = None
    flashinfer: FlashInferView | None = None

    def to(self, device: torch.device | str) -> AttnMetadata:
        """The same metadata with every tensor on `device` (the CUDA path)."""
        def move(view):
            if view is None:
                return None
            return type(view)(**{k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                                 for k, v in vars(view).items()})

        prefills = [PrefillChunk(c.q_start, c.q_end, c.pages.to(device), c.kv_len,
                                 None if (mask := c.attn_mask()) is None else mask.to(device), c.causal, c.plain)
                    for c in self.prefills]
        return AttnMetadata(self.slot_pages.to(device), self.slot_offsets.to(device), self.window, prefills,
                            move(self.decode), move(self.flashinfer))


def bottom_right_causal_mask(q_len: int, kv_len: int) -> torch.Tensor:
    """Query i of the last q_len rows of kv_len keys sees keys j <= kv_len - q_len + i."""
    i = torch.arange(q_len).unsqueeze(1)
    j = torch.arange(kv_len).unsqueeze(0)
    return j <= (kv_len - q_len) + i


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None,
                blocks: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """Key at absolute row k is visible to the query at row q when k <= q and, with a
    sliding window W, k > q - W (transformers' convention: W keys including itself).

    `blocks` (row ranges [start, end)): q and k in the same block see each other whatever
    their order, and the window still applies: transformers' Gemma 3 masks are
    OR(causal, same block) on full layers and AND(window, OR(causal, same block)) on
    sliding ones (`create_masks_for_vision_model`), so a block row sees every later row of
    its block but an earlier one only within the window."""
    mask = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    if blocks:
        qb, kb = block_ids(q_pos, blocks), block_ids(k_pos, blocks)
        mask |= (qb.unsqueeze(-1) == kb.unsqueeze(-2)) & (qb >= 0).unsqueeze(-1)
    if window is not None:
        mask &= k_pos.unsqueeze(-2) > q_pos.unsqueeze(-1) - window
    return mask


def block_ids(pos: torch.Tensor, blocks: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Each row's block (its index in `blocks`), -1 for rows in none."""
    out = torch.full(pos.shape, -1, dtype=torch.long)
    for i, (start, end) in enumerate(blocks):
        out[(pos >= start) & (pos < end)] = i
    return out


# -- the builders: one per backend -------------------------------------------------------


class _Step:
    """What one pass over a step's rows gathers, for a builder to turn into tensors."""

    __slots__ = ("chunk_pages", "csr", "entries", "prefills", "slot_offsets", "slot_pages")

    def __init__(self) -> None:
        self.slot_pages: list[int] = []
        self.slot_offsets: list[int] = []
        self.prefills: list[PrefillChunk] = []
        self.chunk_pages: list[list[int]] = []  # each prefill chunk's pages, as ints
        #: per decode entry: (its live pages, first row held, rows held, rows cached, rows new, row of T)
        self.entries: list[tuple[list[int], int, int, int, int, int]] = []
        #: FlashInfer's (indptr, indices, last page lengths, query indptr)
        self.csr: tuple[list[int], list[int], list[int], list[int]] = ([0], [], [], [0])


class MetadataBuilder:
    """Builds one step's `AttnMetadata` for one label, for one backend.

    The pass over the rows (slots, prefill chunks, decode entries) is shared; each backend
    makes only the view it reads (`_finish`). `rows` holds one `AttnRows` per request, in
    batch order, decode entries first. This runs once per label per step, so it makes few
    tensors: a decode step's per-call cost is most of the null model's per-token time.
    """

    name = ""
    #: whether the backend reads FlashInfer's CSR page table
    csr = False
    #: whether the backend's prefill chunks may go through the C prefill kernel (`PrefillChunk.plain`)
    plain_chunks = False

    def build(self, rows: list[AttnRows], page_size: int, window: int | None = None,
              causal: bool = True) -> AttnMetadata:
        """`causal=False`: every new row sees every row its request holds (an encoder's
        prompt, which runs whole; no decode entries)."""
        return self._finish(self._pass(rows, page_size, window, causal), page_size, window)

    def _pass(self, rows: list[AttnRows], page_size: int, window: int | None, causal: bool) -> _Step:
        step = _Step()
        slot_pages, slot_offsets, csr = step.slot_pages, step.slot_offsets, step.csr
        t = 0
        for row in rows:
            pages, first_page, cached, new, is_decode = row[:5]
            blocks = row[5] if len(row) > 5 else ()  # (plain 5-tuples are rows without blocks)
            if new == 1:
                slot_pages.append(pages[cached // page_size - first_page])
                slot_offsets.append(cached % page_size)
            else:
                slot_pages.extend(pages[r // page_size - first_page] for r in range(cached, cached + new))
                slot_offsets.extend(r % page_size for r in range(cached, cached + new))
            first_row = first_page * page_size
            kv_len = cached + new - first_row  # rows held in the live pages
            n_pages = pages_for(kv_len, page_size)
            used = pages[:n_pages]
            if self.csr:
                if blocks:
                    raise ValueError("FlashInfer's causal plan has no bidirectional blocks: build this step's "
                                     "metadata for torch")
                csr[1].extend(used)
                csr[0].append(len(csr[1]))
                csr[2].append(kv_len - (n_pages - 1) * page_size)
                csr[3].append(t + new)
            elif is_decode:
                step.entries.append((used, first_row, kv_len, cached, new, t))
            elif not causal:
                step.chunk_pages.append(used)
                step.prefills.append(PrefillChunk(t, t + new, torch.tensor(used, dtype=torch.long), kv_len, None,
                                                  False))
            elif first_row == 0 and cached == 0 and window is None and not blocks:
                step.chunk_pages.append(used)
                step.prefills.append(PrefillChunk(t, t + new, torch.tensor(used, dtype=torch.long), kv_len, None,
                                                  plain=self.plain_chunks))
            else:  # cached rows, a window or blocks: an explicit mask (else torch's plain causal fast path)
                chunk = PrefillChunk(t, t + new, torch.tensor(used, dtype=torch.long), kv_len, None,
                                     plain=self.plain_chunks and not blocks,
                                     lazy_mask=(cached, first_row, window, blocks), first_row=first_row)
                if not chunk.plain:
                    chunk.attn_mask()  # the torch path runs it: built with the metadata, once for every layer
                step.chunk_pages.append(used)
                step.prefills.append(chunk)
            t += new
        return step

    def _finish(self, step: _Step, page_size: int, window: int | None) -> AttnMetadata:
        raise NotImplementedError

    def cross(self, rows: list[CrossRows], page_size: int) -> AttnMetadata:
        """Metadata for attention over rows written earlier, with no causal order: every
        query of a request sees all of its held rows (the torch path's view on every
        backend: one query row per request goes through its batched decode, others as a
        chunk). Nothing is written (no slots)."""
        empty = torch.zeros(0, dtype=torch.long)
        prefills: list[PrefillChunk] = []
        decode_rows, decode_pages, decode_lens = [], [], []
        t = 0
        for pages, kv_len, q in rows:
            used = list(pages[: pages_for(kv_len, page_size)])
            if q == 1:
                decode_rows.append(t)
                decode_pages.append(used)
                decode_lens.append(kv_len)
            else:
                mask = torch.ones(q, kv_len, dtype=torch.bool)
                prefills.append(PrefillChunk(t, t + q, torch.tensor(used, dtype=torch.long), kv_len, mask))
            t += q
        meta = AttnMetadata(empty, empty, None, prefills)
        if decode_rows:
            padded = _padded(decode_pages)
            j = torch.arange(padded.shape[1] * page_size).unsqueeze(0)
            mask = j < torch.tensor(decode_lens).unsqueeze(1)
            meta.decode = TorchDecode(padded, torch.tensor(decode_rows, dtype=torch.long), mask[:, None, None, :])
        return meta


def _padded(pages: list[list[int]]) -> torch.Tensor:
    """long [B, max pages]: each entry's pages, padded with page 0 (masked by its users)."""
    width = max(len(p) for p in pages)
    return torch.tensor([p + [0] * (width - len(p)) for p in pages], dtype=torch.long)


class TorchBuilder(MetadataBuilder):
    """torch's SDPA: prefill chunks one call each, decode entries one batched call over
    their gathered pages under a key mask (entries of several rows padded to the longest)."""

    name = "torch"

    def _finish(self, step: _Step, page_size: int, window: int | None) -> AttnMetadata:
        meta = AttnMetadata(*_slots(step), window, step.prefills)
        if not step.entries:
            return meta
        pages = _padded([e[0] for e in step.entries])
        info = torch.tensor([e[1:] for e in step.entries], dtype=torch.long)  # [B, 5]
        width = pages.shape[1] * page_size
        q = int(info[:, 3].max())
        if q == 1:
            j = torch.arange(width).unsqueeze(0)
            mask = j < info[:, 1:2]  # only rows the live pages hold
            if window is not None:
                mask &= (info[:, 0:1] + j) > info[:, 2:3] - window
            meta.decode = TorchDecode(pages, info[:, 4].contiguous(), mask[:, None, None, :])
        else:
            meta.decode = _multi_row_decode(pages, info, q, width, window)
        return meta


def _multi_row_decode(pages: torch.Tensor, info: torch.Tensor, q: int, width: int,
                      window: int | None) -> TorchDecode:
    """Decode entries of several rows (the last token and its speculative drafts) as one
    batched attention: entry b's query i (i < its rows) sits at row `cached + i` and sees
    the held rows up to it; shorter entries are padded to `q` queries with their last row
    (computed, then dropped)."""
    first, held, cached, new, t = (info[:, c : c + 1] for c in range(5))
    i = torch.arange(q).unsqueeze(0)  # [1, Q]
    real = i < new  # [B, Q]
    ii = torch.minimum(i, new - 1)
    visible = held - (new - 1 - ii)  # keys held up to and including query ii's own row
    j = torch.arange(width).view(1, 1, -1)
    mask = j < visible.unsqueeze(-1)  # [B, Q, L]
    if window is not None:
        mask &= (first.unsqueeze(-1) + j) > (cached + ii).unsqueeze(-1) - window
    rows = t + ii
    return TorchDecode(pages, rows, mask[:, None], real.reshape(-1).nonzero().squeeze(1), rows[real])


class KernelBuilder(MetadataBuilder):
    """The C kernels (`cpu_kernels`): every decode query row in one kernel call that reads
    the pages in place; prefill chunks through the C prefill kernel where they are plain
    causal (else torch's SDPA). One int64 tensor holds all of the step's fields (views into
    it): each tensor made from a Python list has a fixed cost."""

    name = "kernel"
    plain_chunks = True

    def _finish(self, step: _Step, page_size: int, window: int | None) -> AttnMetadata:
        if not step.entries:
            n_slots = len(step.slot_pages)
            ints = torch.from_numpy(np.array(step.slot_pages + step.slot_offsets, dtype=np.int64))
            return AttnMetadata(ints[:n_slots], ints[n_slots:], window, step.prefills)
        host = _host_step(step, window)
        ints = torch.from_numpy(np.array(host.ints, dtype=np.int64))
        at, n_query = 2 * host.n_slots, host.n_query
        b, width = len(step.entries), host.width
        decode = KernelDecode(ints[host.pages_at : host.pages_at + b * width].view(b, width),
                              ints[at : at + 4 * n_query].view(4, n_query))
        return AttnMetadata(ints[: host.n_slots], ints[host.n_slots : at], window, step.prefills, decode)

    def host(self, rows: list[AttnRows], page_size: int, window: int | None = None) -> HostStep | None:
        """A step's metadata as `_finish` lays it out, as plain ints: what the C stack reads
        (modeling/decoder/cpu_stack.py), without the tensors, whose every op costs tens of
        microseconds with the caches cold from a step's weights. None where a prefill chunk
        is not one the C prefill kernel takes whole (`PrefillChunk.plain`)."""
        step = self._pass(rows, page_size, window, True)
        if not all(c.plain for c in step.prefills):
            return None
        return _host_step(step, window)


class HostStep(NamedTuple):
    """`KernelBuilder`'s int64 fields of a step, end to end in `ints`: slot pages [T], slot
    offsets [T], then per decode query row its row of T, its entry, and the held rows
    [lo, hi) it sees ([4, n_query]), then the entries' pages [B, width] from `pages_at`
    (padded with page 0, never read: hi bounds the keys), then per prompt chunk its first
    and end rows of T, its keys held, where its pages start after `chunk_pages_at` and the
    absolute row of its first key (the prefill kernel's `key_base`) ([n_chunks, 5] from
    `chunks_at`), then the chunks' pages from `chunk_pages_at`."""

    ints: list[int]
    n_slots: int
    n_query: int
    width: int
    pages_at: int
    n_chunks: int = 0
    chunks_at: int = 0
    chunk_pages_at: int = 0
    window: int = 0  # the label's sliding window (0: none), which the chunks' keys are under


def _host_step(step: _Step, window: int | None) -> HostStep:
    n_slots = len(step.slot_pages)
    flat = step.slot_pages + step.slot_offsets
    query: list[list[int]] = [[], [], [], []]  # per decode query row: row of T, entry, lo, hi
    width = max((len(e[0]) for e in step.entries), default=0)
    for b, (_, first_row, held, cached, new, t) in enumerate(step.entries):
        for i in range(new):  # query i sits at row cached + i and sees the held rows up to it
            query[0].append(t + i)
            query[1].append(b)
            query[2].append(0 if window is None else max(0, cached + i - window - first_row + 1))
            query[3].append(held - (new - 1 - i))
    n_query = len(query[0])
    for col in query:
        flat += col
    pages_at = len(flat)
    for e in step.entries:
        flat += e[0]
        flat += [0] * (width - len(e[0]))  # pad: page 0, never read (hi bounds the keys)
    if not step.prefills:
        return HostStep(flat, n_slots, n_query, width, pages_at, window=window or 0)
    chunks_at, at = len(flat), 0
    for chunk, pages in zip(step.prefills, step.chunk_pages):
        flat += (chunk.q_start, chunk.q_end, chunk.kv_len, at, chunk.first_row)
        at += len(pages)
    chunk_pages_at = len(flat)
    for pages in step.chunk_pages:
        flat += pages
    return HostStep(flat, n_slots, n_query, width, pages_at, len(step.prefills), chunks_at, chunk_pages_at,
                    window or 0)


class FlashInferBuilder(MetadataBuilder):
    """FlashInfer (CUDA): the CSR page table its wrapper plans from; the wrapper takes
    every row of the step, so no chunks or decode view are built."""

    name = "flashinfer"
    csr = True

    def _finish(self, step: _Step, page_size: int, window: int | None) -> AttnMetadata:
        indptr, indices, last_lens, qo_indptr = step.csr
        view = FlashInferView(*(torch.tensor(x, dtype=torch.int32) for x in (indptr, indices, last_lens, qo_indptr)))
        return AttnMetadata(*_slots(step), window, flashinfer=view)


def _slots(step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    ints = torch.from_numpy(np.array(step.slot_pages + step.slot_offsets, dtype=np.int64))
    n = len(step.slot_pages)
    return ints[:n], ints[n:]


BUILDERS: dict[str, MetadataBuilder] = {b.name: b for b in (TorchBuilder(), KernelBuilder(), FlashInferBuilder())}


def cpu_backend(cache_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype = torch.float32,
                softcap: float | None = None, heads: int = 1, kv_heads: int = 1) -> str:
    """The backend a CPU model's attention runs on: the C kernels where they are built and
    take the step (float32 queries on float32, bfloat16 or int8 pages, no soft-capping, at
    most 128 query heads in whole groups per KV head), else torch."""
    kind = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}.get(cache_dtype)
    built = cpu_kernels.library() is not None and (kind == 0 or (kind == 1 and _bf16_kernels() is not None)
                                                   or (kind == 2 and _i8_kernels() is not None))
    ok = built and compute_dtype == torch.float32 and softcap is None and heads <= 128 and heads % kv_heads == 0
    return "kernel" if ok else "torch"


def build_metadata(rows: list[AttnRows], page_size: int, window: int | None = None,
                   backend: str | None = None) -> AttnMetadata:
    """One step's metadata for one label on `backend` (None: `cpu_backend()`'s pick for
    float32)."""
    return BUILDERS[backend or cpu_backend()].build(rows, page_size, window)


def cross_metadata(rows: list[CrossRows], page_size: int) -> AttnMetadata:
    """`MetadataBuilder.cross`: every query of a request sees all of its held rows."""
    return BUILDERS["torch"].cross(rows, page_size)


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> None:
    """Write this step's new K/V rows into their pages. cache: [P, 2, ps, H, D] (int8:
    [P, 2, ps, H, D + 4], each head quantized, `quantize_kv`). Float32 rows into float32,
    bfloat16 or int8 pages go through a C kernel (bfloat16: rounded to nearest even, as
    `.to(torch.bfloat16)`; int8: `quantize_kv`'s bytes), others through torch's indexing."""
    kind = _kernel_pages(cache)
    if (kind is not None and torch.float32 == k.dtype == v.dtype
            and k.shape[0] == meta.slot_pages.shape[0] == meta.slot_offsets.shape[0]
            and _rows_contiguous(k) and _rows_contiguous(v)
            and meta.slot_pages.dtype == meta.slot_offsets.dtype == torch.long
            and meta.slot_pages.is_contiguous() and meta.slot_offsets.is_contiguous()):
        if kind == 2 and (i8 := _i8_kernels()) is not None:
            i8[0](cache.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), meta.slot_pages.data_ptr(),
                  meta.slot_offsets.data_ptr(), k.shape[0], k.shape[1] * k.shape[2], k.shape[2], cache.shape[2])
            return
        bf16 = _bf16_kernels()
        kernel = cpu_kernels.write_kv() if kind == 0 else None if bf16 is None or kind != 1 else bf16[0]
        if kernel is not None:
            kernel(cache.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), meta.slot_pages.data_ptr(),
                   meta.slot_offsets.data_ptr(), k.shape[0], k.shape[1] * k.shape[2], cache.shape[2])
            return
    if cache.dtype == torch.int8:
        k, v = quantize_kv(k), quantize_kv(v)
    cache[meta.slot_pages, 0, meta.slot_offsets] = k.to(cache.dtype)  # a bfloat16 pool under float32 compute
    cache[meta.slot_pages, 1, meta.slot_offsets] = v.to(cache.dtype)


def _rows_contiguous(x: torch.Tensor) -> bool:
    """[T, H, D] whose every row is H * D contiguous floats (rows may be strided)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def paged_attention(
    q: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata, scale: float, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], attending over each request's pages (after write_kv),
    on the backend whose builder made `meta`. `softcap`: scores become
    tanh(s / softcap) * softcap before the softmax (Gemma 2; not the C kernel's). `sinks`
    [Hq]: gpt-oss's attention sinks, one logit per query head that joins every row's softmax
    denominator and adds no value (torch's path and the C kernels; on CUDA the runner builds
    such a model's metadata for torch)."""
    if sinks is not None and meta.flashinfer is not None:
        raise ValueError("attention sinks are not FlashInfer's here: build this model's metadata for torch")
    if meta.flashinfer is not None:
        return meta.flashinfer.wrapper.run(q, cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    page_size = cache.shape[2]
    h, d = cache.shape[-2], cache.shape[-1]  # (an int8 pool's d counts each head's scale bytes)
    keys, values = cache.select(1, 0), cache.select(1, 1)  # [P, ps, H, D] views
    dec = meta.decode
    if isinstance(dec, KernelDecode):
        if softcap is not None:
            raise ValueError("the C decode kernel has no soft-capping: build this model's metadata for torch")
        _decode_kernel(q, cache, dec, scale, out, sinks)
        if not meta.prefills:
            return out
    elif dec is not None:
        b, width = dec.pages.shape
        # index_select copies whole pages (contiguous [ps, H, D] blocks) into a contiguous
        # result, so the reshape is a view; advanced indexing on the strided K view is slower.
        flat = dec.pages.view(-1)
        # (a KV pool in another dtype than q's, e.g. float16 pages under float32 compute, is
        # read into q's dtype, int8 pages dequantized)
        k = _read_pages(keys.index_select(0, flat).view(b, width * page_size, h, d), q.dtype).transpose(1, 2)
        v = _read_pages(values.index_select(0, flat).view(b, width * page_size, h, d), q.dtype).transpose(1, 2)
        if dec.rows.dim() == 2:
            out[dec.out] = _multi_row_decode_attention(q, k, v, dec, scale, softcap, sinks)
        else:
            hq = q.shape[1]
            every_row = dec.rows.shape[0] == q.shape[0]  # a step of decodes only
            qd = q if every_row else q[dec.rows]  # [B, Hq, D]
            # The query heads sharing a KV head go in as that head's query block ([B, Hkv, G, D]
            # against [B, Hkv, L, D]): one GEMM per KV head, with fewer GQA copies than SDPA's
            # expansion of K and V to every query head.
            qg = qd.reshape(b, h, hq // h, q.shape[2])
            if sinks is None:
                o = _sdpa(qg, k, v, scale, softcap, attn_mask=dec.mask)
            else:
                o = _decode_with_sinks(qg, k, v, dec.mask, scale, sinks.view(1, h, hq // h, 1))
            o = o.reshape(b, hq, q.shape[2])
            if every_row:
                return o
            out[dec.rows] = o
    _prefill_chunks(q, cache, meta, scale, softcap, out, sinks)
    return out


def _prefill_chunks(q: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata, scale: float, softcap: float | None,
                    out: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
    """Each prefill chunk's rows into `out`: through the C prefill kernel where it takes the
    chunk (`_prefill_kernel`: a 2,048-row prompt's attention there is several times torch's
    speed), else torch's SDPA over a gathered copy of the chunk's pages."""
    h, d = cache.shape[-2], cache.shape[-1]
    keys, values = cache.select(1, 0), cache.select(1, 1)  # [P, ps, H, D] views
    for chunk in meta.prefills:
        if softcap is None and (chunk.plain if chunk.causal else chunk.mask is None) and _prefill_kernel(
                q, cache, chunk, meta.window if chunk.causal else -1, scale, out, sinks):
            continue
        k = _read_pages(keys.index_select(0, chunk.pages).view(-1, h, d)[: chunk.kv_len], q.dtype)
        v = _read_pages(values.index_select(0, chunk.pages).view(-1, h, d)[: chunk.kv_len], q.dtype)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        qp = q[chunk.q_start : chunk.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        mask = chunk.attn_mask()
        sink = None if sinks is None else sinks.view(1, -1, 1, 1)
        if mask is None:
            o = _sdpa(qp, k, v, scale, softcap, is_causal=chunk.causal, enable_gqa=True, sinks=sink)
        else:
            o = _sdpa(qp, k, v, scale, softcap, attn_mask=mask, enable_gqa=True, sinks=sink)
        out[chunk.q_start : chunk.q_end] = o.squeeze(0).transpose(0, 1)


@functools.cache
def _prefill_function(lib: ctypes.CDLL, sinks: bool = False) -> Any | None:
    """`lib`'s `mstar_prefill_attention` (kernels/prefill_attention.c; `sinks`: its
    `_sinks` variant, one more pointer) with its argument types declared (once per library);
    None where an older build lacks it."""
    try:
        fn = lib.mstar_prefill_attention_sinks if sinks else lib.mstar_prefill_attention
    except AttributeError:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.restype = ctypes.c_int
    args: list[Any] = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, i64]
    fn.argtypes = [*args, ptr, i64] if sinks else args
    return fn


def _prefill_kernel(q: torch.Tensor, cache: torch.Tensor, chunk: PrefillChunk, window: int | None, scale: float,
                    out: torch.Tensor, sinks: torch.Tensor | None = None) -> bool:
    """One plain causal chunk (`chunk.plain`: bottom-right causal under `window`, no blocks),
    or a bidirectional one (an encoder's: `window` -1, every row sees every key), through the
    C prefill kernel, which reads its pages in place and splits the rows over the
    kernels' thread pool (flash attention, float32 arithmetic: within float32 rounding of
    SDPA, and the same bits on any thread count). False, with nothing written, where it does
    not take the chunk: no kernel built, pages not float32 or bfloat16 in one CPU block,
    queries not float32 rows of contiguous heads, or a shape the kernel refuses (head_dim not
    a multiple of 8 or over 256, more than 48 query heads per KV head). int8 pages are
    dequantized as the kernel packs each KV head's keys (`dequantize_kv`'s bits)."""
    lib = cpu_kernels.library()
    # always the `_sinks` entry (NULL sinks but gpt-oss's): it takes the chunk's first key row,
    # so a row's key blocks sit at absolute rows and its bits do not depend on how many pages
    # behind a sliding window were released before its chunk (or how its prompt was cut)
    fn = None if lib is None else _prefill_function(lib, True)
    kind = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}.get(cache.dtype)
    hq, d = q.shape[1], q.shape[2]
    if (fn is None or kind is None or cache.device.type != "cpu" or not cache.is_contiguous()
            or q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d or not out.is_contiguous()
            or chunk.pages.dtype != torch.long or not chunk.pages.is_contiguous()
            or (sinks is not None and not _c_floats(sinks, hq))):
        return False
    at = chunk.q_start * q.element_size()
    rc = fn(q.data_ptr() + at * q.stride(0), q.stride(0), cache.data_ptr(), kind, chunk.pages.data_ptr(),
            chunk.q_end - chunk.q_start, chunk.kv_len, hq, cache.shape[3], d, cache.shape[2], window or 0, scale,
            out.data_ptr() + at * hq * d, hq * d, None if sinks is None else sinks.data_ptr(), chunk.first_row)
    return rc == 0


def _c_floats(x: torch.Tensor, n: int) -> bool:
    """`x` is n contiguous float32 values on the CPU (what a kernel's sinks pointer reads)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and x.numel() == n


def _decode_kernel(q: torch.Tensor, cache: torch.Tensor, dec: KernelDecode, scale: float,
                   out: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every decode query row through the C kernel, into `out` (returned). The runner picked
    this backend for float32 queries on float32, bfloat16 or int8 pages (`cpu_backend`), so a
    call it cannot take is a bug, raised as such. `sinks`: `mstar_paged_decode_sinks`."""
    kind = _kernel_pages(cache)
    kernel = _decode_function(kind)
    hq, d = q.shape[1], q.shape[2]
    if sinks is not None:
        lib = cpu_kernels.library()
        with_sinks = None if lib is None or kind is None else _decode_sinks_function(lib)
        kernel = None if with_sinks is None or not _c_floats(sinks, hq) else functools.partial(with_sinks, kind)
    if kernel is None or q.dtype != torch.float32 or hq > 128 or hq % cache.shape[3]:
        raise RuntimeError(f"metadata built for the C decode kernel, which cannot take {q.dtype} queries of "
                           f"{hq} heads on {cache.dtype} pages of {cache.shape[3]} heads on {cache.device}")
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()  # the kernel reads each row's heads as contiguous head_dim blocks
    n = dec.query.shape[1]
    pages = dec.pages
    keys = pages.shape[1] * cache.shape[2]
    scratch = torch.empty(_decode_scratch(cpu_kernels.library())(n, hq, d, keys), dtype=torch.float32)
    base, step = dec.query.data_ptr(), dec.query.stride(0) * dec.query.element_size()
    rc = kernel(q.data_ptr(), q.stride(0), cache.data_ptr(), pages.data_ptr(), pages.shape[1],
                base, base + step, base + 2 * step, base + 3 * step, n, hq, cache.shape[3], d, cache.shape[2],
                scale, out.data_ptr(), scratch.data_ptr(), keys, *([] if sinks is None else [sinks.data_ptr()]))
    if rc != 0:
        raise RuntimeError(f"paged_decode kernel refused the batch (code {rc})")
    return out


def _decode_function(kind: int | None) -> Any:
    """The decode kernel of page kind `kind` (`_kernel_pages`), or None."""
    if kind == 0:
        return cpu_kernels.paged_decode()
    pair = _bf16_kernels() if kind == 1 else _i8_kernels() if kind == 2 else None
    return None if pair is None else pair[1]


@functools.cache
def _decode_sinks_function(lib: ctypes.CDLL) -> Any | None:
    """`mstar_paged_decode_sinks(kind, <mstar_paged_decode's arguments>, sinks)` with its
    argument types declared; None where an older build lacks it."""
    try:
        fn = lib.mstar_paged_decode_sinks
    except AttributeError:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.restype = ctypes.c_int
    fn.argtypes = [i64, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr,
                   i64, ptr]
    return fn


@functools.cache
def _decode_scratch(lib: ctypes.CDLL) -> Any:
    """`mstar_paged_decode_scratch(rows, hq, d, max_keys)`: the floats of scratch a decode call
    needs (a count per row, and a record per partition of its keys: the partition size is the
    kernel's, so the kernel says)."""
    fn = lib.mstar_paged_decode_scratch
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int64] * 4
    return fn


def _multi_row_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dec: TorchDecode, scale: float,
                                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode entries of Q rows each in one SDPA call: per KV head, its G query heads' Q
    rows form one [G * Q] query block against the entry's keys (the mask tiled G times);
    returns the real rows, in `dec.out` order."""
    b, qn = dec.rows.shape
    h, d = k.shape[1], k.shape[-1]
    hq = q.shape[1]
    g = hq // h
    qd = q[dec.rows.reshape(-1)].view(b, qn, h, g, d).permute(0, 2, 3, 1, 4).reshape(b, h, g * qn, d)
    # query block row g * Q + i is head h * G + g's row i: its sink is that head's
    sink = None if sinks is None else sinks.view(1, h, g, 1, 1).expand(1, h, g, qn, 1).reshape(1, h, g * qn, 1)
    o = _sdpa(qd, k, v, scale, softcap, attn_mask=dec.mask.repeat(1, 1, g, 1), sinks=sink)
    o = o.view(b, h, g, qn, d).permute(0, 3, 1, 2, 4).reshape(b * qn, hq, d)
    return o[dec.keep]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None, *,
          attn_mask: torch.Tensor | None = None, is_causal: bool = False, enable_gqa: bool = False,
          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """torch's SDPA, or with soft-capped scores or attention sinks transformers' eager
    attention op for op (SDPA has neither): scores * scale, tanh-capped, masked, float32
    softmax, @ v. `sinks` (broadcast to the scores' [..., rows, 1]): gpt-oss's eager op, a
    column of sink logits joined to the scores, the row max subtracted, softmax, the column
    dropped."""
    if sinks is not None:
        return _eager_with_sinks(q, k, v, scale, sinks, attn_mask, is_causal, enable_gqa)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if is_causal:
        attn_mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _decode_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                       sinks: torch.Tensor) -> torch.Tensor:
    """Single-row decode entries with sinks ([B, Hkv, G, D] against [B, Hkv, L, D] under mask
    [B, 1, 1, L]), each entry alone over its keys up to its last visible one: one batched call
    would run every entry at the longest entry's padded width, whose GEMM and softmax give
    other bits than the entry's own width, so a row would depend on its neighbours."""
    width = mask.shape[-1]
    ends = (width - mask.view(mask.shape[0], width).flip(-1).int().argmax(dim=1)).tolist()
    return torch.cat([_eager_with_sinks(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], scale, sinks,
                                        mask[i : i + 1, ..., :n], False, False) for i, n in enumerate(ends)])


def _eager_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor,
                      attn_mask: torch.Tensor | None, is_causal: bool, enable_gqa: bool) -> torch.Tensor:
    """transformers' gpt-oss `eager_attention_forward` (the implementation it runs with sinks:
    GptOssPreTrainedModel has no SDPA) on this path's shapes."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if is_causal:
        attn_mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    logits = torch.cat([s, sinks.to(s.dtype).expand(*s.shape[:-1], 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
