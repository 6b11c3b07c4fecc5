"""The served cpu demo image attacked the way a hostile client would, in a real container run hardened as
issue 31 asks: read-only root, noexec tmpfs /tmp, no capabilities, no-new-privileges, 1536 MiB of
memory and no swap, --pids-limit 64, an API key. Framing and strict input, floods of idle and slow
connections, 64 and 200 clients sending the largest allowed request at once, tokenizer amplification,
the drain under `docker stop`, and a stalled engine worker that Docker restarts. After every attack on
the shared container it is still running, was never killed for memory, and /health answers 200; no
attack gets a 500 or a traceback. Loopback only; every loop and wait is bounded. The memory figures of
docs/server.md come from benchmarks/server_memory.py."""
from __future__ import annotations

import json
import resource
import socket
import threading
import time

import pytest

from tests.integration.served import ServedContainer, embed, posts_in_threads, raw_exchange, request
from tests.serving import statuses

pytestmark = pytest.mark.integration

MEMORY_LIMIT = "1536m"
MEMORY_BOUND = 1536 << 20
PIDS_LIMIT = 64
KEY = "adversarial-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NORMAL_S = 2.0  # a normal client's answer, under every attack
HARDENED_ENV = {"MOPT_API_KEY": KEY}


@pytest.fixture(scope="module")
def served(docker_cli, cpu_demo_image):
    container = ServedContainer(docker_cli.path, cpu_demo_image, memory=MEMORY_LIMIT, pids_limit=PIDS_LIMIT,
                                env=HARDENED_ENV)
    try:
        container.start()
        yield container
    finally:
        container.stop()


@pytest.fixture(scope="module")
def info(served) -> dict:
    status, _, raw = request(served.port, "GET", "/info", headers=AUTH)
    assert status == 200, raw[:500]
    return json.loads(raw)


def check_alive(served) -> None:
    state = served.state()
    assert state["Running"] and not state["OOMKilled"], f"{state}\n{served.logs()[-3000:]}"
    assert request(served.port, "GET", "/health", timeout=10)[0] == 200
    logs = served.logs()
    assert "Traceback" not in logs and "can't start new thread" not in logs, logs[-3000:]


def post_raw(headers: list[str], body: bytes = b"", target: str = "/v1/embeddings", host: bool = True) -> bytes:
    lines = [f"POST {target} HTTP/1.1", *(["Host: test"] if host else []), f"Authorization: Bearer {KEY}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


BODY = b'{"input": "hello"}'
JSON_LEN = ["Content-Type: application/json", f"Content-Length: {len(BODY)}"]


def json_post(body: bytes, *headers: str) -> bytes:
    return post_raw(["Content-Type: application/json", f"Content-Length: {len(body)}", *headers], body)


# --- framing and strict input ----------------------------------------------------------------------------

@pytest.mark.parametrize("data, status", [
    (post_raw(JSON_LEN, BODY, host=False), 400),
    (post_raw(["Host: other", *JSON_LEN], BODY), 400),
    (post_raw(JSON_LEN, BODY, target="http://test/v1/embeddings"), 200),
    (post_raw(JSON_LEN, BODY).replace(b"POST /v1", b"POST\x0b/v1"), 400),
    (post_raw(JSON_LEN, BODY).replace(b"embeddings HTTP", b"embeddings\x0cHTTP"), 400),
    (post_raw(["Content-Encoding: gzip", *JSON_LEN], BODY), 415),
    (post_raw(["Content-Type: text/plain", f"Content-Length: {len(BODY)}"], BODY), 415),
    (json_post('{"input": "hello"}'.encode("utf-16")), 400),
    (json_post(b'{"input": "a", "input": "bbbb"}'), 400),
    (json_post(b'{"input": "a", "dimensions": NaN}'), 400),
    (post_raw(["Content-Type: application/json", "Content-Length: 5", "Transfer-Encoding: chunked"], b"0\r\n\r\n"),
     400),
    (post_raw(["Content-Type: application/json", "Transfer-Encoding: chunked"], b"5\r\nhello\r\n0\r\n\r\n"), 411),
    (post_raw(["Content-Type: application/json", "Content-Length: 17", "Content-Length: 17"], BODY), 400),
], ids=["no-host", "two-hosts", "absolute-form", "vt", "ff", "gzip", "text-plain", "utf16", "duplicate-key",
        "nan", "cl-and-te", "chunked", "two-lengths"])
def test_framing_and_strict_input(served, data, status):
    raw = raw_exchange(served.port, data, timeout=5)
    assert statuses(raw)[:1] == [status], raw[:400]
    if status != 200:
        assert b'"error"' in raw
    check_alive(served)


def test_a_cross_site_simple_post_is_refused_even_without_a_key(docker_cli, cpu_demo_image):
    """text/plain is what a web page can POST anywhere without a preflight: a keyless server refuses it."""
    container = ServedContainer(docker_cli.path, cpu_demo_image, memory=MEMORY_LIMIT, pids_limit=PIDS_LIMIT)
    try:
        container.start()
        status, _, raw = request(container.port, "POST", "/v1/embeddings", BODY, {"Content-Type": "text/plain"})
        assert status == 415 and json.loads(raw)["error"]["code"] == "unsupported_media_type"
    finally:
        container.stop()


def test_metrics_count_the_route_called(served):
    status, _, _ = request(served.port, "POST", "/embed", b'{"inputs": "hi"}',
                           {"Content-Type": "application/json", **AUTH})
    assert status == 200
    _, _, text = request(served.port, "GET", "/metrics")
    assert b'mopt_requests_total{route="/embed",status="200"}' in text


def test_malformed_bodies_are_400_json(served):
    for body in (b'{"input": [[' + b"7" * 5001 + b"]]}", b"[" * 200_000, b'{"input": "\xff\xfe"}',
                 b'{"input": "x", "dimensions": 1e999}'):
        status, _, raw = request(served.port, "POST", "/v1/embeddings", body,
                                 {"Content-Type": "application/json", **AUTH})
        assert status == 400 and json.loads(raw)["error"]["message"], raw[:300]
    check_alive(served)


# --- floods ---------------------------------------------------------------------------------------------

class NormalClient:
    """A normal client's small request every 0.2 s while an attack runs; every latency recorded."""

    def __init__(self, port: int):
        self.port, self.latencies, self.failures = port, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while True:
            started = time.monotonic()
            try:
                status, _ = embed(self.port, {"input": "a normal request"}, timeout=30, headers=AUTH)
                if status != 200:
                    self.failures.append(status)
            except OSError as exc:
                self.failures.append(repr(exc))
            self.latencies.append(time.monotonic() - started)
            if self._stop.wait(0.2):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(60)

    def check(self, bound: float) -> None:
        assert self.latencies and not self.failures, self.failures[:5]
        assert max(self.latencies) < bound, sorted(self.latencies)[-5:]


def _fds(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))


