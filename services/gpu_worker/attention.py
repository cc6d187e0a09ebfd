"""Paged attention over FlashInfer's page layout on the CPU: decode rows through a C kernel
that reads the pages in place (`cpu_kernels`, where they build), else torch.

Pages are `[num_pages, 2, page_size, kv_heads, head_dim]` per layer; a request's KV is the
pages in `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, the last one filled to
`kv_last_page_len[b]`. `AttnMetadata` is built once per step and shared by every layer,
so layers do no Python work per request beyond one SDPA call per prefill chunk; all decode
rows of a step go through one kernel call (or, on the torch path, one batched SDPA call
over a gathered copy of their pages).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from services.gpu_worker import cpu_kernels
from shared.pages import pages_for


def _bf16_kernels() -> tuple | None:
    """(`mstar_write_kv_bf16`, `mstar_paged_decode_bf16`): the bfloat16-page variants of
    the float32 kernels (kernels/paged_attention.c), same arguments; None where the
    kernels are not built (or an older build lacks them)."""
    lib = cpu_kernels.library()
    return None if lib is None else _bf16_functions(lib)


@functools.cache
def _bf16_functions(lib: ctypes.CDLL) -> tuple | None:
    """`lib`'s two bfloat16-page kernels with their argument types declared (once per library)."""
    try:
        write, decode = lib.mstar_write_kv_bf16, lib.mstar_paged_decode_bf16
    except AttributeError:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    write.restype = None
    write.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64]
    decode.restype = ctypes.c_int
    decode.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr,
                       ptr, i64]
    return write, decode


def _kernel_pages(cache: torch.Tensor) -> int | None:
    """Which C kernels take `cache`'s pages: 0 float32, 1 bfloat16, None (torch's path)."""
    if cache.device.type != "cpu" or not cache.is_contiguous():
        return None
    if cache.dtype == torch.float32:
        return 0
    if cache.dtype == torch.bfloat16 and _bf16_kernels() is not None:
        return 1
    return None


class AttnRows(NamedTuple):
    """One request's rows of one label in a step."""

    pages: list[int]  # its live pages, in order
    first_page: int  # the label page index of pages[0] (pages before it were released behind the window)
    cached: int  # rows already in KV before this step
    new: int  # rows this step writes
    decode: bool  # a decode entry (its last token, and any speculative drafts)


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
    mask: torch.Tensor | None  # bool [q, kv_len] or None when plain causal (no cached rows)


@dataclass
class AttnMetadata:
    slot_pages: torch.Tensor  # long [T]: page each new row is written to
    slot_offsets: torch.Tensor  # long [T]: row inside that page
    #: long [B]: rows of T that are single-token decodes; or long [B, Q] when some decode
    #: entries carry speculative drafts (Q rows each, short entries padded with their last)
    decode_rows: torch.Tensor | None = None
    decode_pages: torch.Tensor | None = None  # long [B, max_pages] (padded with page 0)
    decode_mask: torch.Tensor | None = None  # bool [B, 1, 1 or Q, max_pages * page_size]
    decode_keep: torch.Tensor | None = None  # long [N]: with [B, Q] rows, the real ones of B * Q
    decode_out: torch.Tensor | None = None  # long [N]: the rows of T they are
    #: long [4, N] per decode query row (the kernel's view): its row of T, its entry (row of
    #: decode_pages), and the held rows [lo, hi) it sees
    decode_query: torch.Tensor | None = None
    #: long [B, 5] per decode entry: first row held, rows held, rows cached, rows new, row of T
    decode_info: torch.Tensor | None = None
    window: int | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # FlashInfer-layout view of the same batch, for backends that take it directly.
    kv_indptr: torch.Tensor | None = None
    kv_indices: torch.Tensor | None = None
    kv_last_page_len: torch.Tensor | None = None
    qo_indptr: torch.Tensor | None = None  # int32 [B + 1]: each request's rows of T
    #: a planned FlashInfer wrapper (CUDA); when set, attention runs through it
    wrapper: object | None = None

    def to(self, device: torch.device | str) -> AttnMetadata:
        """The same metadata with every tensor on `device` (the CUDA path)."""
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in vars(self).items()}
        moved["prefills"] = [PrefillChunk(c.q_start, c.q_end, c.pages.to(device), c.kv_len,
                                          None if c.mask is None else c.mask.to(device))
                             for c in self.prefills]
        return AttnMetadata(**moved)


