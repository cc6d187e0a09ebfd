"""The gpu worker's heartbeat, sent from its own thread so a long step is never taken for a hang.

The step loop is synchronous: a 2,000-row prefill on a slow path, a big prompt-logprobs
step or a busy neighbour can hold it for many seconds. A heartbeat sent from that loop
(as before issue 26) stops whenever a step is long, and the conductor failed live workers
for it. Here a daemon thread beats every `HEARTBEAT_INTERVAL_S` on its own PUSH socket
(zmq sockets are not shared across threads; the context is). It needs the GIL only for a
moment, and torch ops and the C kernels (ctypes) release it, so it beats through any step;
a SIGSTOPped, crashed or deadlocked process stops it, which is what liveness means.

Each beat says whether a step is running and for how long (`Heartbeat.step_s`), so the
conductor can tell a long step from a silent process. A step that runs past
`STEP_WATCHDOG_S` (minutes, `MSTAR_STEP_WATCHDOG_S`; 0 turns it off) is logged here with
what it held, and then treated as the hang it is: the worker exits with `EXIT_HUNG` so its
supervisor (the launcher, compose, Kubernetes) starts a fresh one; its connection closes
and the conductor fails its requests at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import zmq

from shared import curve
from shared.frames import FrameCodec, Heartbeat, ToConductor

log = logging.getLogger("mstar.gpu_worker")

HEARTBEAT_INTERVAL_S = 1.0
#: a single step running longer than this is a hang (the default is minutes: the longest
#: legitimate step, a full token budget of prefill on a slow machine, takes seconds)
STEP_WATCHDOG_S = float(os.environ.get("MSTAR_STEP_WATCHDOG_S", "300"))
#: the exit status of a worker whose step hung (EX_SOFTWARE): restarted, as any crash
EXIT_HUNG = 70


class Liveness:
    """Beats for the worker from a daemon thread; the step loop marks each step's start
    and end (two attribute writes, no lock: a float read is atomic under the GIL)."""

    def __init__(self, ctx: zmq.Context, conductor_addr: str, worker_id: str, incarnation: str,
                 describe: Callable[[], str], watchdog_s: float = STEP_WATCHDOG_S,
                 interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.worker_id, self.incarnation = worker_id, incarnation
        #: what the worker holds, for the watchdog's log line (read from this thread while
        #: the step runs: it only copies lists)
        self.describe = describe
        self.watchdog_s, self.interval_s = watchdog_s, interval_s
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 8)  # a conductor that is away needs no backlog of beats
        curve.secure_client(self.sock, conductor_addr)
        self.sock.connect(conductor_addr)
        self.codec = FrameCodec(ToConductor)
        #: monotonic time the running step began, 0.0 between steps
        self.step_started = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mstar-heartbeat", daemon=True)

    def start(self) -> Liveness:
        self._thread.start()
        return self

    def step_began(self) -> None:
        self.step_started = time.monotonic()

    def step_ended(self) -> None:
        self.step_started = 0.0

    def step_s(self) -> float:
        started = self.step_started
        return time.monotonic() - started if started else 0.0

    def beat(self) -> Heartbeat:
        return Heartbeat(self.worker_id, time.time(), self.incarnation, round(self.step_s(), 3))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            hb = self.beat()
            if self.watchdog_s > 0 and hb.step_s > self.watchdog_s:
                self._hung(hb.step_s)
            try:
                self.sock.send_multipart(self.codec.encode(hb), zmq.NOBLOCK)
            except zmq.Again:
                pass  # no conductor connected right now: the next beat tries again
            except zmq.ZMQError:
                return  # the context is closing

    def _hung(self, seconds: float) -> None:
        try:
            held = self.describe()
        except Exception as exc:  # the step's thread is changing what we read: say so, still exit
            held = f"(could not list: {exc})"
        log.critical("a step has run for %.0fs, past the step watchdog (MSTAR_STEP_WATCHDOG_S=%g); it held %s; "
                     "exiting with status %d so the worker is restarted", seconds, self.watchdog_s, held, EXIT_HUNG)
        logging.shutdown()
        os._exit(EXIT_HUNG)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)
        self.sock.close(0)
