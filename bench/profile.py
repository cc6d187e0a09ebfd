"""Where the serving time goes: `py-spy record` on every process of a running server while
a load runs, summarized as the top functions by self and inclusive samples per process.

py-spy samples without pausing the targets (`--nonblocking`) and leaves idle threads out,
so a process's samples are its busy time; `busy` is samples / (duration * rate).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def py_spy() -> str | None:
    exe = Path(sys.executable).parent / "py-spy"
    return str(exe) if exe.exists() else shutil.which("py-spy")


class Recorder:
    """One `py-spy record --format raw` per pid, started now, for `duration` seconds."""

    def __init__(self, pids: dict[str, int], out_dir: Path, duration: float, rate: int = 250) -> None:
        exe = py_spy()
        if exe is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy)")
        out_dir.mkdir(parents=True, exist_ok=True)
        self.duration, self.rate = duration, rate
        self.files = {name: out_dir / f"{name}.txt" for name in pids}
        self.procs = {
            name: subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(int(duration)),
                                    "--rate", str(rate), "--format", "raw", "--nonblocking",
                                    "--output", str(self.files[name])],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for name, pid in pids.items()
        }

    def wait(self) -> dict[str, dict]:
        out = {}
        for name, proc in self.procs.items():
            _, err = proc.communicate(timeout=self.duration + 60)
            path = self.files[name]
            if proc.returncode != 0 or not path.exists():
                out[name] = {"error": err.decode(errors="replace")[-500:]}
                continue
            out[name] = summarize(path.read_text(), self.duration, self.rate)
        return out


REPO_ROOT = str(Path(__file__).resolve().parent.parent)


def _short(frame: str) -> str:
    m = FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    file = m["file"]
    for marker in ("/site-packages/", "/lib/python3.11/", f"{REPO_ROOT}/"):
        if marker in file:
            file = file.split(marker, 1)[1]
    return f"{file}:{m['func']}"


def summarize(raw: str, duration: float, rate: int, top: int = 15) -> dict:
    """Top functions by self samples (the leaf frame) and by inclusive samples (anywhere on
    the stack, once per sample), as percentages of this process's busy samples."""
    self_c: Counter[str] = Counter()
    incl_c: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_short(f) for f in stack.split(";")
                  if f and not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        total += n
        self_c[frames[-1]] += n
        for f in set(frames):
            incl_c[f] += n
    pct = (lambda c: round(100.0 * c / total, 1)) if total else (lambda c: 0.0)
    return {
        "samples": total,
        "busy": round(total / (duration * rate), 3) if duration else None,
        "self": [(f, pct(c)) for f, c in self_c.most_common(top)],
        "inclusive": [(f, pct(c)) for f, c in incl_c.most_common(top * 2)],
    }


def service_pids(pids: list[int]) -> dict[str, int]:
    """The mstar service processes among `pids`, by name (api, data_worker, ...)."""
    out = {}
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for part in cmd:
            s = part.decode(errors="replace")
            if s.startswith("services.") and s != "services.launcher":
                out[s.removeprefix("services.")] = pid
    return out
