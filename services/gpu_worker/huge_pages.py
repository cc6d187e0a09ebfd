"""The decode step's hot memory on 2 MB pages: the layers' weights and the KV pools.

A CPU decode step streams every layer's weights (96.6 MB for the default model) and each
running request's K/V pages through the cores once. On 4 KB pages that is ~25,000 pages a
step, far past what the TLB holds, so the stream keeps stopping on page walks; on 2 MB pages
it is ~50. Measured on the default model (2 cores, one request's decode steps in process,
4 alternating pairs), 2 MB pages took a step from 4.88 to 4.72 ms at 128 tokens of context
and from 7.65 to 6.90 ms at 2,048, where the K/V pages add 47 MB to the stream.

Linux gives a mapping transparent huge pages where it asks for them
(`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, the common default, or `always`)
and where its ranges are 2 MB aligned, so `anonymous` over-maps by 2 MB, starts the tensor
on a 2 MB boundary and advises `MADV_HUGEPAGE`. The weights, which `prepare` leaves in many
small tensors (each below the 2 MB a huge page needs), are copied into one such arena
(`place`), tensor by tensor: the same bytes, so every result is bitwise what it was.

Where the kernel gives no huge pages (`never`, fragmented memory) this is plain anonymous
memory, as before. Memory: the KV pools are still faulted lazily, now 2 MB at a time (at
most 2 MB more per layer than the pages written), and the arena's copy replaces the
tensors it copies. `MSTAR_HUGE_PAGES=0` turns both off (to compare).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable

import torch

HUGE = 1 << 21
#: the byte alignment of each tensor inside the arena (a cache line; the kernels need 64)
ALIGN = 64


def enabled() -> bool:
    return os.environ.get("MSTAR_HUGE_PAGES", "1").lower() not in ("0", "false", "no") and hasattr(
        mmap, "MADV_HUGEPAGE")


def anonymous(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed memory (uint8), faulted on first write; with huge pages on, it
    starts on a 2 MB boundary in a mapping advised `MADV_HUGEPAGE`. The tensor keeps the
    mapping alive (frombuffer holds a reference to the buffer)."""
    huge = enabled() and nbytes >= HUGE
    buf = mmap.mmap(-1, nbytes + (HUGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(buf, dtype=torch.uint8)
    if not huge:
        return base
    buf.madvise(mmap.MADV_HUGEPAGE)
    start = -base.data_ptr() % HUGE
    return base[start : start + nbytes]


def place(slots: Iterable[tuple[object, str]]) -> int:
    """Copy the tensor at each (owner, attribute) into one huge-page arena and point the
    attribute at its copy; the bytes placed (0 when huge pages are off or nothing is given).
    Call it before anything keeps a pointer to these tensors (the C decode stack)."""
    found = [(owner, name, t) for owner, name in slots
             if isinstance(t := getattr(owner, name, None), torch.Tensor) and t.device.type == "cpu" and t.numel()]
    if not enabled() or not found:
        return 0
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, _, t in found]
    arena = anonymous(sum(sizes))
    offset = 0
    for (owner, name, t), size in zip(found, sizes):
        copy = arena[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        copy.copy_(t)
        setattr(owner, name, copy)
        offset += size
    return offset


def hot_slots(model: torch.nn.Module, *extra: object) -> list[tuple[object, str]]:
    """The (owner, attribute) of every tensor a decode step streams: those each module (and
    each of `extra`, e.g. an LM head that is not a module) names in its `hot_tensors`."""
    owners = list({id(o): o for o in (*model.modules(), *extra)}.values())  # a head may be a module too
    return [(o, name) for o in owners for name in getattr(o, "hot_tensors", ())]
