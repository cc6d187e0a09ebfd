"""The conductor: validates the deployment, sets each request's loop caps and KV configs,
refuses what cannot fit, admits by footprint, picks a worker and routes aborts.

Admission: the conductor tracks, per worker and pool, the pages it has promised (the sum
of the footprints of requests dispatched there and not yet finished). A request is sent
only to a worker whose unpromised pages cover its footprint; otherwise it waits in one
FIFO queue. The queue is served strictly oldest first (a head that does not fit blocks
the rest), so a large request is never starved by small ones behind it.

Placement (issue 27): among the workers whose unpromised pages fit, the least loaded one
(requests placed there and not finished: the conductor knows it at once, where a
worker's stats trail by a tick), ties broken round-robin. Free pages are not a measure of
load: a worker with a bigger pool once took every request of a 16-client burst while its
peer idled. A worker whose prefix cache holds the request's leading pages wins if its load
is within `AFFINITY_SLACK` of the least (SGLang's cache-aware router balances the same way).

With no worker registered a request waits at most `Deployment.queue_timeout_s` (30 s),
then gets a 503 naming the reason, instead of hanging until a worker comes back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict, deque
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shared import curve, trace
from shared.config import Deployment
from shared.errors import SERVER_SIDE, ErrorKind, new_error_id
from shared.fingerprint import mismatch
from shared.frames import (
    Abort,
    ClusterStatus,
    Dispatched,
    Fingerprint,
    FrameCodec,
    Heartbeat,
    NewRequest,
    RequestError,
    RequestFinished,
    StatusQuery,
    ToConductor,
    WorkerReady,
    WorkerRefused,
    WorkerStats,
)
from shared.layout import (
    PagedKVConfig,
    hit_pages,
    label_footprint,
    leading_keys,
    prefix_chain,
    prompt_pages,
    shareable_count,
)
from shared.pages import pages_for
from shared.specs.base import ModelSpec
from shared.zmq_utils import Pushers, bind, bind_pull, cleanup_ipc, recv_frames

log = logging.getLogger("mstar.conductor")

TOMBSTONE_TTL_S = 60.0
#: a worker holding a request's prefix may have this many more requests in flight than the
#: least loaded one (or a quarter more, when more) and still be preferred for it
AFFINITY_SLACK = 2
#: a worker silent this long (no heartbeat: SIGSTOPped, dead, deadlocked) is declared
#: failed; workers beat from a thread of their own, so a long step never counts (a step
#: past the step watchdog is the worker's to end: services/gpu_worker/liveness.py)
HEARTBEAT_TIMEOUT_S = float(os.environ.get("MSTAR_HEARTBEAT_TIMEOUT", "5"))


class Refusal(Exception):
    """A request the conductor will not run: what went wrong (`kind`), a client-safe
    `message` naming the limit, and the request field it concerns (`param`)."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.param = kind, message, param


@dataclass
class WorkerState:
    worker_id: str
    address: str
    pools: dict[str, PagedKVConfig]
    incarnation: str = ""
    promised: dict[str, int] = field(default_factory=dict)
    requests: dict[str, tuple[dict[str, int], str]] = field(default_factory=dict)  # id -> (pages per pool, reply_to)
    stats: WorkerStats | None = None
    last_seen: float = field(default_factory=time.monotonic)
    monitor: asyncio.Task | None = None
    #: chain keys of prompt pages recently sent here: an estimate of its prefix cache
    cached: OrderedDict = field(default_factory=OrderedDict)
    dispatched: int = 0
    #: how long the worker's running step had run at its last heartbeat (0.0: between steps),
    #: said when it goes silent
    step_s: float = 0.0
    #: when the conductor last placed a request here (round-robin among equals)
    picked: int = 0

    def remember(self, keys: dict[str, tuple[list[int], int]]) -> None:
        """What the worker's prefix index holds once the request's prompt ran: every full
        prompt page (LRU order, bounded by its pool sizes)."""
        capacity = sum(p.num_pages for p in self.pools.values())
        for chain, _ in keys.values():
            for k in chain:
                self.cached[k] = None
                self.cached.move_to_end(k)
        while len(self.cached) > capacity:
            self.cached.popitem(last=False)

    def hit_pages(self, keys: dict[str, tuple[list[int], int]]) -> int:
        """Leading pages every label would share here (0 if any label shares none): of its
        shareable pages, those this worker's index holds, as `KVManager` matches them."""
        if not keys:
            return 0
        return min(next((i for i, k in enumerate(chain[:n]) if k not in self.cached), n) for chain, n in keys.values())

    def free(self, pool: str) -> int:
        return self.pools[pool].num_pages - self.promised.get(pool, 0)

    def fits(self, need: dict[str, int]) -> bool:
        return all(self.free(p) >= n for p, n in need.items())


