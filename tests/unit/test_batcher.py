"""The dynamic batcher with a fake engine: each request gets its own vectors back from a shared
batch, gathering stops at max_batch or max_wait, an engine error fails one batch only, close()
finishes queued work, and the queue depth is reported; a small request goes before the rest of a
large one, the queue is bounded, and dead requests never reach the engine."""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from builder.runtime.batcher import LEAD_S, Batcher, CallModel
from tests.serving import wait_for

WAIT = 5  # seconds any future or event may take before the test fails (not slept)


def vec(seq: list[int]) -> list[float]:
    """A vector that names its sequence, so a request given another's vectors is seen."""
    return [float(seq[0]), float(len(seq)), float(sum(seq))]


class FakeEngine:
    """embed_ids for the batcher: records every batch; the first call can be held until released."""

    def __init__(self, hold_first: bool = False, fail_on: int | None = None):
        self.calls: list[list[list[int]]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.fail_on = fail_on

    def __call__(self, seqs):
        self.calls.append([list(s) for s in seqs])
        self.entered.set()
        assert self.release.wait(WAIT)
        if any(self.fail_on in s for s in seqs):
            raise ValueError(f"bad token {self.fail_on}")
        return [vec(s) for s in seqs]


class Recorder:
    def __init__(self):
        self.depths: list[int] = []
        self.batches: list[int] = []
        self.seconds: list[float] = []

    def set_queue_depth(self, n: int) -> None:
        self.depths.append(n)

    def batch_done(self, size: int, seconds: float = -1.0) -> None:  # -1: the batcher gave no time
        self.batches.append(size)
        self.seconds.append(seconds)


@pytest.fixture
def make():
    made = []

    def factory(engine, max_batch, max_wait_ms, metrics=None, max_queue_tokens=None,
                max_batch_tokens=None, depth=1, quiet_s=10.0) -> Batcher:
        # depth 1 by default: these tests hold the scheduling of one call after another; the pipelined
        # calls (depth 2, the server's) have tests of their own at the end. quiet_s 10 s by default: a
        # partial batch waits its whole max_wait unless a test says otherwise.
        batcher = Batcher(engine, max_batch, max_wait_ms, metrics, max_queue_tokens=max_queue_tokens,
                          max_batch_tokens=max_batch_tokens, depth=depth, quiet_s=quiet_s)
        made.append(batcher)
        return batcher

    yield factory
    for batcher in made:
        batcher.close(timeout=WAIT)


def busy(batcher: Batcher, engine: FakeEngine, size: int):
    """Occupy the worker with a full batch so the next requests queue up behind it."""
    blocker = batcher.submit([[1000 + i] for i in range(size)])
    assert engine.entered.wait(WAIT)
    return blocker


def test_queued_requests_share_one_batch_and_get_their_own_vectors(make):
    engine, metrics = FakeEngine(hold_first=True), Recorder()
    batcher = make(engine, max_batch=4, max_wait_ms=5000, metrics=metrics)
    blocker = busy(batcher, engine, 4)
    requests = [[[1, 2]], [[3], [4, 5, 6]], [[7, 8, 9, 10]]]
    futures = [batcher.submit(seqs) for seqs in requests]
    engine.release.set()
    assert blocker.result(WAIT) == [vec([1000 + i]) for i in range(4)]
    for seqs, fut in zip(requests, futures, strict=True):
        assert fut.result(WAIT) == [vec(s) for s in seqs]
    # One engine call; the requests with the fewest inputs first (arrival order among equals), each
    # request's inputs shortest first.
    assert engine.calls[1] == [[1, 2], [7, 8, 9, 10], [3], [4, 5, 6]]
    assert len(engine.calls) == 2
    assert metrics.depths == [4, 0, 1, 3, 4, 0]  # queued inputs, not requests
    assert metrics.batches == [4, 4]


def test_concurrent_submits_each_get_their_own_vectors(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=15, max_wait_ms=5000)
    blocker = busy(batcher, engine, 15)
    requests = [[[10 * i + j] * (1 + j) for j in range(1 + i % 3)] for i in range(8)]  # 15 inputs
    with ThreadPoolExecutor(8) as pool:
        futures = list(pool.map(batcher.submit, requests))
    engine.release.set()
    blocker.result(WAIT)
    for seqs, fut in zip(requests, futures, strict=True):
        assert fut.result(WAIT) == [vec(s) for s in seqs]
    # All 15 inputs waited behind the blocker: one full batch, no wait.
    assert len(engine.calls) == 2 and len(engine.calls[1]) == 15


def test_gathering_stops_at_max_batch(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=2, max_wait_ms=100)
    busy(batcher, engine, 2)
    futures = [batcher.submit([[i]]) for i in (1, 2, 3)]
    engine.release.set()
    assert [f.result(WAIT) for f in futures] == [[vec([1])], [vec([2])], [vec([3])]]
    assert engine.calls[1:] == [[[1], [2]], [[3]]]


def test_a_request_larger_than_max_batch_is_split_into_chunks_back_to_back(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch=2, max_wait_ms=5000)
    seqs = [[i] * (5 - i) for i in range(5)]  # longest first: the chunks go shortest first
    started = time.monotonic()
    assert batcher.submit(seqs).result(WAIT) == [vec(s) for s in seqs]
    assert engine.calls == [[[4], [3, 3]], [[2, 2, 2], [1] * 4], [[0] * 5]]
    assert time.monotonic() - started < 2  # the last, partial chunk did not wait max_wait for company


def test_a_partial_batch_waits_max_wait_for_more(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch=100, max_wait_ms=200)
    started = time.monotonic()
    first, second = batcher.submit([[1]]), batcher.submit([[2], [3]])
    assert first.result(WAIT) == [vec([1])] and second.result(WAIT) == [vec([2]), vec([3])]
    waited = time.monotonic() - started
    assert 0.2 <= waited < 2, waited
    assert engine.calls == [[[1], [2], [3]]]


def test_an_engine_error_fails_only_its_batch(make):
    engine, metrics = FakeEngine(hold_first=True, fail_on=-1), Recorder()
    batcher = make(engine, max_batch=2, max_wait_ms=50, metrics=metrics)
    busy(batcher, engine, 2)
    bad, good_same_batch, good_next_batch = (batcher.submit([[-1]]), batcher.submit([[5]]),
                                             batcher.submit([[6], [7]]))
    engine.release.set()
    for fut in (bad, good_same_batch):
        with pytest.raises(ValueError, match="^bad token -1$"):
            fut.result(WAIT)
    assert good_next_batch.result(WAIT) == [vec([6]), vec([7])]
    # The worker lives on.
    assert batcher.submit([[8]]).result(WAIT) == [vec([8])]
    assert engine.calls[1:] == [[[-1], [5]], [[6], [7]], [[8]]]
    assert metrics.batches == [2, 2, 1]  # the failed batch is not counted as done
    assert metrics.depths[-1] == 0


def test_without_metrics(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch=4, max_wait_ms=1)
    assert batcher.submit([[1], [2]]).result(WAIT) == [vec([1]), vec([2])]


def test_close_finishes_queued_work(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=1, max_wait_ms=5000)
    blocker = busy(batcher, engine, 1)
    queued = [batcher.submit([[i]]) for i in (1, 2)]
    closer = threading.Thread(target=batcher.close, kwargs={"timeout": WAIT})
    closer.start()
    engine.release.set()
    closer.join(WAIT)
    assert not closer.is_alive() and not batcher._thread.is_alive()
    assert blocker.done() and [f.result(0) for f in queued] == [[vec([1])], [vec([2])]]


def test_close_of_an_idle_batcher_is_prompt(make):
    batcher = make(FakeEngine(), max_batch=4, max_wait_ms=5)
    started = time.monotonic()
    batcher.close(timeout=2)
    assert not batcher._thread.is_alive()
    assert time.monotonic() - started < 0.5  # the worker polls its queue at 0.1 s, not forever


def test_worker_thread_does_not_keep_the_process_alive(make):
    batcher = make(FakeEngine(), max_batch=4, max_wait_ms=5)
    # A daemon thread: a server that exits without close() does not hang; the name shows in thread dumps.
    assert batcher._thread.daemon is True and batcher._thread.name == "mopt-batcher"


def test_the_worker_outlives_an_idle_spell(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch=1, max_wait_ms=1)
    time.sleep(0.25)  # a few of the worker's 0.1 s polls of an empty queue
    assert batcher.submit([[1]]).result(WAIT) == [vec([1])]


def test_close_gives_up_on_a_stuck_engine_after_its_timeout(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=1, max_wait_ms=1)
    busy(batcher, engine, 1)
    started = time.monotonic()
    try:
        batcher.close(timeout=0.2)
        assert 0.2 <= time.monotonic() - started < 2
        assert batcher._thread.is_alive()
    finally:
        engine.release.set()


# --- fair scheduling, bounded queue, dropped work -------------------------------------------------

def test_a_small_request_goes_before_the_rest_of_a_large_one(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=2, max_wait_ms=1)
    large = batcher.submit([[100 + i] for i in range(8)])
    assert engine.entered.wait(WAIT)  # the large request's first chunk is in the engine
    small = batcher.submit([[7]])
    engine.release.set()
    assert small.result(WAIT) == [vec([7])] and large.result(WAIT) == [vec([100 + i]) for i in range(8)]
    # FIFO would have run all four chunks of the large request first.
    assert engine.calls == [[[100], [101]], [[7], [102]], [[103], [104]], [[105], [106]], [[107]]]


def test_a_large_request_is_not_starved_by_a_stream_of_small_ones(make):
    from builder.runtime.batcher import MAX_SKIPS

    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=1, max_wait_ms=1)
    large = batcher.submit([[500], [501], [502]])
    assert engine.entered.wait(WAIT)
    smalls = [batcher.submit([[i]]) for i in range(MAX_SKIPS + 4)]
    engine.release.set()
    large.result(WAIT)
    for fut in smalls:
        fut.result(WAIT)
    # The large request's second chunk waited MAX_SKIPS batches, then went first.
    assert engine.calls.index([[501]]) == 1 + MAX_SKIPS


