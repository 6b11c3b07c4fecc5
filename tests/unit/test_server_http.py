"""The HTTP server (builder/runtime/server.py on uvicorn, builder/runtime/protocol.py) over real sockets on
127.0.0.1, in front of the real EmbeddingService and batcher with a fake engine (no torch): routes, auth,
CORS, Host and target rules, framing, strict entities, the connection guards (header deadline, header
budget, idle eviction at the cap), admission before work (bytes, tokens), tokenizing off the event loop,
clients that leave, the drain, the engine watchdog (death and stall), metrics per route and logs."""
from __future__ import annotations

import http.client
import io
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="the server runs on uvicorn (the runtime's dependency)")

from builder.runtime import server as srv  # noqa: E402
from builder.runtime.errors import RuntimeToolError  # noqa: E402
from builder.runtime.params import EngineParams  # noqa: E402
from builder.runtime.server import HttpOptions  # noqa: E402
from builder.runtime.service import EmbeddingService, ServerLimits  # noqa: E402
from tests.serving import WAIT, Running, error_code, raw_exchange, request, statuses, wait_for  # noqa: E402

KEY = "s3cret-key"
REPO = Path(__file__).resolve().parents[2]


class Encoder:
    """One token per character; records the thread each call ran on; calls in the tokenizer pool may be held."""

    vocab_size = 1000
    query_prefix = ""

    def __init__(self):
        self.threads: list[str] = []
        self.hold = threading.Event()
        self.hold.set()
        self.holding = threading.Event()

    def format_query(self, text):
        return text

    def encode(self, texts, max_tokens=None, direction="right", keep_prefix="", known=None):
        if known and max_tokens is None and all(t in known for t in texts):  # tokenized already (tokenbatch)
            return [list(known[t]) for t in texts]
        name = threading.current_thread().name
        self.threads.append(name)
        if name.startswith("mopt-tokenize_") and not self.hold.is_set():  # the large bodies' threads
            self.holding.set()
            assert self.hold.wait(WAIT)
        return [[ord(c) % 1000 for c in t] for t in texts]


class Engine:
    """Vectors [1, 0]; embed_ids may be held (gate), made to hang (stall) or to count calls."""

    dim = 2
    DEATH = "the engine worker died"  # as EngineProcess's

    def __init__(self):
        self.params = EngineParams(max_seq_len=64, max_batch=8, model_name="fake-model")
        self.encoder = Encoder()
        self.info = {"backend": "fake", "device": "cpu", "target_sm": None, "torch": "0", "engine_sha256": "0" * 64}
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.calls: list[list] = []
        self.dead = False
        self.exitcode = None
        self.killed = False

    def alive(self):
        return not self.dead

    def embed_ids(self, seqs):
        self.entered.set()
        if seqs:
            self.calls.append(seqs)
        assert self.gate.wait(WAIT * 2), "the test never released the engine"
        if self.killed:
            raise RuntimeError("the engine process is gone")
        return [[1.0, 0.0] for _ in seqs]

    def kill(self):  # as EngineProcess.kill: the process is gone, so alive() is False
        self.killed = self.dead = True
        self.gate.set()

    def close(self, timeout):
        self.closed_with = timeout


def make_service(**limits) -> EmbeddingService:
    base = {"max_batch": 8, "max_wait_ms": 1, "max_inputs": 16, "max_body_bytes": 64 * 1024}
    return EmbeddingService(Engine(), ServerLimits(**{**base, **limits}))


@pytest.fixture
def start():
    made: list[Running] = []

    def factory(service=None, **options) -> Running:
        running = Running(service or make_service(), **options)
        made.append(running)
        return running

    yield factory
    for running in made:
        running.service.engine.gate.set()
        running.service.engine.encoder.hold.set()
        running.stop()


def post(port, body, headers=None, path="/v1/embeddings"):
    return request(port, "POST", path, body, headers)


