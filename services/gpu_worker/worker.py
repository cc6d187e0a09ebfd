"""The gpu worker process: the socket loop around the engine (build.py assembles it).

The step loop is a plain synchronous loop over a zmq Poller (like vLLM's EngineCore):
the forward pass holds the CPU anyway, ZMQ's I/O thread queues frames meanwhile, and
between steps every queued frame is drained, so new requests join the next step.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
import uuid
from collections import deque

import msgspec
import torch
import zmq

from services.gpu_worker.build import assemble
from services.gpu_worker.engine import GROUP_LOST, DeviceLost
from services.gpu_worker.liveness import Liveness
from services.gpu_worker.step_types import Finished, StepResult, error_frame
from services.gpu_worker.tp.group import GroupLost, TpGroup
from shared import curve, trace
from shared.cgroup import available_cpus
from shared.config import Deployment
from shared.errors import ErrorKind, new_error_id
from shared.fingerprint import fingerprint
from shared.frames import (
    Abort,
    FrameCodec,
    NewRequest,
    RequestFinished,
    StepOutputs,
    ToApi,
    ToWorker,
    WorkerReady,
    WorkerRefused,
    WorkerStats,
    unpack_tensors,
)
from shared.memory import release_free_heap
from shared.zmq_utils import cleanup_ipc

log = logging.getLogger("mstar.gpu_worker")

STATS_INTERVAL_S = 0.25
#: the heap goes back to the OS once the engine has been idle this long (shared/memory.py)...
TRIM_AFTER_IDLE_S = 1.0
#: ...and this often while it is busy (a trim takes ~1 ms; the pages it frees fault back in
#: at the next large step, ~10 ms of a busy second at most)
TRIM_EVERY_S = 2.0
#: how often the step loop repeats its `WorkerReady` (between steps), so a restarted
#: conductor learns this worker again; liveness itself is `Liveness`'s thread
ANNOUNCE_INTERVAL_S = 1.0
#: an idle engine starts its first step once arrivals pause this long...
GATHER_QUIET_S = 0.004
#: ...or this long after the first arrival, whichever comes first
GATHER_MAX_S = 0.025
#: requests that ended this recently are a burst's likely senders (a closed loop's clients
#: send again as their requests end): once as many have arrived, the gather ends
RECENT_END_S = 0.1
#: at shutdown, how long the last frames to the conductor (failed requests' pages, the
#: final stats) may wait to be taken: a live conductor takes them in a few ms; when the
#: whole deployment stops, the conductor is stopping too and nothing will take them, and
#: the socket's running linger (1 s) held every stop for that whole second
SHUTDOWN_LINGER_MS = 200


class Gather:
    """Hold an idle engine's first step until a burst of arrivals has landed.

    Clients that send together (a closed loop whose requests all finished in one step) reach
    the worker spread over a few ms, through the api, data worker and conductor. Without a
    pause the first step prefills only the first few, the rest join beside streams already
    decoding, and the group never runs in step again (issue 20: the P99 ITL of a round where
    the waves came apart). The cost is at most GATHER_MAX_S of TTFT, and only from idle.
    Once the prompts gathered fill a step's token budget the step starts at once: more
    would wait for a later step anyway, and a wave longer than one step is better spread
    (at 64 concurrent, holding whole waves cost ~28% of the throughput).

    A burst is also over once as many requests have arrived as ended in the `RECENT_END_S`
    before its first: a closed loop's clients send again as their requests end, so those
    are who the burst can hold. A client that sends one request after another (bench.hybrid's
    896-token TTFT, a c1 load) then starts at once instead of paying GATHER_QUIET_S each
    time; a wave of 16 that ended together is still waited for whole. No request ended
    lately (a cold start): the burst's size is unknown, and the quiet and the cap decide."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.first: float | None = None
        self.last = 0.0
        self.rows = 0  # prompt rows arrived since the last step
        self.ends: deque[float] = deque()  # when requests ended, the last RECENT_END_S of them
        self.expected = 0  # requests the burst being gathered is expected to hold (0: unknown)
        self.arrivals = 0  # requests arrived since the last step
        self.complete = False  # the expected burst has arrived: no new gather until the step

    def ended(self, n: int) -> None:
        """`n` requests ended (their clients may send again at once)."""
        now = time.monotonic()
        self.ends.extend([now] * n)
        while self.ends and self.ends[0] < now - RECENT_END_S:
            self.ends.popleft()

    def arrived(self, idle: bool, rows: int) -> None:
        now = time.monotonic()
        if idle and self.first is None and self.rows < self.budget and not self.complete:
            self.first = now
            while self.ends and self.ends[0] < now - RECENT_END_S:
                self.ends.popleft()
            self.expected = len(self.ends)
        self.last = now
        self.rows += rows
        self.arrivals += 1
        if self.rows >= self.budget:
            self.first = None
        elif self.first is not None and 0 < self.expected <= self.arrivals:
            self.first, self.complete = None, True

    def stepped(self) -> None:
        self.rows = self.arrivals = 0
        self.complete = False

    def wait_s(self) -> float:
        """Seconds the step should still wait (0: step now)."""
        if self.first is None:
            return 0.0
        now = time.monotonic()
        left = min(self.last + GATHER_QUIET_S, self.first + GATHER_MAX_S) - now
        if left <= 0:
            self.first = None
            return 0.0
        return left


