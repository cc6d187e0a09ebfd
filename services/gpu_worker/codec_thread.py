"""Outputs that wait for their sound: a speech runner's codec runs in a thread of its own
beside the steps (a real codec decodes a frame in milliseconds to tens of them on a CPU,
which in the step's thread would delay every stream's next frame by it; torch releases the
GIL in its kernels, so the next step's forward runs meanwhile). An output is held, in
emission order, until its sound is made, and sent by a later step (`ready`); when nothing
else is to do the engine waits for the oldest. One thread keeps every request's frames in
order without locks; a codec failure is that request's 500 with an error id.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from services.gpu_worker.step_types import error_frame
from shared.errors import ErrorKind, new_error_id
from shared.frames import Output, RequestError

log = logging.getLogger("mstar.codec")

CODEC_THREAD = "mstar-codec"


class CodecThread:
    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=CODEC_THREAD)
        self.held: deque[tuple[str, Output, Future[bytes]]] = deque()

    def submit(self, reply_to: str, output: Output, sound: Callable[..., bytes], *args) -> None:
        """Hold `output` until `sound(*args)` (run in the codec thread) gives its audio."""
        self.held.append((reply_to, output, self.pool.submit(sound, *args)))

    @property
    def holding(self) -> bool:
        return bool(self.held)

    def ready(self, wait: bool) -> tuple[list[tuple[str, Output]], list[tuple[str, RequestError]]]:
        """Held outputs whose sound is made, in emission order (`wait`: block for the
        oldest when none is); errors for those whose codec failed."""
        ready: list[tuple[str, Output]] = []
        failed: list[tuple[str, RequestError]] = []
        while self.held and (self.held[0][2].done() or (wait and not ready and not failed)):
            reply_to, output, job = self.held.popleft()
            try:
                output.audio = job.result()
            except Exception:
                error_id = new_error_id()
                log.exception("the codec failed on %s (error_id=%s)", output.request_id, error_id)
                failed.append((reply_to, error_frame(output.request_id, ErrorKind.INTERNAL,
                                                     "internal error in the audio codec", error_id)))
                continue
            ready.append((reply_to, output))
        return ready, failed


class HeldSound:
    """The runner hooks (runners/base.py's `holding`, `ready_outputs`) of a speech runner whose
    outputs wait in its `thread` for their sound (Orpheus', CSM's)."""

    thread: CodecThread

    @property
    def holding(self) -> bool:
        return self.thread.holding

    def ready_outputs(self, wait: bool) -> tuple[list[tuple[str, Output]], list[tuple[str, RequestError]]]:
        return self.thread.ready(wait)


def sound_bytes(chunks: list[np.ndarray]) -> bytes:
    """Sample chunks as the bytes `Output.audio` carries (float32 little-endian)."""
    return np.concatenate(chunks).astype("<f4").tobytes() if chunks else b""
