"""Dynamic batching with a bounded queue and fair scheduling.

One worker thread makes every engine call. A request is a job; each engine call takes up to
max_batch inputs and max_batch_tokens tokens (a token budget, as TEI's --max-batch-tokens: a batch
of short texts holds many, one of long texts few), gathered for at most max_wait_ms, so concurrent
small requests share a forward pass and a large request is split into chunks. One input is always
taken, whatever its length.

Scheduling: shortest remaining work first. Each batch is filled from the jobs with the fewest
inputs left, so a small request is taken in the next batch instead of waiting behind every chunk
of earlier large ones (FIFO made a one-input request wait 34 s behind four large ones). A large job
still gets whatever room the small ones leave, and a job passed over MAX_SKIPS batches in a row
goes first, so a stream of small requests cannot starve it for longer than that.

Dropping: before each batch, jobs whose deadline passed, whose client left (client_gone()) or whose
future was cancelled are removed; their remaining inputs never reach the engine.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, InvalidStateError

MAX_SKIPS = 8  # batches a waiting job may be passed over before it goes first


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the queue is full; retry after {retry_after}s")
        self.retry_after = retry_after


class Dropped(Exception):
    """A job removed from the queue before its work reached the engine: reason 'timeout' or 'client_gone'."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Job:
    __slots__ = ("seqs", "fut", "deadline", "client_gone", "order", "next", "done", "results", "tokens",
                 "skipped")

    def __init__(self, seqs, fut, deadline, client_gone):
        self.seqs, self.fut, self.deadline, self.client_gone = seqs, fut, deadline, client_gone
        # Chunks in length order: inputs of similar length share an engine call, so padding stays small.
        self.order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        self.next = 0  # inputs of self.order already sent to the engine
        self.done = 0
        self.results: list = [None] * len(seqs)
        self.tokens = sum(len(s) for s in seqs)
        self.skipped = 0

    @property
    def left(self) -> int:
        return len(self.seqs) - self.next

    def drop_reason(self, now: float) -> str | None:
        if self.fut.done():  # cancelled by the waiting request, or failed by an earlier batch
            return "cancelled"
        if self.deadline is not None and now >= self.deadline:
            return "timeout"
        if self.client_gone is not None:
            try:
                if self.client_gone():
                    return "client_gone"
            except Exception:  # noqa: BLE001  (a broken probe must not stop the worker)
                return None
        return None


def _settle(fut: Future, result=None, exc: BaseException | None = None) -> None:
    # The waiting request may cancel its future at any moment: a settled future is left as it is.
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def blend_rate(rate: float, tokens: int, seconds: float) -> float:
    """The engine's recent tokens per second: the first batch's rate, then a moving average that gives
    each new batch a fifth of the weight (one slow batch moves Retry-After, it does not set it)."""
    latest = tokens / seconds
    return latest if rate <= 0 else 0.8 * rate + 0.2 * latest


