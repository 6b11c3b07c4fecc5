"""Dynamic batching: one worker thread gathers queued requests up to max_batch inputs or
max_wait_ms, then makes one engine call, so concurrent small requests share a forward pass."""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future


class Batcher:
    def __init__(self, embed_ids, max_batch: int, max_wait_ms: float, metrics=None):
        self._embed = embed_ids
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.metrics = metrics
        self._q: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mopt-batcher", daemon=True)
        self._thread.start()

    def submit(self, seqs: list[list[int]]) -> Future:
        fut: Future = Future()
        with self._lock:
            self._pending += len(seqs)
            self._report()
        self._q.put((seqs, fut))
        return fut

    def _report(self) -> None:
        if self.metrics:
            self.metrics.set_queue_depth(self._pending)

    def _gather(self):
        try:
            first = self._q.get(timeout=0.1)
        except queue.Empty:
            return []
        items, count = [first], len(first[0])
        deadline = time.monotonic() + self.max_wait
        while count < self.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                item = self._q.get(timeout=left)
            except queue.Empty:
                break
            items.append(item)
            count += len(item[0])
        return items

    def _loop(self) -> None:
        # On close, finish what is queued so no request waits forever.
        while not (self._stop.is_set() and self._q.empty()):
            items = self._gather()
            if not items:
                continue
            flat = [s for seqs, _ in items for s in seqs]
            with self._lock:
                self._pending -= len(flat)
                self._report()
            try:
                out = self._embed(flat)
            except Exception as exc:  # fail these requests, keep the worker alive
                for _, fut in items:
                    fut.set_exception(exc)
                continue
            if self.metrics:
                self.metrics.batch_done(len(flat))
            pos = 0
            for seqs, fut in items:
                fut.set_result(out[pos:pos + len(seqs)])
                pos += len(seqs)

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
