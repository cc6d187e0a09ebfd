"""Per-hop timestamps of requests, for finding where a served request's time goes.

`MSTAR_TRACE=DIR` (set for the whole deployment): each process appends one line per hop,
`<request id> <hop> <ms>`, to `DIR/<pid>.trace`, the time being CLOCK_MONOTONIC (one clock
for every process on the host, so the hops of api, data worker, conductor and gpu worker
line up). `bench.ttft_hops` sets it, sends long prompts one at a time and prints each hop's
median. Unset (always, outside that bench), `stamp` is one global test: nothing is written.
"""

from __future__ import annotations

import os
import time
from typing import IO

_DIR = os.environ.get("MSTAR_TRACE") or ""
_file: IO[str] | None = None


def enabled() -> bool:
    return bool(_DIR)


def stamp(request_id: str, hop: str, at_ms: float | None = None) -> None:
    """Note that `request_id` passed `hop` now, or at `at_ms` (time.monotonic() in ms);
    a no-op unless MSTAR_TRACE is set."""
    if not _DIR:
        return
    global _file
    if _file is None:
        os.makedirs(_DIR, exist_ok=True)
        _file = open(os.path.join(_DIR, f"{os.getpid()}.trace"), "a", buffering=1)
    ms = time.monotonic() * 1e3 if at_ms is None else at_ms
    _file.write(f"{request_id} {hop} {ms:.3f}\n")


def read(directory: str) -> dict[str, dict[str, list[float]]]:
    """Every request's hops (each hop's times, in order), from a trace folder."""
    out: dict[str, dict[str, list[float]]] = {}
    for name in os.listdir(directory):
        if not name.endswith(".trace"):
            continue
        with open(os.path.join(directory, name)) as f:
            for line in f:
                rid, hop, ms = line.split()
                out.setdefault(rid, {}).setdefault(hop, []).append(float(ms))
    return out
