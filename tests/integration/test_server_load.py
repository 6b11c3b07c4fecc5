"""The embeddings server run as a plain program (`python -m builder.runtime serve`) on the real MiniLM
engine compiled on CPU: bad input of every kind gets a 4xx JSON error in OpenAI's format and the
server keeps serving; a bounded load test on loopback (concurrency 8, <= 15 s) has no errors and
bounded memory (RSS from /proc/<pid>/status).
"""
from __future__ import annotations

import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the runtime needs torch")
pytest.importorskip("transformers", reason="the runtime needs transformers")

from tests.unit.test_runtime_minilm import engine, minilm_dir  # noqa: E402,F401  (the module-scoped compile)

pytestmark = pytest.mark.runtime
REPO = Path(__file__).resolve().parents[2]
CONCURRENCY = 8
DURATION_S = 15.0
MAX_REQUESTS = 5000
RSS_GROWTH_BOUND_MIB = 64


@pytest.fixture(scope="module")
def server(engine):  # noqa: F811
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "builder.runtime", "serve", "--engine-dir", str(engine[0]),
                             "--host", "127.0.0.1", "--port", str(port), "--max-inputs", "4",
                             "--max-input-tokens", "32"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline() or "{}").get("event") == "loading", proc.stderr.read()[-3000:]
    line = proc.stdout.readline()  # once the engine has loaded
    assert line and json.loads(line)["event"] == "serving", proc.stderr.read()[-3000:]
    yield port, proc
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def post(port: int, body: bytes, headers: dict | None = None, path: str = "/v1/embeddings"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def raw(port: int, data: bytes, shut_write: bool = False) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        if shut_write:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
            if b"\r\n\r\n" in out:
                head, _, body = out.partition(b"\r\n\r\n")
                length = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n")
                                   if ln.lower().startswith(b"content-length")), b"0"))
                if len(body) >= length:
                    break
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def ok(port: int) -> bool:
    status, body = post(port, json.dumps({"input": "still serving"}).encode())
    return status == 200 and len(json.loads(body)["data"][0]["embedding"]) == 384