def test_a_request_passed_over_from_its_arrival_goes_first_after_max_skips(make):
    from builder.runtime.batcher import MAX_SKIPS

    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=1, max_wait_ms=1)
    busy(batcher, engine, 1)
    large = batcher.submit([[500], [501]])  # never picked while one-input requests wait
    smalls = [batcher.submit([[i]]) for i in range(MAX_SKIPS + 4)]
    engine.release.set()
    assert large.result(WAIT) == [vec([500]), vec([501])]
    for fut in smalls:
        fut.result(WAIT)
    # Passed over in MAX_SKIPS batches, then first (the one-input requests passed over as often then go
    # first too, oldest first, before the rest of it).
    assert engine.calls.index([[500]]) == 1 + MAX_SKIPS and engine.calls[-1] == [[501]]


def test_requests_with_the_same_work_left_keep_their_arrival_order(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=1, max_wait_ms=1)
    busy(batcher, engine, 1)
    futures = [batcher.submit([[i], [i + 50]]) for i in range(4)]
    engine.release.set()
    for i, fut in enumerate(futures):
        assert fut.result(WAIT) == [vec([i]), vec([i + 50])]
    # Each request's rest goes next (least work left); among equals, first come first served.
    assert engine.calls[1:] == [call for i in range(4) for call in ([[i]], [[i + 50]])]


