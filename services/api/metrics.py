"""Prometheus metrics for `/metrics` (DESIGN.md section 7), in a registry of our own.

Two kinds live here:
- api-side measurements: `mstar_requests_total{status}` and the latency histograms
  `mstar_ttft_seconds` (arrival at the api -> first token out) and `mstar_itl_seconds`
  (time between tokens; a frame carrying k tokens after a gap g counts k gaps of g/k, so
  speculative bursts do not hide per-token latency);
- cluster gauges read from the latest `ClusterStatus` the conductor answered, summed over
  workers: `mstar_kv_pages_used{pool}`, `mstar_kv_pages_total{pool}`,
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
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.frames import ClusterStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATUSES = ("ok", "abort", "error_4xx", "error_5xx")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)


def status_label(status_code: int | None, finish_reason: str | None = None) -> str:
    """The `mstar_requests_total` label for a request that ended this way."""
    if status_code is None:
        return "abort" if finish_reason == "abort" else "ok"
    return "error_5xx" if status_code >= 500 else "error_4xx"


class ClusterCollector(Collector):
    """Exposes the latest ClusterStatus at scrape time (no stale per-label gauges to reset)."""

    def __init__(self) -> None:
        self.status: ClusterStatus | None = None
        self.up = False

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("mstar_conductor_up", "1 if the conductor answered the last status query")
        up.add_metric([], 1.0 if self.up else 0.0)
        yield up
        st = self.status
        if st is None:
            return
        used: dict[str, int] = {}
        total: dict[str, int] = {}
        reserved: dict[str, int] = {}
        peak: dict[str, int] = {}
        for w in st.workers:
            for p in w.pools:
                used[p.name] = used.get(p.name, 0) + (p.total_pages - p.free_pages)
                total[p.name] = total.get(p.name, 0) + p.total_pages
                reserved[p.name] = reserved.get(p.name, 0) + p.reserved_pages
                peak[p.name] = max(peak.get(p.name, 0), p.peak_used_pages)
        g_used = GaugeMetricFamily("mstar_kv_pages_used", "KV pages in use, summed over workers", labels=["pool"])
        g_total = GaugeMetricFamily("mstar_kv_pages_total", "KV pages in each pool, summed over workers",
                                    labels=["pool"])
        g_res = GaugeMetricFamily("mstar_kv_pages_reserved",
                                  "KV pages set aside for admitted footprints, not yet taken", labels=["pool"])
        g_peak = GaugeMetricFamily("mstar_kv_pages_peak", "most KV pages in use at once on any one worker",
                                   labels=["pool"])
        for name in sorted(total):
            g_used.add_metric([name], used[name])
            g_total.add_metric([name], total[name])
            g_res.add_metric([name], reserved[name])
            g_peak.add_metric([name], peak[name])
        yield g_used
        yield g_total
        yield g_res
        yield g_peak
        yield GaugeMetricFamily("mstar_ready_workers", "workers that loaded the model and warmed up",
                                value=st.ready_workers)
        yield GaugeMetricFamily("mstar_requests_running", "requests running on workers",
                                value=sum(w.running for w in st.workers))
        yield GaugeMetricFamily("mstar_requests_waiting", "requests queued (conductor + workers)",
                                value=st.waiting + sum(w.waiting for w in st.workers))
        yield CounterMetricFamily("mstar_prefix_cache_queries",
                                  "requests that looked up the prefix cache, summed over workers",
                                  value=sum(w.prefix_queries for w in st.workers))
        yield CounterMetricFamily("mstar_prefix_cache_hit_tokens",
                                  "prompt rows served from the prefix cache instead of computed",
                                  value=sum(w.prefix_hit_tokens for w in st.workers))
        cached = GaugeMetricFamily("mstar_prefix_cache_pages", "KV pages indexed in the prefix cache", labels=["pool"])
        for name in sorted(total):
            cached.add_metric([name], sum(p.cached_pages for w in st.workers for p in w.pools if p.name == name))
        yield cached
        yield CounterMetricFamily("mstar_spec_draft_tokens", "speculative draft tokens verified, summed over workers",
                                  value=sum(w.spec_draft_tokens for w in st.workers))
        yield CounterMetricFamily("mstar_spec_accepted_tokens",
                                  "speculative draft tokens accepted, summed over workers",
                                  value=sum(w.spec_accepted_tokens for w in st.workers))
        yield CounterMetricFamily(
            "mstar_kv_footprint_overruns",
            "pages taken past a label's footprint (bugs), summed over workers",
            value=sum(w.footprint_overruns for w in st.workers),
        )


class ApiMetrics:
    """All metrics of one api process; `render()` is the `/metrics` body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("mstar_requests", "finished requests by final status", ["status"],
                                registry=self.registry)
        for s in STATUSES:
            self.requests.labels(s)
        self.ttft = Histogram("mstar_ttft_seconds", "arrival at the api to first token", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("mstar_itl_seconds", "time between output tokens", buckets=ITL_BUCKETS,
                             registry=self.registry)
        self.cluster = ClusterCollector()
        self.registry.register(self.cluster)

    def count(self, label: str) -> None:
        self.requests.labels(label).inc()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, gap: float, tokens: int) -> None:
        per_token = gap / tokens
        for _ in range(tokens):
            self.itl.observe(per_token)

    def set_cluster_status(self, status: ClusterStatus | None) -> None:
        """Record a status answer, or None when the conductor did not answer in time."""
        self.cluster.up = status is not None
        if status is not None:
            self.cluster.status = status

    def render(self) -> bytes:
        return generate_latest(self.registry)
