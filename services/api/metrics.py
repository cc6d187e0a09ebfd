"""Prometheus metrics for `/metrics` (DESIGN.md section 7), in a registry of our own.

Every series carries a `model_name` label (the served name), as vLLM's do.

Two kinds live here:
- api-side measurements: `mstar_requests_total{status}`; per finished request (stop,
  length or abort) `mstar_request_success_total{finished_reason}`, its `usage` added to
  `mstar_prompt_tokens_total` and `mstar_generation_tokens_total`, and the histograms
  `mstar_e2e_request_latency_seconds` (arrival at the api -> the request's end) and
  `mstar_request_queue_time_seconds` (arrival at the api -> the conductor's `Dispatched`
  frame: tokenization plus the conductor's queue); and per token the latency histograms
  `mstar_ttft_seconds` (arrival at the api -> first token out) and `mstar_itl_seconds`
  (time between tokens; a frame carrying k tokens after a gap g counts k gaps of g/k, so
  speculative bursts do not hide per-token latency);
- cluster gauges read from the latest `ClusterStatus` the conductor answered, summed over
  workers: `mstar_kv_pages_used{pool}`, `mstar_kv_pages_total{pool}`,
  `mstar_kv_cache_usage_ratio` (used / total pages over every pool),
  `mstar_requests_running`, `mstar_requests_waiting` (conductor queue + worker queues),
  `mstar_kv_footprint_overruns_total`, `mstar_spec_draft_tokens_total` and
  `mstar_spec_accepted_tokens_total` (prompt-lookup speculation; acceptance is their
  ratio), plus `mstar_ready_workers` and
  `mstar_conductor_up` (0 when the last status query got no answer; the other cluster
  series are then the last ones seen, or absent if none ever was).

`status` labels of `mstar_requests_total`, one per finished `/generate` or WebSocket request:
- `ok`: finished with finish_reason stop or length;
- `abort`: cancelled or the client went away (or a worker reported abort);
- `error_4xx`: refused (validation, a conductor length check, a conflict, ...);
- `error_5xx`: failed on the server side.

`StatsWindow` also tallies tokens as they arrive (prompt tokens at a request's first
output, generated ones per output frame) for the api's periodic stats line
(`stats_log.py`), whose throughput should follow the traffic rather than the moments
requests end.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.frames import ClusterStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATUSES = ("ok", "abort", "error_4xx", "error_5xx")
FINISH_REASONS = ("stop", "length", "abort")
#: a speech request's wall time over the audio seconds it made (below 1: faster than real time)
RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0, 16.0, 32.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
#: vLLM's request-latency buckets (e2e and queue time), seconds
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, *REQUEST_BUCKETS)


def status_label(status_code: int | None, finish_reason: str | None = None) -> str:
    """The `mstar_requests_total` label for a request that ended this way."""
    if status_code is None:
        return "abort" if finish_reason == "abort" else "ok"
    return "error_5xx" if status_code >= 500 else "error_4xx"


def kv_usage(status: ClusterStatus) -> float:
    """Used / total KV pages over every pool of every worker (0 with no pages)."""
    used = total = 0
    for w in status.workers:
        for p in w.pools:
            used += p.total_pages - p.free_pages
            total += p.total_pages
    return used / total if total else 0.0


class ClusterCollector(Collector):
    """Exposes the latest ClusterStatus at scrape time (no stale per-label gauges to reset)."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.status: ClusterStatus | None = None
        self.up = False

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def _per_pool(self, name: str, doc: str, values: dict[str, int]) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name", "pool"])
        for pool in sorted(values):
            g.add_metric([self.model_name, pool], values[pool])
        return g

    def collect(self) -> Iterator[Metric]:
        yield self._gauge("mstar_conductor_up", "1 if the conductor answered the last status query",
                          1.0 if self.up else 0.0)
        st = self.status
        if st is None:
            return
        yield from self._pools(st)
        ws = st.workers
        yield self._gauge("mstar_kv_cache_usage_ratio", "KV pages in use / KV pages, over every pool and worker",
                          kv_usage(st))
        yield self._gauge("mstar_ready_workers", "workers that loaded the model and warmed up", st.ready_workers)
        yield self._gauge("mstar_requests_running", "requests running on workers", sum(w.running for w in ws))
        yield self._gauge("mstar_requests_waiting", "requests queued (conductor + workers)",
                          st.waiting + sum(w.waiting for w in ws))
        yield self._counter("mstar_prefix_cache_queries",
                            "requests that looked up the prefix cache, summed over workers",
                            sum(w.prefix_queries for w in ws))
        yield self._counter("mstar_prefix_cache_hit_tokens",
                            "prompt rows served from the prefix cache instead of computed",
                            sum(w.prefix_hit_tokens for w in ws))
        yield self._counter("mstar_spec_draft_tokens", "speculative draft tokens verified, summed over workers",
                            sum(w.spec_draft_tokens for w in ws))
        yield self._counter("mstar_spec_accepted_tokens", "speculative draft tokens accepted, summed over workers",
                            sum(w.spec_accepted_tokens for w in ws))
        yield self._counter("mstar_world_clip_encodes", "a world model's context clips encoded (the others were "
                            "in the worker's clip cache), summed over workers", sum(w.clip_encodes for w in ws))
        yield self._counter("mstar_denoise_steps", "a diffusion model's denoising steps run (each request's "
                            "iterations of its loop), summed over workers", sum(w.denoise_steps for w in ws))
        yield self._counter("mstar_kv_footprint_overruns",
                            "pages taken past a label's footprint (bugs), summed over workers",
                            sum(w.footprint_overruns for w in ws))
        kernels = GaugeMetricFamily("mstar_cpu_kernels_info", "1 for the CPU kernels' class each worker runs "
                                    "(avx512, avx2, neon, generic; none: no CPU kernels)",
                                    labels=["model_name", "worker_id", "kernels"])
        for w in ws:
            kernels.add_metric([self.model_name, w.worker_id, w.kernels or "none"], 1.0)
        yield kernels
        placed = CounterMetricFamily("mstar_worker_requests_dispatched",
                                     "requests the conductor placed on each ready worker (since it registered)",
                                     labels=["model_name", "worker_id"])
        for worker_id, n in sorted(st.dispatched.items()):
            placed.add_metric([self.model_name, worker_id], n)
        yield placed

    def _pools(self, st: ClusterStatus) -> Iterator[Metric]:
        used: dict[str, int] = {}
        total: dict[str, int] = {}
        reserved: dict[str, int] = {}
        peak: dict[str, int] = {}
        cached: dict[str, int] = {}
        for w in st.workers:
            for p in w.pools:
                used[p.name] = used.get(p.name, 0) + (p.total_pages - p.free_pages)
                total[p.name] = total.get(p.name, 0) + p.total_pages
                reserved[p.name] = reserved.get(p.name, 0) + p.reserved_pages
                peak[p.name] = max(peak.get(p.name, 0), p.peak_used_pages)
                cached[p.name] = cached.get(p.name, 0) + p.cached_pages
        yield self._per_pool("mstar_kv_pages_used", "KV pages in use, summed over workers", used)
        yield self._per_pool("mstar_kv_pages_total", "KV pages in each pool, summed over workers", total)
        yield self._per_pool("mstar_kv_pages_reserved", "KV pages set aside for admitted footprints, not yet taken",
                             reserved)
        yield self._per_pool("mstar_kv_pages_peak", "most KV pages in use at once on any one worker", peak)
        yield self._per_pool("mstar_prefix_cache_pages", "KV pages indexed in the prefix cache", cached)


