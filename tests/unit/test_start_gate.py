"""The launcher's start gate (shared/start_gate.py): a gated process imports, then waits for
the verdict; GO lets it on, a closed pipe ends it silently with code 0, and a process
started without the gate never waits. Real processes and a real pipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shared.start_gate import GATE_ENV, GO

REPO = Path(__file__).resolve().parents[2]
#: the child: the gate (preloading a module), then a line that says it went on
CHILD = ("import sys\nfrom shared import start_gate\nstart_gate.wait('json')\n"
         "print('went on', 'json' in sys.modules, flush=True)\n")


def _gated(verdict: bytes | None) -> subprocess.CompletedProcess:
    """Run CHILD behind a gate; write `verdict` (None: close the pipe unwritten)."""
    read, write = os.pipe()
    env = dict(os.environ, **{GATE_ENV: str(read)}, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, pass_fds=(read,), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(read)
    if verdict is not None:
        os.write(write, verdict)
    os.close(write)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_go_lets_the_process_on_with_its_modules_imported():
    r = _gated(GO)
    assert (r.returncode, r.stdout, r.stderr) == (0, "went on True\n", "")


def test_a_closed_gate_ends_the_process_silently():
    """A refused deployment: the launcher closes the pipe; the child says nothing, exits 0."""
    r = _gated(None)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


def test_no_gate_no_wait():
    env = {k: v for k, v in os.environ.items() if k != GATE_ENV}
    r = subprocess.run([sys.executable, "-c", CHILD], env=dict(env, PYTHONPATH=str(REPO)), cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "went on False\n")