def _loop_needs(spec: ModelSpec, loops: dict[str, int], max_tokens: int, prompt_len: int) -> dict[str, int]:
    """The iterations the request needs of each loop, or a 400 naming the first loop whose
    `max_iters` it exceeds: every loop a model declares is refused the same way (the decode
    loop's own message comes first, from max_tokens)."""
    need = spec.get_loop_caps(max_tokens, prompt_len=prompt_len)
    unknown = sorted(set(need) - set(loops))
    if unknown:
        raise Refusal(ErrorKind.INTERNAL, f"get_loop_caps names loop(s) {unknown} the graph does not have")
    for loop, n in need.items():
        if n > loops[loop]:
            raise Refusal(ErrorKind.TOO_LONG, f"the request needs {n} iterations of loop {loop!r}, "
                                              f"which runs at most {loops[loop]} (its max_iters)", "max_tokens")
    return need


def plan_request(spec: ModelSpec, req: NewRequest, pools: dict[str, PagedKVConfig]) -> NewRequest:
    """Fill max_tokens, loop caps and KV configs, or raise `Refusal` naming the limit.

    `pools` is a worker's actual pool set (sizes included)."""
    try:
        spec.refuse_undeclared_labels(req.kv_layout)
    except ValueError as exc:
        raise Refusal(ErrorKind.INTERNAL, str(exc)) from exc
    max_seq_len = min(p.max_seq_len for p in pools.values())
    if spec.engine == "pooling":  # a prompt's forward, no decode loop (embed, score)
        return _plan_pooling(spec, req, pools, max_seq_len)
    if spec.engine in ("policy", "world"):  # a prefix, then its loop inside the worker
        return _plan_policy(spec, req, pools, max_seq_len)
    loops = spec.graph_loops()
    decode_iters = loops.get(spec.decode_loop)
    if req.prompt_len >= max_seq_len:
        raise Refusal(ErrorKind.TOO_LONG,
                      f"prompt is {req.prompt_len} tokens; "
                      f"with at least 1 new token it exceeds max_seq_len {max_seq_len}", "prompt")
    max_tokens = req.max_tokens
    if max_tokens is None:
        # The most the loop and the sequence limit allow for this prompt.
        max_tokens = max_seq_len - req.prompt_len
        if decode_iters is not None:
            max_tokens = min(max_tokens, decode_iters + 1)
        # ...and what the smallest pool can hold (one row per token, the last never written).
        pool_rows = min(p.num_pages * p.page_size for p in pools.values())
        max_tokens = max(1, min(max_tokens, pool_rows - req.prompt_len + 1))
        if req.max_tokens_default is not None:  # the model's own default (generation_config.json)
            max_tokens = min(max_tokens, req.max_tokens_default)
    if decode_iters is not None and max_tokens - 1 > decode_iters:
        named = "" if spec.decode_loop == "decode_loop" else f" ({spec.decode_loop})"  # a speech model's frame_loop
        raise Refusal(ErrorKind.TOO_LONG,
                      f"max_tokens - 1 = {max_tokens - 1} exceeds the decode loop's max_iters {decode_iters}{named}",
                      "max_tokens")
    if req.prompt_len + max_tokens > max_seq_len:
        raise Refusal(ErrorKind.TOO_LONG,
                      f"prompt ({req.prompt_len} tokens) + max_tokens ({max_tokens}) = {req.prompt_len + max_tokens} "
                      f"exceeds max_seq_len {max_seq_len}", "max_tokens")
    caps = spec.clamp_caps(_loop_needs(spec, loops, max_tokens, req.prompt_len))
    configs = spec.kv_configs(req.kv_layout, caps, pools)
    for name, cfg in configs.items():
        if cfg.total_pages > pools[name].num_pages:
            raise Refusal(ErrorKind.TOO_LONG,
                          f"the request needs {cfg.total_pages} KV pages of pool {name!r}, "
                          f"which holds {pools[name].num_pages} in all", "max_tokens")
    return msgspec.structs.replace(req, max_tokens=max_tokens, loop_caps=caps, kv_configs=configs)