def test_the_worker_survives_a_request_dropped_while_it_waits(make):
    """A dead request dropped by the idle worker leaves it waiting for the next one, not gone."""
    from builder.runtime.batcher import Dropped

    engine = FakeEngine()
    batcher = make(engine, max_batch=4, max_wait_ms=1)
    late = batcher.submit([[1]], deadline=time.monotonic() - 1)
    with pytest.raises(Dropped):
        late.result(WAIT)
    assert batcher.submit([[2]]).result(WAIT) == [vec([2])]
    assert engine.calls == [[[2]]]


def test_after_a_failed_batch_the_worker_serves_requests_with_deadlines(make):
    engine = FakeEngine(hold_first=True, fail_on=13)
    batcher = make(engine, max_batch=1, max_wait_ms=1)
    busy(batcher, engine, 1)
    bad = batcher.submit([[13]])
    good = batcher.submit([[2], [3]], deadline=time.monotonic() + 60)
    engine.release.set()
    with pytest.raises(ValueError, match="bad token 13"):
        bad.result(WAIT)
    assert good.result(WAIT) == [vec([2]), vec([3])]


def test_queue_full_and_dropped_say_why():
    from builder.runtime.batcher import Dropped, QueueFull

    assert str(QueueFull(3)) == "the queue is full; retry after 3s" and QueueFull(3).retry_after == 3
    assert str(Dropped("timeout")) == "timeout" and Dropped("client_gone").reason == "client_gone"


def test_the_retry_hint_follows_the_measured_engine_rate(make):
    """An engine that takes 0.5 s for 10 tokens runs at about 20 tokens/s: 100 queued tokens drain in
    about 5 s (a loaded machine only makes the engine slower, so the hint only grows)."""
    from builder.runtime.batcher import QueueFull

    class SlowEngine(FakeEngine):
        def __call__(self, seqs):
            out = super().__call__(seqs)
            time.sleep(0.5)
            return out

    engine = SlowEngine()
    batcher = make(engine, max_batch=1, max_wait_ms=1, max_queue_tokens=100)
    assert batcher.submit([list(range(10))]).result(WAIT) == [vec(list(range(10)))]  # measures the rate
    engine.release.clear()
    engine.entered.clear()
    busy(batcher, engine, 1)
    queued = batcher.submit([list(range(100))])
    with pytest.raises(QueueFull) as full:
        batcher.submit([[1]])
    assert 4 <= full.value.retry_after <= 12, full.value.retry_after
    engine.release.set()
    queued.result(WAIT)


def test_a_full_queue_refuses_with_a_retry_hint(make):
    from builder.runtime.batcher import QueueFull

    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=1, max_wait_ms=1, max_queue_tokens=4)
    busy(batcher, engine, 1)  # in the engine, no longer queued
    first = batcher.submit([[1, 2, 3]])
    with pytest.raises(QueueFull) as full:
        batcher.submit([[4, 5]])  # 3 + 2 > 4
    assert full.value.retry_after == 1  # no engine rate known yet
    second = batcher.submit([[6]])  # 3 + 1 fits
    engine.release.set()
    assert first.result(WAIT) == [vec([1, 2, 3])] and second.result(WAIT) == [vec([6])]
    # An empty queue takes a request above the bound (max_request_tokens bounds each request).
    assert batcher.submit([[9] * 10]).result(WAIT) == [vec([9] * 10)]


def test_the_engine_rate_is_the_first_batch_then_a_moving_average():
    from builder.runtime.batcher import blend_rate

    assert blend_rate(0.0, 100, 2.0) == 50.0  # the first batch sets it
    assert blend_rate(50.0, 100, 1.0) == pytest.approx(0.8 * 50 + 0.2 * 100)  # a fifth of the weight
    assert blend_rate(0.5, 100, 1.0) == pytest.approx(0.8 * 0.5 + 0.2 * 100)  # however slow it was