def test_idle_and_slow_floods_do_not_deny_service(served):
    """2,000 sockets that send nothing and 600 that send a byte of headers every 2 s, for 12 s."""
    _fds(4000)
    idle, slow = [], []
    try:
        with NormalClient(served.port) as normal:
            for _ in range(2000):
                idle.append(socket.create_connection(("127.0.0.1", served.port), timeout=5))
            for _ in range(600):
                sock = socket.create_connection(("127.0.0.1", served.port), timeout=5)
                sock.setblocking(False)
                slow.append(sock)
            end = time.monotonic() + 12
            while time.monotonic() < end:
                for sock in slow:
                    try:
                        sock.send(b"G")
                    except OSError:
                        pass  # closed by the server's header deadline
                time.sleep(2)
        normal.check(1.0)
    finally:
        for sock in idle + slow:
            sock.close()
    check_alive(served)


def cjk_body(info: dict, truncate: bool = False) -> bytes:
    """The issue's largest request: 128 inputs (fewer if max_inputs is lower) of max_input_chars CJK
    characters, JSON-escaped (6 bytes a character). A 4 MiB body answered 503 before it is read breaks the
    client's pipe before it reads the answer (it still sends), so the flood stays at the issue's size."""
    limits = info["limits"]
    text = "\u4e2d\u6587" * (limits["max_input_chars"] // 2)
    payload = {"input": [text] * min(limits["max_inputs"], 128)}
    if truncate:
        payload["truncate_prompt_tokens"] = -1
    body = json.dumps(payload).encode()
    assert len(body) <= limits["max_body_bytes"], len(body)
    return body


def flood(port: int, count: int, body: bytes, timeout: float = 240) -> list:
    results: list = [None] * count

    def one(i):
        try:
            results[i] = request(port, "POST", "/v1/embeddings", body, {"Content-Type": "application/json", **AUTH},
                                 timeout=timeout)[0]
        except OSError as exc:
            results[i] = repr(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return results


@pytest.mark.parametrize("clients", [64, 200])
def test_many_clients_with_the_largest_requests_stay_within_memory(served, info, clients):
    body = cjk_body(info)
    served.reset_peak()
    with NormalClient(served.port) as normal:
        results = flood(served.port, clients, body)
    # Refused after tokenizing (each input is over the token limit), or shed before reading (503).
    assert all(r in (400, 503) for r in results), sorted(set(map(str, results)))
    assert results.count(400) >= 1
    normal.check(NORMAL_S)
    assert served.peak_memory_bytes() < MEMORY_BOUND
    check_alive(served)


def test_tokenizer_amplification_does_not_hold_up_a_normal_client(served, info):
    """24 clients loop 262 KB bodies that are refused only after tokenizing, for 10 s."""
    limits = info["limits"]
    text = ("word " * (limits["max_input_chars"] // 5))[:limits["max_input_chars"]]
    body = json.dumps({"input": [text] * min(128, limits["max_inputs"])}).encode()
    assert len(body) > 200_000
    stop = time.monotonic() + 10
    codes: list = []

    def loop():
        while time.monotonic() < stop:
            try:
                codes.append(request(served.port, "POST", "/v1/embeddings", body,
                                     {"Content-Type": "application/json", **AUTH}, timeout=60)[0])
            except OSError as exc:
                codes.append(repr(exc))

    with NormalClient(served.port) as normal:
        threads = [threading.Thread(target=loop, daemon=True) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    assert codes and all(c in (400, 503) for c in codes), codes[:10]
    # The bound (2 s). 1 s held here only by luck: on these 2 cores, shared with the 24 clients, the
    # server of 79782d8 measured 0.90 and 1.86 s, this one 1.24-1.89 s (docs/server.md).
    normal.check(NORMAL_S)
    check_alive(served)


def test_header_flood_is_431(served):
    raw = raw_exchange(served.port, post_raw([f"X-Pad-{i}: {'a' * 1000}" for i in range(200)]), timeout=5)
    assert statuses(raw) == [431] and b'"error"' in raw


# --- the drain and the watched engine (containers of their own) ------------------------------------------

def test_docker_stop_answers_every_request_and_exits_zero(docker_cli, cpu_demo_image):
    """20 heavy requests (a backlog of tens of seconds on 2 cores), then `docker stop` (10 s): every
    request gets a whole response, 200 or 503, and the server exits 0 before Docker's SIGKILL."""
    container = ServedContainer(docker_cli.path, cpu_demo_image, memory=MEMORY_LIMIT, pids_limit=PIDS_LIMIT,
                                env=HARDENED_ENV)
    try:
        container.start()
        info = json.loads(request(container.port, "GET", "/info", headers=AUTH)[2])
        limits = info["limits"]
        text = ("lorem ipsum dolor sit amet " * (limits["max_input_chars"] // 27 + 1))[:limits["max_input_chars"]]
        body = json.dumps({"input": [text] * 64, "truncate_prompt_tokens": -1}).encode()
        results, threads = posts_in_threads(container.port, body, 20, AUTH, timeout=60)
        took = container.docker_stop_under_load(threads, settle_s=3)
        state = container.state()
        assert state["ExitCode"] == 0 and not state["OOMKilled"], (state, container.logs()[-2000:])
        assert took < 10, took
        assert all(r in (200, 503) for r in results), results
        assert 200 in results
        assert "Traceback" not in container.logs()
    finally:
        container.stop()


def test_a_stalled_engine_worker_is_detected_and_the_container_restarted(docker_cli, cpu_demo_image):
    container = ServedContainer(docker_cli.path, cpu_demo_image, memory=MEMORY_LIMIT, pids_limit=PIDS_LIMIT,
                                env=HARDENED_ENV, docker_args=("--restart", "on-failure:3"))
    try:
        container.start()
        assert embed(container.port, {"input": "before"}, headers=AUTH)[0] == 200
        # The engine worker: the server's child started by multiprocessing's spawn (its command line ends
        # in --multiprocessing-fork; the [k] keeps this shell's own command line from matching).
        pid = container.exec("sh", "-c", "grep -l -e '-multiprocessing-for[k]' /proc/[0-9]*/cmdline 2>/dev/null"
                                         " | head -n1 | cut -d/ -f3")
        assert pid.isdigit(), pid
        container.exec("sh", "-c", f"kill -STOP {pid}")  # the shell's kill: the image has no procps
        stopped = time.monotonic()
        failed_at = None
        while time.monotonic() - stopped < 20:
            try:
                if request(container.port, "GET", "/health", timeout=2)[0] != 200:
                    failed_at = time.monotonic()
                    break
            except OSError:
                failed_at = time.monotonic()
                break
            time.sleep(0.2)
        assert failed_at is not None and failed_at - stopped < 10, "a stalled worker kept /health at 200"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and container.inspect("{{.RestartCount}}") == "0":
            time.sleep(0.5)
        assert container.inspect("{{.RestartCount}}") != "0", container.logs()[-2000:]
        assert "exit code 71" in container.logs()
        container.refresh_port()  # a restarted container may get another host port
        container.wait_healthy(120)
        assert embed(container.port, {"input": "after the restart"}, headers=AUTH)[0] == 200
    finally:
        container.stop()