class Batcher:
    def __init__(self, embed_ids, max_batch: int, max_wait_ms: float, metrics=None,
                 max_queue_tokens: int | None = None, max_batch_tokens: int | None = None):
        self._embed = embed_ids
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000.0
        self.metrics = metrics
        self.max_queue_tokens = max_queue_tokens
        self._jobs: list[_Job] = []  # jobs with inputs not yet sent to the engine
        self._queued_tokens = 0  # tokens of those inputs
        self._rate = 0.0  # tokens per second of recent engine calls, for Retry-After
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="mopt-batcher", daemon=True)
        self._thread.start()

    # --- called by request threads ------------------------------------------------------------------

    def submit(self, seqs: list[list[int]], deadline: float | None = None, client_gone=None) -> Future:
        """Queue one request; its future gets the vectors in input order. Raises QueueFull when the
        queue holds max_queue_tokens already (an empty queue takes any request)."""
        fut: Future = Future()
        with self._cond:
            job = _Job(seqs, fut, deadline, client_gone)
            if (self.max_queue_tokens is not None and self._jobs
                    and self._queued_tokens + job.tokens > self.max_queue_tokens):
                raise QueueFull(self._retry_after())
            self._jobs.append(job)  # in arrival order: the sorts below are stable, so ties stay first-come
            self._queued_tokens += job.tokens
            self._report()
            self._cond.notify()
        return fut

    def _retry_after(self) -> int:
        # Seconds to drain the queue at the recent engine rate, 1..30 (1 before any batch ran).
        if self._rate <= 0:
            return 1
        return int(min(30, max(1, round(self._queued_tokens / self._rate))))

    def _report(self) -> None:
        if self.metrics:
            self.metrics.set_queue_depth(sum(j.left for j in self._jobs))

    # --- the worker ---------------------------------------------------------------------------------

    def _drop_dead(self, now: float) -> None:
        """Remove jobs that must not reach the engine; caller holds the lock."""
        keep = []
        for job in self._jobs:
            reason = job.drop_reason(now)
            if reason is None:
                keep.append(job)
                continue
            self._queued_tokens -= sum(len(job.seqs[i]) for i in job.order[job.next:])
            if reason != "cancelled":
                _settle(job.fut, exc=Dropped(reason))
        if len(keep) != len(self._jobs):
            self._jobs = keep
            self._report()

    def _take(self) -> list[tuple[_Job, list[int]]]:
        """Pick up to max_batch inputs and max_batch_tokens tokens, the jobs with the least work left
        first; caller holds the lock."""
        # Jobs passed over MAX_SKIPS times first, oldest first; then the least work left.
        starved: list[_Job] = []
        rest: list[_Job] = []
        for job in self._jobs:
            (starved if job.skipped >= MAX_SKIPS else rest).append(job)
        ranked = starved + sorted(rest, key=lambda j: j.left)
        batch, room = [], self.max_batch
        budget = self.max_batch_tokens
        for job in ranked:
            idx = job.order[job.next:job.next + room]
            if budget is not None:
                fits, used = 0, 0
                for i in idx:
                    if used + len(job.seqs[i]) > budget and (batch or fits):
                        break
                    used += len(job.seqs[i])
                    fits += 1
                idx = idx[:fits]
            if not idx:
                job.skipped += 1
                continue
            job.next += len(idx)
            job.skipped = 0
            room -= len(idx)
            tokens = sum(len(job.seqs[i]) for i in idx)
            self._queued_tokens -= tokens
            if budget is not None:
                budget -= tokens
            batch.append((job, idx))
        self._jobs = [j for j in self._jobs if j.left]
        self._report()
        return batch

    def _full(self) -> bool:
        """Whether the queue holds a whole batch: max_batch inputs, or the token budget."""
        return (sum(j.left for j in self._jobs) >= self.max_batch
                or (self.max_batch_tokens is not None and self._queued_tokens >= self.max_batch_tokens))

    def _gather(self) -> list[tuple[_Job, list[int]]]:
        """The next batch; [] only once closed with nothing left to do."""
        with self._cond:
            while True:
                self._drop_dead(time.monotonic())
                while not self._jobs:
                    if self._stop:
                        return []
                    self._cond.wait()  # submit() and close() notify
                    self._drop_dead(time.monotonic())
                # Wait up to max_wait for a full batch; not when closing, nor for the rest of a request
                # already under way (its chunks go back to back).
                until = time.monotonic() + self.max_wait
                while not self._stop and not self._full() and not any(j.next for j in self._jobs):
                    left = until - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                    self._drop_dead(time.monotonic())
                if self._jobs:  # else every job left while gathering: start over
                    return self._take()

    def _loop(self) -> None:
        # On close, finish what is queued so no request waits forever: _gather returns [] only then.
        while batch := self._gather():
            self._run(batch)

    def _run(self, batch: list[tuple[_Job, list[int]]]) -> None:
        flat = [job.seqs[i] for job, idx in batch for i in idx]
        started = time.monotonic()
        try:
            out = self._embed(flat)
        except Exception as exc:  # fail these requests (all their chunks), keep the worker alive
            with self._cond:
                for job, _ in batch:
                    _settle(job.fut, exc=exc)
                self._drop_dead(time.monotonic())  # their remaining chunks leave the queue
            return
        took = time.monotonic() - started
        tokens = sum(len(s) for s in flat)
        if took > 0:
            self._rate = blend_rate(self._rate, tokens, took)
        if self.metrics:
            self.metrics.batch_done(len(flat))
        pos = 0
        for job, idx in batch:
            for i in idx:
                job.results[i] = out[pos]
                pos += 1
            job.done += len(idx)
            if job.done == len(job.seqs):
                _settle(job.fut, job.results)

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)
