"""Load on one target: closed-loop clients or open-loop arrivals, on asyncio with aiohttp (the
client vLLM's own serving benchmark uses): one event loop holds every connection, so a thousand in
flight cost a thousand sockets, not a thousand threads.

Closed loop: CLIENTS connections, each sends its next request when the last one answered; the
throughput a server reaches when it sets the pace. Open loop: arrivals at RATE per second, Poisson
with the workload's seed, whether or not the server keeps up; latency counts from the scheduled
arrival, so the time a request waits for a free connection or in the server's queue shows. Every run
is bounded: its duration, its request count, the requests in flight, each request's time and the
bytes of each answer.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from .api import Api, BadAnswer, printable

MAX_ANSWER_BYTES = 64 * 1024 * 1024  # one answer, at most
ANSWER_BUDGET_BYTES = 2 * 1024**3  # every answer in flight together: the per-answer cap shrinks with concurrency
USER_AGENT = "mopt-bench"
TICK_S = 0.25


@dataclass(frozen=True)
class Run:
    """One measured run: what was sent, what came back, and how long it took."""

    mode: str  # closed | open
    level: float  # closed: clients; open: offered requests/s
    sent: int
    ok: int
    errors: dict  # kind -> count: http_503, timeout, connection, bad_response, backlog
    wall_s: float
    texts: int  # in the answered requests
    tokens: int | None  # as the server counted them; None when any answer did not say
    latencies_ms: tuple[float, ...] = field(default=(), repr=False)  # answered requests, sorted
    client_cpu: float = 0.0  # the load generator's own CPU time over the run's wall time (1.0: one core busy)

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.wall_s if self.tokens is not None and self.wall_s > 0 else None

    def percentile(self, q: float) -> float | None:
        """The nearest-rank percentile of the answered requests' latencies (ms), None with none."""
        if not self.latencies_ms:
            return None
        rank = max(1, math.ceil(q / 100 * len(self.latencies_ms)))
        return self.latencies_ms[rank - 1]

    @property
    def label(self) -> str:
        return f"{self.level:g} clients" if self.mode == "closed" else f"{self.level:.3g} req/s offered"

    def to_json(self) -> dict:
        tps = self.tokens_per_s
        return {"mode": self.mode, "level": self.level, "sent": self.sent, "ok": self.ok,
                "errors": dict(sorted(self.errors.items())), "wall_s": round(self.wall_s, 3),
                "requests_per_s": round(self.requests_per_s, 3), "texts_per_s": round(self.texts / self.wall_s, 2)
                if self.wall_s > 0 else 0.0, "tokens": self.tokens,
                "tokens_per_s": round(tps, 1) if tps is not None else None, "client_cpu": round(self.client_cpu, 3),
                "latency_ms": {name: _round(self.percentile(q)) for name, q in
                               (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))}}


def _round(value: float | None) -> float | None:
    return round(value, 2) if value is not None else None


@dataclass
class _Tally:
    ok: int = 0
    texts: int = 0
    tokens: int | None = 0
    errors: Counter = field(default_factory=Counter)
    latencies: list = field(default_factory=list)


