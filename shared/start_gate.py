"""The launcher's start gate: `mstar serve` starts its services before its deployment
check has answered, so that their imports (the gpu worker's torch: a second or more of a
start) run while the check does instead of after it.

A service started so finds `MSTAR_START_GATE` (the read end of a pipe) in its
environment: it imports what it would import anyway, then reads one byte. `1`: the
deployment passed, go on. Anything else (the pipe closed unwritten, or the launcher gone):
it was refused, so leave at once and silently, having loaded no weights and bound no
socket; the launcher's one-line refusal is all the operator sees. A service started any
other way (a restart by the launcher, compose, by hand) has no gate and never waits.
"""

from __future__ import annotations

import importlib
import os

#: the environment variable holding the gate's file descriptor
GATE_ENV = "MSTAR_START_GATE"
#: the byte the launcher writes for each gated service once the deployment is accepted
GO = b"1"


def wait(*modules: str) -> None:
    """Where this process was started behind the gate: import `modules` (the service's
    own heavy imports, done now to overlap the launcher's check), then block until the
    launcher's verdict; a refusal ends the process here with exit code 0."""
    fd = os.environ.pop(GATE_ENV, None)  # popped: nothing this service starts inherits it
    if fd is None:
        return
    for name in modules:
        importlib.import_module(name)
    try:
        verdict = os.read(int(fd), 1)
        os.close(int(fd))
    except (OSError, ValueError):
        verdict = b""
    if verdict != GO:
        os._exit(0)
