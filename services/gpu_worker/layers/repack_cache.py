"""GGUF weights repacked for the quantized GEMM kernel, kept on disk so that a worker maps
them instead of repacking at every start (`quant.repack`: ~1 s for SmolLM2-135M on a busy
two-core machine, seconds for larger models).

One file per GGUF file and set of kept tensors, in `~/.cache/mstar/repack`
(`MSTAR_REPACK_CACHE` places it; `off`, `0`, `no` or `false` turns the cache off), keyed
as the GGUF summary is (the file's path, size and mtime) plus what the repacked layout
depends on: `LAYOUT_VERSION`, the source of `layers/quant.py` (any change to it repacks
once), the gguf and numpy versions, and each tensor's name, type and shape. The file is:

    MAGIC | header length (u64 LE) | JSON header | zero padding | arrays, each 64-byte aligned

and the header holds the key, the data's size and its CRC-32, and per tensor its form and
its arrays' offsets, dtypes and shapes. A file is used only when its magic, key, size and
checksum all match (a partial or corrupt file is rebuilt, never used); it is mapped
copy-on-write, so its pages are the page cache's, shared by every worker of the machine.

Written once, under a lock (workers starting together repack once: the others wait and
map the result), to a temp file renamed into place (a reader sees the whole file or none).
Files beyond `MSTAR_REPACK_CACHE_BYTES` in all (default 8 GiB), or beyond `FILES_KEPT`,
are deleted least recently used first; a model larger than the cap alone is not kept.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from services.gpu_worker.layers import quant
from shared import disk_cache

log = logging.getLogger("mstar.repack_cache")

#: bumped whenever the file format or what a file holds changes
LAYOUT_VERSION = 3
MAGIC = b"MSTARRP1"
ALIGN = 64
SUFFIX = ".rpk"
#: files kept in the cache folder at most (the most recently used): the byte cap is what
#: binds for real models; the count only bounds a folder of tiny ones (a test suite's)
FILES_KEPT = 256
DEFAULT_MAX_BYTES = 8 << 30

#: one tensor repacked: (form, w, d, m), or None where `quant.repack` refused it
Entry = tuple[int, np.ndarray, np.ndarray, np.ndarray | None] | None


def cache_dir() -> Path | None:
    """`MSTAR_REPACK_CACHE`, else ~/.cache/mstar/repack (shared/disk_cache.py); None when
    the cache is turned off."""
    return disk_cache.cache_folder("MSTAR_REPACK_CACHE", "repack")


def max_bytes() -> int:
    try:
        return int(os.environ.get("MSTAR_REPACK_CACHE_BYTES") or DEFAULT_MAX_BYTES)
    except ValueError:
        return DEFAULT_MAX_BYTES


@functools.cache
def layout_digest() -> str:
    """What the repacked layout depends on besides the GGUF file."""
    h = hashlib.sha256(f"{LAYOUT_VERSION}|gguf {_version(gguf)}|numpy {np.__version__}|".encode())
    h.update(Path(quant.__file__).read_bytes())
    return h.hexdigest()


def _version(module) -> str:
    try:
        return importlib.metadata.version(module.__name__)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def cache_key(path: str | Path, quant_state: dict) -> str:
    """The key of the repacked file for `quant_state` (name -> `QuantTensor`) read from the
    GGUF file at `path`; OSError if the file cannot be stat'ed."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    tensors = sorted((name, qt.qtype, list(qt.shape)) for name, qt in quant_state.items())
    blob = json.dumps([layout_digest(), str(resolved), st.st_size, st.st_mtime_ns, tensors])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def build(quant_state: dict) -> dict[str, Entry]:
    """Repack every tensor (what a cache miss costs)."""
    out: dict[str, Entry] = {}
    for name, qt in quant_state.items():
        try:
            form, w, d, m = quant.repack(qt.qtype, qt.data, qt.shape)
        except ValueError:
            out[name] = None
            continue
        out[name] = (form, w, d, m)  # (d and m float16 or float32, as the form says)
    return out


def layer(entry: Entry, shape: tuple[int, int]) -> quant.QuantLinear | None:
    """The `QuantLinear` of one repacked tensor (`QuantLinear.from_gguf`'s, from its parts)."""
    if entry is None:
        return None
    form, w, d, m = entry
    t = torch.from_numpy
    return quant.QuantLinear(form, t(w), t(d), None if m is None else t(m), shape[1], shape[0])


def repacked(path: str | Path | None, quant_state: dict) -> dict[str, Entry]:
    """Every tensor of `quant_state` repacked: mapped from the cache when it holds them,
    else repacked and written there (under the lock) for the next start."""
    folder = cache_dir() if path is not None and quant_state else None
    if folder is None or path is None:
        return build(quant_state)
    try:
        key = cache_key(path, quant_state)
    except OSError:
        return build(quant_state)
    out = folder / f"{key}{SUFFIX}"
    # [0], not a tuple unpacking: mypy solves read_or_make's T as the Optional itself there
    entries = disk_cache.read_or_make(out, lambda: read(out, key), lambda: build(quant_state),
                                      lambda made: write(out, key, made))[0]
    assert entries is not None  # build() always makes them
    return entries


