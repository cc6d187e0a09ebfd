"""Page arithmetic, written once: how many pages `rows` rows take.

Every ceiling division in the services and the specs goes through here, so the conductor's
estimate, the KV manager's allocation and the attention metadata count pages one way.
Integers only (no float rounding: `math.ceil(a / b)` is wrong past 2**53).
"""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """`ceil(a / b)` for integers, `b > 0`."""
    return -(-a // b)


def pages_for(rows: int, page_size: int) -> int:
    """Pages that hold `rows` rows from the start of a page (0 rows: 0 pages)."""
    return -(-rows // page_size)