def in_thread(fn, *args):
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args)
        except Exception as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def head(method="POST", path="/v1/embeddings", headers=(), body=b"", version="HTTP/1.1") -> bytes:
    lines = [f"{method} {path} {version}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def post_head(body: bytes, *extra: str) -> bytes:
    return head(headers=("Host: t", "Content-Type: application/json", f"Content-Length: {len(body)}", *extra),
                body=body)


# --- routes -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/embeddings", "/embeddings"])
def test_openai_routes(start, path):
    port = start().port
    status, _, body = post(port, {"input": ["ab", "c"]}, path=path)
    data = json.loads(body)
    assert status == 200 and [d["embedding"] for d in data["data"]] == [[1.0, 0.0], [1.0, 0.0]]
    assert data["usage"] == {"prompt_tokens": 3, "total_tokens": 3} and data["model"] == "fake-model"


def test_tei_embed_route(start):
    port = start().port
    status, _, body = post(port, {"inputs": "abc"}, path="/embed")
    assert (status, json.loads(body)) == (200, [[1.0, 0.0]])


def test_tei_root_route_embeds_as_embed_does(start):
    """TEI answers POST / with the model's task (huggingface_hub's InferenceClient posts there)."""
    port = start().port
    status, _, body = post(port, {"inputs": ["abc", "de"], "truncate": True, "truncation_direction": "Left"}, path="/")
    assert (status, json.loads(body)) == (200, [[1.0, 0.0], [1.0, 0.0]])
    status, _, body = post(port, {"input": "abc"}, path="/")  # TEI's fields, not OpenAI's
    assert status == 400 and json.loads(body)["error"]["param"] == "inputs"
    status, headers, _ = request(port, "GET", "/")
    assert status == 405 and headers["allow"] == "POST, OPTIONS"


def test_info_carries_text_embeddings_inference_fields(start):
    service = make_service(max_inputs=16, max_batch=8)
    running = start(service, max_connections=99, tokenizer_threads=3)
    info = json.loads(request(running.port, "GET", "/info")[2])
    tei = {key: info[key] for key in ("model_id", "model_dtype", "model_type", "max_concurrent_requests",
                                      "max_input_length", "max_batch_tokens", "max_client_batch_size",
                                      "auto_truncate", "tokenization_workers", "max_batch_requests")}
    assert tei == {"model_id": "fake-model", "model_dtype": "float32", "model_type": {"embedding": {"pooling": "mean"}},
                   "max_concurrent_requests": 99, "max_input_length": 64, "max_batch_tokens": 8 * 64,
                   "max_client_batch_size": 16, "auto_truncate": False, "tokenization_workers": 3,
                   "max_batch_requests": 8}
    assert isinstance(info["version"], str) and info["model"] == "fake-model"


@pytest.mark.parametrize("path, key", [("/health", "status"), ("/v1/models", "data"), ("/info", "model"),
                                       ("/openapi.json", "openapi"), ("/ready", "status")])
def test_get_routes(start, path, key):
    status, headers, body = request(start().port, "GET", path)
    assert status == 200 and key in json.loads(body) and headers["content-type"] == "application/json"


def test_head_has_headers_and_no_body(start):
    port = start().port
    status, headers, body = request(port, "HEAD", "/health")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0


@pytest.mark.parametrize("path, allow", [("/v1/embeddings", "POST, OPTIONS"), ("/health", "GET, HEAD, OPTIONS"),
                                         ("*", "GET, HEAD, POST, OPTIONS")])
def test_options_answers_allow(start, path, allow):
    raw = raw_exchange(start().port, head("OPTIONS", path, ("Host: t",)), wait=0.5)
    assert statuses(raw) == [204] and f"allow: {allow}".lower().encode() in raw.lower()


@pytest.mark.parametrize("method, path, allow", [("GET", "/v1/embeddings", "POST, OPTIONS"),
                                                 ("POST", "/health", "GET, HEAD, OPTIONS"),
                                                 ("DELETE", "/info", "GET, HEAD, OPTIONS")])
def test_method_not_allowed_is_405_json(start, method, path, allow):
    status, headers, body = request(start().port, method, path)
    assert status == 405 and headers["allow"] == allow and json.loads(body)["error"]["code"] == "method_not_allowed"


def test_unknown_route_is_404_json(start):
    status, _, body = request(start().port, "GET", "/nope")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


def test_keep_alive_serves_several_requests(start):
    port = start().port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    try:
        for _ in range(3):
            conn.request("POST", "/v1/embeddings", body=b'{"input": "x"}', headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("connection") is None
            resp.read()
    finally:
        conn.close()


def test_expect_100_continue(start):
    port = start().port
    body = b'{"input": "x"}'
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(head(headers=("Host: t", "Content-Type: application/json", f"Content-Length: {len(body)}",
                                   "Expect: 100-continue")))
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        assert resp.status == 200


# --- auth and CORS ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x"])
def test_missing_or_wrong_key_is_401(start, authorization):
    port = start(api_key=KEY).port
    headers = {"Authorization": authorization} if authorization else {}
    status, hdrs, body = post(port, {"input": "x"}, headers)
    assert status == 401 and hdrs["www-authenticate"] == "Bearer"
    assert json.loads(body)["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_right_key_passes(start, scheme):
    assert post(start(api_key=KEY).port, {"input": "x"}, {"Authorization": f"{scheme} {KEY}"})[0] == 200


def test_the_key_is_not_in_the_options_repr():
    assert KEY not in repr(HttpOptions(api_key=KEY))


def test_probes_are_open_and_metrics_open_by_default(start):
    port = start(api_key=KEY).port
    assert [request(port, "GET", p)[0] for p in ("/health", "/ready", "/metrics", "/info")] == [200, 200, 200, 401]


def test_metrics_closed_with_metrics_auth(start):
    port = start(api_key=KEY, metrics_auth=True).port
    assert request(port, "GET", "/metrics")[0] == 401
    assert request(port, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})[0] == 200


def test_cors_exact_origins(start):
    port = start(cors_origins=("https://a.example",)).port
    _, headers, _ = post(port, {"input": "x"}, {"Origin": "https://a.example"})
    assert headers["access-control-allow-origin"] == "https://a.example" and headers["vary"] == "Origin"
    _, headers, _ = post(port, {"input": "x"}, {"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in headers
    raw = raw_exchange(port, head("OPTIONS", "/v1/embeddings", ("Host: t", "Origin: https://a.example",
                                                                "Access-Control-Request-Method: POST")), wait=0.5)
    assert statuses(raw) == [204] and b"access-control-allow-headers: Authorization, Content-Type" in raw


def test_no_cors_headers_by_default(start):
    _, headers, _ = post(start().port, {"input": "x"}, {"Origin": "https://a.example"})
    assert not any(h.startswith("access-control") for h in headers)


# --- Host, targets, framing, entities ------------------------------------------------------------------

BODY = b'{"input": "x"}'


@pytest.mark.parametrize("headers, code", [
    (("Content-Type: application/json", f"Content-Length: {len(BODY)}"), "invalid_host"),
    (("Host: a", "Host: b", "Content-Type: application/json", f"Content-Length: {len(BODY)}"), "invalid_host"),
    (("Host: a b", "Content-Type: application/json", f"Content-Length: {len(BODY)}"), "invalid_host"),
    (("Host: user@a", "Content-Type: application/json", f"Content-Length: {len(BODY)}"), "invalid_host"),
])
def test_host_rules(start, headers, code):
    raw = raw_exchange(start().port, head(headers=headers, body=BODY))
    assert statuses(raw) == [400] and error_code(raw) == code and b"connection: close" in raw


def test_http10_without_host_is_served(start):
    raw = raw_exchange(start().port, head("GET", "/health", version="HTTP/1.0"))
    assert statuses(raw) == [200]


def test_absolute_form_target_is_routed_by_its_path(start):
    port = start(api_key=KEY).port
    raw = raw_exchange(port, head(path="http://t/v1/embeddings", body=BODY, headers=(
        "Host: t", "Content-Type: application/json", f"Content-Length: {len(BODY)}", f"Authorization: Bearer {KEY}")))
    assert statuses(raw) == [200]


@pytest.mark.parametrize("data", [
    b"GET health HTTP/1.1\r\nHost: t\r\n\r\n",  # not a path
    b"GET * HTTP/1.1\r\nHost: t\r\n\r\n",  # * is for OPTIONS only
    b"POST\x0b/v1/embeddings HTTP/1.1\r\nHost: t\r\n\r\n",  # VT splitting the request line
    b"POST /v1/embeddings\x0cHTTP/1.1\r\nHost: t\r\n\r\n",  # FF
    b"GET /health\r\n\r\n",  # HTTP/0.9
    b"GET /health HTTP/2.0\r\nHost: t\r\n\r\n",
])
def test_bad_request_lines_are_400_json_and_closed(start, data):
    raw = raw_exchange(start().port, data)
    assert statuses(raw) == [400] and error_code(raw) is not None and b"connection: close" in raw


@pytest.mark.parametrize("headers", [
    ("Content-Length: 5", "Transfer-Encoding: chunked"),  # the smuggling shape
    (f"Content-Length: {len(BODY)}", f"Content-Length: {len(BODY)}"),
    (f"Content-Length: +{len(BODY)}",),
    ("X: a\r\n b", f"Content-Length: {len(BODY)}"),  # obs-fold
    ("X: a\rY: b", f"Content-Length: {len(BODY)}"),  # bare CR
    ("X: a\0b", f"Content-Length: {len(BODY)}"),
])
def test_ambiguous_framing_is_400_and_closed(start, headers):
    raw = raw_exchange(start().port, head(headers=("Host: t", "Content-Type: application/json", *headers), body=BODY))
    assert statuses(raw) == [400] and b"connection: close" in raw


def test_chunked_bodies_are_411(start):
    chunked = b"e\r\n" + BODY + b"\r\n0\r\n\r\n"
    raw = raw_exchange(start().port, head(headers=("Host: t", "Content-Type: application/json",
                                                   "Transfer-Encoding: chunked"), body=chunked))
    assert statuses(raw) == [411] and error_code(raw) == "length_required"


@pytest.mark.parametrize("encoding, status", [("gzip", 415), ("br", 415), ("identity, gzip", 415),
                                              ("identity", 200)])
def test_content_encoding(start, encoding, status):
    raw = raw_exchange(start().port, post_head(BODY, f"Content-Encoding: {encoding}"), wait=0.5)
    assert statuses(raw) == [status]


def test_get_with_a_body_closes_the_connection(start):
    raw = raw_exchange(start().port, head("GET", "/health", ("Host: t", "Content-Length: 2"), b"{}"))
    assert statuses(raw) == [200] and b"connection: close" in raw


# --- the connection guards -------------------------------------------------------------------------------

def test_headers_over_the_budget_are_431_in_one_piece_or_trickled(start):
    port = start(max_header_bytes=2048).port
    raw = raw_exchange(port, head("GET", "/health", ("Host: t", "X: " + "a" * 4000)))
    assert statuses(raw) == [431] and error_code(raw) == "headers_too_large"
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        for _ in range(30):  # an endless header, 200 bytes at a time
            try:
                sock.sendall(b"X-" + b"a" * 196 + b": b\r\n")
            except OSError:
                break
            time.sleep(0.005)
        sock.settimeout(WAIT)
        assert sock.recv(200).startswith(b"HTTP/1.1 431")


def test_slow_headers_get_408_at_the_header_deadline(start):
    port = start(header_timeout_s=0.5).port
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        started = time.monotonic()
        sock.settimeout(WAIT)
        data = b""
        while chunk := sock.recv(1000):
            data += chunk
        assert data.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 3


def test_a_silent_connection_is_closed_without_an_answer(start):
    port = start(header_timeout_s=0.3).port
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.settimeout(WAIT)
        assert sock.recv(100) == b""


def test_idle_keep_alive_connection_is_closed(start):
    port = start(idle_timeout_s=0.3).port
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(head("GET", "/health", ("Host: t",)))
        sock.settimeout(WAIT)
        data = b""
        while chunk := sock.recv(4096):  # the answer, then the close after the idle timeout
            data += chunk
        assert statuses(data) == [200]


def test_idle_connections_are_evicted_for_a_working_client(start):
    running = start(max_connections=8)
    idle = [socket.create_connection(("127.0.0.1", running.port), timeout=WAIT) for _ in range(40)]
    try:
        started = time.monotonic()
        status, _, _ = post(running.port, {"input": "x"})
        assert status == 200 and time.monotonic() - started < 1.0
        table = running.server.config.mopt.table
        assert table.evicted >= 32 and table.open <= 8
    finally:
        for sock in idle:
            sock.close()


def test_at_the_cap_with_every_connection_working_a_new_one_is_503(start):
    service = make_service()
    running = start(service, max_connections=2)
    service.engine.gate.clear()
    busy = [in_thread(post, running.port, {"input": "x"}) for _ in range(2)]
    assert wait_for(lambda: running.server.config.mopt.table.open == 2 and not running.server.config.mopt.table.idle)
    raw = raw_exchange(running.port, head("GET", "/health", ("Host: t",)))
    assert statuses(raw) == [503] and error_code(raw) == "server_busy" and b"retry-after: 1" in raw
    service.engine.gate.set()
    for thread, box in busy:
        thread.join(WAIT)
        assert box["result"][0] == 200


def test_an_idle_and_slow_flood_does_not_keep_a_client_waiting(start):
    running = start(max_connections=64, header_timeout_s=2)
    socks = []
    try:
        for i in range(300):
            sock = socket.create_connection(("127.0.0.1", running.port), timeout=WAIT)
            if i % 2:
                sock.sendall(b"GET /health HTTP/1.1\r\nX: ")  # slow: a header never finished
            socks.append(sock)
        for _ in range(3):
            started = time.monotonic()
            assert post(running.port, {"input": "x"})[0] == 200
            assert time.monotonic() - started < 1.0
    finally:
        for sock in socks:
            sock.close()


# --- admission, tokenizing off the loop, clients that leave, deadlines --------------------------------------

def test_bodies_beyond_the_inflight_byte_budget_are_503_unread(start):
    service = make_service()
    running = start(service, max_inflight_bytes=3000)
    service.engine.gate.clear()
    big = json.dumps({"input": ["a"] * 4, "user": "u" * 2000}).encode()
    first = in_thread(post, running.port, big)
    assert service.engine.entered.wait(WAIT)
    # The second request's headers alone: refused before its body is sent.
    with socket.create_connection(("127.0.0.1", running.port), timeout=WAIT) as sock:
        sock.sendall(post_head(big)[:-len(big)])
        sock.settimeout(WAIT)
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    assert statuses(data) == [503] and error_code(data) == "server_busy" and b"retry-after: 1" in data
    service.engine.gate.set()
    first[0].join(WAIT)
    assert first[1]["result"][0] == 200
    assert post(running.port, big)[0] == 200  # the budget was given back
    assert service.metrics.dropped["busy"] == 1


def test_answers_are_reserved_under_the_inflight_budget_until_written(start):
    """1,000 inputs a request (langchain's default) answer megabytes each: an answer's bytes (inputs x dim
    x ANSWER_BYTES_PER_VALUE) are reserved before the work is queued, and given back once written."""
    from builder.runtime.service import ANSWER_BYTES_PER_VALUE

    service = make_service()
    answer = 16 * service.engine.dim * ANSWER_BYTES_PER_VALUE  # 640 bytes
    running = start(service, max_inflight_bytes=answer + 400)
    app = running.server.app
    service.engine.gate.clear()
    body = {"input": ["a"] * 16}
    first = in_thread(post, running.port, body)
    assert service.engine.entered.wait(WAIT)
    assert app.inflight_bytes == answer + len(json.dumps(body))  # its body and its answer
    status, headers, raw = post(running.port, body)  # its body fits the budget, its answer does not
    assert status == 503 and json.loads(raw)["error"]["code"] == "server_busy" and headers["retry-after"] == "1"
    assert service.metrics.dropped["busy"] == 1
    service.engine.gate.set()
    first[0].join(WAIT)
    assert first[1]["result"][0] == 200
    assert wait_for(lambda: app.inflight_bytes == 0)
    lone = start(make_service(), max_inflight_bytes=answer // 2)
    assert post(lone.port, body)[0] == 200  # alone, a request is taken whatever its answer's size
    assert lone.server.app.inflight_bytes == 0


def test_the_token_budget_answers_503_with_retry_after(start):
    service = make_service(max_queue_tokens=10)
    running = start(service)
    service.engine.gate.clear()
    first = in_thread(post, running.port, {"input": "a" * 8})
    assert service.engine.entered.wait(WAIT)
    second = in_thread(post, running.port, {"input": "b" * 8})  # queued: the engine is busy
    assert wait_for(lambda: service.batcher._queued_tokens == 8)
    status, headers, body = post(running.port, {"input": "c" * 8})
    assert status == 503 and json.loads(body)["error"]["code"] == "queue_full" and "retry-after" in headers
    service.engine.gate.set()
    for thread, box in (first, second):
        thread.join(WAIT)
        assert box["result"][0] == 200


def test_large_requests_are_tokenized_off_the_event_loop(start):
    service = make_service()
    running = start(service)
    encoder = service.engine.encoder
    assert post(running.port, {"input": "x"})[0] == 200
    assert encoder.threads[-1].startswith("mopt-tokenize-batch_")  # small: with the other small ones
    encoder.hold.clear()
    big = in_thread(post, running.port, {"input": ["y" * 30] * 16,
                                         "user": "u" * (16 * 1024 + 1)})
    assert encoder.holding.wait(WAIT)
    assert encoder.threads[-1].startswith("mopt-tokenize_")
    started = time.monotonic()  # a small request is answered while the large one is being tokenized
    assert post(running.port, {"input": "x"})[0] == 200 and time.monotonic() - started < 1.0
    encoder.hold.set()
    big[0].join(WAIT)
    assert big[1]["result"][0] == 200


def test_with_no_inline_bytes_every_request_is_tokenized_in_the_pool(start):
    running = start(inline_body_bytes=0)
    encoder = running.service.engine.encoder
    assert post(running.port, {"input": "x"})[0] == 200
    assert encoder.threads[-1].startswith("mopt-tokenize-small_")
    running = start(inline_body_bytes=64)
    assert post(running.port, {"input": "x" * 10})[0] == 200  # a body of 17 bytes: inline, in a batch
    assert running.service.engine.encoder.threads[-1].startswith("mopt-tokenize-batch_")


def test_after_the_drain_the_engine_gets_a_bounded_close(start):
    """docker stop with a call still running: the worker's polite exit waited up to 10 s more and Docker's
    SIGKILL came first (exit 137); after the drain the engine gets CLOSE_AFTER_DRAIN_S, then is killed."""
    running = start()
    assert running.stop() == 0
    assert running.service.engine.closed_with == srv.CLOSE_AFTER_DRAIN_S <= 0.5


def test_small_bodies_never_wait_behind_large_ones_being_tokenized(start):
    """Every large-body thread busy (tokenizing held): a small request is tokenized in threads of its own
    and answered at once (the adversarial suite's normal client waited 3.7 s with one pool for both)."""
    service = make_service(max_body_bytes=128 * 1024)
    running = start(service, inline_body_bytes=0)
    encoder = service.engine.encoder
    encoder.hold.clear()
    big = {"input": ["y" * 30] * 16, "user": "u" * (srv.SMALL_BODY_BYTES + 1)}
    held = [in_thread(post, running.port, big) for _ in range(running.server.app.options.tokenizer_threads)]
    assert wait_for(lambda: sum(n.startswith("mopt-tokenize_") for n in encoder.threads) == len(held))
    started = time.monotonic()
    assert post(running.port, {"input": "x"})[0] == 200 and time.monotonic() - started < 1.0
    assert encoder.threads[-1].startswith("mopt-tokenize-small_")
    encoder.hold.set()
    for thread, box in held:
        thread.join(WAIT)
        assert box["result"][0] == 200


def test_a_client_that_leaves_has_its_queued_work_dropped(start):
    service = make_service()
    running = start(service)
    service.engine.gate.clear()
    first = in_thread(post, running.port, {"input": "first"})
    assert service.engine.entered.wait(WAIT)
    with socket.create_connection(("127.0.0.1", running.port), timeout=WAIT) as sock:
        sock.sendall(post_head(b'{"input": "gone"}'))
        assert wait_for(lambda: service.batcher._queued_tokens == 4)
    (job,) = service.batcher._jobs
    assert wait_for(job.client_gone)  # the event loop has seen the close (a busy machine takes a moment)
    service.engine.gate.set()  # before the next engine call the batcher sees the client gone
    first[0].join(WAIT)
    assert first[1]["result"][0] == 200
    assert wait_for(lambda: service.metrics.dropped["client_gone"] == 1)
    assert all(seq != [ord(c) for c in "gone"] for call in service.engine.calls for seq in call)


def test_the_request_deadline_covers_queueing(start):
    service = make_service()
    running = start(service, request_timeout_s=0.5)
    service.engine.gate.clear()
    first = in_thread(post, running.port, {"input": "first"})
    assert service.engine.entered.wait(WAIT)
    status, _, body = post(running.port, {"input": "late"})
    assert status == 503 and json.loads(body)["error"]["code"] == "timeout"
    service.engine.gate.set()
    first[0].join(WAIT)


def test_metrics_count_the_route_called(start):
    service = make_service()
    port = start(service).port
    post(port, {"inputs": "x"}, path="/embed")
    post(port, {"inputs": "x"}, path="/")
    post(port, {"input": "x"}, path="/embeddings")
    post(port, {"input": []})
    _, _, body = request(port, "GET", "/metrics")
    text = body.decode()
    for line in ('mopt_requests_total{route="/embed",status="200"} 1.0',
                 'mopt_requests_total{route="/",status="200"} 1.0',
                 'mopt_requests_total{route="/embeddings",status="200"} 1.0',
                 'mopt_requests_total{route="/v1/embeddings",status="400"} 1.0'):
        assert line in text


# --- the drain and the watchdog -------------------------------------------------------------------------

def test_drain_answers_every_request_and_exits_zero(start):
    service = make_service(max_batch=1)
    running = start(service, drain_timeout_s=2.0)
    service.engine.gate.clear()
    clients = [in_thread(post, running.port, {"input": f"r{i}"}) for i in range(4)]
    assert service.engine.entered.wait(WAIT)
    # One call runs, one is sent behind it (a whole batch: max_batch 1), two wait in the queue.
    assert wait_for(lambda: len(service.batcher._inflight) == 2 and sum(j.left for j in service.batcher._jobs) == 2)
    started = time.monotonic()
    running.server.stop("SIGTERM")
    assert wait_for(lambda: request_refused(running.port), 3)  # new connections are refused at once
    time.sleep(1.2)  # the cut-off (drain - 1 s margin) answers the queued ones
    service.engine.gate.set()
    assert running.stop() == 0 and time.monotonic() - started < 2.5
    results = []
    for thread, box in clients:
        thread.join(WAIT)
        status, headers, body = box["result"]
        results.append(status)
        assert headers.get("connection") == "close"
        if status == 503:
            assert json.loads(body)["error"]["code"] == "shutting_down"
    assert sorted(results) == [200, 200, 503, 503]


def request_refused(port) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return True
    return False


def test_ready_is_503_while_draining(start):
    service = make_service()
    running = start(service, drain_timeout_s=2.0)
    service.engine.gate.clear()
    conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=WAIT)
    try:
        conn.request("POST", "/v1/embeddings", body=b'{"input": "x"}', headers={"Content-Type": "application/json"})
        assert service.engine.entered.wait(WAIT)
        running.server.stop("SIGTERM")
        assert wait_for(lambda: running.server.app.draining)
        assert running.server.app._get("/ready")[0] == 503
        service.engine.gate.set()
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_a_dead_engine_ends_serve_with_70(start, caplog):
    service = make_service()
    service.engine.exitcode = -9
    running = start(service, drain_timeout_s=1)
    assert request(running.port, "GET", "/health")[0] == 200
    caplog.set_level(logging.ERROR, logger="builder.runtime.server")
    service.engine.dead = True
    assert running.wait_exit() == srv.EXIT_ENGINE_DIED
    assert any("engine worker died (exit code -9)" in r.getMessage() for r in caplog.records)


def test_a_stalled_engine_fails_health_then_ends_serve_with_71(start, caplog):
    service = make_service(engine_stall_s=0.5)
    running = start(service, drain_timeout_s=1)
    caplog.set_level(logging.ERROR, logger="builder.runtime.server")
    assert post(running.port, {"input": "x"})[0] == 200  # the engine's rate is known: calls get short deadlines
    service.engine.entered.clear()
    service.engine.gate.clear()
    waiting = in_thread(post, running.port, {"input": "x"})
    assert service.engine.entered.wait(WAIT)
    assert wait_for(lambda: service.engine_stalled() is not None, 3)
    with pytest.raises(srv.ApiError) as err:
        service.health()  # what /health answers until the listener closes (then the probe's connection fails)
    assert (err.value.status, err.value.code) == (503, "engine_stalled")
    assert running.wait_exit() == srv.EXIT_ENGINE_STALLED and service.engine.killed
    waiting[0].join(WAIT)
    assert waiting[1]["result"][0] == 503  # the request on the stalled engine was answered
    assert any("has not answered for" in r.getMessage() for r in caplog.records)


def test_an_idle_engine_is_pinged_and_a_hung_ping_is_a_stall(start):
    service = make_service(engine_ping_s=0.1, engine_stall_s=0.5)
    running = start(service, drain_timeout_s=1)
    assert wait_for(lambda: service.engine.entered.is_set())  # the first ping
    assert service.engine.calls == []  # pings carry no work
    service.engine.gate.clear()  # the next ping hangs
    service.engine.entered.clear()
    assert running.wait_exit() == srv.EXIT_ENGINE_STALLED


def test_sigterm_drains_and_exits_zero(tmp_path):
    """The real signal path, in a child process (signal handlers belong to the main thread)."""
    script = tmp_path / "serve.py"
    script.write_text(
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from tests.unit.test_server_http import make_service\n"
        "from builder.runtime.server import HttpOptions, serve\n"
        "sys.exit(serve(make_service(), '127.0.0.1', 0, HttpOptions(drain_timeout_s=2)))\n")
    proc = subprocess.Popen([sys.executable, str(script), str(REPO)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    try:
        port = json.loads(proc.stdout.readline())["port"]
        assert post(port, {"input": "x"})[0] == 200
        proc.terminate()
        assert proc.wait(WAIT) == 0
        assert json.loads(proc.stdout.readline()) == {"event": "stopped", "exit_code": 0, "reason": "SIGTERM"}
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)


# --- logs ---------------------------------------------------------------------------------------------

def test_json_access_log_line(start):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(srv.JsonFormatter())
    access = logging.getLogger("builder.runtime.server.access")
    access.addHandler(handler)
    old = access.level
    access.setLevel(logging.INFO)
    try:
        port = start(api_key=KEY).port
        post(port, {"input": "x"}, {"Authorization": f"Bearer {KEY}"}, path="/v1/embeddings?x=1")
        assert wait_for(lambda: stream.getvalue().endswith("\n"))
    finally:
        access.removeHandler(handler)
        access.setLevel(old)
    (line,) = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert (line["method"], line["path"], line["status"], line["client"]) == ("POST", "/v1/embeddings", 200,
                                                                              "127.0.0.1")
    assert line["level"] == "INFO" and line["time"].endswith("+00:00") and line["duration_ms"] >= 0
    assert KEY not in stream.getvalue()


def test_configure_logging_json_and_text(capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        srv.configure_logging(True, "INFO")
        logging.getLogger("x.y").warning("hello %s", "there")
        line = json.loads(capsys.readouterr().err.strip())
        assert line["message"] == "hello there" and line["logger"] == "x.y" and line["level"] == "WARNING"
        srv.configure_logging(False, "INFO")
        logging.getLogger("x.y").warning("plain")
        assert capsys.readouterr().err.strip().endswith("WARNING x.y: plain")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]


# --- the serve flags (__main__) and the own-server flavours -------------------------------------------

def serve_args(monkeypatch, argv, env=None):
    from builder.runtime import __main__ as cli

    for name in ("MOPT_API_KEY", "MOPT_API_KEY_FILE", "MOPT_METRICS_AUTH", "MOPT_CORS_ORIGINS", "MOPT_LOG_FORMAT",
                 "MOPT_ENGINE_PROCESS", "MOPT_REQUEST_TIMEOUT", "MOPT_MAX_INFLIGHT_BYTES", "MOPT_HEADER_TIMEOUT",
                 "MOPT_INLINE_BODY_BYTES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    return cli, cli.build_parser().parse_args(["serve", "--engine-dir", "e", *argv])


def test_http_options_from_flags_and_env(monkeypatch, tmp_path):
    cli, a = serve_args(monkeypatch, ["--cors-origins", "https://a.example, https://b.example", "--metrics-auth",
                                      "--request-timeout", "5", "--log-format", "json", "--header-timeout", "3",
                                      "--tokenizer-threads", "3"],
                        {"MOPT_API_KEY": KEY, "MOPT_MAX_INFLIGHT_BYTES": str(32 << 20), "MOPT_INLINE_BODY_BYTES": "0"})
    assert cli.http_options(a) == HttpOptions(
        api_key=KEY, metrics_auth=True, cors_origins=("https://a.example", "https://b.example"),
        request_timeout_s=5.0, header_timeout_s=3.0, tokenizer_threads=3, max_inflight_bytes=32 << 20,
        json_logs=True, inline_body_bytes=0)
    (tmp_path / "key").write_text(f"  {KEY}\n")
    cli, a = serve_args(monkeypatch, [], {"MOPT_API_KEY_FILE": str(tmp_path / "key"), "MOPT_METRICS_AUTH": "0"})
    assert cli.http_options(a).api_key == KEY and cli.http_options(a).metrics_auth is False
    assert cli.http_options(serve_args(monkeypatch, [])[1]) == HttpOptions()


@pytest.mark.parametrize("argv, env, message", [
    (["--api-key", "a"], {"MOPT_API_KEY_FILE": "/nonexistent"}, "not both"),
    (["--api-key", "  "], {}, "empty"),
    (["--api-key-file", "/nonexistent/key"], {}, "--api-key-file"),
    (["--max-connections", "0"], {}, "--max-connections"),
    (["--drain-timeout", "0"], {}, "--drain-timeout"),
    (["--header-timeout", "-1"], {}, "--header-timeout"),
    (["--max-inflight-bytes", "1000"], {}, "--max-inflight-bytes must be at least --max-body-bytes"),
    (["--tokenizer-threads", "0"], {}, "--tokenizer-threads"),
    (["--inline-body-bytes", "-1"], {}, "--inline-body-bytes"),
])
def test_http_options_usage_errors(monkeypatch, argv, env, message):
    from builder.runtime.errors import UsageError

    cli, a = serve_args(monkeypatch, argv, env)
    with pytest.raises(UsageError, match=message):
        cli.http_options(a)


@pytest.mark.parametrize("value, expected", [("true", True), ("1", True), ("0", False), ("False", False)])
def test_boolean_env_variables(monkeypatch, value, expected):
    _, a = serve_args(monkeypatch, [], {"MOPT_ENGINE_PROCESS": value, "MOPT_METRICS_AUTH": value})
    assert a.engine_process is expected and a.metrics_auth is expected


def test_bad_boolean_env_variable_is_a_one_line_usage_error(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        serve_args(monkeypatch, [], {"MOPT_METRICS_AUTH": "maybe"})
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == "error: MOPT_METRICS_AUTH='maybe' is not a boolean (true/false/1/0)"


def test_main_exits_with_serves_code(monkeypatch):
    from builder.runtime import __main__ as cli

    monkeypatch.setitem(cli.COMMANDS, "serve", lambda a: srv.EXIT_ENGINE_STALLED)
    assert cli.main(["serve", "--engine-dir", "e"]) == srv.EXIT_ENGINE_STALLED


def test_trtllm_refuses_a_key_it_cannot_enforce():
    from builder.runtime.backends import tensorrt_llm as tl
    from builder.runtime.errors import UsageError

    with pytest.raises(UsageError, match="no API key option"):
        tl.check_http_options(HttpOptions(api_key=KEY))
    tl.check_http_options(HttpOptions())
    tl.check_http_options(None)


# --- the engine loading while the server listens -------------------------------------------------------

class _Loader:
    """serve(load=...): holds the load until released, then returns a service or raises."""

    def __init__(self, error: BaseException | None = None):
        self.release = threading.Event()
        self.error = error
        self.service: EmbeddingService | None = None

    def __call__(self):
        assert self.release.wait(WAIT)
        if self.error is not None:
            raise self.error
        self.service = make_service()
        return self.service


def test_while_the_engine_loads_the_server_is_alive_not_ready_and_takes_no_work():
    loader = _Loader()
    running = Running(None, load=loader)
    try:
        status, _, body = request(running.port, "GET", "/health")
        assert (status, json.loads(body)) == (200, {"status": "loading"})  # liveness: the process is fine
        for method, path in (("GET", "/ready"), ("GET", "/v1/models"), ("GET", "/info"),
                             ("POST", "/v1/embeddings"), ("POST", "/embed")):
            body_in = {"input": "hi"} if method == "POST" else None
            status, headers, body = request(running.port, method, path, body_in)
            assert status == 503 and json.loads(body)["error"]["code"] == "loading", (path, status)
            assert headers["retry-after"] == str(srv.LOADING_RETRY_S)
        assert request(running.port, "GET", "/metrics")[0] == 200
        assert request(running.port, "GET", "/openapi.json")[0] == 200
        loader.release.set()
        assert wait_for(lambda: request(running.port, "GET", "/ready")[0] == 200)
        status, _, body = request(running.port, "POST", "/v1/embeddings", {"input": "hi"})
        assert status == 200 and len(json.loads(body)["data"]) == 1
        assert json.loads(request(running.port, "GET", "/health")[2])["status"] != "loading"
        assert running.stop() == 0 and running.error is None
    finally:
        loader.release.set()
        running.stop()
        if loader.service is not None:
            loader.service.engine.gate.set()


def test_a_failed_load_stops_the_server_with_its_exit_code_and_message():
    err = RuntimeToolError("the guard refused this engine")
    err.exit_code = 3
    loader = _Loader(err)
    running = Running(None, load=loader)
    loader.release.set()
    assert running.wait_exit() is None  # serve() raised: no exit code returned
    assert running.error is err  # the CLI prints its message and exits with its code


def test_a_server_stopped_while_loading_closes_what_loads_after():
    loader = _Loader()
    running = Running(None, load=loader)
    assert running.stop() == 0
    loader.release.set()
    assert wait_for(lambda: loader.service is not None)
    assert wait_for(lambda: loader.service.batcher._stop)  # closed, never served


def test_served_model_name_and_aliases(start):
    """--served-model-name 'mine,alias' (vLLM's flag): /v1/models lists both; a request naming an alias is
    answered with it, any other name (clients send their own defaults) with the primary one."""
    port = start(make_service(served_model_names=("mine", "alias"))).port
    models = json.loads(request(port, "GET", "/v1/models")[2])["data"]
    assert [(m["id"], m["root"]) for m in models] == [("mine", "mine"), ("alias", "mine")]
    for asked, answered in (("alias", "alias"), ("mine", "mine"), ("text-embedding-3-small", "mine"), (None, "mine")):
        body = {"input": "x", **({"model": asked} if asked else {})}
        status, _, raw = post(port, body)
        assert status == 200 and json.loads(raw)["model"] == answered, asked
    assert json.loads(request(port, "GET", "/info")[2])["model_id"] == "mine"


@pytest.mark.parametrize("value, names", [("mine", ("mine",)), ("mine, alias", ("mine", "alias"))])
def test_served_model_name_flag(value, names):
    from builder.runtime.__main__ import build_parser

    args = build_parser().parse_args(["serve", "--engine-dir", "e", "--served-model-name", value])
    assert args.served_model_name == names


@pytest.mark.parametrize("value", ["", "a,,b", "a,a", "a,b\x01c", "x" * 257])
def test_a_bad_served_model_name_is_a_usage_error(value):
    proc = subprocess.run([sys.executable, "-m", "builder.runtime", "serve", "--engine-dir", "e",
                           "--served-model-name", value], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--served-model-name" in proc.stderr and "Traceback" not in proc.stderr


class _InProcessEngine(Engine):
    """An engine whose client is in the server process (vLLM's): its forward passes run in a process of
    the backend's own (EngineCore); here without a kill."""

    DEATH = "the engine's own process exited"  # as engine.Engine's

    @property
    def kill(self):
        raise AttributeError("kill")


def test_the_server_process_behind_an_in_process_engine_exiting_ends_serve_with_70(start, caplog):
    """The log names the process that ended: vLLM's EngineCore, not a worker mopt started."""
    service = EmbeddingService(_InProcessEngine(), ServerLimits(max_batch=8, max_wait_ms=1))
    service.engine.exitcode = -9
    running = start(service, drain_timeout_s=1)
    caplog.set_level(logging.ERROR, logger="builder.runtime.server")
    service.engine.dead = True
    assert running.wait_exit() == srv.EXIT_ENGINE_DIED
    assert any("the engine's own process exited (exit code -9)" in r.getMessage() for r in caplog.records)


def test_a_request_still_at_the_engine_when_the_drain_ends_gets_503_not_500(start, caplog):
    """The drain's time runs out with a call still at the engine: uvicorn cancels the request, which is
    answered 503 shutting_down (not uvicorn's 500 and its traceback in the log)."""
    service = make_service()
    running = start(service, drain_timeout_s=1.0)
    service.engine.gate.clear()  # the engine call outlives the drain
    thread, box = in_thread(post, running.port, {"input": "slow"})
    assert service.engine.entered.wait(WAIT)
    caplog.set_level(logging.ERROR)
    running.server.stop("SIGTERM")
    thread.join(WAIT)
    status, headers, body = box["result"]
    assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
    assert headers.get("connection") == "close" and headers.get("retry-after") == "1"
    service.engine.gate.set()
    assert running.wait_exit() == 0
    assert not any("Exception in ASGI application" in r.getMessage() for r in caplog.records)