@pytest.mark.parametrize("rate, hint", [(1.0, 5), (2.0, 2), (10.0, 1), (0.01, 30)])
def test_the_retry_hint_is_the_queue_drained_at_the_engine_rate(make, rate, hint):
    from builder.runtime.batcher import QueueFull

    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=1, max_wait_ms=1, max_queue_tokens=5)
    busy(batcher, engine, 1)
    queued = batcher.submit([[1, 2, 3, 4, 5]])  # 5 tokens waiting
    batcher._rate = rate  # as if measured: seconds = 5 tokens / rate, within 1..30
    with pytest.raises(QueueFull) as full:
        batcher.submit([[6]])
    assert full.value.retry_after == hint
    engine.release.set()
    assert queued.result(WAIT) == [vec([1, 2, 3, 4, 5])]


@pytest.mark.parametrize("kind", ["deadline", "client_gone", "cancelled"])
def test_dead_requests_leave_the_queue_before_the_engine_sees_them(make, kind):
    from builder.runtime.batcher import Dropped

    engine, metrics = FakeEngine(hold_first=True), Recorder()
    batcher = make(engine, max_batch=1, max_wait_ms=1, metrics=metrics)
    busy(batcher, engine, 1)
    gone = threading.Event()
    deadline = time.monotonic() + 0.05 if kind == "deadline" else None
    dead = batcher.submit([[7], [8]], deadline=deadline, client_gone=gone.is_set)
    alive = batcher.submit([[9]], deadline=time.monotonic() + WAIT)
    if kind == "deadline":
        time.sleep(0.1)
    elif kind == "client_gone":
        gone.set()
    else:
        assert dead.cancel()
    engine.release.set()
    assert alive.result(WAIT) == [vec([9])]
    assert engine.calls[1:] == [[[9]]]  # nothing of the dead request reached the engine
    if kind == "cancelled":
        assert dead.cancelled()
    else:
        with pytest.raises(Dropped) as dropped:
            dead.result(WAIT)
        assert dropped.value.reason == {"deadline": "timeout", "client_gone": "client_gone"}[kind]
    assert metrics.depths[-1] == 0 and batcher._queued_tokens == 0


def test_an_engine_error_drops_the_rest_of_its_request(make):
    engine = FakeEngine(fail_on=-1)
    batcher = make(engine, max_batch=2, max_wait_ms=1)
    bad = batcher.submit([[-1], [-1, 2], [3, 3, 3], [4, 4, 4, 4]])
    with pytest.raises(ValueError, match="bad token -1"):
        bad.result(WAIT)
    assert batcher.submit([[5]]).result(WAIT) == [vec([5])]
    assert engine.calls == [[[-1], [-1, 2]], [[5]]]  # the failed request's second chunk never ran
    assert batcher._queued_tokens == 0


def test_a_probe_that_raises_does_not_stop_the_worker(make):
    def broken():
        raise RuntimeError("probe")

    batcher = make(FakeEngine(), max_batch=2, max_wait_ms=1)
    assert batcher.submit([[1]], client_gone=broken).result(WAIT) == [vec([1])]


def test_batches_are_cut_by_the_token_budget(make):
    """max_batch_tokens: a call takes inputs while their tokens fit (short texts: many, long: few), the
    shortest first; an input longer than the whole budget still goes, alone."""
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=100, max_wait_ms=5000, max_batch_tokens=10)
    blocker = busy(batcher, engine, 10)  # 10 one-token inputs fill the budget: no wait
    short = batcher.submit([[1, 1], [2, 2], [3, 3]])  # 6 tokens
    long = batcher.submit([[4] * 6, [5] * 6, [6] * 12])  # 24 tokens, one over the budget alone
    engine.release.set()
    blocker.result(WAIT)
    assert short.result(WAIT) == [vec(s) for s in ([1, 1], [2, 2], [3, 3])]
    assert long.result(WAIT) == [vec(s) for s in ([4] * 6, [5] * 6, [6] * 12)]
    sizes = [sum(map(len, call)) for call in engine.calls[1:]]
    assert engine.calls[1] == [[1, 1], [2, 2], [3, 3]]  # the smaller request's 6 tokens; 6 more would not fit
    assert sizes == [6, 6, 6, 12]
    assert all(size <= 10 or len(call) == 1 for size, call in zip(sizes, engine.calls[1:], strict=True))


def test_one_requests_inputs_add_up_against_the_budget(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch=100, max_wait_ms=50, max_batch_tokens=10)
    seqs = [[i] * 3 for i in range(1, 5)]  # 12 tokens: three inputs fit in 10, the fourth does not
    assert batcher.submit(seqs).result(WAIT) == [vec(s) for s in seqs]
    assert engine.calls == [seqs[:3], seqs[3:]]


def test_a_full_token_budget_goes_without_waiting(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch=100, max_wait_ms=5000, max_batch_tokens=8)
    started = time.monotonic()
    assert batcher.submit([[7] * 8]).result(WAIT) == [vec([7] * 8)]
    assert time.monotonic() - started < 2  # 8 tokens fill the budget: no max_wait for company
    assert engine.calls == [[[7] * 8]]


