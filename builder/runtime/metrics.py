"""Prometheus metrics on prometheus_client: the process (RSS, CPU, open fds) and the server's own.

Each Metrics has its own registry, so two services (or tests) in one process never clash."""
from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

# The *_created series (one timestamp per counter child) only double the output; nothing reads them.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DROP_REASONS = ("timeout", "client_gone", "queue_full")


class Metrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        r = self.registry
        self._requests = Counter("mopt_requests", "Requests by route and HTTP status.", ["route", "status"],
                                 registry=r)
        self._tokens = Counter("mopt_tokens", "Prompt tokens embedded.", registry=r)
        self._inputs = Counter("mopt_inputs", "Inputs embedded.", registry=r)
        self._queue = Gauge("mopt_queue_depth", "Inputs waiting for the batch worker.", registry=r)
        self._latency = Histogram("mopt_request_latency_seconds", "Request latency.", ["route"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self._batch = Histogram("mopt_batch_size", "Inputs per engine call.", buckets=BATCH_BUCKETS, registry=r)
        self._dropped = Counter("mopt_dropped_requests", "Requests dropped before the engine, by reason.",
                                ["reason"], registry=r)
        for reason in DROP_REASONS:  # present at 0 from the start, so rate() sees the first drop
            self._dropped.labels(reason)
        # labels() takes a lock and formats its key on every call: keep each child once.
        self._children: dict = {}
        self._lock = threading.Lock()

    def _child(self, route: str, status: int):
        key = (route, status)
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = (self._requests.labels(route, str(status)), self._latency.labels(route))
                self._children[key] = child
        return child

    def request_done(self, status: int, seconds: float, tokens: int = 0, inputs: int = 0,
                     route: str = "/v1/embeddings") -> None:
        requests, latency = self._child(route, status)
        requests.inc()
        latency.observe(seconds)
        if tokens:
            self._tokens.inc(tokens)
        if inputs:
            self._inputs.inc(inputs)

    def batch_done(self, size: int) -> None:
        self._batch.observe(size)

    def set_queue_depth(self, n: int) -> None:
        self._queue.set(n)

    def request_dropped(self, reason: str) -> None:
        self._dropped.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