def bottom_right_causal_mask(q_len: int, kv_len: int) -> torch.Tensor:
    """Query i of the last q_len rows of kv_len keys sees keys j <= kv_len - q_len + i."""
    i = torch.arange(q_len).unsqueeze(1)
    j = torch.arange(kv_len).unsqueeze(0)
    return j <= (kv_len - q_len) + i


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Key at absolute row k is visible to the query at row q when k <= q and, with a
    sliding window W, k > q - W (transformers' convention: W keys including itself)."""
    mask = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    if window is not None:
        mask &= k_pos.unsqueeze(-2) > q_pos.unsqueeze(-1) - window
    return mask


def build_metadata(
    rows: list[AttnRows], page_size: int, window: int | None = None, flashinfer: bool = True
) -> AttnMetadata:
    """Build one step's metadata for one label.

    `rows` holds one `AttnRows` per request, in batch order, decode entries first.
    `flashinfer`: also build the CSR view FlashInfer plans from (the CPU path has no use
    for it). This runs once per label per step, so it makes few tensors: a decode step's
    per-call cost is most of the null model's per-token time. The torch path's decode
    fields (rows, mask) are derived on first use (`torch_decode_fields`).
    """
    slot_pages: list[int] = []
    slot_offsets: list[int] = []
    indptr = [0]
    qo_indptr = [0]
    indices: list[int] = []
    last_lens: list[int] = []
    decode_pages: list[list[int]] = []
    decode_info: list[tuple[int, int, int, int, int]] = []  # (first row held, rows held, first query row, queries, t)
    query: list[list[int]] = [[], [], [], []]  # per decode query row: row of T, entry, lo, hi
    prefills: list[PrefillChunk] = []
    t = 0
    for pages, first_page, cached, new, is_decode in rows:
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
        if flashinfer:
            indices.extend(used)
            indptr.append(len(indices))
            last_lens.append(kv_len - (n_pages - 1) * page_size)
        if is_decode:
            decode_pages.append(used)
            decode_info.append((first_row, kv_len, cached, new, t))
            for i in range(new):  # query i sits at row cached + i and sees the held rows up to it
                query[0].append(t + i)
                query[1].append(len(decode_pages) - 1)
                query[2].append(0 if window is None else max(0, cached + i - window - first_row + 1))
                query[3].append(kv_len - (new - 1 - i))
        else:
            if first_row == 0 and cached == 0 and window is None:
                mask = None  # plain causal: torch's fast path
            else:
                q_pos = torch.arange(cached, cached + new)
                k_pos = torch.arange(first_row, first_row + kv_len)
                mask = window_mask(q_pos, k_pos, window)
            prefills.append(PrefillChunk(t, t + new, torch.tensor(used, dtype=torch.long), kv_len, mask))
        t += new
        qo_indptr.append(t)
    csr = (indptr, indices, last_lens, qo_indptr) if flashinfer else None
    return _assemble(slot_pages, slot_offsets, prefills, window, decode_pages, decode_info, query, csr)


def _assemble(slot_pages: list[int], slot_offsets: list[int], prefills: list[PrefillChunk], window: int | None,
              decode_pages: list[list[int]], decode_info: list[tuple[int, int, int, int, int]],
              query: list[list[int]], csr: tuple[list[int], list[int], list[int], list[int]] | None) -> AttnMetadata:
    """The tensors of `build_metadata`, from the lists its loop gathered.

    Apart from the loop so that the loop reads as one pass over the rows; this runs once
    per call, not per row. One tensor holds all of the step's int64 fields (views into
    it): each tensor made from a Python list has a fixed cost, and this runs per label
    per step. `csr` is FlashInfer's (indptr, indices, last page lengths, query indptr),
    None on the CPU path.
    """
    n_slots, n_query = len(slot_pages), len(query[0])
    flat = slot_pages + slot_offsets
    width = max((len(p) for p in decode_pages), default=0)
    if decode_pages:
        for col in query:
            flat += col
        for p in decode_pages:
            flat += p
            flat += [0] * (width - len(p))  # pad: page 0, masked
        for info in decode_info:
            flat += info
    ints = torch.from_numpy(np.array(flat, dtype=np.int64))
    meta = AttnMetadata(slot_pages=ints[:n_slots], slot_offsets=ints[n_slots : 2 * n_slots], prefills=prefills,
                        window=window)
    if csr is not None:
        indptr, indices, last_lens, qo_indptr = csr
        meta.kv_indptr = torch.tensor(indptr, dtype=torch.int32)
        meta.kv_indices = torch.tensor(indices, dtype=torch.int32)
        meta.kv_last_page_len = torch.tensor(last_lens, dtype=torch.int32)
        meta.qo_indptr = torch.tensor(qo_indptr, dtype=torch.int32)
    if decode_pages:
        b, at = len(decode_pages), 2 * n_slots
        meta.decode_query = ints[at : at + 4 * n_query].view(4, n_query)
        at += 4 * n_query
        meta.decode_pages = ints[at : at + b * width].view(b, width)
        meta.decode_info = ints[at + b * width :].view(b, 5)
    return meta


def torch_decode_fields(meta: AttnMetadata, page_size: int) -> None:
    """The torch path's view of the decode entries (rows of T, key mask; for entries of
    several rows also which padded rows are real), from `decode_info`; once per step, on
    the first layer that needs it."""
    info, window = meta.decode_info, meta.window
    width = meta.decode_pages.shape[1] * page_size
    q = int(info[:, 3].max())
    if q == 1:
        j = torch.arange(width, device=info.device).unsqueeze(0)
        mask = j < info[:, 1:2]  # only rows the live pages hold
        if window is not None:
            mask &= (info[:, 0:1] + j) > info[:, 2:3] - window
        meta.decode_rows = info[:, 4].contiguous()
        meta.decode_mask = mask[:, None, None, :]
    else:
        _multi_row_decode(meta, info, q, width, window)


def _multi_row_decode(meta: AttnMetadata, info: torch.Tensor, q: int, width: int, window: int | None) -> None:
    """Decode entries of several rows (the last token and its speculative drafts) as one
    batched attention: entry b's query i (i < its rows) sits at row `cached + i` and sees
    the held rows up to it; shorter entries are padded to `q` queries with their last row
    (computed, then dropped)."""
    first, held, cached, new, t = (info[:, c : c + 1] for c in range(5))
    i = torch.arange(q, device=info.device).unsqueeze(0)  # [1, Q]
    real = i < new  # [B, Q]
    ii = torch.minimum(i, new - 1)
    visible = held - (new - 1 - ii)  # keys held up to and including query ii's own row
    j = torch.arange(width, device=info.device).view(1, 1, -1)
    mask = j < visible.unsqueeze(-1)  # [B, Q, L]
    if window is not None:
        mask &= (first.unsqueeze(-1) + j) > (cached + ii).unsqueeze(-1) - window
    meta.decode_rows = t + ii
    meta.decode_mask = mask[:, None]
    meta.decode_keep = real.reshape(-1).nonzero().squeeze(1)
    meta.decode_out = meta.decode_rows[real]


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> None:
    """Write this step's new K/V rows into their pages. cache: [P, 2, ps, H, D]. Float32
    rows into float32 or bfloat16 pages go through a C kernel (bfloat16: rounded to nearest
    even, as `.to(torch.bfloat16)`), others through torch's indexing."""
    kind = _kernel_pages(cache)
    if (kind is not None and torch.float32 == k.dtype == v.dtype
            and k.shape[0] == meta.slot_pages.shape[0] == meta.slot_offsets.shape[0]
            and _rows_contiguous(k) and _rows_contiguous(v)
            and meta.slot_pages.dtype == meta.slot_offsets.dtype == torch.long
            and meta.slot_pages.is_contiguous() and meta.slot_offsets.is_contiguous()):
        kernel = cpu_kernels.write_kv() if kind == 0 else _bf16_kernels()[0]
        if kernel is not None:
            kernel(cache.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), meta.slot_pages.data_ptr(),
                   meta.slot_offsets.data_ptr(), k.shape[0], k.shape[1] * k.shape[2], cache.shape[2])
            return
    cache[meta.slot_pages, 0, meta.slot_offsets] = k.to(cache.dtype)  # a bfloat16 pool under float32 compute
    cache[meta.slot_pages, 1, meta.slot_offsets] = v.to(cache.dtype)


