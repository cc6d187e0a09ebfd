"""What a worker measures at start about this machine running this model, kept across
starts: the scheduler's step-cost calibration (`step_costs.calibrate`), a second or more
of a start on a busy two-core machine; the next start with the same model files, kernel
build, machine and limits reads it back.

One small JSON file per measurement in `~/.cache/mstar/tuning` (`MSTAR_TUNING_CACHE`
places it; `off`, `0`, `no` or `false` turns it off, and every start measures again),
named by its kind and a hash of what it depends on, written to a temp file renamed into
place, under a lock (workers starting together measure once), the `FILES_KEPT` most
recently used kept. A file that does not parse, was made for another key, or that its
reader's check refuses is measured again and overwritten, never used. Deleting the folder
re-measures everything.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared import disk_cache

log = logging.getLogger("mstar.tuning_cache")

#: bumped whenever what a file holds changes
VERSION = 1
#: files kept (the most recently used; ~0.5 KB each, so that a test suite's tiny models do
#: not push out the served model's)
FILES_KEPT = 512


def cache_dir() -> Path | None:
    """`MSTAR_TUNING_CACHE`, else ~/.cache/mstar/tuning (shared/disk_cache.py); None when
    the cache is turned off."""
    return disk_cache.cache_folder("MSTAR_TUNING_CACHE", "tuning")


def files_identity(path: str | Path) -> list:
    """(path, size, mtime) of a model file, or of every file of a model folder."""
    root = Path(path).resolve()
    files = [root] if root.is_file() else sorted(f for f in root.iterdir() if f.is_file())
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def machine_identity() -> list:
    """The CPU (model and feature flags), the CPUs this process may use, its cgroup's CPU
    limit, and the C kernels' build (its file name carries the hash of sources and flags)."""
    from services.gpu_worker import cpu_kernels
    from shared.cgroup import cpu_limit

    lib = cpu_kernels.library()
    name = getattr(lib, "_name", None)
    try:
        cls = cpu_kernels.cpu_class()
    except ValueError:
        cls = "none"
    return [platform.machine(), cpu_kernels.cpu_signature(), os.cpu_count(), len(os.sched_getaffinity(0)),
            cpu_limit(), None if name is None else Path(name).name, os.environ.get("MSTAR_CPU_KERNELS", "1"), cls]


@functools.cache
def code_digest() -> str:
    """A hash of the gpu worker's Python sources (the C kernels' build is in
    `machine_identity`): a step's cost follows the code that runs it, so a changed engine
    or model module measures again (~10 ms to read them)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:32]


def key(kind: str, parts: Any) -> str:
    blob = json.dumps([VERSION, kind, parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _path(folder: Path, kind: str, parts: Any) -> tuple[Path, str]:
    k = key(kind, parts)
    return folder / f"{kind}-{k}.json", k


def read(path: Path, k: str, check: Callable[[dict], Any]) -> Any:
    """`check(record)` of the file at `path` for key `k`, or None: missing, unparsable,
    another key, or refused by `check` (which raises or returns None)."""
    try:
        kept = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("tuning cache file %s is unreadable (%s); measuring again", path.name, exc)
        return None
    try:
        if not isinstance(kept, dict) or kept.get("key") != k or kept.get("version") != VERSION:
            raise ValueError("made for another key")
        value = check(kept["record"])
        if value is None:
            raise ValueError("refused by its check")
    except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
        log.warning("tuning cache file %s is unusable (%s); measuring again", path.name, exc)
        return None
    disk_cache.touch(path)
    return value


def write(path: Path, k: str, record: dict) -> None:
    with disk_cache.atomic_write(path, "w") as f:
        json.dump({"version": VERSION, "key": k, "record": record}, f)
    prune(path.parent)


def prune(folder: Path) -> None:
    disk_cache.prune(folder, "*.json", FILES_KEPT)


def cached(kind: str, parts: Any, measure: Callable[[], Any], to_record: Callable[[Any], dict],
           check: Callable[[dict], Any]) -> tuple[Any, bool]:
    """(value, whether it came from the cache): `check(record)` of the kept record for
    (`kind`, `parts`), else `measure()` (under the lock), kept as `to_record(value)`.
    `parts` None, or the cache off: always measured, nothing kept."""
    folder = cache_dir() if parts is not None else None
    if folder is None:
        return measure(), False
    path, k = _path(folder, kind, parts)
    return disk_cache.read_or_make(path, lambda: read(path, k, check), measure,
                                   lambda value: write(path, k, to_record(value)))
