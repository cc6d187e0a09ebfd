"""The api's ZMQ bridge to the rest of mstar (DESIGN.md sections 1 and 2).

Sockets, one job each:
- PULL bound at the api address: `StepOutputs` / `RequestError` / `Heartbeat` (the
  `ToApi` union) from whoever holds a request (gpu workers, conductor, data worker);
- PUSH to the data worker: `GenerateRequest`;
- PUSH to the conductor: `Abort` (the conductor owns aborts: it knows where a request runs);
- DEALER to the conductor's control ROUTER: `StatusQuery` -> `ClusterStatus`.

One receive task demultiplexes: a `StepOutputs` frame carries outputs of many requests and
each `Output` goes to its request's queue; frames for ids that are unknown or already
finished (a late output after an abort) are dropped silently. A request leaves the table on
its final output, on a `RequestError`, or on `abort()`, whichever comes first.

Peers are never required up front: ZMQ connects lazily and queues, so the api starts (and
answers 400s, /health, /metrics) with nothing else running; `/ready` says whether the
conductor answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import Any, cast

import msgspec
import zmq
import zmq.asyncio

from services.api.errors import ApiError
from shared import curve, trace
from shared.errors import ErrorKind, new_error_id
from shared.frames import (
    Abort,
    ClusterStatus,
    Dispatched,
    FrameCodec,
    GenerateRequest,
    Heartbeat,
    ModelCommand,
    Output,
    RequestError,
    StatusQuery,
    StepOutputs,
    ToApi,
)
from shared.zmq_utils import bind_pull, cleanup_ipc, connect, recv_frames

log = logging.getLogger("mstar.api.backend")

STATUS_CACHE_S = 0.25  # /ready and /metrics polled together share one conductor answer
CLOSE_LINGER_MS = 200  # let the final aborts reach the conductor on shutdown


class Aborted(msgspec.Struct, frozen=True):
    """Put on a request's queue by `abort()`, so whoever waits on it finishes at once."""

    reason: str = "abort"


QueueItem = Output | RequestError | Aborted


class RequestHandle:
    """One live request: its outputs arrive on `get()`; `abort()` cancels it everywhere.
    `dispatched_at` is when the conductor's `Dispatched` frame came (`time.perf_counter()`)."""

    __slots__ = ("_backend", "_queue", "dispatched_at", "request_id")

    def __init__(self, request_id: str, backend: Backend) -> None:
        self.request_id = request_id
        self.dispatched_at: float | None = None
        self._queue: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._backend = backend

    async def get(self) -> QueueItem:
        return await self._queue.get()

    def put(self, item: QueueItem) -> None:
        self._queue.put_nowait(item)

    def abort(self, reason: str = "abort") -> None:
        self._backend.abort(self.request_id, reason)