def _plan_pooling(spec: ModelSpec, req: NewRequest, pools: dict[str, PagedKVConfig],
                  max_seq_len: int) -> NewRequest:
    """A pooling request (embeddings, scores): its prompt and no output. The model's max
    length bounds the input (sentence-transformers' `max_seq_length`), never cut here."""
    if req.prompt_len > max_seq_len:
        raise Refusal(ErrorKind.TOO_LONG,
                      f"input is {req.prompt_len} tokens; the model's max length is {max_seq_len} "
                      "(set truncate_prompt_tokens to cut it)", "input")
    configs = spec.kv_configs(req.kv_layout, {}, pools)
    for name, cfg in configs.items():
        if cfg.total_pages > pools[name].num_pages:
            raise Refusal(ErrorKind.TOO_LONG, f"the input needs {cfg.total_pages} KV pages of pool {name!r}, "
                                              f"which holds {pools[name].num_pages} in all", "input")
    # max_tokens 1: the engine's one output is the pooled result, no token
    return msgspec.structs.replace(req, max_tokens=1, loop_caps={}, kv_configs=configs)


def _plan_policy(spec: ModelSpec, req: NewRequest, pools: dict[str, PagedKVConfig],
                 max_seq_len: int) -> NewRequest:
    """A policy request: its prefix (cameras and prompt) bounded by max_seq_len, and each
    loop's cap (the flow loop's steps) within its max_iters, as any loop's."""
    if req.prompt_len > max_seq_len:
        raise Refusal(ErrorKind.TOO_LONG, f"the prefix (cameras and prompt) is {req.prompt_len} rows; the model's "
                                          f"max length is {max_seq_len}", "prompt")
    loops = spec.graph_loops()
    caps = spec.clamp_caps(_loop_needs(spec, loops, 1, req.prompt_len))
    configs = spec.kv_configs(req.kv_layout, caps, pools)
    for name, cfg in configs.items():
        if cfg.total_pages > pools[name].num_pages:
            raise Refusal(ErrorKind.TOO_LONG, f"the prefix needs {cfg.total_pages} KV pages of pool {name!r}, "
                                              f"which holds {pools[name].num_pages} in all", "prompt")
    return msgspec.structs.replace(req, max_tokens=1, loop_caps=caps, kv_configs=configs)


