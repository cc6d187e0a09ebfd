"""Handing freed heap back to the OS.

glibc keeps the pages of freed heap (and raises its mmap threshold as large buffers are
freed, so later large buffers come from the heap too): a process that parsed a tokenizer's
JSON at start-up, or that ran a load with large step buffers, keeps that memory resident
until `malloc_trim` returns it. Each service calls `release_free_heap` at moments when
nothing is in flight: after start-up, and (the gpu worker) once its engine has been idle
for a while.
"""

from __future__ import annotations

import ctypes


def release_free_heap() -> None:
    """`malloc_trim(0)`: the heap's free pages back to the OS. A no-op where the libc has no
    malloc_trim (musl, macOS)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
