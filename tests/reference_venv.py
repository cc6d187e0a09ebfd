"""A reference package's own venv, for the references that pin what mstar's venv cannot hold
(chatterbox-tts pins torch 2.6, qwen-tts transformers 4.57.3): tests/chatterbox_checkpoints.py
and tests/qwen3_tts_checkpoints.py build theirs here.

The venv lives under ~/.cache/mstar-peers/, one per pin set, built once under a lock (a
`.complete` marker says it is whole). It is made --system-site-packages, and a .pth puts
this interpreter's site-packages after the venv's own packages: torch, numpy, safetensors
and the rest come from mstar's venv, the pinned packages (installed into the venv) shadow
theirs. The .pth is rewritten whenever it points elsewhere (CI's venv is not the one that
built the cached venv).
"""

from __future__ import annotations

import fcntl
import shutil
import site
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

PEERS = Path.home() / ".cache" / "mstar-peers"


def venv_path(name: str, pins: Sequence[str]) -> Path:
    """The venv of `pins` (`name-` then the pins without their `==`)."""
    return PEERS / (name + "-" + "-".join(p.replace("==", "") for p in pins))


def reference_python(venv: Path, installs: Sequence[Sequence[str]]) -> Path:
    """`venv`'s python, built (once, under a lock) when missing: each of `installs` is one
    `pip install` into it (its arguments: packages and flags such as --no-deps)."""
    python = venv / "bin" / "python"
    marker = venv / ".complete"
    if marker.is_file():
        _point_at_us(python)
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / (venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                       check=True)
        _point_at_us(python)
        pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--disable-pip-version-check"]
        for args in installs:
            subprocess.run([*pip, *args], check=True)
        marker.touch()
    return python


def _point_at_us(python: Path) -> None:
    """The venv's .pth: this interpreter's site-packages, after the venv's own packages."""
    ours = [p for p in site.getsitepackages() if p.endswith("site-packages")]
    theirs = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    theirs.mkdir(parents=True, exist_ok=True)
    pth = theirs / "zz_mstar_venv.pth"
    text = "\n".join(ours) + "\n"
    if not pth.is_file() or pth.read_text() != text:
        pth.write_text(text)
