"""The HTTP transport (builder/runtime/server.py) over real sockets on 127.0.0.1, against a fake
service that follows the service interface (no torch): routes, auth, CORS, strict framing, the
whole-request deadline, the connection cap, client_gone, the drain, the watchdog and JSON logs."""
from __future__ import annotations

import errno
import http.client
import io
import json
import logging
import socket
import threading
import time

import pytest

from builder.runtime import server as srv
from builder.runtime.server import HttpOptions, make_server
from builder.runtime.service import ApiError

WAIT = 20  # seconds any socket may wait before the test fails (generous: a loaded 2-core machine)
KEY = "s3cret-key"


class FakeMetrics:
    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self):
        self.done: list[tuple] = []

    def render(self) -> bytes:
        return b"mopt_requests_total 1\n"

    def request_done(self, status, seconds, tokens=0, inputs=0):
        self.done.append((status, tokens, inputs))


class FakeLimits:
    max_body_bytes = 4096


class FakeService:
    """The interface server.py uses (iface-15.md); a payload's "sleep" holds the request, "fail"
    raises the ApiError it names."""

    model_name = "fake-model"

    def __init__(self):
        self.limits = FakeLimits()
        self.metrics = FakeMetrics()
        self.alive = True
        self.calls: list[dict] = []
        self.gone_seen = threading.Event()
        self.closed = False

    def _work(self, payload, deadline, client_gone):
        self.calls.append({"payload": payload, "deadline": deadline, "client_gone": client_gone})
        if "fail" in payload:
            err = ApiError(payload["fail"], "failed as asked", code="asked")
            err.headers = {"Retry-After": "3"}
            raise err
        end = time.monotonic() + payload.get("sleep", 0)
        while time.monotonic() < end:
            if payload.get("watch") and client_gone():
                self.gone_seen.set()
                raise ApiError(503, "client left", code="client_gone")
            time.sleep(0.02)

    def embeddings(self, payload, deadline=None, client_gone=None):
        self._work(payload, deadline, client_gone)
        return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [1.0, 0.0]}],
                "model": self.model_name, "usage": {"prompt_tokens": 1, "total_tokens": 1}}, 1

    def embed(self, payload, deadline=None, client_gone=None):
        self._work(payload, deadline, client_gone)
        return [[1.0, 0.0]], 1

    def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}

    def info(self):
        return {"model_id": self.model_name}

    def health(self):
        if not self.alive:
            raise ApiError(503, "the engine process has exited", code="engine_down")
        return {"status": "ok"}

    def engine_alive(self):
        return self.alive

    def close(self):
        self.closed = True


@pytest.fixture
def start():
    made = []

    def factory(service=None, **options):
        service = service or FakeService()
        httpd = make_server(service, "127.0.0.1", 0, HttpOptions(**options))
        thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        made.append((httpd, thread))
        return httpd.server_address[1], service, httpd

    yield factory
    for httpd, thread in made:
        httpd.shutdown()
        httpd.server_close()
        thread.join(WAIT)


