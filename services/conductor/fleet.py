"""Several models behind one conductor (llama-server's router mode, issue 57).

The conductor process keeps one `Conductor` per served model (its spec, its workers, its
queue, its admission by footprint) behind the one pair of sockets every peer knows:
- a `NewRequest` goes to its model's conductor by its `model` (the served name the api
  put on it); a worker's frames by its worker id; a `WorkerReady` by its fingerprint (the
  model the worker loaded), so gpu workers need no notion of a model's name;
- an `Abort` to every model's conductor (only the one holding the request acts on it).

Load on first use and LRU (`--models-max N`): at most N models are *wanted* (their gpu
workers running; the launcher starts and stops the processes by `ModelState.wanted` in
the status it polls). A request for a model not wanted queues in that model's conductor;
when a slot is free the model is wanted (its workers start, register, and drain the
queue); when none is, the least recently used wanted model with nothing queued (or whose
oldest queued request came after the waiting model's: a busy model cannot starve another)
drains: it places no more requests (new ones queue), and once its running requests finished it is
no longer wanted: its workers are retired (forgotten without failing anything, their
late beats ignored) and the launcher stops their processes. A request waits for its
model's load within `--queue-timeout-s`, as it waits for a first worker.
`ModelCommand` (the api's `POST /models/load` and `/models/unload`) asks the same.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from contextlib import aclosing

import msgspec
import zmq
import zmq.asyncio

from services.conductor.conductor import Conductor
from shared import curve
from shared.config import Deployment
from shared.errors import ErrorKind
from shared.frames import (
    Abort,
    ClusterStatus,
    Fingerprint,
    FrameCodec,
    Heartbeat,
    ModelCommand,
    ModelState,
    NewRequest,
    RequestError,
    RequestFinished,
    StatusQuery,
    ToConductor,
    WorkerReady,
    WorkerRefused,
    WorkerStats,
)
from shared.models import ServedModel
from shared.specs.base import ModelSpec
from shared.zmq_utils import Pushers, bind, bind_pull, cleanup_ipc, recv_frames

log = logging.getLogger("mstar.conductor")

RECONCILE_S = 0.25


class Fleet:
    def __init__(self, d: Deployment, models: list[tuple[ServedModel, ModelSpec, Fingerprint]],
                 addrs: dict[str, str], models_max: int = 0) -> None:
        self.addrs = addrs
        self.ctx = zmq.asyncio.Context()
        self.pushers = Pushers(self.ctx)
        self.codec = FrameCodec(ToConductor)
        self.ctl_codec = FrameCodec(StatusQuery | ModelCommand)
        self.conductors: dict[str, Conductor] = {}
        for m, spec, fp in models:
            c = Conductor(msgspec.structs.replace(d, model=m.model), spec, addrs, fp, self.pushers, self.ctx)
            self.conductors[m.name] = c
        self.order = list(self.conductors)
        self.models_max = models_max if models_max > 0 else math.inf
        cap = len(self.order) if models_max <= 0 else models_max
        self.wanted = {n: i < cap for i, n in enumerate(self.order)}
        self.draining: set[str] = set()
        self.asked: set[str] = set()  # POST /models/load, waiting for a slot
        self.last_used: dict[str, float] = {}
        self.retired: set[str] = set()  # incarnations of workers of an unloaded model

    async def run(self) -> None:
        pull = bind_pull(self.ctx, self.addrs["conductor"])
        router = bind(self.ctx, zmq.ROUTER, self.addrs["conductor_control"])
        log.info("serving %d models (%s), at most %s loaded", len(self.order), ", ".join(self.order),
                 self.models_max)
        try:
            duties = [t for c in self.conductors.values() for t in c.background()]
            await asyncio.gather(self._intake(pull), self._control(router), self._reconcile_loop(), *duties)
        finally:
            pull.close(0)
            router.close(0)
            self.pushers.close()
            cleanup_ipc(self.addrs["conductor"])
            cleanup_ipc(self.addrs["conductor_control"])
            curve.stop(self.ctx)  # else exit hangs on the ZAP handler's socket (a CURVE deployment)

    # -- sockets ---------------------------------------------------------------------------

    async def _intake(self, pull: zmq.Socket) -> None:
        async with aclosing(recv_frames(pull, self.codec, "conductor intake")) as frames:
            async for msg, bufs in frames:
                try:
                    await self._on(msg, bufs)
                except Exception:
                    log.exception("error handling %s (dropped)", type(msg).__name__)

    async def _control(self, router: zmq.asyncio.Socket) -> None:
        while True:
            ident, *frames = await router.recv_multipart()
            try:
                query, _ = self.ctl_codec.decode(frames)
            except Exception as exc:
                log.error("bad control frame: %s", exc)
                continue
            if isinstance(query, ModelCommand):
                reply = await self.command(query)
            else:
                reply = self.status(query.model)
            await router.send_multipart([ident, self.codec.encode(reply)[0]])

    # -- frames ----------------------------------------------------------------------------

    async def _on(self, msg, bufs: list) -> None:
        if isinstance(msg, NewRequest):
            c = self.conductors.get(msg.model)
            if c is None:
                err = RequestError(msg.request_id, ErrorKind.INVALID, f"the model `{msg.model}` is not served here",
                                   "model", code="model_not_found")
                await self.pushers.send(msg.reply_to, self.codec.encode(err))
                return
            self.last_used[msg.model] = time.monotonic()
            await c._on(msg, bufs)
            await self.reconcile()
        elif isinstance(msg, Abort):
            for c in self.conductors.values():
                await c._on(msg, bufs)
        elif isinstance(msg, WorkerReady):
            await self._worker_ready(msg)
        elif isinstance(msg, (WorkerStats, Heartbeat, RequestFinished)):
            worker_id = msg.sender if isinstance(msg, Heartbeat) else msg.worker_id
            owner = next((c for c in self.conductors.values() if worker_id in c.workers), None)
            if owner is not None:
                await owner._on(msg, bufs)
                if isinstance(msg, RequestFinished):
                    await self.reconcile()

    async def _worker_ready(self, msg: WorkerReady) -> None:
        """Registered with the model whose fingerprint it carries, while that model is
        wanted; a worker of no served model is refused (it exits), one of an unloaded
        model, or retired, is left alone (the launcher is stopping it)."""
        if msg.incarnation in self.retired:
            return
        name = next((n for n, c in self.conductors.items()
                     if c.fingerprint is not None and msg.fingerprint is not None
                     and c.fingerprint.model == msg.fingerprint.model), None)
        if name is None:
            theirs = msg.fingerprint.model if msg.fingerprint else "no fingerprint"
            reason = (f"worker {msg.worker_id} at {msg.address} refused: it loaded {theirs}, which is none of the "
                      f"served models ({', '.join(self.order)})")
            log.error("%s", reason)
            await self.pushers.send(msg.address, self.codec.encode(WorkerRefused(msg.worker_id, reason)))
            return
        if self.wanted[name]:
            await self.conductors[name]._on(msg, [])

    # -- load and unload ---------------------------------------------------------------------

    async def command(self, cmd: ModelCommand) -> ClusterStatus:
        if cmd.model not in self.conductors:
            return self._refused(f"the model `{cmd.model}` is not served here; served: {', '.join(self.order)}")
        if cmd.action == "load":
            self.draining.discard(cmd.model)
            self.conductors[cmd.model].paused = False
            if not self.wanted[cmd.model]:
                self.asked.add(cmd.model)
                self.last_used[cmd.model] = time.monotonic()
        elif cmd.action == "unload":
            self.asked.discard(cmd.model)
            if self.wanted[cmd.model]:
                self._drain(cmd.model)
        else:
            return self._refused(f"action must be load or unload, got {cmd.action!r}")
        await self.reconcile()
        return self.status("")

    def _refused(self, why: str) -> ClusterStatus:
        return ClusterStatus(0, models=self.model_states(), error=why)

    def _drain(self, name: str) -> None:
        log.info("model %s drains to be unloaded", name)
        self.draining.add(name)
        self.conductors[name].paused = True

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_S)
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconciling the loaded models failed")

    async def reconcile(self) -> None:
        """Unload what drained; then load the models that wait (oldest request first),
        each into a free slot or the slot of the least recently used idle model."""
        for name in [n for n in self.order if n in self.draining]:
            c = self.conductors[name]
            if not any(w.requests for w in c.workers.values()):
                self.draining.discard(name)
                self.wanted[name] = False
                c.paused = False
                self.retired.update(c.retire())
                log.info("model %s unloaded", name)
        for name in self._waiting_models():
            if sum(self.wanted.values()) < self.models_max:
                self.wanted[name] = True
                self.asked.discard(name)
                log.info("model %s loading", name)
                continue
            if self.draining:
                return  # a slot is being freed; the next reconcile takes it
            # a loaded model whose queue is empty, or whose oldest request came after this
            # model's oldest (so a busy model cannot starve another past its queue timeout)
            waited = self._oldest(name)
            victims = [n for n in self.order if self.wanted[n] and self._oldest(n) > waited]
            if not victims:
                return
            self._drain(min(victims, key=lambda n: self.last_used.get(n, -1.0)))
            return await self.reconcile()

    def _oldest(self, name: str) -> float:
        """When the model's oldest queued request arrived (inf: none queued; a load command
        with nothing queued counts from the command)."""
        c = self.conductors[name]
        times = [c.queued_at.get(r.request_id, math.inf) for r, _ in c.queue]
        return min(times, default=self.last_used.get(name, 0.0) if name in self.asked else math.inf)

    def _waiting_models(self) -> list[str]:
        """Models not wanted that a request (or a load command) waits for, oldest first."""
        return sorted((n for n in self.order if not self.wanted[n] and (self.conductors[n].queue or n in self.asked)),
                      key=self._oldest)

    # -- status --------------------------------------------------------------------------------

    def model_states(self) -> list[ModelState]:
        now = time.monotonic()
        states = []
        for name in self.order:
            c = self.conductors[name]
            ready = len(c.workers)
            status = ("unloading" if name in self.draining else "loaded" if ready else "loading") \
                if self.wanted[name] else "unloaded"
            used = self.last_used.get(name)
            states.append(ModelState(name, status, self.wanted[name], ready,
                                     sum(len(w.requests) for w in c.workers.values()), len(c.queue),
                                     -1.0 if used is None else round(now - used, 3)))
        return states

    def status(self, model: str) -> ClusterStatus:
        """One model's status (`model` named), or every model's summed ("")."""
        if model in self.conductors:
            return msgspec.structs.replace(self.conductors[model].status(), models=self.model_states())
        parts = [c.status() for c in self.conductors.values()]
        return ClusterStatus(sum(p.ready_workers for p in parts), [w for p in parts for w in p.workers],
                             sum(p.waiting for p in parts), {k: v for p in parts for k, v in p.dispatched.items()},
                             self.model_states())

