"""The memory behind the paged KV pools.

On the CPU the pools are anonymous private mappings: the kernel hands out zeroed pages on
first write, so a pool sized for the whole machine costs resident memory only for the pages
requests have written (`torch.zeros` would touch, and keep resident, every byte at start-up:
most of an idle server's memory). The KV manager reuses pages given back first (last in,
first out), and the prefix cache keeps its pages within the most pages ever held at once
(kv_manager.Pool.take: past that it reuses its least recently used page before touching a
fresh one), so the resident KV follows the peak the traffic needed, not the pool's size.
Zero (not uninitialised) memory matters: attention masks unused rows, but a masked score
times a NaN left in an unwritten row would still be NaN.

Where the kernel gives transparent huge pages, the pools sit on 2 MB pages (huge_pages: a
decode step's walk over K/V pages then misses the TLB far less) and are faulted 2 MB at a
time, so the resident KV is at most 2 MB a layer past the peak. The address space is still
reserved up front, and `MSTAR_KV_PREFAULT=1` writes every page
at start-up instead, for a deployment that wants an out-of-memory to happen at boot rather
than under load. On an accelerator the pools are plain `torch.zeros` (device memory is
allocated whole either way).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os

import torch

from services.gpu_worker import huge_pages
from shared.cgroup import memory_available
from shared.layout import INT8_SCALE_BYTES


def prefault_requested() -> bool:
    return os.environ.get("MSTAR_KV_PREFAULT", "").lower() in ("1", "true", "yes")


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of `shape`; on the CPU backed by a lazily-faulted anonymous mapping
    (on 2 MB pages where the kernel gives them: huge_pages)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    t = huge_pages.anonymous(nbytes).view(dtype).view(shape)
    if prefault_requested():
        t.zero_()
    return t


def kv_cache(num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
             dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One [num_pages, 2 (K, V), page_size, kv_heads, head_dim] tensor per layer of a pool;
    int8: [..., head_dim + 4], each head's values then its float32 scale (inline, so a pool is
    still one tensor a layer and a page's rows one contiguous run; attention.quantize_kv)."""
    width = head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim
    return [zeroed_tensor((num_pages, 2, page_size, kv_heads, width), dtype, device) for _ in range(num_layers)]


def release_pools(caches: dict[str, list[torch.Tensor]]) -> int:
    """Give the pools' resident memory back while no page holds a request (after the
    warm-up, whose pages are free again): on 2 MB pages (huge_pages) its few rows keep 2 MB
    a layer resident, 60 MB for SmolLM2-135M's 30 layers, until traffic needs them.
    `MADV_DONTNEED` on the whole pages inside each CPU tensor (all from `zeroed_tensor`: a
    private anonymous mapping), which fault back in as zeros, as the pool started; no page's
    content outlives its request, so nothing is lost. Not with MSTAR_KV_PREFAULT (those
    pages are wanted resident). Returns the bytes released."""
    if prefault_requested():
        return 0
    libc, done, page = ctypes.CDLL(None, use_errno=True), 0, mmap.PAGESIZE
    for tensors in caches.values():
        for t in tensors:
            if t.device.type != "cpu" or not t.numel():
                continue
            a, n = t.data_ptr(), t.numel() * t.element_size()
            lo, hi = -(-a // page) * page, (a + n) // page * page
            if hi > lo and libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) == 0:
                done += hi - lo
    return done


#: madvise's "drop these pages" (Linux; the mmap module names it only from Python 3.8 on Linux)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def state_cache(num_layers: int, num_slots: int, state_floats: int, device: torch.device) -> list[torch.Tensor]:
    """One [num_slots, state_floats] float32 tensor per layer of a state pool (linear
    attention: each slot one request's convolution window and recurrent matrix; lazily
    faulted as the KV pages are, so an idle slot costs no resident memory)."""
    return [zeroed_tensor((num_slots, state_floats), torch.float32, device) for _ in range(num_layers)]


def available_memory_bytes(device: torch.device | None = None) -> int:
    """Free memory where the KV pools will live: the GPU's; on the CPU the host's
    MemAvailable, or what the container's cgroup still allows when that is less (a pool
    sized from the host's memory would get a memory-limited container OOM-killed)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    host = 8 << 30
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    limited = memory_available()
    return host if limited is None else min(host, limited)


def size_pool(num_kv_pages: int, kv_memory_fraction: float, bytes_per_page: int, min_pages: int,
              device: torch.device | None = None) -> int:
    """`num_kv_pages` when set, else `kv_memory_fraction` of available memory, and at least
    `min_pages` (enough for one request of max_seq_len)."""
    if num_kv_pages:
        return num_kv_pages
    pages = int(available_memory_bytes(device) * kv_memory_fraction) // bytes_per_page
    return max(pages, min_pages)