def test_without_a_token_budget_only_the_row_cap_cuts(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch=3, max_wait_ms=5000)
    seqs = [[i] * 50 for i in range(1, 5)]
    assert batcher.submit(seqs).result(WAIT) == [vec(s) for s in seqs]
    assert [len(call) for call in engine.calls] == [3, 1]


# --- pipelined calls (depth 2) ------------------------------------------------------------------------

def test_the_next_call_is_sent_while_one_runs_once_the_queue_is_full(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=2, max_wait_ms=0, depth=2)
    blocker = busy(batcher, engine, 2)
    futures = [batcher.submit([[i]]) for i in (1, 2)]  # a whole batch: sent at once, behind the running call
    assert wait_for(lambda: len(batcher._inflight) == 2)
    third = batcher.submit([[3]])  # no slot: it waits for the first call to end
    time.sleep(0.05)
    assert len(engine.calls) == 1 and len(batcher._inflight) == 2
    engine.release.set()
    blocker.result(WAIT)
    assert [f.result(WAIT) for f in futures] == [[vec([1])], [vec([2])]] and third.result(WAIT) == [vec([3])]


def test_less_than_half_a_batch_waits_for_the_running_call_even_when_it_is_due(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch=4, max_wait_ms=0, depth=2)
    batcher.submit([[1]]).result(WAIT)
    batcher._rate = 1e9  # every call is due at once
    engine.release.clear()
    engine.entered.clear()
    first = batcher.submit([[7]])
    assert engine.entered.wait(WAIT)
    second = batcher.submit([[8]])  # a quarter of a batch
    time.sleep(0.1)
    assert len(batcher._inflight) == 1
    engine.release.set()
    assert first.result(WAIT) == [vec([7])] and second.result(WAIT) == [vec([8])]


def test_an_idle_engines_batch_goes_out_once_requests_stop_coming(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch=100, max_wait_ms=5000, quiet_s=0.1)
    started = time.monotonic()
    futures = []
    for i in range(5):  # one every 20 ms: inside the quiet period, so all in one call
        futures.append(batcher.submit([[i]]))
        time.sleep(0.02)
    assert [f.result(WAIT) for f in futures] == [[vec([i])] for i in range(5)]
    assert 0.1 <= time.monotonic() - started < 2  # after the quiet period, long before max_wait
    assert engine.calls == [[[0], [1], [2], [3], [4]]]


def test_without_a_known_rate_a_partial_batch_waits_for_the_running_call(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=4, max_wait_ms=0, depth=2)
    blocker = busy(batcher, engine, 4)
    fut = batcher.submit([[5]])
    time.sleep(0.1)
    assert len(batcher._inflight) == 1  # not sent: when the running call ends is not known
    engine.release.set()
    blocker.result(WAIT)
    assert fut.result(WAIT) == [vec([5])]


def test_with_a_known_rate_the_next_call_is_sent_just_before_the_running_one_is_due(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch=2, max_wait_ms=0, depth=2)  # one input is half a batch
    batcher.submit([[1]]).result(WAIT)
    batcher._rate = 1000.0  # tokens per second: a 200-token call is due in 0.2 s
    engine.release.clear()
    engine.entered.clear()
    first = batcher.submit([[7] * 200])
    assert engine.entered.wait(WAIT)
    second = batcher.submit([[8]])
    assert len(batcher._inflight) == 1
    assert wait_for(lambda: len(batcher._inflight) == 2, 1.0)  # sent before the first call ended
    engine.release.set()
    assert first.result(WAIT) == [vec([7] * 200)] and second.result(WAIT) == [vec([8])]


def test_stalled_counts_from_when_a_call_started_running(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=1, max_wait_ms=0, depth=2)
    batcher._rate = 1e9
    batcher.stall_timeout = 0.2
    batcher.submit([[1]])
    batcher.submit([[2]])
    assert wait_for(lambda: len(batcher._inflight) == 2)
    assert batcher._inflight[1].started is None  # queued behind the first: not running yet
    assert wait_for(lambda: batcher.stalled() is not None, 2.0)
    engine.release.set()
    assert wait_for(lambda: not batcher._inflight)
    assert batcher.stalled() is None


def test_the_call_model_separates_a_fixed_cost_from_the_cost_per_token():
    from builder.runtime.batcher import CallModel

    model = CallModel()
    assert model.seconds(100, 0.0) == float("inf")  # nothing known: wait for the running call
    assert model.seconds(100, 1000.0) == 0.1  # a rate only: tokens / rate
    for tokens in (100, 1000, 2000, 4000):
        model.add(tokens, 0.005 + tokens * 1e-6)  # 5 ms a call plus 1 us a token
    assert model.seconds(3000, 1e9) == pytest.approx(0.008)
    assert model.seconds(0, 1e9) == pytest.approx(0.005)
    same = CallModel()
    for _ in range(5):
        same.add(500, 0.01)  # one size only: no slope to fit, the rate decides
    assert same.seconds(1000, 50_000.0) == 0.02