class Load:
    """Requests to one target's API: BODIES in turn (cycling), each of TEXTS texts."""

    def __init__(self, base_url: str, api: Api, bodies: list[bytes], texts: list[int], *, api_key: str | None,
                 timeout_s: float, max_in_flight: int):
        self.url = base_url.rstrip("/") + api.path
        self.api, self.bodies, self.texts = api, bodies, texts
        self.headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s, self.max_in_flight = timeout_s, max_in_flight
        self.answer_cap = MAX_ANSWER_BYTES

    def _session(self, connections: int) -> aiohttp.ClientSession:
        """A session of CONNECTIONS connections at most; an answer gets at most its share of the budget."""
        self.answer_cap = max(1 << 20, min(MAX_ANSWER_BYTES, ANSWER_BUDGET_BYTES // connections))
        connector = aiohttp.TCPConnector(limit=connections, limit_per_host=connections)
        return aiohttp.ClientSession(connector=connector, headers=self.headers, auto_decompress=True,
                                     timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def _one(self, session: aiohttp.ClientSession, index: int, tally: _Tally, since: float) -> None:
        """Send request INDEX; LATENCY counts from SINCE (its start, or its scheduled arrival)."""
        n = self.texts[index % len(self.bodies)]
        try:  # never a redirect: it would take the load to a host the loopback rule did not check
            async with session.post(self.url, data=self.bodies[index % len(self.bodies)],
                                    allow_redirects=False) as response:
                data = await _read_bounded(response, self.answer_cap)
                if response.status != 200:
                    tally.errors[f"http_{response.status}"] += 1
                    return
                _, tokens = self.api.check(data, n, response.headers)
        except (BadAnswer, aiohttp.ClientResponseError):
            tally.errors["bad_response"] += 1
            return
        except TimeoutError:
            tally.errors["timeout"] += 1
            return
        except (aiohttp.ClientError, OSError):
            tally.errors["connection"] += 1
            return
        tally.latencies.append((time.perf_counter() - since) * 1000)
        tally.ok += 1
        tally.texts += n
        tally.tokens = None if tokens is None or tally.tokens is None else tally.tokens + tokens

    async def probe(self) -> tuple[int, int | None]:
        """One request, strictly: its (dimension, tokens), or BadAnswer/aiohttp errors as they come."""
        async with self._session(1) as session, session.post(self.url, data=self.bodies[0],
                                                              allow_redirects=False) as response:
            data = await _read_bounded(response, self.answer_cap)
            if response.status != 200:
                where = f" to {printable(response.headers.get('Location', ''), 120)}" if response.status in (
                    301, 302, 303, 307, 308) else ""
                raise BadAnswer(f"HTTP {response.status}{where}: {printable(data[:300])}")
            return self.api.check(data, self.texts[0], response.headers)

    async def closed(self, clients: int, duration_s: float, max_requests: int,
                     tick: Callable[[float], None] = lambda f: None) -> Run:
        tally = _Tally()
        counter = itertools.count()
        cpu = time.process_time()
        async with self._session(clients) as session:  # a connection per client: none waits for one
            start = time.perf_counter()
            deadline = start + duration_s

            async def client() -> None:
                while time.perf_counter() < deadline:
                    index = next(counter)
                    if index >= max_requests:
                        return
                    await self._one(session, index, tally, time.perf_counter())

            with _ticking(tick, start, duration_s):
                await asyncio.gather(*(client() for _ in range(clients)))
            wall = time.perf_counter() - start
        sent = min(next(counter), max_requests)
        return _run("closed", clients, sent, tally, wall, time.process_time() - cpu)

    async def open(self, rate: float, duration_s: float, max_requests: int, seed: int,
                   tick: Callable[[float], None] = lambda f: None) -> Run:
        tally = _Tally()
        rng = random.Random(seed)
        tasks: set[asyncio.Task] = set()
        sent = 0
        cpu = time.process_time()
        async with self._session(self.max_in_flight) as session:
            start = time.perf_counter()
            at = 0.0
            with _ticking(tick, start, duration_s):
                while sent < max_requests:
                    at += rng.expovariate(rate)
                    if at >= duration_s:
                        break
                    delay = start + at - time.perf_counter()
                    await asyncio.sleep(max(0.0, delay))  # also when late: the answers' tasks must run too
                    sent += 1
                    if len(tasks) >= self.max_in_flight:  # the server has fallen this far behind
                        tally.errors["backlog"] += 1
                        continue
                    task = asyncio.create_task(self._one(session, sent - 1, tally, start + at))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*tasks)
            wall = time.perf_counter() - start
        return _run("open", rate, sent, tally, wall, time.process_time() - cpu)


def _run(mode: str, level: float, sent: int, tally: _Tally, wall: float, cpu_s: float) -> Run:
    return Run(mode=mode, level=level, sent=sent, ok=tally.ok, errors=dict(tally.errors), wall_s=wall,
               texts=tally.texts, tokens=tally.tokens if tally.ok else None,
               latencies_ms=tuple(sorted(tally.latencies)), client_cpu=cpu_s / wall if wall > 0 else 0.0)


async def _read_bounded(response: aiohttp.ClientResponse, cap: int) -> bytes:
    if response.content_length is not None and response.content_length > cap:
        raise BadAnswer(f"an answer of {response.content_length} bytes (more than {cap})")
    chunks, size = [], 0
    async for chunk in response.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > cap:
            raise BadAnswer(f"an answer of more than {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class _ticking:
    """Calls TICK with the elapsed fraction of the run every TICK_S while the block runs."""

    def __init__(self, tick: Callable[[float], None], start: float, duration_s: float):
        self.tick, self.start, self.duration_s = tick, start, duration_s
        self.task: asyncio.Task | None = None

    async def _loop(self) -> None:
        while True:
            self.tick(min(1.0, (time.perf_counter() - self.start) / self.duration_s))
            await asyncio.sleep(TICK_S)

    def __enter__(self):
        self.task = asyncio.get_running_loop().create_task(self._loop())
        return self

    def __exit__(self, *exc) -> None:
        assert self.task is not None
        self.task.cancel()
        self.tick(1.0)
