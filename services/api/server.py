"""uvicorn's Server with a shutdown that ends open requests cleanly and exits 0.

On SIGTERM/SIGINT uvicorn stops accepting and waits for open connections; a long stream
would otherwise be cancelled mid-write at the graceful timeout (a traceback, a cut-off
response, no abort on the workers). Here, once `drain_s` has passed, the backend fails
every still-live request with a 503: each stream ends with an error event, each pending
JSON reply is a 503, the workers get an Abort, and uvicorn then exits on its own.

uvicorn also re-raises the caught signal after a graceful shutdown, which turns a clean
stop into exit status -15 (SIGTERM) or a KeyboardInterrupt; a stop that was asked for
and completed is a success for the launcher and compose, so it is not re-raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Generator
from typing import Protocol

import uvicorn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Drains(Protocol):
    """What ends the live requests at shutdown: the backend, or every model's (`fleet`)."""

    def fail_live(self, message: str = ...) -> int: ...


class ApiServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, backend: Drains, drain_s: float) -> None:
        super().__init__(config)
        self._backend = backend
        self._drain_s = drain_s

    def _drain(self) -> None:
        self._backend.fail_live(f"server is shutting down (requests still live after {self._drain_s:g} s)")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self._drain_s, self._drain)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Like uvicorn's, without re-raising the stop signal once shut down."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