def kernel_class(device: torch.device) -> str:
    """The CPU kernels' class this worker runs (`WorkerStats.kernels`; "" where none)."""
    from services.gpu_worker import cpu_kernels

    if device.type != "cpu" or cpu_kernels.library() is None:
        return ""
    return cpu_kernels.cpu_class()


class GpuWorker:
    def __init__(self, d: Deployment, bind_addr: str, advertise_addr: str, conductor_addr: str, worker_id: str,
                 group: TpGroup | None = None) -> None:
        self.d = d
        self.worker_id = worker_id
        self.bind_addr = bind_addr
        self.advertise_addr = advertise_addr
        # All cores but one (as vLLM's CPU build): the api, data worker and conductor need a
        # core too, and oversubscribing a small machine costs far more than one thread. The
        # cores are the ones the affinity mask and the container's CPU quota allow.
        torch.set_num_threads(int(os.environ.get("MSTAR_TORCH_THREADS") or max(1, available_cpus() - 1)))
        parts = assemble(d, group)
        self.spec, self.pools, self.kv, self.engine = parts.spec, parts.pools, parts.kv, parts.engine
        #: this worker's tensor-parallel group, as its rank 0 (None: one process)
        self.group = group
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        if bind_addr.startswith("ipc://") and os.path.exists(bind_addr[6:]):
            os.unlink(bind_addr[6:])
        curve.secure_server(self.pull, bind_addr)
        self.pull.bind(bind_addr)
        self.conductor = self.ctx.socket(zmq.PUSH)
        self.conductor.setsockopt(zmq.LINGER, 1000)
        curve.secure_client(self.conductor, conductor_addr)
        self.conductor.connect(conductor_addr)
        self.replies: dict[str, zmq.Socket] = {}
        self.in_codec = FrameCodec(ToWorker)
        self.out_codec = FrameCodec(ToApi)
        self.running = True
        self.gather = Gather(d.max_batch_tokens)
        self.incarnation = uuid.uuid4().hex
        self.fingerprint = fingerprint(d)
        self.refused: str | None = None  # the conductor's reason, when it refused this worker
        self._last_stats: tuple | None = None
        tensor = next(itertools.chain(parts.model.parameters(), parts.model.buffers()), torch.empty(0))
        self._kernels = kernel_class(tensor.device)
        self.liveness = Liveness(self.ctx, conductor_addr, worker_id, self.incarnation, self._held)
        #: the exit status `__main__` returns (a lost device or a hung step: non-zero, restarted)
        self.exit_code = 0

    # -- wire ------------------------------------------------------------------------

    def _reply(self, address: str) -> zmq.Socket:
        sock = self.replies.get(address)
        if sock is None:
            sock = self.replies[address] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            curve.secure_client(sock, address)
            sock.connect(address)
        return sock

    def _to_conductor(self, msg: msgspec.Struct) -> None:
        self.conductor.send_multipart(self.out_codec.encode(msg), copy=False)

    def _send_results(self, res: StepResult) -> None:
        by_dest: dict[str, list] = {}
        for dest, out in res.outputs:
            if dest:
                by_dest.setdefault(dest, []).append(out)
        if trace.enabled():
            for _, out in res.outputs:
                trace.stamp(out.request_id, "gpu.send")
        for dest, outs in by_dest.items():
            self._reply(dest).send_multipart(self.out_codec.encode(StepOutputs(outs)), copy=False)
        for dest, err in res.errors:
            if dest:
                self._reply(dest).send_multipart(self.out_codec.encode(err), copy=False)
        for rid, pages, status in res.finished:
            self._to_conductor(RequestFinished(self.worker_id, rid, pages, status))
        if res.finished:
            self.gather.ended(len(res.finished))
        if res.finished:
            # pages were released: report now, not at the next tick, so /metrics agrees with
            # the replies a client already holds (peaks of requests shorter than a tick included)
            self._stats()

    def _handle(self, frames: list) -> None:
        try:
            msg, bufs = self.in_codec.decode(frames)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            log.error("protocol error from conductor: %s (frame dropped)", exc)
            return
        if isinstance(msg, NewRequest):
            trace.stamp(msg.request_id, "gpu.recv")
            self.gather.arrived(idle=not self.engine.running, rows=msg.prompt_len)
            try:
                self.engine.add(msg, unpack_tensors(msg.input_tensors, bufs))
                trace.stamp(msg.request_id, "gpu.added")
            except Exception as exc:
                error_id = new_error_id()
                log.error("request %s refused at ingest (error_id=%s): %s", msg.request_id, error_id, exc)
                res = StepResult()
                res.errors.append((msg.reply_to,
                                   error_frame(msg.request_id, ErrorKind.INTERNAL, "internal error", error_id)))
                res.finished.append(Finished(msg.request_id, 0, "error"))
                self._send_results(res)
        elif isinstance(msg, WorkerRefused):
            log.error("%s", msg.reason)
            self.refused, self.running = msg.reason, False
        elif isinstance(msg, Abort):
            found = self.engine.abort(msg.request_id)
            if found is not None:
                self._to_conductor(RequestFinished(self.worker_id, msg.request_id, found[1], "abort"))

    def _stats(self, force: bool = False) -> None:
        pools = self.kv.stats()
        kv = self.kv
        drafted, accepted = self.engine.spec_draft_tokens, self.engine.spec_accepted_tokens
        encodes = int(getattr(self.engine.runner, "encodes", 0))  # a world model's (runners/world.py)
        denoised = int(getattr(self.engine.runner, "denoise_steps", 0))  # a diffusion model's (runners/diffusion.py)
        key = (tuple(pools), len(self.engine.running), len(self.engine.waiting), kv.footprint_overruns,
               kv.prefix_queries, drafted, encodes, denoised)
        if force or key != self._last_stats:
            self._last_stats = key
            self._to_conductor(WorkerStats(self.worker_id, pools, len(self.engine.running), len(self.engine.waiting),
                                           kv.footprint_overruns, kv.prefix_queries, kv.prefix_hit_tokens,
                                           drafted, accepted, kernels=self._kernels, clip_encodes=encodes,
                                           denoise_steps=denoised))

    def _held(self) -> str:
        """The requests this worker holds, for the step watchdog's log line."""
        running = [r.request_id for r in list(self.engine.running)]
        return f"{len(running)} running request(s) {running[:16]}, {len(self.engine.waiting)} waiting"

    def _step(self) -> None:
        if trace.enabled():
            for r in self.engine.running + list(self.engine.waiting):
                trace.stamp(r.request_id, "gpu.step")
        self.liveness.step_began()
        try:
            res = self.engine.step()
        except DeviceLost as lost:
            # The device cannot run another step: fail what the step held, then exit so the
            # supervisor starts a fresh process (every later step would fail the same way).
            log.critical("the worker cannot step again (%s); failing every request and exiting", lost.cause)
            self._send_results(lost.result)
            self.exit_code, self.running = 1, False
            return
        finally:
            self.liveness.step_ended()
        self._send_results(res)

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "running", False))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "running", False))
        ready = WorkerReady(self.worker_id, self.advertise_addr, list(self.pools.values()), self.incarnation,
                            self.fingerprint)
        self._to_conductor(ready)
        self._stats(force=True)
        self.liveness.start()
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        last_stats = last_beat = busy_at = trimmed_at = time.monotonic()
        release_free_heap()  # what loading and the warm-up freed
        trimmed = True
        while self.running:
            wait = self.gather.wait_s()
            timeout = int(wait * 1e3) if wait else 0 if self.engine.has_work else 50  # ms (pyzmq truncates too)
            if poller.poll(timeout):
                while True:
                    try:
                        frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle([f.buffer for f in frames])
            if self.engine.has_work and not self.gather.wait_s():
                self._step()
                self.gather.stepped()
            now = time.monotonic()
            if self.engine.has_work:
                busy_at, trimmed = now, False
                if now - trimmed_at >= TRIM_EVERY_S:  # under a long load too: glibc keeps freed step buffers
                    release_free_heap()
                    trimmed_at = now
            elif not trimmed and now - busy_at >= TRIM_AFTER_IDLE_S:
                release_free_heap()  # a load's step buffers, freed: resident memory follows the load
                trimmed, trimmed_at = True, now
            if now - last_stats >= STATS_INTERVAL_S:
                self._stats()
                last_stats = now
            if now - last_beat >= ANNOUNCE_INTERVAL_S:
                self._to_conductor(ready)  # for a conductor that just (re)started, with fresh stats
                self._stats(force=True)
                last_beat = now
                if self.group is not None and not self.engine.has_work:
                    self._group_beat()
            if self.group is not None and self.running and self.group.dead_child() is not None:
                self._group_lost(GroupLost(f"tensor-parallel rank exited with code {self.group.dead_child()}"))
        self.shutdown()

    def _group_beat(self) -> None:
        """Idle: a heartbeat through the tensor-parallel group (it finds a rank on another
        host gone before a request does)."""
        try:
            self.engine.runner.beat()  # type: ignore[attr-defined]
        except GroupLost as exc:
            self._group_lost(exc)

    def _group_lost(self, exc: GroupLost) -> None:
        """A rank died: fail what this worker holds (503) and exit non-zero, so the
        supervisor restarts the group."""
        log.critical("%s; failing every request and exiting so the group restarts", exc)
        self._send_results(self.engine.fail_all(ErrorKind.WORKER_FAILED, GROUP_LOST))
        self.exit_code, self.running = 1, False

    def shutdown(self) -> None:
        self._send_results(self.engine.fail_all(ErrorKind.WORKER_FAILED, "the worker is shutting down"))
        if self.group is not None:
            if self.exit_code == 0:  # a clean stop: the other ranks exit too (else they die with the group)
                self.engine.runner.stop()  # type: ignore[attr-defined]
                self.group.close()
            else:
                self.group.close_children()
        self._stats(force=True)
        self.liveness.stop()
        for sock in self.replies.values():
            sock.close(0)
        self.pull.close(0)
        self.conductor.close(linger=SHUTDOWN_LINGER_MS)
        curve.stop(self.ctx)
        self.ctx.term()
        cleanup_ipc(self.bind_addr)