def _rows_contiguous(x: torch.Tensor) -> bool:
    """[T, H, D] whose every row is H * D contiguous floats (rows may be strided)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def paged_attention(
    q: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], attending over each request's pages (after write_kv).
    `softcap`: scores become tanh(s / softcap) * softcap before the softmax (Gemma 2)."""
    if meta.wrapper is not None:
        return meta.wrapper.run(q, cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    page_size = cache.shape[2]
    h, d = cache.shape[-2], cache.shape[-1]
    keys, values = cache.select(1, 0), cache.select(1, 1)  # [P, ps, H, D] views
    if meta.decode_query is not None and softcap is None and _decode_kernel(q, cache, meta, scale, out) is not None:
        if not meta.prefills:
            return out
    elif meta.decode_info is not None or meta.decode_rows is not None:
        if meta.decode_rows is None:
            torch_decode_fields(meta, page_size)
        b, width = meta.decode_pages.shape
        # index_select copies whole pages (contiguous [ps, H, D] blocks) into a contiguous
        # result, so the reshape is a view; advanced indexing on the strided K view is slower.
        flat = meta.decode_pages.view(-1)
        # (a KV pool in another dtype than q's, e.g. float16 pages under float32 compute, is
        # read into q's dtype: the C decode kernels take float32 and bfloat16 pages only)
        k = keys.index_select(0, flat).view(b, width * page_size, h, d).transpose(1, 2).to(q.dtype)
        v = values.index_select(0, flat).view(b, width * page_size, h, d).transpose(1, 2).to(q.dtype)
        if meta.decode_rows.dim() == 2:
            out[meta.decode_out] = _multi_row_decode_attention(q, k, v, meta, scale, softcap)
        else:
            hq = q.shape[1]
            every_row = meta.decode_rows.shape[0] == q.shape[0]  # a step of decodes only
            qd = q if every_row else q[meta.decode_rows]  # [B, Hq, D]
            # The query heads sharing a KV head go in as that head's query block ([B, Hkv, G, D]
            # against [B, Hkv, L, D]): one GEMM per KV head, with fewer GQA copies than SDPA's
            # expansion of K and V to every query head.
            o = _sdpa(qd.reshape(b, h, hq // h, d), k, v, scale, softcap, attn_mask=meta.decode_mask)
            o = o.reshape(b, hq, d)
            if every_row:
                return o
            out[meta.decode_rows] = o
    for chunk in meta.prefills:
        k = keys.index_select(0, chunk.pages).view(-1, h, d)[: chunk.kv_len].transpose(0, 1).unsqueeze(0).to(q.dtype)
        v = values.index_select(0, chunk.pages).view(-1, h, d)[: chunk.kv_len].transpose(0, 1).unsqueeze(0).to(q.dtype)
        qp = q[chunk.q_start : chunk.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        if chunk.mask is None:
            o = _sdpa(qp, k, v, scale, softcap, is_causal=True, enable_gqa=True)
        else:
            o = _sdpa(qp, k, v, scale, softcap, attn_mask=chunk.mask, enable_gqa=True)
        out[chunk.q_start : chunk.q_end] = o.squeeze(0).transpose(0, 1)
    return out


def _decode_kernel(q: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata, scale: float,
                   out: torch.Tensor) -> torch.Tensor | None:
    """Every decode query row through the C kernel, into `out` (returned); None (nothing
    written) where it does not apply: no kernel built, not float32 queries on float32 or
    bfloat16 pages on the CPU, or a layout it does not take (q's heads must be contiguous
    rows of head_dim; the cache contiguous). The convention of every CPU kernel wrapper: the
    result, or None for the torch path."""
    kind = _kernel_pages(cache)
    if kind is None or q.dtype != torch.float32:
        return None
    kernel = cpu_kernels.paged_decode() if kind == 0 else _bf16_kernels()[1]
    hq, d = q.shape[1], q.shape[2]
    if (kernel is None or q.stride(2) != 1 or q.stride(1) != d or not cache.is_contiguous()
            or hq > 128 or hq % cache.shape[3]):
        return None
    dq = meta.decode_query
    n = dq.shape[1]
    pages = meta.decode_pages
    keys = pages.shape[1] * cache.shape[2]
    scratch = torch.empty(hq * keys, dtype=torch.float32)
    base, step = dq.data_ptr(), dq.stride(0) * dq.element_size()
    rc = kernel(q.data_ptr(), q.stride(0), cache.data_ptr(), pages.data_ptr(), pages.shape[1],
                base, base + step, base + 2 * step, base + 3 * step, n, hq, cache.shape[3], d, cache.shape[2],
                scale, out.data_ptr(), scratch.data_ptr(), keys)
    if rc != 0:
        raise RuntimeError(f"paged_decode kernel refused the batch (code {rc})")
    return out


def _multi_row_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata, scale: float,
                                softcap: float | None = None) -> torch.Tensor:
    """Decode entries of Q rows each in one SDPA call: per KV head, its G query heads' Q
    rows form one [G * Q] query block against the entry's keys (the mask tiled G times);
    returns the real rows, in `meta.decode_out` order."""
    b, qn = meta.decode_rows.shape
    h, d = k.shape[1], k.shape[-1]
    hq = q.shape[1]
    g = hq // h
    qd = q[meta.decode_rows.reshape(-1)].view(b, qn, h, g, d).permute(0, 2, 3, 1, 4).reshape(b, h, g * qn, d)
    o = _sdpa(qd, k, v, scale, softcap, attn_mask=meta.decode_mask.repeat(1, 1, g, 1))
    o = o.view(b, h, g, qn, d).permute(0, 3, 1, 2, 4).reshape(b * qn, hq, d)
    return o[meta.decode_keep]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None, *,
          attn_mask: torch.Tensor | None = None, is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """torch's SDPA, or with soft-capped scores transformers' eager attention op for op
    (SDPA has no soft-capping): scores * scale, tanh-capped, masked, float32 softmax, @ v."""
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


def cross_metadata(rows: list[CrossRows], page_size: int) -> AttnMetadata:
    """Metadata for attention over rows written earlier, with no causal order: every query
    of a request sees all of its `kv_len` rows. `rows` holds, per request in batch order,
    (its pages, rows held, query rows this step). Nothing is written (no slots); a request
    with one query row goes through the batched decode path, others as a chunk."""
    empty = torch.zeros(0, dtype=torch.long)
    indptr, indices, last_lens = [0], [], []
    decode_rows, decode_pages, decode_lens = [], [], []
    prefills: list[PrefillChunk] = []
    t = 0
    for pages, kv_len, q in rows:
        n_pages = pages_for(kv_len, page_size)
        used = list(pages[:n_pages])
        indices.extend(used)
        indptr.append(len(indices))
        last_lens.append(kv_len - (n_pages - 1) * page_size)
        if q == 1:
            decode_rows.append(t)
            decode_pages.append(used)
            decode_lens.append(kv_len)
        else:
            mask = torch.ones(q, kv_len, dtype=torch.bool)
            prefills.append(PrefillChunk(t, t + q, torch.tensor(used, dtype=torch.long), kv_len, mask))
        t += q
    meta = AttnMetadata(slot_pages=empty, slot_offsets=empty, prefills=prefills,
                        kv_indptr=torch.tensor(indptr, dtype=torch.int32),
                        kv_indices=torch.tensor(indices, dtype=torch.int32),
                        kv_last_page_len=torch.tensor(last_lens, dtype=torch.int32))
    if decode_rows:
        width = max(len(p) for p in decode_pages)
        padded = torch.zeros(len(decode_pages), width, dtype=torch.long)
        for b, p in enumerate(decode_pages):
            padded[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        j = torch.arange(width * page_size).unsqueeze(0)
        mask = j < torch.tensor(decode_lens).unsqueeze(1)
        meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long)
        meta.decode_pages = padded
        meta.decode_mask = mask[:, None, None, :]
    return meta
