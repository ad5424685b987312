"""Prometheus metrics, named as vLLM names them with the `sparkd:` prefix.

Engine state (queue sizes, KV usage, token counters) is read from
`engine.stats()` at scrape time. Latencies are measured here, in the API
layer, from the moment a request is queued to when its stream yields tokens,
so they include everything a client waits for except the network.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The `*_created` timestamp series only add noise to every scrape (vLLM drops them too).
disable_created_metrics()

# vLLM's buckets, so dashboards built for it read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector:
    """Reads the engine's counters on each scrape."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.labels = [model_name]

    def collect(self):
        s = self.engine.stats()
        for family, name, doc, value in (
            (GaugeMetricFamily, "sparkd:num_requests_running", "Requests in the running batch.", s.num_running),
            (GaugeMetricFamily, "sparkd:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            (GaugeMetricFamily, "sparkd:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).",
             s.kv_cache_usage),
            (CounterMetricFamily, "sparkd:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries),
            (CounterMetricFamily, "sparkd:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             s.prefix_cache_hits),
            (CounterMetricFamily, "sparkd:prompt_tokens", "Prompt tokens received.", s.prompt_tokens_total),
            (CounterMetricFamily, "sparkd:generation_tokens", "Tokens generated.", s.generation_tokens_total),
        ):
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric(self.labels, value)
            yield metric


class ServerMetrics:
    """One registry per app, so several servers in one process (tests) do not clash."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(engine, model_name))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("sparkd:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("sparkd:inter_token_latency_seconds", "Time between successive token updates.",
                             ITL_BUCKETS)
        self.e2e = histogram("sparkd:e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> "RequestTimer":
        return RequestTimer(self)


class RequestTimer:
    """Times one engine request from its queueing to its last output."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last_token_time: float | None = None

    def on_output(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if any(seq.num_new_tokens for seq in out.outputs):
            if self.last_token_time is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                self.metrics.itl.observe(now - self.last_token_time)
            self.last_token_time = now
        if out.finished and out.error is None:
            self.metrics.e2e.observe(now - self.start)