class StatsWindow:
    """Tokens as they arrive, for the periodic stats line (read and compared by `stats_log`)."""

    __slots__ = ("generation_tokens", "prompt_tokens")

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0


class ApiMetrics:
    """All metrics of one api process; `render()` is the `/metrics` body."""

    def __init__(self, model_name: str = "", sample_rate: int = 0) -> None:
        self.model_name = model_name
        #: a speech model's audio rate: its outputs' samples per second (0: no sound)
        self.sample_rate = sample_rate
        self.registry = reg = CollectorRegistry()
        self.requests = Counter("mstar_requests", "finished requests by final status", ["model_name", "status"],
                                registry=reg)
        for s in STATUSES:
            self.requests.labels(model_name, s)
        self.success = Counter("mstar_request_success",
                               "requests that ended with a finish reason (stop, length, abort)",
                               ["model_name", "finished_reason"], registry=reg)
        for r in FINISH_REASONS:
            self.success.labels(model_name, r)
        self.prompt_tokens = self._counter("mstar_prompt_tokens", "prompt tokens of finished requests (their usage)")
        self.generation_tokens = self._counter("mstar_generation_tokens",
                                               "generated tokens of finished requests (their usage)")
        self.ttft = self._histogram("mstar_ttft_seconds", "arrival at the api to first token", TTFT_BUCKETS)
        self.itl = self._histogram("mstar_itl_seconds", "time between output tokens", ITL_BUCKETS)
        self.e2e = self._histogram("mstar_e2e_request_latency_seconds", "arrival at the api to the request's end",
                                   REQUEST_BUCKETS)
        self.queue = self._histogram("mstar_request_queue_time_seconds",
                                     "arrival at the api to dispatch on a worker", QUEUE_BUCKETS)
        if sample_rate:  # a speech model's: vLLM-style histograms beside the token ones
            self.ttfa = self._histogram("mstar_time_to_first_audio_seconds",
                                        "arrival at the api to the request's first sound", TTFT_BUCKETS)
            self.rtf = self._histogram("mstar_real_time_factor",
                                       "a speech request's wall time over the audio seconds it made", RTF_BUCKETS)
            self.audio_seconds = self._counter("mstar_audio_seconds", "seconds of audio made (finished requests)")
        self.window = StatsWindow()
        self.cluster = ClusterCollector(model_name)
        reg.register(self.cluster)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(self.model_name)

    def count(self, label: str) -> None:
        self.requests.labels(self.model_name, label).inc()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, gap: float, tokens: int) -> None:
        per_token = gap / tokens
        for _ in range(tokens):
            self.itl.observe(per_token)

    def tokens_arrived(self, prompt: int, generated: int) -> None:
        """Tokens seen in an output frame (prompt: at a request's first output only)."""
        self.window.prompt_tokens += prompt
        self.window.generation_tokens += generated

    def finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, e2e_s: float,
                 queue_s: float | None) -> None:
        """One request ended with a finish reason; its usage and latencies."""
        self.success.labels(self.model_name, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(e2e_s)
        if queue_s is not None:
            self.queue.observe(max(0.0, queue_s))

    def audio_finished(self, first_audio_s: float, samples: int, e2e_s: float) -> None:
        """A speech request ended having made `samples` (its first sound `first_audio_s`
        after arrival)."""
        seconds = samples / self.sample_rate
        self.ttfa.observe(first_audio_s)
        self.audio_seconds.inc(seconds)
        if seconds:
            self.rtf.observe(e2e_s / seconds)

    def set_cluster_status(self, status: ClusterStatus | None) -> None:
        """Record a status answer, or None when the conductor did not answer in time."""
        self.cluster.up = status is not None
        if status is not None:
            self.cluster.status = status

    def render(self) -> bytes:
        return generate_latest(self.registry)
