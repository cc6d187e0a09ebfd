"""The folders of mstar's on-disk caches and their pruning, one way for all of them (the
GGUF summaries, the repacked weights, the start-up measurements).

Each cache is a folder of files named by a hash of what they depend on: an env var places
it (`MSTAR_GGUF_CACHE`, `MSTAR_REPACK_CACHE`, `MSTAR_TUNING_CACHE`), else it lives under
~/.cache/mstar/, or under the temp dir where home is read-only; the off words turn a cache
off where that is allowed. A file is made once by whichever process gets there first
(`read_or_make`: the others wait on its lock, then read it), is written whole or not at all
(`atomic_write`), and after each write the least recently written files past a count (and a
byte cap, where given) are deleted with their lock files.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TypeVar

log = logging.getLogger("mstar.disk_cache")

T = TypeVar("T")

#: what an env var says to turn a cache off
OFF_WORDS = ("0", "off", "no", "false", "none")


def cache_folder(env: str, name: str, can_turn_off: bool = True) -> Path | None:
    """The folder `env` names, else ~/.cache/mstar/<name>, made if missing (the temp dir's
    mstar-<name> if that cannot be made); None when `env` turns the cache off."""
    value = (os.environ.get(env) or "").strip()
    if can_turn_off and value.lower() in OFF_WORDS:
        return None
    base = Path(value) if value else Path.home() / ".cache" / "mstar" / name
    for folder in (base, Path(tempfile.gettempdir()) / f"mstar-{name}"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return folder
        except OSError:
            continue
    return None


def prune(folder: Path, pattern: str, files_kept: int, max_bytes: int | None = None,
          keep: Path | None = None) -> None:
    """Delete the files matching `pattern` past the `files_kept` most recently written, or
    past `max_bytes` in all (never `keep`, the file just written), with their `.lock`
    files. A file another process has mapped lives on until its last user exits."""
    try:
        files = sorted(folder.glob(pattern), key=lambda f: f.stat().st_mtime, reverse=True)
        total = 0
        for i, f in enumerate(files):
            size = f.stat().st_size
            if f != keep and (i >= files_kept or (max_bytes is not None and total + size > max_bytes)):
                f.unlink(missing_ok=True)
                f.with_suffix(".lock").unlink(missing_ok=True)
                continue
            total += size
    except OSError:
        pass  # another process pruned it first


def touch(path: Path) -> None:
    """Mark a cache file recently used (the last to be pruned); a no-op where it is gone."""
    try:
        os.utime(path)
    except OSError:
        pass


def read_or_make(path: Path, read: Callable[[], T | None], make: Callable[[], T | None],
                 write: Callable[[T], object]) -> tuple[T | None, bool]:
    """(`read()`, True) where the cache file at `path` is usable (`read` returns None for a
    missing or unusable one), else (`make()`, False), made under the file's lock (processes
    starting together make it once: the others, reading again inside the lock, find it)
    and kept by `write` (a value of None is not kept; an OSError of `write` is logged: the
    value is still returned)."""
    value = read()
    if value is not None:
        return value, True
    with _lock(path):
        value = read()
        if value is not None:
            return value, True
        value = make()
        if value is not None:
            try:
                write(value)
            except OSError as exc:
                log.warning("could not keep %s in %s: %s", path.name, path.parent, exc)
        return value, False


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """`path`'s .lock file held exclusively for the block; no lock where it cannot be
    opened (a read-only folder: the write then fails and is only logged)."""
    try:
        lock = open(path.with_suffix(".lock"), "w")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "wb") -> Iterator[IO]:
    """A temporary file beside `path`, renamed onto it when the block ends without an
    error (removed otherwise): a reader sees the whole file or none."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