def test_stalled_reads_the_time_it_is_given(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=1, max_wait_ms=0)
    batcher.stall_timeout = 5.0
    batcher.submit([[1]])
    assert wait_for(lambda: batcher._inflight and batcher._inflight[0].started is not None)
    started = batcher._inflight[0].started
    assert batcher.stalled(started + 1.0) is None  # within the deadline (60 s: no rate measured yet)
    assert batcher.stalled(started + 61.0) == pytest.approx(61.0)
    engine.release.set()


def test_two_engine_calls_in_flight_by_default():
    batcher = Batcher(lambda seqs: [[0.0] for _ in seqs], 4, 0)
    try:
        assert batcher.depth == 2
    finally:
        batcher.close(timeout=WAIT)


def test_pings_are_neither_batches_nor_samples_of_the_engine_speed():
    """An idle batcher's pings (empty calls) reach the engine but count as no batch and teach the call
    model nothing."""
    calls: list[list] = []
    metrics = Recorder()
    batcher = Batcher(lambda seqs: calls.append(list(seqs)) or [vec(s) for s in seqs], 4, 0, metrics,
                      ping_interval_s=0.02, depth=1)
    try:
        assert wait_for(lambda: len(calls) >= 3, timeout=WAIT)  # a few pings
        assert all(c == [] for c in calls)
        assert metrics.batches == [] and len(batcher.model.calls) == 0
        assert batcher.submit([[5]]).result(WAIT) == [vec([5])]
        assert metrics.batches == [1] and [t for t, _ in batcher.model.calls] == [1]
    finally:
        batcher.close(timeout=WAIT)


def test_a_failing_ping_fails_no_request():
    def engine(seqs):
        if not seqs:
            raise RuntimeError("engine gone")  # a dead engine is the watchdog's to report
        return [vec(s) for s in seqs]

    batcher = Batcher(engine, 4, 0, ping_interval_s=0.01, depth=1)
    try:
        time.sleep(0.1)
        assert batcher.submit([[5]]).result(WAIT) == [vec([5])]
    finally:
        batcher.close(timeout=WAIT)


def test_a_finished_call_is_not_followed_by_a_ping_before_the_interval():
    """A completion wakes the worker waiting beside a call in flight (depth 2); with nothing queued it then
    waits out the ping interval, it does not ping at once."""
    calls: list[list] = []
    batcher = Batcher(lambda seqs: calls.append(list(seqs)) or [vec(s) for s in seqs], 4, 0,
                      ping_interval_s=60.0, depth=2)
    try:
        for i in range(3):
            assert batcher.submit([[i + 1]]).result(WAIT) == [vec([i + 1])]
            time.sleep(0.05)  # time for a wrongly woken worker to ping
        assert calls == [[[1]], [[2]], [[3]]]
    finally:
        batcher.close(timeout=WAIT)


@pytest.mark.parametrize("concurrent, at_once", [(True, 2), (False, 1)])
def test_an_engine_that_batches_calls_itself_gets_the_calls_in_flight_at_once(concurrent, at_once):
    """vLLM (concurrent): the depth's calls run side by side; any other engine: one after another."""
    running, most, lock = [0], [0], threading.Lock()
    release = threading.Event()

    def engine(seqs):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(0.3)  # long enough for a second call to start beside it, if it may
        with lock:
            running[0] -= 1
        return [vec(s) for s in seqs]

    batcher = Batcher(engine, 2, 0, depth=2, concurrent=concurrent)
    try:
        futures = [batcher.submit([[i + 1], [i + 2]]) for i in range(4)]  # full batches: sent at once
        assert [f.result(WAIT) for f in futures] == [[vec([i + 1]), vec([i + 2])] for i in range(4)]
        assert most[0] == at_once
    finally:
        release.set()
        batcher.close(timeout=WAIT)


def test_a_submit_that_raises_fails_its_batch_and_the_batcher_goes_on():
    """A custom submit (the worker pipe) that raises is a failed call: its requests get the error, the
    next request is served."""
    sent: list[list] = []

    def submit(seqs):
        sent.append(list(seqs))
        if len(sent) == 1:
            raise BrokenPipeError("engine pipe closed")
        done = Future()
        done.set_result([vec(s) for s in seqs])
        return done

    batcher = Batcher(None, 4, 0, submit=submit, depth=1)
    try:
        with pytest.raises(BrokenPipeError, match="^engine pipe closed$"):
            batcher.submit([[7]]).result(WAIT)
        assert batcher.submit([[8]]).result(WAIT) == [vec([8])]
        assert sent == [[[7]], [[8]]]
    finally:
        batcher.close(timeout=WAIT)


def test_fail_queued_fails_the_waiting_jobs_and_counts_them(make):
    """The watchdog's verdict on a dead engine: every queued job gets the error at once; the call
    already in the engine is left to finish."""
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=1, max_wait_ms=5000)
    blocker = busy(batcher, engine, 1)
    queued = [batcher.submit([[i]]) for i in (1, 2)]
    gone = RuntimeError("engine died")
    assert batcher.fail_queued(gone) == 2
    for fut in queued:
        assert fut.exception(WAIT) is gone
    assert batcher._queued_tokens == 0 and batcher.fail_queued(gone) == 0
    engine.release.set()
    assert blocker.result(WAIT) == [vec([1000])]