class Backend:
    """Owns the api's sockets and the table of live requests."""

    def __init__(
        self,
        *,
        api_addr: str,
        reply_to: str,
        data_worker_addr: str,
        conductor_addr: str,
        control_addr: str,
        status_timeout_s: float = 1.0,
        model: str = "",
    ) -> None:
        self.api_addr = api_addr
        self.reply_to = reply_to
        self.data_worker_addr = data_worker_addr
        self.conductor_addr = conductor_addr
        self.control_addr = control_addr
        self.status_timeout_s = status_timeout_s
        #: the served model whose workers `/ready` and `/metrics` report (several models
        #: behind one conductor; a conductor of one model ignores it)
        self.model = model
        self._codec = FrameCodec(ToApi)
        self._control_codec = FrameCodec(ClusterStatus)
        self._ctx: zmq.asyncio.Context | None = None
        self._pull: zmq.Socket | None = None
        self._to_data: zmq.asyncio.Socket | None = None
        self._to_conductor: zmq.asyncio.Socket | None = None
        self._control: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self._live: dict[str, RequestHandle] = {}
        # Live requests no worker has yet: a data worker or conductor crash loses these.
        self._pending: set[str] = set()
        self._watch_tasks: list[asyncio.Task[None]] = []
        self._status_lock = asyncio.Lock()
        self._status: ClusterStatus | None = None
        self._status_at = -1e9
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._pull is not None

    @property
    def live_count(self) -> int:
        return len(self._live)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live

    async def start(self) -> None:
        """Bind the PULL and start demultiplexing (idempotent; peers connect on first use)."""
        if self._pull is not None:
            return
        if self._closed:
            raise RuntimeError("backend is closed")
        self._ctx = zmq.asyncio.Context()
        self._pull = bind_pull(self._ctx, self.api_addr)
        loop = asyncio.get_running_loop()
        self._recv_task = loop.create_task(self._receive(), name="api-recv")
        self._to_data = self._socket(zmq.PUSH, self.data_worker_addr)
        self._to_conductor = self._socket(zmq.PUSH, self.conductor_addr)
        self._watch_tasks = [loop.create_task(self._watch_peer(self._to_data, "data worker")),
                             loop.create_task(self._watch_peer(self._to_conductor, "conductor"))]
        log.info("pulling outputs at %s (reply_to %s)", self.api_addr, self.reply_to)

    async def close(self) -> None:
        """Abort what is live, wake its waiters with a 503, close sockets, remove the ipc file."""
        if self._closed:
            return
        self._closed = True
        for task in self._watch_tasks:
            task.cancel()
        if self._recv_task is not None:
            self._recv_task.cancel()
            try:
                await self._recv_task
            except asyncio.CancelledError:
                pass
        self.fail_live()
        if self._ctx is not None:
            for sock in (self._to_data, self._to_conductor):
                if sock is not None:
                    sock.close(linger=CLOSE_LINGER_MS)
            if self._pull is not None:
                self._pull.close(linger=0)
            if self._control is not None:
                self._control.close(linger=0)
            curve.stop(self._ctx)
            self._ctx.term()
        if self._pull is not None:
            cleanup_ipc(self.api_addr)
        self._pull = self._to_data = self._to_conductor = self._control = None

    def fail_live(self, message: str = "server is shutting down") -> int:
        """Abort every live request and end it for its client with a 503 (shutdown)."""
        live, self._live = self._live, {}
        self._pending.clear()
        if not live:
            return 0
        error_id = new_error_id()
        log.warning("ending %d live request(s): %s (error id %s)", len(live), message, error_id)
        for request_id, handle in live.items():
            self._send_abort(request_id, "shutdown")
            handle.put(RequestError(request_id, ErrorKind.UNAVAILABLE, message, error_id=error_id))
        return len(live)

    def _socket(self, kind: int, address: str) -> zmq.asyncio.Socket:
        assert self._ctx is not None, "backend not started"
        return connect(self._ctx, kind, address)

    # ---- requests --------------------------------------------------------------------

    async def submit(self, req: GenerateRequest) -> RequestHandle:
        """Register the request's queue, then send it to the data worker.

        Raises a conflict ApiError when the id is already live: two clients must not share one
        reply queue.
        """
        if self._closed:
            raise ApiError(ErrorKind.UNAVAILABLE, "server is shutting down")
        await self.start()
        if req.request_id in self._live:
            raise ApiError(ErrorKind.CONFLICT, f"request_id {req.request_id!r} is already in use by a live request",
                           "request_id")
        handle = RequestHandle(req.request_id, self)
        self._live[req.request_id] = handle  # before sending: the first output may be quick
        self._pending.add(req.request_id)
        if self._to_data is None:
            self._to_data = self._socket(zmq.PUSH, self.data_worker_addr)
        try:
            trace.stamp(req.request_id, "api.send")
            await self._to_data.send_multipart(self._codec.encode(req), copy=False)
        except BaseException:
            self._live.pop(req.request_id, None)
            self._pending.discard(req.request_id)
            raise
        return handle

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Cancel a request everywhere: tell the conductor, forget its queue, wake its waiter.

        Synchronous on purpose: it runs from disconnect handlers and cancelled tasks, where
        an await could itself be cancelled before the Abort leaves.
        """
        handle = self._live.pop(request_id, None)
        if handle is None:
            return
        self._pending.discard(request_id)
        self._send_abort(request_id, reason)
        handle.put(Aborted(reason))

    def _send_abort(self, request_id: str, reason: str) -> None:
        if self._ctx is None:
            return
        if self._to_conductor is None:
            self._to_conductor = self._socket(zmq.PUSH, self.conductor_addr)
        # A PUSH with an unlimited HWM sends at once; the future only reports failures.
        sent = self._to_conductor.send_multipart(self._codec.encode(Abort(request_id, reason)), copy=False)
        fut = cast("asyncio.Future[Any]", sent)  # an asyncio.Future at run time; pyzmq's stub says only Awaitable
        fut.add_done_callback(_log_send_failure)

    # ---- receiving -------------------------------------------------------------------

    async def _receive(self) -> None:
        assert self._pull is not None
        while True:
            try:
                # closed before another is made: a reader on the socket's fd at a time
                async with aclosing(recv_frames(self._pull, self._codec, peer=f"api pull {self.api_addr}")) as frames:
                    async for msg, _ in frames:
                        self._dispatch(msg)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop every request's outputs
                log.exception("api receive loop failed; continuing")

    def _dispatch(self, msg: StepOutputs | RequestError | Dispatched | Heartbeat) -> None:
        live = self._live
        if type(msg) is StepOutputs:
            for out in msg.outputs:
                handle = live.get(out.request_id)
                if handle is None:
                    continue
                if out.finish_reason is not None:
                    del live[out.request_id]
                self._pending.discard(out.request_id)
                trace.stamp(out.request_id, "api.output")
                handle.put(out)
        elif type(msg) is RequestError:
            self._pending.discard(msg.request_id)
            handle = live.pop(msg.request_id, None)
            if handle is not None:
                handle.put(msg)
        elif type(msg) is Dispatched:
            self._pending.discard(msg.request_id)
            handle = live.get(msg.request_id)
            if handle is not None:
                handle.dispatched_at = time.perf_counter()

    async def _watch_peer(self, sock: zmq.asyncio.Socket, peer: str) -> None:
        """A data worker or conductor that dies closes its connection: the requests it
        held (those no worker has yet) end at once with a 503 instead of hanging. Those
        already on a worker are unaffected; their outputs come straight here."""
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                await mon.recv_multipart()
                self.fail_pending(f"the {peer} failed before this request reached a worker; it was not run")
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            mon.close(0)

    def fail_pending(self, message: str) -> int:
        lost = [rid for rid in self._pending if rid in self._live]
        self._pending.clear()
        if not lost:
            return 0
        error_id = new_error_id()
        log.error("ending %d request(s) not yet on a worker: %s (error id %s)", len(lost), message, error_id)
        for rid in lost:
            handle = self._live.pop(rid)
            self._send_abort(rid, "peer_failed")  # a surviving conductor drops its queued copy
            handle.put(RequestError(rid, ErrorKind.UNAVAILABLE, message, error_id=error_id))
        return len(lost)

    # ---- cluster status --------------------------------------------------------------

    async def cluster_status(self) -> ClusterStatus | None:
        """The conductor's latest status, or None when it does not answer in time."""
        if time.monotonic() - self._status_at < STATUS_CACHE_S:
            return self._status
        async with self._status_lock:
            if time.monotonic() - self._status_at < STATUS_CACHE_S:
                return self._status
            status = await self._query_status()
            # an answer of no ready worker is not kept: a deployment that just became ready is
            # seen at the next poll, not up to STATUS_CACHE_S later (the launcher's start-up
            # wait); no answer at all is kept (each query waits for the status timeout)
            starting = status is not None and status.ready_workers == 0
            self._status, self._status_at = status, -1e9 if starting else time.monotonic()
            return status

    async def ask(self, query: StatusQuery | ModelCommand) -> ClusterStatus | None:
        """One control query, uncached (a model command, or every model's status)."""
        async with self._status_lock:
            return await self._query_status(query)

    async def _query_status(self, query: StatusQuery | ModelCommand | None = None) -> ClusterStatus | None:
        if self._closed:
            return None
        await self.start()
        if self._control is None:
            self._control = self._socket(zmq.DEALER, self.control_addr)
        sock = self._control
        try:
            await sock.send_multipart(self._codec.encode(query or StatusQuery(self.model)))
            # pyzmq's stub gives the async poll no flags argument (run time: flags=POLLIN, returns the events)
            if not await sock.poll(int(self.status_timeout_s * 1000), zmq.POLLIN):  # type: ignore[call-arg]
                # Replies carry no query id: drop the socket so a late answer can never be
                # taken for the next query's.
                self._reset_control()
                return None
            frames = await sock.recv_multipart()
            body = [f for f in frames if len(f)]  # tolerate a REQ-style empty delimiter
            status, _ = self._control_codec.decode(body[-1:])
            return status
        except (msgspec.DecodeError, msgspec.ValidationError, IndexError) as exc:
            log.error("protocol error from conductor control %s: %s", self.control_addr, exc)
            self._reset_control()
            return None
        except zmq.ZMQError as exc:
            log.warning("status query to %s failed: %s", self.control_addr, exc)
            self._reset_control()
            return None

    def _reset_control(self) -> None:
        if self._control is not None:
            self._control.close(linger=0)
            self._control = None


def _log_send_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("sending an abort failed: %s", fut.exception())
