"""The served cpu demo image attacked the way a hostile client would, in a real container started
hardened (read-only root, noexec tmpfs /tmp, no capabilities, no-new-privileges) under a memory
limit with no swap: request smuggling shapes, bad framing, slow senders, a connection flood,
oversized and malformed bodies, the largest allowed requests at once. After every attack the
container is still running, was never killed for memory, and /health answers 200; no attack gets a
500. Loopback only; every loop and wait is bounded. The figures of docs/reliability.md come from
benchmarks/server_memory.py, not from here.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from tests.integration.served import ServedContainer, embed, raw_exchange, request, statuses

pytestmark = pytest.mark.integration

MEMORY_LIMIT = "1536m"
MAX_CONNECTIONS = 12
REQUEST_TIMEOUT_S = 45  # the largest requests, four at once, take ~20 s on 2 busy cores
MAX_BODY = 4 << 20


@pytest.fixture(scope="module")
def served(docker_cli, cpu_demo_image):
    container = ServedContainer(docker_cli.path, cpu_demo_image, memory=MEMORY_LIMIT,
                                server_args=("--max-connections", str(MAX_CONNECTIONS),
                                             "--request-timeout", str(REQUEST_TIMEOUT_S)))
    try:
        container.start()
        yield container
    finally:
        container.stop()


@pytest.fixture(scope="module")
def info(served) -> dict:
    status, _, raw = request(served.port, "GET", "/info")
    assert status == 200, raw[:500]
    return json.loads(raw)


@pytest.fixture(autouse=True)
def still_serving(served):
    yield
    state = served.state()
    assert state["Running"] and not state["OOMKilled"], f"{state}\n{served.logs()[-3000:]}"
    assert request(served.port, "GET", "/health", timeout=10)[0] == 200
    assert "Traceback" not in served.logs(), served.logs()[-3000:]


def post_raw(headers: list[str], body: bytes = b"") -> bytes:
    head = "\r\n".join(["POST /v1/embeddings HTTP/1.1", "Host: test", *headers]) + "\r\n\r\n"
    return head.encode() + body


def test_content_length_with_transfer_encoding_is_refused_and_closed(served):
    # A proxy honouring chunked sees one request; reading by Content-Length would find a second.
    smuggled = b"0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: test\r\n\r\n"
    raw = raw_exchange(served.port, post_raw([f"Content-Length: {len(smuggled)}", "Transfer-Encoding: chunked"],
                                             smuggled))
    assert statuses(raw) == [400], raw[:400]


@pytest.mark.parametrize("lengths", [["17", "17"], ["+17"], ["1_7"], ["0x11"], ["17 ", "x"], ["-1"]],
                         ids=["duplicate", "plus", "underscore", "hex", "junk", "negative"])
def test_bad_content_length_is_400_and_closed(served, lengths):
    body = b'{"input": "hi"}xx'
    raw = raw_exchange(served.port, post_raw([f"Content-Length: {v}" for v in lengths], body))
    assert statuses(raw) == [400], raw[:400]


def test_huge_content_length_is_refused_without_reading(served):
    started = time.monotonic()
    raw = raw_exchange(served.port, post_raw(["Content-Length: " + "9" * 40]))
    assert statuses(raw)[0] in (400, 413), raw[:400]
    assert time.monotonic() - started < 5


def test_chunked_body_is_handled_or_refused(served):
    body = b'{"input": "hello"}'
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    raw = raw_exchange(served.port, post_raw(["Transfer-Encoding: chunked"], chunked))
    codes = statuses(raw)
    assert len(codes) == 1 and codes[0] in (200, 400, 411), raw[:400]


def test_header_flood_is_bounded(served):
    headers = [f"X-Pad-{i}: {'a' * 1000}" for i in range(200)]  # ~200 KB of headers
    raw = raw_exchange(served.port, post_raw(headers))
    codes = statuses(raw)
    assert len(codes) == 1 and codes[0] in (400, 431), raw[:400]
    assert b'"error"' in raw


@pytest.mark.parametrize("body", [
    b'{"input": [[' + b"7" * 5001 + b"]]}",
    b'{"input": "x", "dimensions": 1' + b"0" * 40 + b"}",
    b'{"input": "x", "dimensions": 1e999}',
    b"[" * 200_000,
    b'{"input": "\xff\xfe"}',
    b'{"input": "x", "encoding_format": "float"',
], ids=["5001-digit-int", "huge-dimensions", "float-overflow", "deep-nesting", "bad-utf8", "truncated-json"])
def test_malformed_bodies_are_400_json(served, body):
    status, _, raw = request(served.port, "POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
    assert status == 400, raw[:300]
    assert json.loads(raw)["error"]["message"]


def test_slow_sender_is_cut_at_the_whole_request_deadline(served):
    """One byte every 0.5 s keeps every single read alive; the whole-request deadline still ends it."""
    started = time.monotonic()
    closed_at = None
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: test\r\n")
        s.settimeout(0.5)
        for _ in range(int((REQUEST_TIMEOUT_S + 10) / 0.5)):
            try:
                s.sendall(b"X")
                s.recv(4096)  # an answer (408) or b"" (closed): either way the server ended it
                closed_at = time.monotonic()
                break
            except TimeoutError:
                continue
            except OSError:
                closed_at = time.monotonic()
                break
    assert closed_at is not None, "the server kept a slow sender beyond its request deadline"
    assert closed_at - started < REQUEST_TIMEOUT_S + 5


def test_connection_flood_gets_fast_503_beyond_the_cap(served):
    held: list[socket.socket] = []
    refused_after = None
    try:
        for n in range(MAX_CONNECTIONS + 8):
            s = socket.create_connection(("127.0.0.1", served.port), timeout=5)
            held.append(s)
            started = time.monotonic()
            s.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            head = s.recv(4096)
            assert time.monotonic() - started < 3, "a connection beyond the cap must be answered fast"
            if head.startswith(b"HTTP/1.1 503") or head.startswith(b"HTTP/1.0 503"):
                assert b"Retry-After" in head
                refused_after = n
                break
            assert head.startswith(b"HTTP/1.1 200"), head[:200]
    finally:
        for s in held:
            s.close()
    # Docker's own health probe may hold one slot for a moment.
    assert refused_after is not None and MAX_CONNECTIONS - 1 <= refused_after <= MAX_CONNECTIONS, refused_after
    time.sleep(1)  # the held connections' threads see the close


class HealthPoller:
    """/health polled every 0.25 s while an attack runs; every answer recorded."""

    def __init__(self, port: int):
        self.port, self.codes, self._stop = port, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while True:  # at least one probe, however fast the attack ends
            try:
                self.codes.append(request(self.port, "GET", "/health", timeout=10)[0])
            except OSError as exc:
                self.codes.append(repr(exc))
            if self._stop.wait(0.25):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(15)


def parallel(count: int, fn) -> list:
    results: list = [None] * count

    def run(i):
        try:
            results[i] = fn()
        except Exception as exc:  # noqa: BLE001  (reported by the assertion on the results)
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    return results


def test_four_maximum_bodies_at_once_stay_within_memory(served, info):
    """The attack of the issue: one long string filling the body limit, four at once."""
    text = "word " * ((MAX_BODY - 64) // 5)
    body = json.dumps({"input": text}).encode()
    assert len(body) <= MAX_BODY
    before = served.memory_bytes()
    served.reset_peak()
    with HealthPoller(served.port) as poll:
        results = parallel(4, lambda: request(served.port, "POST", "/v1/embeddings", body,
                                              {"Content-Type": "application/json"}, timeout=60))
    assert all(not isinstance(r, Exception) and r[0] == 400 for r in results), results
    assert poll.codes and all(c == 200 for c in poll.codes), poll.codes
    # Four 4 MiB bodies are read, checked for length and refused: a few times their size, not GBs.
    assert served.peak_memory_bytes() - before < 256 << 20


def test_largest_allowed_requests_at_once_succeed(served, info):
    """max_inputs inputs of max_input_chars characters each, truncated to the token limit, four at once."""
    limits = info["limits"]
    count, chars = limits["max_inputs"], limits["max_input_chars"]
    text = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
    payload = {"input": [text] * count, "truncate_prompt_tokens": -1}
    with HealthPoller(served.port) as poll:
        results = parallel(4, lambda: embed(served.port, payload, timeout=REQUEST_TIMEOUT_S + 30))
    # Under load a request may be shed with a 503 (queue full, deadline); none may fail otherwise.
    assert all(not isinstance(r, Exception) and r[0] in (200, 503) for r in results), results
    assert any(r[0] == 200 and len(r[1]["data"]) == count for r in results)
    assert poll.codes and all(c == 200 for c in poll.codes), poll.codes


def test_small_request_does_not_wait_behind_large_ones(served, info):
    count = info["limits"]["max_inputs"]
    large = {"input": ["a sentence of moderate length for the engine to embed " * 4] * count}
    timings: dict[str, list[float]] = {"large": [], "small": []}

    def timed(kind, payload):
        started = time.monotonic()
        status, _ = embed(served.port, payload, timeout=REQUEST_TIMEOUT_S + 30)
        timings[kind].append(time.monotonic() - started)
        return status

    threads = [threading.Thread(target=timed, args=("large", large)) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the large ones are queued first
    assert timed("small", {"input": "hi"}) == 200
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 40)
    assert len(timings["large"]) == 3
    assert timings["small"][0] < max(timings["large"]) / 2, timings
