"""Prometheus metrics on prometheus_client: the process (RSS, CPU, open fds), the platform, and the
server's own.

The server's own figures are plain numbers under one lock, handed to prometheus_client by a
collector at scrape time: a request pays one lock and a bisect, as the hand-written exposition did,
where prometheus_client's Counter/Histogram objects take a lock per value (100k request_done calls:
0.2-0.4 s this way, 0.9-1.4 s with those objects). Each Metrics has its own registry, so two
services (or tests) in one process never clash."""
from __future__ import annotations

import bisect
import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# timeout, client_gone: dropped before the engine; queue_full: the token budget; busy: the byte budget;
# shutdown: queued when the drain's cut-off came; engine_down: queued when the engine died or stalled.
DROP_REASONS = ("timeout", "client_gone", "queue_full", "busy", "shutdown", "engine_down")


class _Histogram:
    """Counts per bucket (not cumulative: one increment per observation); cumulated when scraped."""

    def __init__(self, buckets):
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: a value on a bound counts in it
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out


class Metrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}  # (route, status) -> count
        self.latency: dict[str, _Histogram] = {}  # route -> latency
        self.tokens = 0
        self.inputs = 0
        self.queue_depth = 0
        self.engine_seconds = 0.0  # engine calls' running time, summed (utilisation = its rate)
        self.batch_size = _Histogram(BATCH_BUCKETS)
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.registry.register(self)

    def request_done(self, status: int, seconds: float, tokens: int = 0, inputs: int = 0,
                     route: str = "/v1/embeddings") -> None:
        with self._lock:
            key = (route, status)
            self.requests[key] = self.requests.get(key, 0) + 1
            latency = self.latency.get(route)
            if latency is None:
                latency = self.latency[route] = _Histogram(LATENCY_BUCKETS)
            latency.observe(seconds)
            self.tokens += tokens
            self.inputs += inputs

    def batch_done(self, size: int, seconds: float = 0.0) -> None:
        with self._lock:
            self.batch_size.observe(size)
            self.engine_seconds += seconds

    def set_queue_depth(self, n: int) -> None:
        self.queue_depth = n  # one assignment: atomic under the GIL

    def request_dropped(self, reason: str) -> None:
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def collect(self):
        """prometheus_client's collector protocol: the figures above as metric families."""
        with self._lock:
            requests = CounterMetricFamily("mopt_requests", "Requests by route and HTTP status.",
                                           labels=["route", "status"])
            for (route, status), n in sorted(self.requests.items()):
                requests.add_metric([route, str(status)], n)
            latency = HistogramMetricFamily("mopt_request_latency_seconds", "Request latency.", labels=["route"])
            for route, hist in sorted(self.latency.items()):
                latency.add_metric([route], hist.buckets(), hist.sum)
            batch = HistogramMetricFamily("mopt_batch_size", "Inputs per engine call.",
                                          buckets=self.batch_size.buckets(), sum_value=self.batch_size.sum)
            dropped = CounterMetricFamily("mopt_dropped_requests", "Requests dropped before the engine, by reason.",
                                          labels=["reason"])
            for reason, n in sorted(self.dropped.items()):
                dropped.add_metric([reason], n)
            families = [requests,
                        CounterMetricFamily("mopt_tokens", "Prompt tokens embedded.", value=self.tokens),
                        CounterMetricFamily("mopt_inputs", "Inputs embedded.", value=self.inputs),
                        GaugeMetricFamily("mopt_queue_depth", "Inputs waiting for the batch worker.",
                                          value=self.queue_depth),
                        CounterMetricFamily("mopt_engine_seconds", "Seconds engine calls ran (its rate of "
                                            "increase is the engine's utilisation).", value=self.engine_seconds),
                        latency, batch, dropped]
        yield from families

    def describe(self):
        return []  # no fixed description: the registry calls collect() per scrape only

    def render(self) -> bytes:
        return generate_latest(self.registry)