# --- the call model, the deadlines and the hand-over, held exactly (the mutation check's survivors) ------

def _model(points) -> CallModel:
    model = CallModel()
    for tokens, seconds in points:
        model.add(tokens, seconds)
    return model


def test_the_call_model_keeps_the_last_64_calls():
    model = _model((t, 0.001 * t) for t in range(100))
    assert len(model.calls) == 64 and model.calls[0][0] == 36


@pytest.mark.parametrize("points, tokens, rate, want", [
    # exact fit of fixed + slope x on binary fractions: fixed 0 counts as a fit
    ([(2, 0.5), (4, 1.0), (2, 0.5), (4, 1.0)], 8, 1000.0, 2.0),
    # fixed 0.25, slope 0.125 on tokens 1 and 2: a variance of 0.25 (below 1) still fits
    ([(1, 0.375), (2, 0.5), (1, 0.375), (2, 0.5)], 10, 1000.0, 1.5),
    # no slope (the same time whatever the size): the rate decides
    ([(2, 0.5), (4, 0.5), (2, 0.5), (4, 0.5)], 8, 4.0, 2.0),
    # a falling line (bigger calls faster): the rate decides
    ([(2, 1.0), (4, 0.5), (2, 1.0), (4, 0.5)], 8, 4.0, 2.0),
    # fewer than four calls: the rate; a rate below one token a second is still a rate
    ([(2, 0.5)], 3, 0.5, 6.0),
    ([], 3, 0.0, math.inf),
])
def test_the_call_model_fits_a_line_or_falls_back_to_the_rate(points, tokens, rate, want):
    assert _model(points).seconds(tokens, rate) == want


def test_stalled_deadlines_at_their_bounds(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=4, max_wait_ms=0)
    assert batcher.stall_timeout == 5.0 and batcher.longest_call_s == 0.0
    busy(batcher, engine, 4)  # 4 tokens in flight
    started = batcher._inflight[0].started
    batcher._rate = 0.5  # tokens a second: expected 8 s, deadline 4 x 8 = 32 s
    assert batcher.stalled(started + 32.0) is None  # at the deadline exactly: not yet
    assert batcher.stalled(started + 32.5) == pytest.approx(32.5)
    assert batcher.stalled(started + 20.0) is None  # past the 5 s floor, within 32 s
    batcher._inflight[0].tokens = 0  # a ping: nothing to compute, the floor alone
    assert batcher.stalled(started + 5.0) is None and batcher.stalled(started + 5.5) == pytest.approx(5.5)
    engine.release.set()


def test_the_next_call_is_due_when_the_calls_in_flight_end_less_the_lead(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=4, max_wait_ms=0, depth=2)
    busy(batcher, engine, 4)
    with batcher._cond:
        batcher._rate = 8.0  # 4 tokens: 0.5 s
        started = batcher._inflight[0].started
        # relative to the start: approx's relative tolerance on a monotonic clock's value (hours of uptime)
        # would pass LEAD_S added instead of taken off
        assert batcher._due() - started == pytest.approx(0.5 - LEAD_S, abs=1e-9)
    engine.release.set()


def test_half_a_batch_waits_for_the_running_calls_due_time(make):
    """Behind a call due in 0.6 s, half a batch is sent at that time, not at once and not after the call."""
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=4, max_wait_ms=0, depth=2)
    busy(batcher, engine, 4)
    with batcher._cond:
        batcher._rate = 4 / 0.6
    half = [batcher.submit([[7]]), batcher.submit([[8]])]
    time.sleep(0.25)
    assert len(batcher._inflight) == 1  # not yet due
    assert wait_for(lambda: len(batcher._inflight) == 2, timeout=2.0)  # sent while the first still runs
    engine.release.set()
    assert [f.result(WAIT) for f in half] == [[vec([7])], [vec([8])]]


def test_half_a_token_budget_is_half_the_budget():
    batcher = Batcher(lambda seqs: [vec(s) for s in seqs], 64, 0, max_batch_tokens=100, depth=1)
    try:
        with batcher._cond:
            batcher._queued_tokens = 10
            assert not batcher._full(0.5)
            batcher._queued_tokens = 50
            assert batcher._full(0.5) and not batcher._full()
    finally:
        batcher.close(timeout=WAIT)


def test_a_finished_call_starts_the_clock_of_the_next_and_records_its_time(make):
    engine = FakeEngine(hold_first=True)
    metrics = Recorder()
    batcher = make(engine, max_batch=2, max_wait_ms=0, metrics=metrics, depth=2)
    first = busy(batcher, engine, 2)
    second = batcher.submit([[5], [6]])  # a whole batch: sent at once, waits in the pipe
    assert wait_for(lambda: len(batcher._inflight) == 2, timeout=WAIT)
    assert batcher._inflight[1].started is None  # not running yet
    engine.release.set()
    assert first.result(WAIT) and second.result(WAIT) == [vec([5]), vec([6])]
    assert metrics.batches == [2, 2] and all(s > 0 for s in metrics.seconds)
    assert [t for t, _ in batcher.model.calls] == [2, 2] and all(s > 0 for _, s in batcher.model.calls)
    assert 0 < batcher.longest_call_s < WAIT


