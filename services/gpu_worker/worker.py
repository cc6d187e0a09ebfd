"""The gpu worker process: loads the model, owns the KV pools, runs the step loop.

The step loop is a plain synchronous loop over a zmq Poller (like vLLM's EngineCore):
the forward pass holds the CPU anyway, ZMQ's I/O thread queues frames meanwhile, and
between steps every queued frame is drained, so new requests join the next step.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid

import msgspec
import torch
import zmq

from services.gpu_worker.engine import Engine, StepResult
from services.gpu_worker.flashinfer_backend import FlashInferPlanner, flashinfer_available
from services.gpu_worker.kv_manager import KVManager
from services.gpu_worker.kv_memory import kv_cache
from services.gpu_worker.weights import build_model
from shared.config import Deployment
from shared.errors import ErrorKind, new_error_id
from shared.frames import (
    Abort,
    FrameCodec,
    NewRequest,
    RequestError,
    RequestFinished,
    SamplingParams,
    StepOutputs,
    ToApi,
    ToWorker,
    WorkerReady,
    WorkerStats,
    pack_tensors,
    unpack_tensors,
)
from shared.model_source import ModelSource
from shared.zmq_utils import cleanup_ipc

log = logging.getLogger("mstar.gpu_worker")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
STATS_INTERVAL_S = 0.25
HEARTBEAT_INTERVAL_S = 1.0


def pick_device() -> torch.device:
    """MSTAR_DEVICE (cpu | cuda | cuda:N), else CUDA when there is one. On CUDA the
    decoder path attends through FlashInfer when it is importable, through torch if not."""
    want = os.environ.get("MSTAR_DEVICE", "auto")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def available_memory_bytes(device: torch.device | None = None) -> int:
    """Free memory where the KV pools will live: the GPU's, or the host's MemAvailable."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def size_pool(d: Deployment, bytes_per_page: int, max_seq_len: int, device: torch.device | None = None) -> int:
    """`--num-kv-pages`, or `kv_memory_fraction` of available memory (at least enough for
    one request of max_seq_len)."""
    if d.num_kv_pages:
        return d.num_kv_pages
    pages = int(available_memory_bytes(device) * d.kv_memory_fraction) // bytes_per_page
    return max(pages, -(-max_seq_len // d.page_size))


class GpuWorker:
    def __init__(self, d: Deployment, bind_addr: str, advertise_addr: str, conductor_addr: str, worker_id: str) -> None:
        self.d = d
        self.worker_id = worker_id
        self.bind_addr = bind_addr
        self.advertise_addr = advertise_addr
        # All cores but one (as vLLM's CPU build): the api, data worker and conductor need a
        # core too, and oversubscribing a small machine costs far more than one thread.
        torch.set_num_threads(int(os.environ.get("MSTAR_TORCH_THREADS", max(1, (os.cpu_count() or 1) - 1))))
        source = ModelSource(d.model)
        self.spec = source.spec(d.page_size, d.max_seq_len, d.dtype)
        self.spec.validate()
        self.device = pick_device()
        if self.spec.engine != "decoder" and self.device.type != "cpu":
            log.warning("the %s engine runs on the CPU path only for now; ignoring device %s", self.spec.engine, self.device)
            self.device = torch.device("cpu")
        num_pages = size_pool(d, self.spec.bytes_per_page(d.page_size), self.spec.max_seq_len, self.device)
        self.pools = self.spec.paged_pools(num_pages)
        dtype = TORCH_DTYPES[d.dtype]
        t0 = time.time()
        self.model = build_model(source, self.spec, dtype, self.device)
        self.caches = {
            name: kv_cache(p.num_layers, p.num_pages, p.page_size, p.kv_heads, p.head_dim, dtype, self.device)
            for name, p in self.pools.items()
        }
        planner = None
        if self.device.type == "cuda" and self.spec.engine == "decoder" and flashinfer_available():
            planner = FlashInferPlanner(self.device)
        self.kv = KVManager(self.pools, self.spec.kv_labels, reserve_max_seq_len=d.admission == "max-seq-len",
                            prefix_cache=d.prefix_cache)
        engine_cls = Engine
        if self.spec.engine == "encoder_decoder":
            from services.gpu_worker.encdec_engine import EncDecEngine as engine_cls
        self.engine = engine_cls(
            self.model, self.spec, self.kv, self.caches, eos_ids=source.tokenizer.eos_token_ids,
            max_num_seqs=d.max_num_seqs, max_batch_tokens=d.max_batch_tokens, max_seq_len=self.spec.max_seq_len,
            **({"planner": planner} if planner is not None else {}),
            **({"speculative_k": d.speculative_k, "ngram_max": d.speculative_ngram_max, "ngram_min": d.speculative_ngram_min}
               if d.speculative_k and self.spec.engine == "decoder" else {}),
        )
        log.info("model loaded in %.1fs; pools %s", time.time() - t0,
                 {n: f"{p.num_pages} pages x {p.page_size} rows" for n, p in self.pools.items()})
        self.warm_up()
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        if bind_addr.startswith("ipc://") and os.path.exists(bind_addr[6:]):
            os.unlink(bind_addr[6:])
        self.pull.bind(bind_addr)
        self.conductor = self.ctx.socket(zmq.PUSH)
        self.conductor.setsockopt(zmq.LINGER, 1000)
        self.conductor.connect(conductor_addr)
        self.replies: dict[str, zmq.Socket] = {}
        self.in_codec = FrameCodec(ToWorker)
        self.out_codec = FrameCodec(ToApi)
        self.running = True
        self.incarnation = uuid.uuid4().hex
        self._last_stats: tuple | None = None

    def warm_up(self) -> None:
        """One real prefill + decode through the paged path, so the first request does not
        pay for lazy init; its pages go back before the worker says it is ready."""
        n = min(16, self.spec.max_seq_len - 2)
        ppo = self.spec.process_prompt(list(range(1, n + 1)))
        caps = self.spec.clamp_caps(self.spec.get_loop_caps(2, prompt_len=n))
        refs, _ = pack_tensors(ppo.new_input_tensors)
        # Warm-up exercises the kernels, not the model's declarations (intake checks those).
        declared = {lab.name for lab in self.spec.kv_labels}
        layout = {name: lay for name, lay in ppo.kv_layout.items() if name in declared}
        req = NewRequest("warmup", "", refs, SamplingParams(temperature=0.0), "", n, 2, layout, caps,
                         self.spec.kv_configs(layout, caps, self.pools))
        caching, self.kv.prefix_cache = self.kv.prefix_cache, False  # leave no trace in the cache or its counters
        self.engine.add(req, ppo.new_input_tensors)
        while self.engine.has_work:
            if self.engine.step().errors:
                raise RuntimeError("the warm-up request failed (see the error logged above); the model cannot serve")
        self.kv.prefix_cache, self.kv.prefix_queries = caching, 0
        for pool in self.kv.pools.values():
            pool.peak_used = 0
        assert self.kv.used_pages() == 0, "warm-up left pages behind"
        if hasattr(self.model, "warm_gemms"):
            t0 = time.time()
            runs = self.model.warm_gemms(self.engine.max_batch_tokens, min(self.engine.max_num_seqs, self.engine.max_batch_tokens))
            log.info("built %d GEMM kernels for every row bucket in %.2fs", runs, time.time() - t0)

    # -- wire ------------------------------------------------------------------------

    def _reply(self, address: str) -> zmq.Socket:
        sock = self.replies.get(address)
        if sock is None:
            sock = self.replies[address] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        return sock

    def _to_conductor(self, msg: msgspec.Struct) -> None:
        self.conductor.send_multipart(self.out_codec.encode(msg), copy=False)

    def _send_results(self, res: StepResult) -> None:
        by_dest: dict[str, list] = {}
        for dest, out in res.outputs:
            if dest:
                by_dest.setdefault(dest, []).append(out)
        for dest, outs in by_dest.items():
            self._reply(dest).send_multipart(self.out_codec.encode(StepOutputs(outs)), copy=False)
        for dest, err in res.errors:
            if dest:
                self._reply(dest).send_multipart(self.out_codec.encode(err), copy=False)
        for rid, pages, status in res.finished:
            self._to_conductor(RequestFinished(self.worker_id, rid, pages, status))

    def _handle(self, frames: list) -> None:
        try:
            msg, bufs = self.in_codec.decode(frames)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            log.error("protocol error from conductor: %s (frame dropped)", exc)
            return
        if isinstance(msg, NewRequest):
            try:
                self.engine.add(msg, unpack_tensors(msg.input_tensors, bufs))
            except Exception as exc:
                error_id = new_error_id()
                log.error("request %s refused at ingest (error_id=%s): %s", msg.request_id, error_id, exc)
                res = StepResult()
                res.errors.append((msg.reply_to, RequestError(msg.request_id, ErrorKind.INTERNAL, "internal error", error_id=error_id)))
                res.finished.append((msg.request_id, 0, "error"))
                self._send_results(res)
        elif isinstance(msg, Abort):
            found = self.engine.abort(msg.request_id)
            if found is not None:
                self._to_conductor(RequestFinished(self.worker_id, msg.request_id, found[1], "abort"))

    def _stats(self, force: bool = False) -> None:
        pools = self.kv.stats()
        kv = self.kv
        drafted, accepted = self.engine.spec_draft_tokens, self.engine.spec_accepted_tokens
        key = (tuple(pools), len(self.engine.running), len(self.engine.waiting), kv.footprint_overruns, kv.prefix_queries, drafted)
        if force or key != self._last_stats:
            self._last_stats = key
            self._to_conductor(WorkerStats(self.worker_id, pools, len(self.engine.running), len(self.engine.waiting),
                                           kv.footprint_overruns, kv.prefix_queries, kv.prefix_hit_tokens, drafted, accepted))

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "running", False))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "running", False))
        ready = WorkerReady(self.worker_id, self.advertise_addr, list(self.pools.values()), self.incarnation)
        self._to_conductor(ready)
        self._stats(force=True)
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        last_stats = last_beat = time.monotonic()
        while self.running:
            timeout = 0 if self.engine.has_work else 50
            if poller.poll(timeout):
                while True:
                    try:
                        frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle([f.buffer for f in frames])
            if self.engine.has_work:
                self._send_results(self.engine.step())
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL_S:
                self._stats()
                last_stats = now
            if now - last_beat >= HEARTBEAT_INTERVAL_S:
                self._to_conductor(ready)  # the heartbeat, with fresh stats for a conductor that just (re)met us
                self._stats(force=True)
                last_beat = now
        self.shutdown()

    def shutdown(self) -> None:
        self._send_results(self.engine.fail_all(ErrorKind.WORKER_FAILED, "the worker is shutting down"))
        self._stats(force=True)
        for sock in self.replies.values():
            sock.close(0)
        self.pull.close(0)
        self.conductor.close()
        self.ctx.term()
        cleanup_ipc(self.bind_addr)
