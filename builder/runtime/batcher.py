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
future was cancelled are removed; their remaining inputs never reach the engine. fail_queued() fails
every queued job at once (the drain's cut-off, a dead engine).

Pipelining: up to `depth` engine calls are in flight (2 by default). While one runs, the next is
formed just in time: when the queue holds a whole batch, or when the running call is due to end (its
tokens at the recent rate, less LEAD_S), so the engine never waits for Python between two calls and
the next batch still takes everything that arrived meanwhile. engine calls go through submit(seqs)
-> Future: the engine process's pipe (worker.py), or a one-thread executor around a plain function.

Heartbeat: every call records when it started (when the one before it ended) and its tokens; an idle
batcher pings the engine (an empty call) every ping_interval_s. stalled() is true once a call has run
past its deadline: STALL_FACTOR times what its tokens should take at the recent rate, and at least
stall_timeout_s (before any rate is known, FIRST_CALL_S). The server's watchdog reads it.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

MAX_SKIPS = 8  # batches a waiting job may be passed over before it goes first
STALL_FACTOR = 4.0  # a call may take this many times its expected time before the engine counts as stalled
FIRST_CALL_S = 60.0  # a call's deadline while no engine rate has been measured yet (warm-up)
LEAD_S = 0.003  # the next call is sent this long before the running one is due to end (the hand-over)
# An idle engine's batch waits (up to max_wait) while requests keep coming: it goes out once none came for
# this long. A burst of clients (those the last call answered, sending again) lands in one call.
QUIET_S = 0.002


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


class CallModel:
    """How long an engine call of n tokens takes: fixed + n * per_token, fitted by least squares over the
    recent calls. A call costs a fixed part (kernel launches, the pipe, the wrapper) that a plain
    tokens-per-second rate spreads over small calls as if it scaled: with it, the next call was sent too
    early and went out small. Falls back to the rate while the recent calls cannot separate the two."""

    def __init__(self, keep: int = 64):
        self.calls: deque[tuple[int, float]] = deque(maxlen=keep)

    def add(self, tokens: int, seconds: float) -> None:
        self.calls.append((tokens, seconds))

    def seconds(self, tokens: int, rate: float) -> float:
        n = len(self.calls)
        if n >= 4:
            mean_x = sum(x for x, _ in self.calls) / n
            mean_y = sum(y for _, y in self.calls) / n
            var = sum((x - mean_x) ** 2 for x, _ in self.calls)
            if var > 0:
                slope = sum((x - mean_x) * (y - mean_y) for x, y in self.calls) / var
                fixed = mean_y - slope * mean_x
                if slope > 0 and fixed >= 0:
                    return fixed + slope * tokens
        return tokens / rate if rate > 0 else math.inf


def blend_rate(rate: float, tokens: int, seconds: float) -> float:
    """The engine's recent tokens per second: the first batch's rate, then a moving average that gives
    each new batch a fifth of the weight (one slow batch moves Retry-After, it does not set it)."""
    latest = tokens / seconds
    return latest if rate <= 0 else 0.8 * rate + 0.2 * latest


class _Call:
    """One engine call in flight: its batch (None: a ping), tokens, and when it started running (None
    while the call before it still runs)."""

    __slots__ = ("batch", "tokens", "started", "inputs")

    def __init__(self, batch, tokens: int, inputs: int, started: float | None):
        self.batch, self.tokens, self.inputs, self.started = batch, tokens, inputs, started


class Batcher:
    def __init__(self, embed_ids, max_batch: int, max_wait_ms: float, metrics=None,
                 max_queue_tokens: int | None = None, max_batch_tokens: int | None = None,
                 ping_interval_s: float | None = None, stall_timeout_s: float = 5.0, submit=None, depth: int = 2,
                 quiet_s: float = QUIET_S, concurrent: bool = False):
        self._embed = embed_ids
        self._executor = None
        self.depth = max(1, depth)
        if submit is None:  # a plain function: on threads of our own, one call after another unless the
            # engine batches concurrent calls itself (concurrent: one thread per call in flight)
            self._executor = ThreadPoolExecutor(self.depth if concurrent else 1, thread_name_prefix="mopt-engine-call")
            submit = lambda seqs: self._executor.submit(self._embed, seqs)  # noqa: E731
        self._submit = submit
        self._inflight: deque[_Call] = deque()
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000.0
        self.metrics = metrics
        self.max_queue_tokens = max_queue_tokens
        self._jobs: list[_Job] = []  # jobs with inputs not yet sent to the engine
        self._queued_tokens = 0  # tokens of those inputs
        self._queued_inputs = 0  # and how many they are
        self._rate = 0.0  # tokens per second of recent engine calls, for Retry-After
        self.model = CallModel()  # seconds per call, for when the next call is due
        self._last_submit = 0.0
        self.quiet = quiet_s
        self.ping_interval = ping_interval_s
        self.stall_timeout = stall_timeout_s
        self.longest_call_s = 0.0  # the longest engine call so far (the drain keeps room for one)
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
            # The batcher is woken only where its wait can end: the first job, a half or a whole batch.
            # Its other waits end on their own clock (the quiet time reads _last_submit when it runs out):
            # a wake-up per request cost the event loop's thread a GIL hand-over each (9% of its time).
            first, was_full, was_half = not self._jobs, self._full(), self._full(0.5)
            self._jobs.append(job)  # in arrival order: the sorts below are stable, so ties stay first-come
            self._queued_tokens += job.tokens
            self._queued_inputs += len(seqs)
            self._last_submit = time.monotonic()
            self._report()
            if first or (not was_full and self._full()) or (not was_half and self._full(0.5)):
                self._cond.notify()
        return fut

    def _retry_after(self) -> int:
        # Seconds to drain the queue at the recent engine rate, 1..30 (1 before any batch ran).
        if self._rate <= 0:
            return 1
        return int(min(30, max(1, round(self._queued_tokens / self._rate))))

    def _report(self) -> None:
        if self.metrics:
            self.metrics.set_queue_depth(self._queued_inputs)

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
            self._queued_inputs -= job.left
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
            self._queued_inputs -= len(idx)
            if budget is not None:
                budget -= tokens
            batch.append((job, idx))
        self._jobs = [j for j in self._jobs if j.left]
        self._report()
        return batch

    def _full(self, share: float = 1.0) -> bool:
        """Whether the queue holds a whole batch (or that share of one): max_batch inputs, or the token
        budget."""
        return (self._queued_inputs >= share * self.max_batch
                or (self.max_batch_tokens is not None and self._queued_tokens >= share * self.max_batch_tokens))

    def _gather(self) -> list[tuple[_Job, list[int]]]:
        """The next batch, once a call slot is free; [(None, [])] for a ping; [] only once closed with
        nothing left to do."""
        with self._cond:
            while True:
                while len(self._inflight) >= self.depth:
                    self._cond.wait()  # a call's completion notifies
                self._drop_dead(time.monotonic())
                while not self._jobs:
                    if self._stop:
                        return []
                    # submit(), close() and completions notify; an idle batcher wakes to ping the engine
                    if (not self._cond.wait(None if self._inflight else self.ping_interval) and not self._jobs
                            and not self._stop and not self._inflight):
                        return [(None, [])]
                    self._drop_dead(time.monotonic())
                if self._inflight:
                    # The engine is busy: send a whole batch at once; half a batch when the running call
                    # is due to end (a call that ran late: at once); less waits for the call to end, so
                    # a few requests do not go out as a small call of their own.
                    while not self._stop and not self._full() and self._inflight:
                        left = self._due() - time.monotonic() if self._full(0.5) else math.inf
                        if left <= 0:
                            break
                        self._cond.wait(None if left == math.inf else left)
                        self._drop_dead(time.monotonic())
                else:
                    # The engine is idle: wait up to max_wait for a full batch while requests keep coming
                    # (QUIET_S); not when closing, nor for the rest of a request already under way (its
                    # chunks go back to back).
                    until = time.monotonic() + self.max_wait
                    while not self._stop and not self._full() and not any(j.next for j in self._jobs):
                        left = min(until, self._last_submit + self.quiet) - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                        self._drop_dead(time.monotonic())
                if self._jobs:  # else every job left while gathering: start over
                    return self._take()

    def _due(self) -> float:
        """When the calls in flight are expected to end, less LEAD_S (caller holds the lock)."""
        first = self._inflight[0]
        # No rate yet: infinite, so the next call waits for the running one to end.
        end = (first.started or time.monotonic()) + sum(self.model.seconds(c.tokens, self._rate)
                                                         for c in self._inflight)
        return end - LEAD_S

    def _loop(self) -> None:
        # On close, finish what is queued so no request waits forever: _gather returns [] only then.
        while batch := self._gather():
            self._dispatch(batch)
        with self._cond:  # the calls still in flight deliver their results
            while self._inflight:
                self._cond.wait()

    def _dispatch(self, batch: list[tuple[_Job | None, list[int]]]) -> None:
        ping = batch[0][0] is None
        flat = [] if ping else [job.seqs[i] for job, idx in batch for i in idx]
        with self._cond:
            call = _Call(None if ping else batch, sum(len(s) for s in flat), len(flat),
                         None if self._inflight else time.monotonic())
            self._inflight.append(call)
        try:
            fut = self._submit(flat)
        except Exception as exc:  # noqa: BLE001  (as a failed call)
            fut = Future()
            fut.set_exception(exc)
        fut.add_done_callback(lambda done, call=call: self._complete(call, done))

    def _complete(self, call: _Call, fut: Future) -> None:
        """A call ended (on the engine's thread): its results to their jobs, the next call starts now."""
        now = time.monotonic()
        exc = fut.exception()
        with self._cond:
            self._inflight.remove(call)
            if self._inflight and self._inflight[0].started is None:
                self._inflight[0].started = now
            self._cond.notify_all()
            if call.batch is None:  # a ping: a dead engine is the watchdog's to report
                return
            if exc is not None:  # fail these requests (all their chunks), keep the batcher alive
                for job, _ in call.batch:
                    _settle(job.fut, exc=exc)
                self._drop_dead(now)  # their remaining chunks leave the queue
                return
            took = now - (call.started or now)
            self.longest_call_s = max(self.longest_call_s, took)
            if took > 0:
                self._rate = blend_rate(self._rate, call.tokens, took)
                self.model.add(call.tokens, took)
            if self.metrics:
                self.metrics.batch_done(call.inputs, took)
            out = fut.result()
            pos = 0
            for job, idx in call.batch:
                for i in idx:
                    job.results[i] = out[pos]
                    pos += 1
                job.done += len(idx)
                if job.done == len(job.seqs):
                    _settle(job.fut, job.results)

    def stalled(self, now: float | None = None) -> float | None:
        """Seconds the engine call under way has run, once past its deadline (None before that)."""
        try:
            call = self._inflight[0]
        except IndexError:
            return None
        started, tokens = call.started, call.tokens
        if started is None:
            return None
        now = time.monotonic() if now is None else now
        if not tokens:  # a ping: nothing to compute
            expected = 0.0
        else:
            expected = tokens / self._rate if self._rate > 0 else FIRST_CALL_S / STALL_FACTOR
        limit = max(self.stall_timeout, STALL_FACTOR * expected)
        return now - started if now - started > limit else None

    def fail_queued(self, exc: BaseException) -> int:
        """Fail every job still waiting for the engine (chunks already in the engine finish unused);
        returns how many."""
        with self._cond:
            jobs, self._jobs = self._jobs, []
            self._queued_tokens = self._queued_inputs = 0
            for job in jobs:
                _settle(job.fut, exc=exc)
            self._report()
        return len(jobs)

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._executor is not None:
            self._executor.shutdown(wait=False)