def _arrays(entry: Entry) -> list[np.ndarray]:
    return [] if entry is None else [a for a in entry[1:] if a is not None]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def write(out: Path, key: str, entries: dict[str, Entry]) -> bool:
    """Write `entries` to `out` atomically; False when they would not fit the cap."""
    table: dict[str, Any] = {}
    offset, crc = 0, 0
    chunks: list[tuple[int, np.ndarray]] = []
    for name, entry in entries.items():
        if entry is None:
            table[name] = None
            continue
        specs: list[list[Any] | None] = []
        for a in entry[1:]:
            if a is None:
                specs.append(None)
                continue
            a = np.ascontiguousarray(a)
            offset = _align(offset)
            specs.append([offset, a.dtype.str, list(a.shape)])
            chunks.append((offset, a))
            offset += a.nbytes
        table[name] = {"form": entry[0], "arrays": specs}
    data_bytes = offset
    if data_bytes > max_bytes():
        log.info("repacked weights (%d MiB) exceed the cache's cap; not kept", data_bytes >> 20)
        return False
    pos = 0
    for off, a in chunks:  # the CRC covers the padding too: the data region as written
        crc = zlib.crc32(bytes(off - pos), crc)
        # numpy's stubs give ndarray __buffer__ (typing.Buffer) only for Python >= 3.12
        crc = zlib.crc32(a.reshape(-1).view(np.uint8), crc)  # type: ignore[arg-type]
        pos = off + a.nbytes
    header = json.dumps({"key": key, "data_bytes": data_bytes, "crc32": crc, "entries": table}).encode()
    start = _align(len(MAGIC) + 8 + len(header))
    with disk_cache.atomic_write(out) as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        f.write(bytes(start - f.tell()))
        for off, a in chunks:
            f.write(bytes(start + off - f.tell()))
            f.write(a.reshape(-1).view(np.uint8).data)
    prune(out.parent, keep=out)
    return True


#: [start, end) addresses of the cache files this process has mapped (see `release`)
_MAPPED: list[tuple[int, int]] = []
_MADV_DONTNEED = 4


def release(tensors) -> int:
    """Hand back the pages of mapped tensors that are no longer used: the q/k/v and
    gate/up parts the model concatenates into new memory at `prepare`, whose mapped pages
    (read once, by the checksum) would stay in this process's resident set beside their
    copy. `madvise(MADV_DONTNEED)` on the pages wholly inside each tensor; the mapping is
    private and never written, so a page touched again is read back from the file, the
    same bytes. Tensors not in a cache file of this process are left alone (anonymous
    memory would be zeroed). Returns the bytes released."""
    page, done = mmap.PAGESIZE, 0
    libc = None
    for t in tensors:
        if t is None or not t.numel():
            continue
        a = t.data_ptr()
        n = t.numel() * t.element_size()
        if not any(lo <= a and a + n <= hi for lo, hi in _MAPPED):
            continue
        lo, hi = -(-a // page) * page, (a + n) // page * page
        if hi <= lo:
            continue
        libc = libc or ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) == 0:
            done += hi - lo
    return done


def read(out: Path, key: str) -> dict[str, Entry] | None:
    """The entries of the cache file `out` mapped, or None when it is missing, partial,
    corrupt or made for another key (the caller then rebuilds it)."""
    try:
        mm = np.memmap(out, dtype=np.uint8, mode="c")
    except (OSError, ValueError):  # missing, or empty
        return None
    try:
        entries = _parse(mm, key)
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        log.warning("repacked-weights cache file %s is unusable (%s); repacking", out.name, exc)
        return None
    _MAPPED.append((mm.ctypes.data, mm.ctypes.data + mm.size))
    disk_cache.touch(out)
    return entries


def _parse(mm: np.ndarray, key: str) -> dict[str, Entry]:
    if bytes(mm[: len(MAGIC)]) != MAGIC:
        raise ValueError("not a repacked-weights file")
    (n,) = struct.unpack("<Q", bytes(mm[len(MAGIC): len(MAGIC) + 8]))
    head_end = len(MAGIC) + 8 + n
    if head_end > mm.size:
        raise ValueError("truncated header")
    header = json.loads(bytes(mm[len(MAGIC) + 8: head_end]))
    if header["key"] != key:
        raise ValueError("made for another file or layout")
    start = _align(head_end)
    data_bytes = int(header["data_bytes"])
    if mm.size != start + data_bytes:
        raise ValueError(f"{mm.size} bytes, not {start + data_bytes} (partial)")
    data = mm[start:]
    if zlib.crc32(data) != header["crc32"]:  # type: ignore[arg-type]  # numpy: ndarray is a Buffer (stubs: >= 3.12)
        raise ValueError("checksum mismatch")
    entries: dict[str, Entry] = {}
    for name, spec in header["entries"].items():
        if spec is None:
            entries[name] = None
            continue
        arrays: list[np.ndarray | None] = []
        for a in spec["arrays"]:
            if a is None:
                arrays.append(None)
                continue
            off, dtype, shape = int(a[0]), np.dtype(a[1]), tuple(a[2])
            nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            if off % ALIGN or off + nbytes > data_bytes:
                raise ValueError(f"array of {name} out of bounds")
            arrays.append(data[off: off + nbytes].view(dtype).reshape(shape))
        if len(arrays) != 3 or arrays[0] is None or arrays[1] is None:
            raise ValueError(f"entry {name} malformed")
        entries[name] = (int(spec["form"]), arrays[0], arrays[1], arrays[2])
    return entries


def prune(folder: Path, keep: Path | None = None) -> None:
    """The least recently written files past `FILES_KEPT` or the byte cap go (never `keep`,
    the file just written)."""
    disk_cache.prune(folder, f"*{SUFFIX}", FILES_KEPT, max_bytes(), keep)