def request(port, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def raw(port, data: bytes, wait: float = WAIT) -> tuple[int, dict, bytes, bool]:
    """Send data; return (status, headers, body, closed: the server closed the connection after)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(data)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        body = resp.read()
        sock.settimeout(0.5)  # a closing server closes at once; one keeping the connection sends nothing
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
        return resp.status, dict(resp.getheaders()), body, closed


def wait_for(condition, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(condition())


def error_code(body: bytes) -> str:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err["code"]


POST_HEAD = b"POST /v1/embeddings HTTP/1.1\r\nHost: t\r\n"
BODY = b'{"input": "x"}'


# --- routes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/embeddings", "/embeddings"])
def test_openai_routes(start, path):
    port, service, _ = start()
    status, headers, body = request(port, "POST", path, {"input": "x"})
    assert status == 200 and json.loads(body)["object"] == "list"
    assert headers["Content-Type"] == "application/json"
    call = service.calls[-1]
    assert call["payload"] == {"input": "x"}
    assert time.monotonic() < call["deadline"] <= time.monotonic() + 60  # the whole request's deadline
    assert wait_for(lambda: service.metrics.done) and service.metrics.done[-1] == (200, 1, 1)


def test_tei_embed_route(start):
    port, service, _ = start()
    status, _, body = request(port, "POST", "/embed", {"inputs": "x"})
    assert status == 200 and json.loads(body) == [[1.0, 0.0]]
    assert service.calls[-1]["payload"] == {"inputs": "x"}


@pytest.mark.parametrize("path, expected", [("/v1/models", {"object": "list"}), ("/info", {"model_id": "fake-model"}),
                                            ("/health", {"status": "ok"})])
def test_get_routes(start, path, expected):
    port, _, _ = start()
    status, _, body = request(port, "GET", path)
    assert status == 200 and expected.items() <= json.loads(body).items()


def test_metrics_route(start):
    port, _, _ = start()
    status, headers, body = request(port, "GET", "/metrics")
    assert status == 200 and body == b"mopt_requests_total 1\n"
    assert headers["Content-Type"] == FakeMetrics.CONTENT_TYPE


def test_health_503_when_the_engine_is_down(start):
    port, service, _ = start()
    service.alive = False
    status, _, body = request(port, "GET", "/health")
    assert status == 503 and error_code(body) == "engine_down"


def test_openapi_lists_every_route(start):
    port, _, _ = start()
    status, _, body = request(port, "GET", "/openapi.json")
    doc = json.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == set(srv.ROUTES)
    for path, methods in srv.ROUTES.items():
        assert {m.lower() for m in methods} <= set(doc["paths"][path]), path

    def fields(path):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return set(schema["properties"])

    assert {"input", "encoding_format", "dimensions", "input_type", "truncate_prompt_tokens", "user"} <= fields(
        "/v1/embeddings")
    assert {"inputs", "truncate", "truncation_direction", "normalize", "dimensions"} <= fields("/embed")
    assert doc["components"]["schemas"]["Error"]["properties"]["error"]["required"] == [
        "message", "type", "param", "code"]


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/openapi.json", "/metrics"])
def test_head_has_headers_and_no_body(start, path):
    port, _, _ = start()
    _, get_headers, get_body = request(port, "GET", path)
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(f"HEAD {path} HTTP/1.1\r\nHost: t\r\n\r\n"
                     "GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        data = b""
        for _ in range(100):  # until the server closes after the second answer
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"Content-Length: %d" % len(get_body) in head
    assert get_headers["Content-Length"] == str(len(get_body))
    assert rest.startswith(b"HTTP/1.1 200") and rest.endswith(b'{"status":"ok"}')  # no body bytes between


@pytest.mark.parametrize("path, allow", [("/v1/embeddings", "POST, OPTIONS"), ("/embed", "POST, OPTIONS"),
                                         ("/health", "GET, HEAD, OPTIONS"), ("*", "GET, HEAD, POST, OPTIONS")])
def test_options_answers_allow(start, path, allow):
    port, _, _ = start(api_key=KEY)  # no key needed for OPTIONS
    status, headers, body = request(port, "OPTIONS", path)
    assert status == 204 and headers["Allow"] == allow and body == b""
    assert "Access-Control-Allow-Origin" not in headers


@pytest.mark.parametrize("method, path, allow", [("GET", "/v1/embeddings", "POST, OPTIONS"),
                                                 ("DELETE", "/health", "GET, HEAD, OPTIONS"),
                                                 ("POST", "/v1/models", "GET, HEAD, OPTIONS"),
                                                 ("PUT", "/embed", "POST, OPTIONS")])
def test_method_not_allowed_is_405_json(start, method, path, allow):
    port, _, _ = start()
    status, headers, body = request(port, method, path)
    assert status == 405 and headers["Allow"] == allow and error_code(body) == "method_not_allowed"


@pytest.mark.parametrize("method", ["GET", "POST", "HEAD", "OPTIONS", "BREW"])
def test_unknown_route_is_404_json(start, method):
    port, _, _ = start()
    status, headers, body = request(port, method, "/nothing", {"input": "x"} if method == "POST" else None)
    assert status == 404
    if method != "HEAD":
        assert error_code(body) == "not_found" and headers["Content-Type"] == "application/json"


def test_service_errors_keep_their_status_and_headers(start):
    port, service, _ = start()
    status, headers, body = request(port, "POST", "/v1/embeddings", {"input": "x", "fail": 503})
    assert status == 503 and headers["Retry-After"] == "3" and error_code(body) == "asked"
    assert wait_for(lambda: service.metrics.done) and service.metrics.done[-1][0] == 503


def test_unexpected_service_failure_is_a_json_500(start):
    port, service, _ = start()
    service.embeddings = lambda *a, **k: 1 / 0
    status, _, body = request(port, "POST", "/v1/embeddings", {"input": "x"})
    assert status == 500 and error_code(body) == "internal"


# 100,000 levels: deeper than any recursion limit a test process may have raised (torch's Dynamo raises it).
@pytest.mark.parametrize("raw_body, code", [(b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
                                            (b'{"input": [' + b"9" * 5001 + b"]}", "invalid_json"),
                                            (b"{nope", "invalid_json")])
def test_bad_json_is_400(start, raw_body, code):
    port, service, _ = start()
    service.limits.max_body_bytes = 1 << 20
    status, _, body, _ = raw(port, POST_HEAD + b"Content-Length: %d\r\n\r\n" % len(raw_body) + raw_body)
    assert status == 400 and error_code(body) == code


def test_keep_alive_serves_several_requests(start):
    port, _, _ = start()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    try:
        for _ in range(3):
            conn.request("POST", "/v1/embeddings", body=BODY)
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("Connection") is None
            resp.read()
    finally:
        conn.close()


def test_keep_alive_responses_are_not_held_by_nagle(start):
    """Headers and body are two writes: with Nagle on, each response waits ~40 ms for the client's
    delayed ACK (25 requests: > 1 s). With TCP_NODELAY they take a few ms."""
    port, _, _ = start()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    try:
        started = time.monotonic()
        for _ in range(25):
            conn.request("POST", "/v1/embeddings", body=BODY)
            conn.getresponse().read()
        assert time.monotonic() - started < 0.8
    finally:
        conn.close()


# --- auth ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", ""])
def test_missing_or_wrong_key_is_401(start, authorization):
    port, service, _ = start(api_key=KEY)
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path in [("POST", "/v1/embeddings"), ("POST", "/embed"), ("GET", "/v1/models"), ("GET", "/info"),
                         ("GET", "/openapi.json"), ("GET", "/nothing")]:
        status, got, body = request(port, method, path, {"input": "x"} if method == "POST" else None, headers)
        assert status == 401 and got["WWW-Authenticate"] == "Bearer", (method, path)
        assert error_code(body) == "invalid_api_key"
    assert service.calls == []


def test_the_key_is_not_in_the_options_repr():
    assert KEY not in repr(HttpOptions(api_key=KEY)) and KEY not in str(HttpOptions(api_key=KEY))


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_right_key_passes(start, scheme):
    port, _, _ = start(api_key=KEY)
    status, _, _ = request(port, "POST", "/v1/embeddings", {"input": "x"}, {"Authorization": f"{scheme} {KEY}"})
    assert status == 200


def test_health_is_open_and_metrics_open_by_default(start):
    port, _, _ = start(api_key=KEY)
    assert request(port, "GET", "/health")[0] == 200
    assert request(port, "GET", "/metrics")[0] == 200


def test_metrics_closed_with_metrics_auth(start):
    port, _, _ = start(api_key=KEY, metrics_auth=True)
    assert request(port, "GET", "/metrics")[0] == 401
    assert request(port, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    assert request(port, "GET", "/health")[0] == 200


def test_unauthenticated_post_body_is_not_read(start):
    port, _, _ = start(api_key=KEY)
    status, _, _, closed = raw(port, POST_HEAD + b"Content-Length: 4000\r\n\r\n{")  # the body never comes
    assert status == 401 and closed


# --- CORS ----------------------------------------------------------------------------------------------

def test_no_cors_headers_by_default(start):
    port, _, _ = start()
    _, headers, _ = request(port, "GET", "/health", headers={"Origin": "https://a.example"})
    assert not any(h.startswith("Access-Control") for h in headers) and "Vary" not in headers


def test_cors_exact_origins(start):
    port, _, _ = start(cors_origins=("https://a.example",), api_key=KEY)
    _, headers, _ = request(port, "GET", "/health", headers={"Origin": "https://a.example"})
    assert headers["Access-Control-Allow-Origin"] == "https://a.example" and headers["Vary"] == "Origin"
    _, headers, _ = request(port, "GET", "/health", headers={"Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in headers and headers["Vary"] == "Origin"
    status, headers, _ = request(port, "OPTIONS", "/v1/embeddings", headers={
        "Origin": "https://a.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "https://a.example"
    assert headers["Access-Control-Allow-Methods"] == "POST, OPTIONS"
    assert headers["Access-Control-Allow-Headers"] == "Authorization, Content-Type"
    assert int(headers["Access-Control-Max-Age"]) > 0
    status, headers, _ = request(port, "OPTIONS", "/v1/embeddings", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 204 and "Access-Control-Allow-Methods" not in headers
    assert "Access-Control-Allow-Origin" not in headers


def test_cors_any_origin(start):
    port, _, _ = start(cors_origins=("*",))
    _, headers, _ = request(port, "POST", "/v1/embeddings", {"input": "x"}, {"Origin": "https://b.example"})
    assert headers["Access-Control-Allow-Origin"] == "*"


# --- strict framing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers, status, code", [
    (b"Content-Length: 14\r\nTransfer-Encoding: chunked\r\n", 400, "invalid_framing"),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 14\r\n", 400, "invalid_framing"),
    (b"Content-Length: 14\r\nContent-Length: 14\r\n", 400, "invalid_content_length"),
    (b"Content-Length: 14\r\ncontent-length: 20\r\n", 400, "invalid_content_length"),
    (b"Content-Length: +14\r\n", 400, "invalid_content_length"),
    (b"Content-Length: 1_4\r\n", 400, "invalid_content_length"),
    (b"Content-Length: 1 4\r\n", 400, "invalid_content_length"),
    (b"Content-Length:\r\n 14\r\n", 400, "invalid_headers"),  # obs-fold
    # obs-fold hiding a Transfer-Encoding inside X-A's value: a proxy may read it as a header of its own
    (b"Content-Length: 14\r\nX-A: a\r\n Transfer-Encoding: chunked\r\n", 400, "invalid_headers"),
    (b"Content-Length: 14\r\nX-A: a\r\n\tTransfer-Encoding: chunked\r\n", 400, "invalid_headers"),
    (b"Content-Length: 0x0e\r\n", 400, "invalid_content_length"),
    (b"Content-Length: \xd9\xa1\xd9\xa4\r\n", 400, "invalid_content_length"),  # Arabic-Indic digits
    (b"Content-Length: -14\r\n", 400, "invalid_content_length"),
    (b"Content-Length: 14.0\r\n", 400, "invalid_content_length"),
    (b"Content-Length: \r\n", 400, "invalid_content_length"),
    (b"Content-Length: " + b"9" * 5001 + b"\r\n", 400, "invalid_content_length"),
    (b"Content-Length: 99999999999\r\n", 413, "body_too_large"),
    (b"Transfer-Encoding: chunked\r\n", 411, "length_required"),
    (b"Transfer-Encoding: gzip, chunked\r\n", 411, "length_required"),
    (b"", 411, "length_required"),
    (b"Content-Length 14\r\n", 400, "invalid_headers"),  # no colon
    (b"Content-Length: 14\x0b\r\n", 400, "invalid_content_length"),  # only spaces and tabs are trimmed
    (b"Content-Length: X14X\r\n", 400, "invalid_content_length"),
    (b"Content-Length: " + b"9" * 19 + b"\r\n", 400, "invalid_content_length"),  # past 18 digits: refused
    (b"Content-Length: " + b"9" * 18 + b"\r\n", 413, "body_too_large"),  # 18 digits: a number, too large
])
def test_framing_refused_and_closed(start, headers, status, code):
    port, service, _ = start()
    # The body hides a second request: it must never be answered.
    smuggled = b"0\r\n\r\nGET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    got, _, body, closed = raw(port, POST_HEAD + headers + b"\r\n" + BODY + smuggled)
    assert (got, error_code(body), closed) == (status, code, True)
    assert service.calls == []
    if headers in FRAMING_MESSAGES:
        assert json.loads(body)["error"]["message"] == FRAMING_MESSAGES[headers]


FRAMING_MESSAGES = {
    b"Content-Length 14\r\n": "malformed request headers",  # the parser's defect, named as such
    b"Content-Length: 14\r\nTransfer-Encoding: chunked\r\n": "Content-Length and Transfer-Encoding together",
    b"Transfer-Encoding: chunked\r\n": "Transfer-Encoding is not supported; send Content-Length",
    b"Content-Length: 14\r\nContent-Length: 14\r\n": "more than one Content-Length header",
    b"Content-Length: -14\r\n": "Content-Length must not be negative",
    b"Content-Length: +14\r\n": "Content-Length must be a decimal number of bytes",
}


def test_empty_lines_before_a_request_line_are_ignored(start):
    """RFC 9112 2.2: a client may send CRLF after a body; the next request is still answered (it was
    dropped: the connection closed with no answer)."""
    port, service, _ = start()
    data = POST_HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY + b"\r\n\r\n"
    data += b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(data)
        out = b""
        for _ in range(100):
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    assert out.count(b"HTTP/1.1 200") == 2 and out.endswith(b'{"status":"ok"}')
    assert len(service.calls) == 1


def test_only_empty_lines_is_a_400(start):
    port, _, _ = start()
    got, _, body, closed = raw(port, b"\r\n" * 10)
    assert (got, error_code(body), closed) == (400, "bad_request", True)


def test_http09_is_refused_at_once(start):
    """'GET /health' with no version: answered with a 400 at once, not after the deadline (the stdlib
    waited for headers that never come)."""
    port, _, _ = start(request_timeout_s=30)
    started = time.monotonic()
    got, _, body, closed = raw(port, b"GET /health\r\n")
    assert (got, error_code(body), closed) == (400, "bad_request", True)
    assert time.monotonic() - started < 2


def test_a_reset_while_the_body_is_read_is_not_an_error(start, caplog):
    """A client that resets mid-body: no traceback in the log, no 500 attempted."""
    port, service, _ = start()
    with caplog.at_level(logging.INFO, logger="builder.runtime.server"):
        sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.sendall(POST_HEAD + b"Content-Length: 1000\r\n\r\n" + b'{"input": ')
        time.sleep(0.2)
        sock.close()  # SO_LINGER 0: an RST
        assert request(port, "GET", "/health")[0] == 200  # the server is still serving
        time.sleep(0.2)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert service.calls == []


@pytest.mark.parametrize("key", ["k\u00e9y", "k\udce9y", "two words", "tab\tkey", "nl\n"])
def test_an_api_key_outside_printable_ascii_is_a_usage_error(key):
    """'k\u00e9y' matched curl (UTF-8) but not Python clients (latin-1); '\udce9' (a non-UTF-8
    MOPT_API_KEY) failed the start with a traceback."""
    from builder.runtime.errors import UsageError

    with pytest.raises(UsageError, match="printable ASCII"):
        HttpOptions(api_key=key)


def test_large_bodies_are_parsed_a_few_at_a_time(start, monkeypatch):
    """A 4 MiB body can take ~20x its size once parsed: 8 at once are parsed PARSE_CONCURRENCY at a
    time (they were parsed all at once: 256 connections could hold 256 parsed bodies)."""
    port, service, _ = start()
    service.limits.max_body_bytes = 1 << 20
    lock, now, most = threading.Lock(), [0], [0]

    def loads(raw):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.1)
        with lock:
            now[0] -= 1
        return json.loads(raw)

    monkeypatch.setattr(srv, "json", type("J", (), {"loads": staticmethod(loads), "dumps": staticmethod(json.dumps),
                                                    "JSONDecodeError": json.JSONDecodeError}))
    big = {"input": "x", "pad": "y" * (srv.SMALL_BODY_BYTES + 1)}
    threads = [threading.Thread(target=request, args=(port, "POST", "/v1/embeddings", big)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert len(service.calls) == 8 and most[0] == srv.PARSE_CONCURRENCY


def test_a_large_body_of_too_many_inputs_is_let_go_inside_the_parse_gate(start):
    """'[1],' x 1M parses to ~96 MB: refused before the next large body is parsed, not later in the
    service (8 such bodies at once peaked at 476 MiB of RSS, 165 MiB with this and one parse at a time)."""
    port, service, _ = start()
    service.limits.max_body_bytes, service.limits.max_inputs = 1 << 20, 4
    status, _, body = request(port, "POST", "/v1/embeddings", {"input": [[1]] * 30000})
    assert (status, error_code(body)) == (400, "too_many_inputs") and service.calls == []
    status, _, _ = request(port, "POST", "/v1/embeddings", {"input": [1] * 30000})  # one input of many ids
    assert status == 200 and len(service.calls) == 1


@pytest.mark.parametrize("path, field", [("/v1/embeddings", "input"), ("/embeddings", "input"), ("/embed", "inputs")])
def test_a_large_body_refused_in_the_parse_gate_names_its_routes_field(start, path, field):
    port, service, _ = start()
    service.limits.max_body_bytes, service.limits.max_inputs = 1 << 20, 4
    status, _, body = request(port, "POST", path, {field: [[1]] * 30000})
    assert (status, error_code(body), json.loads(body)["error"]["param"]) == (400, "too_many_inputs", field)


def test_fields_a_route_does_not_read_are_dropped_after_parsing(start):
    class Service(FakeService):
        REQUEST_FIELDS = {"/v1/embeddings": frozenset({"input", "sleep"})}

    port, service, _ = start(Service())
    status, _, _ = request(port, "POST", "/v1/embeddings", {"input": "x", "junk": [[1]] * 500, "sleep": 0})
    assert status == 200 and service.calls[-1]["payload"] == {"input": "x", "sleep": 0}
    request(port, "POST", "/embed", {"inputs": "x", "junk": 1})  # a route without a list: all kept
    assert service.calls[-1]["payload"] == {"inputs": "x", "junk": 1}


@pytest.mark.parametrize("headers", [
    b"X-A: a\rContent-Length: 14\r\n",  # the stdlib read a Content-Length a proxy keeping the CR would not
    b"Content-Length: 1\r4\r\n",
    b"Content-Length: 14\r\nX-A: a\x00b\r\n",
])
def test_a_bare_cr_or_nul_in_the_headers_is_refused(start, headers):
    port, service, _ = start()
    got, _, body, closed = raw(port, POST_HEAD + headers + b"\r\n" + BODY)
    assert (got, error_code(body), closed) == (400, "invalid_headers", True)
    assert service.calls == []


def _answers(port, data: bytes) -> tuple[bytes, bool]:
    """Everything the server sends within 1 s, and whether it closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(data)
        sock.settimeout(1)
        out = b""
        try:
            for _ in range(100):
                chunk = sock.recv(65536)
                if not chunk:
                    return out, True
                out += chunk
        except TimeoutError:
            pass
        return out, False


def test_http10_keep_alive_is_said_in_the_response(start):
    """An HTTP/1.0 client keeps a connection only when the response says 'Connection: keep-alive';
    without it, it waited for the close (the idle timeout)."""
    port, _, _ = start()
    out, closed = _answers(port, b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert b"\r\nConnection: keep-alive\r\n" in out.partition(b"\r\n\r\n")[0] + b"\r\n" and not closed
    out, closed = _answers(port, b"GET /health HTTP/1.0\r\n\r\n")
    assert b"Connection: close" in out and closed


@pytest.mark.parametrize("options", [b"keep-alive, close", b"keep-alive,close", b"close,Upgrade"])
def test_connection_close_among_other_options_closes(start, options):
    port, _, _ = start()
    out, closed = _answers(port, b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: " + options + b"\r\n\r\n"
                                 b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    assert out.count(b"HTTP/1.1 200") == 1 and b"Connection: close" in out and closed


def test_content_length_with_surrounding_space_is_fine(start):
    port, _, _ = start()
    status, _, _, _ = raw(port, POST_HEAD + b"Content-Length:   14  \r\nConnection: close\r\n\r\n" + BODY)
    assert status == 200


def test_get_with_a_body_closes_the_connection(start):
    port, _, _ = start()
    status, headers, _, closed = raw(port, b"GET /health HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc")
    assert status == 200 and closed and headers["Connection"] == "close"


def test_headers_over_the_byte_budget_are_431(start):
    port, _, _ = start(max_header_bytes=2048)
    status, _, body, closed = raw(port, POST_HEAD + b"X-Big: " + b"a" * 3000 + b"\r\n\r\n")
    assert (status, error_code(body), closed) == (431, "headers_too_large", True)
    # Many small headers add up to the same bound.
    many = b"".join(b"X-%d: %s\r\n" % (i, b"b" * 30) for i in range(80))
    status, _, body, closed = raw(port, POST_HEAD + many + b"\r\n")
    assert (status, error_code(body), closed) == (431, "headers_too_large", True)


def test_too_many_headers_are_431(start):
    port, _, _ = start(max_header_bytes=1 << 20)
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(150))  # over the stdlib's 100
    status, _, body, closed = raw(port, POST_HEAD + many + b"\r\n")
    assert (status, closed) == (431, True) and error_code(body) == "headers_too_large"


def test_huge_request_line_is_414(start):
    port, _, _ = start(max_header_bytes=2048)
    status, _, body, closed = raw(port, b"GET /" + b"a" * 4000 + b" HTTP/1.1\r\nHost: t\r\n\r\n")
    assert (status, error_code(body), closed) == (414, "request_line_too_long", True)


@pytest.mark.parametrize("line", [b"GARBAGE\r\n", b"GET / HTTP/9.x\r\n", b"GET / HTTP/2.0\r\n", b"GET /health\r\n"])
def test_bad_request_lines_get_json(start, line):
    port, _, _ = start()
    status, headers, body, closed = raw(port, line + b"Host: t\r\n\r\n")
    assert 400 <= status < 600 and closed and headers["Content-Type"] == "application/json"
    error_code(body)


def test_body_over_the_limit_is_413_unread(start):
    port, _, _ = start()
    status, _, body, closed = raw(port, POST_HEAD + b"Content-Length: 4097\r\n\r\n")
    assert (status, error_code(body), closed) == (413, "body_too_large", True)


def test_expect_100_continue(start):
    port, _, _ = start()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(POST_HEAD + b"Content-Length: 14\r\nExpect: 100-continue\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 100")
        sock.sendall(BODY)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        assert resp.status == 200


# --- deadlines -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("head", [POST_HEAD + b"Content-Length: 14\r\n\r\n", b"POST /v1/embeddings HTTP/1.1\r\n"])
def test_slow_sender_is_cut_at_the_whole_request_deadline(start, head):
    port, service, _ = start(request_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        started = time.monotonic()
        sock.sendall(head)
        answer = b""
        for i in range(40):  # one byte every 0.1 s: each read is quick, the whole is not
            try:
                sock.sendall(b"{" if head.endswith(b"\r\n\r\n") else b"X-%d: 1\r\n" % i)
            except OSError:
                break
            sock.settimeout(0.1)
            try:
                answer += sock.recv(4096)
            except TimeoutError:
                continue
            if answer:
                break
        sock.settimeout(WAIT)
        while not answer.endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
        elapsed = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer
    assert 0.9 < elapsed < 2.0, elapsed
    assert service.calls == []


def test_idle_keep_alive_connection_is_closed(start):
    port, _, _ = start(idle_timeout_s=0.3)
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        started = time.monotonic()
        assert sock.recv(1) == b""  # closed without an answer
        assert time.monotonic() - started < 2


def test_the_service_gets_what_is_left_of_the_deadline(start):
    port, service, _ = start(request_timeout_s=30)
    before = time.monotonic()
    assert request(port, "POST", "/v1/embeddings", {"input": "x"})[0] == 200
    assert before + 29 < service.calls[-1]["deadline"] < time.monotonic() + 30


# --- connection cap ------------------------------------------------------------------------------------

def test_connection_cap_answers_503_fast(start):
    port, service, httpd = start(max_connections=2)
    held = [socket.create_connection(("127.0.0.1", port), timeout=WAIT) for _ in range(2)]
    try:
        deadline = time.monotonic() + WAIT
        while httpd.active_connections() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        threads_before = threading.active_count()
        started = time.monotonic()
        status, headers, body, closed = raw(port, POST_HEAD + b"Content-Length: 14\r\n\r\n" + BODY)
        assert time.monotonic() - started < 1
        assert (status, error_code(body), closed) == (503, "server_busy", True)
        assert headers["Retry-After"] == "1"
        assert threading.active_count() <= threads_before
        assert service.calls == []
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + WAIT  # the held slots come back once their clients leave
    while httpd.active_connections() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert request(port, "POST", "/v1/embeddings", {"input": "x"})[0] == 200


def test_accept_out_of_fds_backs_off_and_logs_once(start, monkeypatch, caplog):
    _, _, httpd = start()

    def accept():
        raise OSError(errno.EMFILE, "Too many open files")

    fake = type("Sock", (), {"accept": staticmethod(accept)})()
    monkeypatch.setattr(httpd, "socket", fake)
    caplog.set_level(logging.WARNING, logger="builder.runtime.server")
    started = time.monotonic()
    for _ in range(3):
        with pytest.raises(OSError):
            httpd.get_request()
    assert time.monotonic() - started >= 0.25  # slept each time instead of spinning
    assert sum("out of file descriptors" in r.getMessage() for r in caplog.records) == 1


# --- client_gone ---------------------------------------------------------------------------------------

def test_client_gone_turns_true_when_the_client_closes(start):
    port, service, _ = start()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        body = b'{"input": "x", "sleep": 3, "watch": true}'
        sock.sendall(POST_HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + WAIT
        while not service.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.calls and service.calls[-1]["client_gone"]() is False
    assert service.gone_seen.wait(2)
    # Not answered; counted as the client's going.
    assert wait_for(lambda: service.metrics.done) and service.metrics.done[-1][0] == 499


# --- drain, watchdog, serve() --------------------------------------------------------------------------

def run_serve(service, options, **kwargs):
    """serve() on a thread; returns (thread, result dict, the server once ready)."""
    ready = threading.Event()
    box: dict = {}

    def target():
        box["code"] = srv.serve(service, "127.0.0.1", 0, options, install_signals=False,
                                ready=lambda s: (box.update(server=s), ready.set()), **kwargs)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    assert ready.wait(WAIT)
    return thread, box


def test_drain_finishes_in_flight_requests_and_refuses_new_ones(capsys):
    service = FakeService()
    thread, box = run_serve(service, HttpOptions(drain_timeout_s=5), watchdog_interval_s=0.05)
    httpd = box["server"]
    port = httpd.server_address[1]
    idle = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    result: dict = {}

    def slow():
        result["answer"] = request(port, "POST", "/v1/embeddings", {"input": "x", "sleep": 1.5})

    client = threading.Thread(target=slow)
    client.start()
    deadline = time.monotonic() + WAIT
    while not service.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    service.alive = True
    stop_asked = time.monotonic()
    srv_stop(box)

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return True
        return False

    assert wait_for(refused, 2)  # the listening socket is closed while the slow request still runs
    assert client.is_alive()
    assert idle.recv(1) == b""  # an idle keep-alive connection is closed at once
    idle.close()
    client.join(WAIT)
    status, headers, _ = result["answer"]
    assert status == 200 and headers["Connection"] == "close"
    thread.join(WAIT)
    assert box["code"] == 0 and service.closed
    assert time.monotonic() - stop_asked < 3
    lines = capsys.readouterr().out.splitlines()
    assert json.loads(lines[0])["event"] == "serving" and json.loads(lines[-1])["event"] == "stopped"


def srv_stop(box):
    """What the SIGTERM handler does (test_sigterm_drains_and_exits_zero sends the real signal)."""
    box["server"].stop_event.set()


def test_drain_is_bounded():
    service = FakeService()
    thread, box = run_serve(service, HttpOptions(drain_timeout_s=0.5))
    port = box["server"].server_address[1]
    client = threading.Thread(target=lambda: request(port, "POST", "/v1/embeddings", {"input": "x", "sleep": 4}),
                              daemon=True)
    client.start()
    deadline = time.monotonic() + WAIT
    while not service.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    srv_stop(box)
    thread.join(WAIT)
    assert not thread.is_alive() and box["code"] == 0
    assert time.monotonic() - started < 2


def test_watchdog_ends_serve_with_a_nonzero_code_when_the_engine_dies(caplog, capsys):
    service = FakeService()
    service.engine = type("Engine", (), {"exitcode": -9})()  # EngineProcess.exitcode of a killed worker
    caplog.set_level(logging.ERROR, logger="builder.runtime.server")
    thread, box = run_serve(service, HttpOptions(drain_timeout_s=1), watchdog_interval_s=0.05)
    port = box["server"].server_address[1]
    assert request(port, "GET", "/health")[0] == 200
    service.alive = False
    thread.join(WAIT)
    assert not thread.is_alive() and box["code"] == srv.EXIT_ENGINE_DIED != 0
    assert any("engine worker died (exit code -9)" in r.getMessage() for r in caplog.records)
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["exit_code"] == srv.EXIT_ENGINE_DIED


def test_sigterm_drains_and_exits_zero(tmp_path):
    """The real signal path, in a child process (signal handlers belong to the main thread)."""
    import subprocess
    import sys

    script = tmp_path / "serve.py"
    script.write_text(
        "import sys, time\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from tests.unit.test_server_http import FakeService\n"
        "from builder.runtime.server import HttpOptions, serve\n"
        "sys.exit(serve(FakeService(), '127.0.0.1', 0, HttpOptions(drain_timeout_s=2)))\n")
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, str(script), root], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=root)
    try:
        line = proc.stdout.readline()
        port = json.loads(line)["port"]
        assert request(port, "GET", "/health")[0] == 200
        proc.terminate()
        assert proc.wait(WAIT) == 0
        assert json.loads(proc.stdout.readline())["event"] == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)


# --- logs ----------------------------------------------------------------------------------------------

def test_json_access_log_line(start):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(srv.JsonFormatter())
    access = logging.getLogger("builder.runtime.server.access")
    access.addHandler(handler)
    old = access.level
    access.setLevel(logging.INFO)
    try:
        port, _, _ = start(api_key=KEY)
        request(port, "POST", "/v1/embeddings?x=1", {"input": "x"}, {"Authorization": f"Bearer {KEY}"})
        assert wait_for(lambda: stream.getvalue().endswith("\n"))  # written just after the response
    finally:
        access.removeHandler(handler)
        access.setLevel(old)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 1
    line = lines[0]
    assert {"time", "level", "logger", "message", "method", "path", "status", "duration_ms", "client"} <= set(line)
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
                 "MOPT_ENGINE_PROCESS", "MOPT_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    return cli, cli.build_parser().parse_args(["serve", "--engine-dir", "e", *argv])


def test_http_options_from_flags_and_env(monkeypatch, tmp_path):
    cli, a = serve_args(monkeypatch, ["--cors-origins", "https://a.example, https://b.example", "--metrics-auth",
                                      "--request-timeout", "5", "--log-format", "json"], {"MOPT_API_KEY": KEY})
    options = cli.http_options(a)
    assert options == HttpOptions(api_key=KEY, metrics_auth=True, cors_origins=("https://a.example",
                                                                                 "https://b.example"),
                                  request_timeout_s=5.0, json_logs=True)
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

    monkeypatch.setitem(cli.COMMANDS, "serve", lambda a: srv.EXIT_ENGINE_DIED)
    assert cli.main(["serve", "--engine-dir", "e"]) == srv.EXIT_ENGINE_DIED


def test_trtllm_refuses_a_key_it_cannot_enforce():
    from builder.runtime.backends import tensorrt_llm as tl
    from builder.runtime.errors import UsageError

    with pytest.raises(UsageError, match="no API key option"):
        tl.check_http_options(HttpOptions(api_key=KEY))
    tl.check_http_options(HttpOptions())
    tl.check_http_options(None)