def test_a_second_call_counts_from_the_end_of_the_first(make):
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=2, max_wait_ms=0, depth=2)
    busy(batcher, engine, 2)
    batcher.submit([[5], [6]])
    assert wait_for(lambda: len(batcher._inflight) == 2, timeout=WAIT)
    second = batcher._inflight[1]
    before = time.monotonic()
    engine.release.set()
    assert wait_for(lambda: second.started is not None or second not in batcher._inflight, timeout=WAIT)
    assert second.started is None or second.started >= before


def test_a_failed_batch_leaves_waiting_requests_with_deadlines_to_be_served(make):
    engine = FakeEngine(hold_first=True, fail_on=-1)
    batcher = make(engine, max_batch=1, max_wait_ms=0)
    failing = batcher.submit([[-1]])
    assert engine.entered.wait(WAIT)
    waiting = batcher.submit([[3]], deadline=time.monotonic() + 60)
    engine.release.set()
    with pytest.raises(ValueError):
        failing.result(WAIT)
    assert waiting.result(WAIT) == [vec([3])]


def test_engine_calls_run_on_threads_named_for_them():
    names = []
    batcher = Batcher(lambda seqs: names.append(threading.current_thread().name) or [vec(s) for s in seqs], 4, 0,
                      depth=1)
    try:
        assert batcher.submit([[1]]).result(WAIT) == [vec([1])]
        assert names and names[0].startswith("mopt-engine-call_")
    finally:
        batcher.close(timeout=WAIT)


def test_a_ping_is_stalled_past_the_floor_alone():
    """A ping computes nothing: its deadline is stall_timeout_s, however short."""
    release = threading.Event()
    batcher = Batcher(lambda seqs: release.wait(WAIT) and [vec(s) for s in seqs], 4, 0, ping_interval_s=0.01,
                      stall_timeout_s=1.0, depth=1)
    try:
        assert wait_for(lambda: bool(batcher._inflight), timeout=WAIT)  # a ping in flight, held
        started = batcher._inflight[0].started
        assert batcher._inflight[0].tokens == 0
        assert batcher.stalled(started + 0.9) is None and batcher.stalled(started + 1.5) == pytest.approx(1.5)
    finally:
        release.set()
        batcher.close(timeout=WAIT)


class CountingCondition(threading.Condition):
    """A Condition that counts single wake-ups (notify(1)); notify_all is the base class's own."""

    def __init__(self, lock=None):
        super().__init__(lock)
        self.wakeups = 0

    def notify(self, n=1):
        self.wakeups += n == 1
        super().notify(n)

    def notify_all(self):
        threading.Condition.notify(self, len(self._waiters))


def test_requests_wake_the_batcher_only_at_the_first_job_half_and_a_whole_batch(make, monkeypatch):
    """A wake-up per request cost the event loop a GIL hand-over each; the batcher's waits end on the
    first job, half a batch (the running call's due time counts from there) and a whole batch only."""
    import builder.runtime.batcher as batcher_module

    monkeypatch.setattr(batcher_module.threading, "Condition", CountingCondition)
    engine = FakeEngine(hold_first=True)
    batcher = make(engine, max_batch=8, max_wait_ms=0, depth=2)
    monkeypatch.undo()
    cond = batcher._cond
    blocker = busy(batcher, engine, 8)  # the running call; its due time is unknown (no rate yet)
    counts = []
    for i in range(8):
        before = cond.wakeups
        batcher.submit([[i]])
        counts.append(cond.wakeups - before)
    assert counts == [1, 0, 0, 1, 0, 0, 0, 1]  # first job, half (4 of 8), whole (8): nothing else
    assert wait_for(lambda: len(batcher._inflight) == 2)  # the whole batch went out behind the running call
    engine.release.set()
    assert blocker.result(WAIT) == [vec([1000 + i]) for i in range(8)]


def test_the_queued_inputs_are_counted_through_takes_drops_and_failures(make):
    engine, metrics = FakeEngine(hold_first=True), Recorder()
    batcher = make(engine, max_batch=3, max_wait_ms=0, metrics=metrics)
    blocker = busy(batcher, engine, 3)
    kept = batcher.submit([[1], [2], [3], [4]])  # four inputs: a batch of three, then one
    gone = batcher.submit([[5], [6]], client_gone=lambda: True)
    assert batcher._queued_inputs == 6 and metrics.depths[-1] == 6
    engine.release.set()
    blocker.result(WAIT)
    assert kept.result(WAIT) == [vec([i]) for i in (1, 2, 3, 4)]
    with pytest.raises(Exception, match="client_gone"):
        gone.result(WAIT)
    assert batcher._queued_inputs == 0 and metrics.depths[-1] == 0
    engine.release.clear()
    engine.entered.clear()
    blocker = busy(batcher, engine, 3)
    batcher.submit([[7], [8]])
    assert batcher.fail_queued(RuntimeError("cut")) == 1 and batcher._queued_inputs == 0
    engine.release.set()
    blocker.result(WAIT)
