"""torch's intra-op thread count for one block of work, restored after it: the worker
gives torch one core fewer than it has (the other services keep one), and a few jobs want
another count for a while (a quantized model's `prepare`: one; a vision tower: all)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads at `n` inside the block, as they were after it."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
