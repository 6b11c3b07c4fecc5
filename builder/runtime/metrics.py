"""Prometheus text exposition without the client library (the image carries only stdlib + torch)."""
from __future__ import annotations

import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.total += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.total}"]


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = defaultdict(int)  # status code -> count
        self.tokens = 0
        self.inputs = 0
        self.queue_depth = 0
        self.latency = Histogram(LATENCY_BUCKETS)
        self.batch_size = Histogram(BATCH_BUCKETS)

    def request_done(self, status: int, seconds: float, tokens: int = 0, inputs: int = 0) -> None:
        with self._lock:
            self.requests[status] += 1
            self.tokens += tokens
            self.inputs += inputs
            self.latency.observe(seconds)

    def batch_done(self, size: int) -> None:
        with self._lock:
            self.batch_size.observe(size)

    def set_queue_depth(self, n: int) -> None:
        with self._lock:
            self.queue_depth = n

    def render(self) -> str:
        with self._lock:
            lines = ["# HELP mopt_requests_total Embedding requests by HTTP status.",
                     "# TYPE mopt_requests_total counter"]
            lines += [f'mopt_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
            lines += ["# HELP mopt_tokens_total Prompt tokens embedded.", "# TYPE mopt_tokens_total counter",
                      f"mopt_tokens_total {self.tokens}",
                      "# HELP mopt_inputs_total Inputs embedded.", "# TYPE mopt_inputs_total counter",
                      f"mopt_inputs_total {self.inputs}",
                      "# HELP mopt_queue_depth Inputs waiting for the batch worker.",
                      "# TYPE mopt_queue_depth gauge", f"mopt_queue_depth {self.queue_depth}",
                      "# HELP mopt_request_latency_seconds Request latency.",
                      "# TYPE mopt_request_latency_seconds histogram"]
            lines += self.latency.lines("mopt_request_latency_seconds")
            lines += ["# HELP mopt_batch_size Inputs per engine call.", "# TYPE mopt_batch_size histogram"]
            lines += self.batch_size.lines("mopt_batch_size")
            return "\n".join(lines) + "\n"
