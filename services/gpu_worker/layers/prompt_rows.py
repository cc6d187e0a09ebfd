"""Which rows of the running forward are prompt rows (prefill), for layers that compute
them another way than decode rows (`QuantLinear`'s bfloat16 prompt path).

The choice is made by a row's kind, never by how many rows a step has: a prompt row is
computed the same way whether its chunk is 1 row or 2,048 and whatever decode rows run
beside it, and a decode row the same way whether a prompt is being prefilled or not, so a
request's tokens do not depend on the batch it is in. The runner orders a step's decode
rows before its prompt chunks (the scheduler plans them so), and says where the prompt
rows start (`prompt_rows_from`); a layer that runs on a slice of the step's rows (the MLP
in slices of a long prefill) shifts the start by the slice's offset (`shifted`). One
thread runs forwards (the worker's step loop), so a module-level value is enough.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

#: rows at or after this index of the current forward's row axis are prompt rows
#: (a large value: none, the default outside a runner's forward)
_NONE = 1 << 62
_start = _NONE


def start() -> int:
    """The first prompt row of the rows a layer is called on now (>= their count: none)."""
    return _start


@contextlib.contextmanager
def prompt_rows_from(first: int | None) -> Iterator[None]:
    """Rows from `first` on are prompt rows for the forward run inside (None: none are)."""
    global _start
    saved, _start = _start, _NONE if first is None else first
    try:
        yield
    finally:
        _start = saved


@contextlib.contextmanager
def shifted(offset: int) -> Iterator[None]:
    """For a layer called on rows [offset, ...) of the forward: row 0 of its input is row
    `offset` of the step."""
    global _start
    saved = _start
    _start = saved if saved == _NONE else max(0, saved - offset)
    try:
        yield
    finally:
        _start = saved