BAD_JSON_BODIES = [
    ({"input": ""}, "empty_input"), ({"input": []}, "invalid_input"), ({"input": None}, "invalid_input"),
    ({"input": True}, "invalid_input"), ({"input": 1.5}, "invalid_input"), ({"input": {"a": 1}}, "invalid_input"),
    ({"input": [None]}, "invalid_input"), ({"input": [[]]}, "invalid_input"), ({"input": [[1.5]]}, "invalid_input"),
    ({"input": [True]}, "invalid_input"), ({"input": ["a", 1]}, "invalid_input"),
    ({"input": ["a", ""]}, "empty_input"), ({"input": [[101, -1]]}, "invalid_token_id"),
    ({"input": [[10 ** 30]]}, "invalid_token_id"), ({}, "missing_input"), ({"inputs": "a"}, "missing_input"),
    ({"input": ["x"] * 5}, "too_many_inputs"), ({"input": ["x"] * 10_000}, "too_many_inputs"),
    ({"input": "word " * 40}, "context_length_exceeded"), ({"input": [list(range(100, 140))]},
                                                           "context_length_exceeded"),
    ({"input": "a", "encoding_format": 5}, "invalid_encoding_format"),
    ({"input": "a", "encoding_format": "int8"}, "invalid_encoding_format"),
    ({"input": "a", "dimensions": "384x"}, "invalid_dimensions"),
    ({"input": "a", "dimensions": 12}, "invalid_dimensions"),
    ({"input": "a", "input_type": ["query"]}, "invalid_input_type"),
    ({"input": "a", "input_type": "passage"}, "invalid_input_type"),
    ([{"input": "a"}], "invalid_body"), ("input", "invalid_body"), (42, "invalid_body"), (None, "invalid_body"),
]
BAD_RAW_BODIES = [
    (b"{not json", "invalid_json"), (b"\xff\xfe\x00", "invalid_json"), (b"", "invalid_json"),
    (b'{"input": "a"', "invalid_json"), (b"[" * 100_000 + b"]" * 100_000, None),
    (b'{"input": "\\ud800 lone surrogate"}', None), (b'{"input": NaN}', "invalid_json"),
]


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(server):
    port, proc = server
    tried = 0
    for body, code in BAD_JSON_BODIES:
        status, data = post(port, json.dumps(body).encode())
        err = json.loads(data)["error"]
        assert status == 400 and err["code"] == code, (body, status, err)
        assert err["type"] == "invalid_request_error" and err["message"] and "param" in err
        tried += 1
    for body, code in BAD_RAW_BODIES:
        status, data = post(port, body)
        err = json.loads(data)["error"]
        assert 400 <= status < 500 and (code is None or err["code"] == code), (body[:40], status, err)
        tried += 1
    # Transport-level junk: too big, negative or missing Content-Length, a body cut short, wrong route.
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    status, err = raw(port, head + b"Content-Length: 5242880\r\n\r\n{")
    assert status == 413 and err["error"]["code"] == "body_too_large"  # answered before the body is read
    status, err = raw(port, head + b"Content-Length: -5\r\n\r\n")
    assert status == 400 and err["error"]["code"] == "bad_request"  # the HTTP parser refuses it
    status, err = raw(port, head + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    assert status == 411 and err["error"]["code"] == "length_required"
    # A body cut short by a client that leaves: nobody to answer, the connection is closed.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + b"Content-Length: 100\r\n\r\n{\"input\"")
        s.shutdown(socket.SHUT_WR)
        assert s.recv(65536) == b""
    status, data = post(port, b'{"input": "a"}', path="/v1/nothing")
    assert status == 404 and json.loads(data)["error"]["code"] == "not_found"
    tried += 5
    assert ok(port) and proc.poll() is None
    print(f"\nbad inputs tried: {tried}, all answered 4xx in OpenAI's error format; server still serving")


def test_bounded_load_no_errors_bounded_memory(server):
    port, proc = server
    words = "the quick brown fox jumps over a lazy dog while embeddings are computed on cpu".split()
    rng = random.Random(0)
    bodies = [json.dumps({"input": [" ".join(rng.choices(words, k=rng.randint(1, 12)))
                                    for _ in range(rng.randint(1, 4))]}).encode() for _ in range(64)]
    for body in bodies[:16]:  # warm-up: allocator and engine caches settle
        assert post(port, body)[0] == 200
    before = rss_kib(proc.pid)
    deadline = time.monotonic() + DURATION_S
    lock = threading.Lock()
    stats = {"requests": 0, "errors": 0, "latencies": []}
    peak = [before]

    def worker(seed: int) -> None:
        r = random.Random(seed)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # keep-alive, like real clients
        while time.monotonic() < deadline:
            with lock:
                if stats["requests"] >= MAX_REQUESTS:
                    break
                stats["requests"] += 1
            started = time.monotonic()
            try:
                conn.request("POST", "/v1/embeddings", body=r.choice(bodies),
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                good = resp.status == 200 and json.loads(data)["object"] == "list"
            except (OSError, http.client.HTTPException, ValueError):
                good = False
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            with lock:
                stats["latencies"].append(time.monotonic() - started)
                stats["errors"] += 0 if good else 1
        conn.close()

    def sampler() -> None:
        while time.monotonic() < deadline:
            peak[0] = max(peak[0], rss_kib(proc.pid))
            time.sleep(0.25)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CONCURRENCY)]
    threads.append(threading.Thread(target=sampler))
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(DURATION_S + 60)
    elapsed = time.monotonic() - started
    after = rss_kib(proc.pid)
    lat = sorted(stats["latencies"])
    figures = {"concurrency": CONCURRENCY, "seconds": round(elapsed, 1), "requests": stats["requests"],
               "errors": stats["errors"], "rps": round(stats["requests"] / elapsed, 1),
               "p50_ms": round(1000 * lat[len(lat) // 2], 1), "p99_ms": round(1000 * lat[int(len(lat) * 0.99)], 1),
               "rss_before_mib": round(before / 1024, 1), "rss_after_mib": round(after / 1024, 1),
               "rss_peak_mib": round(peak[0] / 1024, 1)}
    print("\nserver load:", json.dumps(figures))
    assert stats["requests"] > 50 and stats["errors"] == 0, figures
    assert (max(after, peak[0]) - before) / 1024 < RSS_GROWTH_BOUND_MIB, figures
    assert ok(port) and proc.poll() is None
    assert os.path.exists(f"/proc/{proc.pid}")
