"""The sweep: the highest open-loop request rate whose p99 latency stays under a target.

It bisects between 0 and the peak a closed-loop run reached (a server cannot hold a higher arrival
rate for long: its queue grows without end). A rate passes when every request was answered and the
p99 is at most the target. The answer is the highest passing rate; by construction every rate tried
above it failed and every one below it passed (the search assumes latency grows with load, as it
does once a queue forms). Bounded: at most STEPS runs (12 at most), and it stops once the bracket
is narrower than 2% of the peak.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .load import Run

MAX_STEPS = 12
RESOLUTION = 0.02  # of the peak


@dataclass(frozen=True)
class Step:
    rate: float
    passed: bool
    run: Run


@dataclass(frozen=True)
class Sweep:
    p99_target_ms: float
    peak_rate: float  # the upper bound: the closed-loop peak, requests/s
    steps: tuple[Step, ...]

    @property
    def answer(self) -> float:
        """The highest rate that passed (0.0 when none did)."""
        return max((s.rate for s in self.steps if s.passed), default=0.0)

    def to_json(self) -> dict:
        return {"p99_target_ms": self.p99_target_ms, "peak_rate": round(self.peak_rate, 3),
                "answer_rate": round(self.answer, 3),
                "steps": [{"rate": round(s.rate, 3), "passed": s.passed} | s.run.to_json() for s in self.steps]}


def passes(run: Run, p99_target_ms: float) -> bool:
    p99 = run.percentile(99)
    return not run.errors and run.ok > 0 and p99 is not None and p99 <= p99_target_ms


def sweep(measure: Callable[[float], Run], peak_rate: float, p99_target_ms: float, steps: int) -> Sweep:
    """Bisect (0, PEAK_RATE] with MEASURE(rate) -> Run, at most STEPS times."""
    low, high = 0.0, peak_rate
    done: list[Step] = []
    rate = peak_rate  # first the peak itself: a server that holds it needs no search
    for _ in range(max(1, min(steps, MAX_STEPS))):
        run = measure(rate)
        ok = passes(run, p99_target_ms)
        done.append(Step(rate, ok, run))
        if ok:
            low = rate
        else:
            high = rate
        if ok and rate == peak_rate or high - low < RESOLUTION * peak_rate:
            break
        rate = (low + high) / 2
    return Sweep(p99_target_ms, peak_rate, tuple(done))
