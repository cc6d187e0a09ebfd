"""`release_free_heap` (shared/memory.py) hands glibc's freed heap back to the OS."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_freed_heap_goes_back_to_the_os():
    # in a fresh process: 200 MiB of 64 KiB buffers (under glibc's mmap threshold, so on
    # the heap), freed, then trimmed; RSS read from /proc after each
    code = """
import gc
from shared.memory import release_free_heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
blocks = [bytearray(64 << 10) for _ in range(3200)]
full = rss()
keep = blocks[-1]
del blocks
gc.collect()
freed = rss()
release_free_heap()
print(full, freed, rss())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    full, freed, trimmed = map(int, out)
    assert full - trimmed > 150, (full, freed, trimmed)
    assert trimmed < freed, (full, freed, trimmed)