def pick_worker(options: list[tuple[WorkerState, dict[str, int], int]]) -> tuple[WorkerState, dict[str, int]]:
    """The worker for a request, of (worker, pages to promise, prefix pages it shares) for
    each worker it fits: the least loaded (requests in flight there), except that one
    sharing the request's prefix wins while its load is within `AFFINITY_SLACK` (or a
    quarter) of the least; equals in turn (round-robin: the one picked longest ago)."""
    least = min(len(w.requests) for w, _, _ in options)
    near = [o for o in options if len(o[0].requests) <= least + max(AFFINITY_SLACK, least // 4)]
    w, need, _ = min(near, key=lambda o: (-o[2], len(o[0].requests), o[0].picked))
    return w, need


class ConductorSockets:
    """The conductor process's two sockets, as one model's `Conductor` and the `Fleet` of
    several serve them: frames on the PULL socket go to `_on`, each control query on the
    ROUTER socket is answered with `_reply`'s status."""

    addrs: dict[str, str]
    ctx: zmq.asyncio.Context
    pushers: Pushers
    codec: FrameCodec
    ctl_codec: FrameCodec

    async def serve(self, duties: list) -> None:
        """Bind both sockets and run them beside `duties` (coroutines) until cancelled."""
        pull = bind_pull(self.ctx, self.addrs["conductor"])
        router = bind(self.ctx, zmq.ROUTER, self.addrs["conductor_control"])
        try:
            await asyncio.gather(self._intake(pull), self._control(router), *duties)
        finally:
            pull.close(0)
            router.close(0)
            self.pushers.close()
            cleanup_ipc(self.addrs["conductor"])
            cleanup_ipc(self.addrs["conductor_control"])
            curve.stop(self.ctx)  # else exit hangs on the ZAP handler's socket (a CURVE deployment)

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
            reply = await self._reply(query)
            await router.send_multipart([ident, self.codec.encode(reply)[0]])

    async def _on(self, msg, bufs: list) -> None:
        raise NotImplementedError

    async def _reply(self, query) -> ClusterStatus:
        raise NotImplementedError


class Conductor(ConductorSockets):
    def __init__(self, d: Deployment, spec: ModelSpec, addrs: dict[str, str],
                 fingerprint: Fingerprint | None = None, pushers: Pushers | None = None,
                 ctx: zmq.asyncio.Context | None = None) -> None:
        self.d = d
        #: what a worker must have loaded to join (None: no check, for in-process tests)
        self.fingerprint = fingerprint
        self.refused: OrderedDict[str, str] = OrderedDict()  # incarnation -> reason, logged once
        self.spec = spec
        self.addrs = addrs
        #: shared by the models' conductors of one process (`fleet.Fleet`), else its own
        self.ctx = ctx or zmq.asyncio.Context()
        self.pushers = pushers or Pushers(self.ctx)
        #: set while the model drains to be unloaded: requests queue, none is placed
        self.paused = False
        self.codec = FrameCodec(ToConductor)
        self.ctl_codec = FrameCodec(StatusQuery)
        self.workers: dict[str, WorkerState] = {}
        self.queue: deque[tuple[NewRequest, list]] = deque()
        self.placement: dict[str, str] = {}  # request id -> worker id
        self.tombstones: OrderedDict[str, float] = OrderedDict()
        # incarnation of a worker declared failed -> the requests it held, aborted on it if
        # it ever speaks again (a SIGSTOPped worker resumed)
        self.dead: OrderedDict[str, list[str]] = OrderedDict()
        #: request id -> when it joined the queue (monotonic)
        self.queued_at: dict[str, float] = {}
        #: since when no worker has been registered (None while one is)
        self.no_worker_since: float | None = time.monotonic()
        self._picks = 0

    async def run(self) -> None:
        await self.serve(self.background())

    def background(self) -> list:
        """The periodic duties beside the sockets: heartbeats watched, the queue expired."""
        return [self._watch_heartbeats(), self._expire_queue()]

    def retire(self) -> list[str]:
        """Forget every worker without failing anything (the model is unloaded, its requests
        all finished): the incarnations retired, so a late beat of theirs is not taken for
        a new worker."""
        gone = []
        for w in list(self.workers.values()):
            if w.monitor is not None:
                w.monitor.cancel()
            self.pushers.drop(w.address)
            gone.append(w.incarnation)
            log.info("worker %s retired (its model is unloaded)", w.worker_id)
        self.workers.clear()
        self.no_worker_since = time.monotonic()
        return gone

    # -- sockets -------------------------------------------------------------------------

    async def _reply(self, query: StatusQuery) -> ClusterStatus:
        return self.status()

    def status(self) -> ClusterStatus:
        stats = [w.stats for w in self.workers.values() if w.stats is not None]
        return ClusterStatus(len(self.workers), stats, len(self.queue),
                             {w.worker_id: w.dispatched for w in self.workers.values()})

    # -- frames ----------------------------------------------------------------------------

    async def _on(self, msg, bufs: list) -> None:
        if isinstance(msg, NewRequest):
            await self._new_request(msg, bufs)
        elif isinstance(msg, Abort):
            await self._abort(msg)
        elif isinstance(msg, RequestFinished):
            self._release(msg.worker_id, msg.request_id)
            await self._drain_queue()
        elif isinstance(msg, WorkerReady):
            await self._worker_ready(msg)
        elif isinstance(msg, WorkerStats):
            w = self.workers.get(msg.worker_id)
            if w is not None:
                w.stats, w.last_seen = msg, time.monotonic()
        elif isinstance(msg, Heartbeat):
            self._heartbeat(msg)

    async def _new_request(self, req: NewRequest, bufs: list) -> None:
        trace.stamp(req.request_id, "cond.recv")
        self._prune_tombstones()
        if req.request_id in self.tombstones:
            return  # the client left before the request got here
        try:
            if req.request_id in self.placement or any(r.request_id == req.request_id for r, _ in self.queue):
                raise Refusal(ErrorKind.CONFLICT, f"request_id {req.request_id!r} is already running", "request_id")
            pools = self._reference_pools()
            if pools is None:
                self.queue.append((req, bufs))  # no worker yet: plan once one announces itself
                self.queued_at[req.request_id] = time.monotonic()
                return
            planned = plan_request(self.spec, req, pools)
            for name, n in self._need(planned).items():
                if n > pools[name].num_pages:
                    raise Refusal(ErrorKind.TOO_LONG,
                                  f"the request needs {n} KV pages of pool {name!r} "
                                  f"under {self.d.admission} admission, "
                                  f"which holds {pools[name].num_pages} in all", "max_tokens")
        except Refusal as r:
            await self._refuse(req, r)
            return
        self.queue.append((planned, bufs))
        self.queued_at[req.request_id] = time.monotonic()
        await self._drain_queue()

    def _reference_pools(self) -> dict[str, PagedKVConfig] | None:
        if not self.workers:
            return None
        # Plan against the largest worker so a request any worker can hold is accepted.
        return max(self.workers.values(), key=lambda w: sum(p.num_pages for p in w.pools.values())).pools

    async def _refuse(self, req: NewRequest, r: Refusal) -> None:
        error_id = None
        message = r.message
        if r.kind in SERVER_SIDE:
            error_id = new_error_id()
            log.error("request %s refused (error_id=%s): %s", req.request_id, error_id, r.message)
            if r.kind is ErrorKind.INTERNAL:
                message = "internal error"
        err = RequestError(req.request_id, r.kind, message, r.param, error_id)
        await self.pushers.send(req.reply_to, self.codec.encode(err))

    async def _drain_queue(self) -> None:
        while self.queue and self.workers and not self.paused:
            req, bufs = self.queue[0]
            if not req.loop_caps:  # queued before any worker existed
                pools = self._reference_pools()
                assert pools is not None  # there are workers
                try:
                    req = plan_request(self.spec, req, pools)
                except Refusal as r:
                    self.queue.popleft()
                    self.queued_at.pop(req.request_id, None)
                    await self._refuse(req, r)
                    continue
                self.queue[0] = (req, bufs)
            base = self._need(req)
            keys = self._prefix_keys(req)
            options = []
            for w in self.workers.values():
                # The pages it will share from this worker's prefix cache need no promise
                # (an over-estimate only makes the worker queue it: it admits exactly).
                hits = w.hit_pages(keys) if self.d.admission == "footprint" and self.d.prefix_cache else 0
                need = self._hit_need(req, base, hits) if hits else base
                if w.fits(need):
                    options.append((w, need, hits))
            if not options:
                return
            w, need = pick_worker(options)
            w.remember(keys)
            w.dispatched += 1
            self._picks += 1
            w.picked = self._picks
            self.queue.popleft()
            self.queued_at.pop(req.request_id, None)
            for pool, n in need.items():
                w.promised[pool] = w.promised.get(pool, 0) + n
            w.requests[req.request_id] = (need, req.reply_to)
            self.placement[req.request_id] = w.worker_id
            trace.stamp(req.request_id, "cond.send")
            await self.pushers.send(w.address, [self.codec.encode(req)[0], *bufs])
            await self.pushers.send(req.reply_to, self.codec.encode(Dispatched(req.request_id, w.worker_id)))

    async def _expire_queue(self) -> None:
        """With no worker registered, fail what has waited `queue_timeout_s` for one (a
        request queued for pages while workers exist waits its turn however long)."""
        timeout = self.d.queue_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4) if timeout > 0 else 1.0)
            if timeout <= 0 or self.workers or self.no_worker_since is None:
                continue
            now = time.monotonic()
            keep: deque[tuple[NewRequest, list]] = deque()
            expired: list[NewRequest] = []
            for entry in self.queue:
                waited = now - max(self.queued_at.get(entry[0].request_id, now), self.no_worker_since)
                (expired.append(entry[0]) if waited >= timeout else keep.append(entry))
            self.queue = keep
            for req in expired:
                self.queued_at.pop(req.request_id, None)
                gone = now - self.no_worker_since
                await self._refuse(req, Refusal(
                    ErrorKind.UNAVAILABLE,
                    f"no gpu worker is ready (none for {gone:.0f}s); the request waited the queue timeout "
                    f"({timeout:g}s, --queue-timeout-s) and was not run"))

    def _prefix_keys(self, req: NewRequest) -> dict[str, tuple[list[int], int]]:
        """Per pool: chain keys of the keyed label's full prompt pages and how many of them
        the request may share, by the walk the worker's prefix index uses
        (`shared.layout.prompt_pages` / `shareable_count`). Empty unless every label the
        prompt writes is keyed: rows computed once feed every such label (a label with no
        spans, scratch only, holds no prompt rows: `KVManager._plan_hits` skips it too)."""
        keys: dict[str, tuple[list[int], int]] = {}
        for name, layout in req.kv_layout.items():
            if not layout.span_rows:
                continue
            lab = self.spec.label(name)
            cfg = req.kv_configs.get(lab.pool)
            if not lab.keys or cfg is None or not leading_keys(layout):
                return {}
            keys[lab.pool] = (prefix_chain(prompt_pages(layout, cfg.page_size)), shareable_count(layout, cfg.page_size))
        return keys

    def _hit_need(self, req: NewRequest, base: dict[str, int], hits: int) -> dict[str, int]:
        """`base` less what a hit of `hits` leading pages spares, as the worker admits it:
        the pages each label the prompt writes shares (a windowed label only those of its
        window: `hit_pages`), and a windowed label's footprint from the hit on."""
        need = dict(base)
        for name, layout in req.kv_layout.items():
            lab = self.spec.label(name)
            cfg = req.kv_configs.get(lab.pool)
            if not layout.span_rows or cfg is None or lab.pool not in need:
                continue
            rows = hits * cfg.page_size
            first, end = hit_pages(cfg.page_size, lab.window, rows)
            full = cfg.footprints.get(name, 0)
            after = label_footprint(layout, req.loop_caps, cfg.page_size, lab.window, rows)
            need[lab.pool] -= (end - first) + (full - after)
        return need

    def _need(self, req: NewRequest) -> dict[str, int]:
        """Pages to promise per pool: the footprint, or under the max-seq-len baseline a
        whole max_seq_len per label, as a server that cannot know footprints reserves."""
        need = {name: cfg.total_pages for name, cfg in req.kv_configs.items()}
        if self.d.admission == "max-seq-len":
            pools = self._reference_pools() or {}
            for name, cfg in req.kv_configs.items():
                if name in pools:
                    need[name] = max(need[name],
                                     pages_for(pools[name].max_seq_len, pools[name].page_size) * len(cfg.footprints))
        return need

    def _release(self, worker_id: str, request_id: str) -> None:
        self.placement.pop(request_id, None)
        w = self.workers.get(worker_id)
        if w is None:
            return
        need, _ = w.requests.pop(request_id, ({}, ""))
        log.debug("request %s finished on %s", request_id, worker_id)
        for pool, n in need.items():
            w.promised[pool] -= n

    # -- worker lifecycle ---------------------------------------------------------------

    async def _worker_ready(self, msg: WorkerReady) -> None:
        if self.fingerprint is not None and await self._refuse_worker(msg):
            return
        w = self.workers.get(msg.worker_id)
        if w is not None and w.incarnation == msg.incarnation:
            w.last_seen = time.monotonic()  # a heartbeat
            return
        if w is not None:
            await self._worker_failed(w, "it restarted")
        lost = self.dead.pop(msg.incarnation, None)
        if lost:
            # Declared failed, now speaking again: its old requests were failed already.
            for rid in lost:
                await self.pushers.send(msg.address, self.codec.encode(Abort(rid, "worker_failed")))
        w = self.workers[msg.worker_id] = WorkerState(msg.worker_id, msg.address, {p.name: p for p in msg.pools},
                                                      msg.incarnation)
        w.monitor = asyncio.ensure_future(self._watch_connection(w))
        self.no_worker_since = None
        log.info("worker %s ready at %s: %s", msg.worker_id, msg.address, {p.name: p.num_pages for p in msg.pools})
        await self._drain_queue()

    async def _refuse_worker(self, msg: WorkerReady) -> bool:
        """Refuse a worker whose model or deployment differs from this conductor's: one
        error line naming both, and a `WorkerRefused` (again on each of its heartbeats,
        should the first be lost) that makes it exit with status 2. True if refused."""
        if self.fingerprint is None:  # nothing to compare with: every worker is welcome
            return False
        reason = mismatch(self.fingerprint, msg.fingerprint)
        if reason is None:
            return False
        reason = f"worker {msg.worker_id} at {msg.address} refused: {reason}"
        if self.refused.get(msg.incarnation) != reason:
            log.error("%s", reason)
            self.refused[msg.incarnation] = reason
            while len(self.refused) > 64:
                self.refused.popitem(last=False)
        await self.pushers.send(msg.address, self.codec.encode(WorkerRefused(msg.worker_id, reason)))
        return True

    async def _watch_connection(self, w: WorkerState) -> None:
        """A worker process that dies closes its connection: fail it at once rather than
        after the heartbeat timeout."""
        mon = self.pushers.get(w.address).get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                event = parse_monitor_message(await mon.recv_multipart())["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    if self.workers.get(w.worker_id) is w:
                        await self._worker_failed(w, "its connection closed")
                    return
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            mon.close(0)

    def _heartbeat(self, msg: Heartbeat) -> None:
        """A worker's beat (from its own thread, so also during a long step). A beat of an
        earlier incarnation, or of a worker not (yet) registered, says nothing about the
        one registered."""
        w = self.workers.get(msg.sender)
        if w is None or (msg.incarnation and msg.incarnation != w.incarnation):
            return
        w.last_seen = time.monotonic()
        w.step_s = msg.step_s

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_TIMEOUT_S / 5)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if now - w.last_seen > HEARTBEAT_TIMEOUT_S:
                    during = f", in a step of {w.step_s:.1f}s at its last beat" if w.step_s else ""
                    await self._worker_failed(w, f"no heartbeat for {now - w.last_seen:.1f}s{during}")

    async def _worker_failed(self, w: WorkerState, reason: str) -> None:
        """Fail every request the worker held (worker_failed, one error id logged with the
        reason), forget its bookkeeping; the other workers and the queue go on."""
        if self.workers.get(w.worker_id) is not w:
            return
        del self.workers[w.worker_id]
        if not self.workers:
            self.no_worker_since = time.monotonic()
        error_id = new_error_id()
        log.error("worker %s failed (%s); failing its %d request(s) (error_id=%s)",
                  w.worker_id, reason, len(w.requests), error_id)
        if w.monitor is not None and w.monitor is not asyncio.current_task():
            w.monitor.cancel()
        self.pushers.drop(w.address)
        self.dead[w.incarnation] = list(w.requests)
        while len(self.dead) > 64:
            self.dead.popitem(last=False)
        for rid, (_, reply_to) in w.requests.items():
            self.placement.pop(rid, None)
            err = RequestError(rid, ErrorKind.WORKER_FAILED,
                               f"the worker serving this request failed ({reason}); it was not completed",
                               error_id=error_id)
            await self.pushers.send(reply_to, self.codec.encode(err))
        await self._drain_queue()

    async def _abort(self, msg: Abort) -> None:
        self.tombstones[msg.request_id] = time.monotonic()
        for i, (req, _) in enumerate(self.queue):
            if req.request_id == msg.request_id:
                del self.queue[i]
                self.queued_at.pop(req.request_id, None)
                return
        worker_id = self.placement.get(msg.request_id)
        if worker_id is not None and worker_id in self.workers:
            await self.pushers.send(self.workers[worker_id].address, self.codec.encode(msg))

    def _prune_tombstones(self) -> None:
        now = time.monotonic()
        while self.tombstones:
            _, t = next(iter(self.tombstones.items()))
            if now - t < TOMBSTONE_TTL_S:
                break
            self.tombstones.popitem(last=False)
