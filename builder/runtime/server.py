"""HTTP transport of the embeddings server on the stdlib (ThreadingHTTPServer): routes, auth, CORS,
strict framing, a whole-request deadline, a connection cap, SIGTERM drain and the engine watchdog.
The request logic lives in service.py; serve() returns the process's exit code."""
from __future__ import annotations

import errno
import hmac
import io
import json
import logging
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .errors import UsageError
from .service import ApiError, parse_inputs

try:  # optional (installed in the images): float vectors dominate responses; orjson writes them ~10x faster
    import orjson
except ImportError:
    orjson = None

log = logging.getLogger(__name__)
access_log = logging.getLogger(__name__ + ".access")

EXIT_ENGINE_DIED = 70  # EX_SOFTWARE: the engine worker is gone; a restart policy starts a fresh container
OPENAPI_PATH = Path(__file__).with_name("openapi.json")
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class HttpOptions:
    api_key: str | None = field(default=None, repr=False)  # None: no auth; repr=False: never in a log
    metrics_auth: bool = False  # /metrics open by default: scrapers rarely carry the key
    cors_origins: tuple[str, ...] = ()  # () no CORS headers; ("*",) any origin; else exact origins
    max_connections: int = 256  # beyond: 503 + Retry-After from the accept thread
    max_header_bytes: int = 16 * 1024  # request line + headers (431/414 beyond)
    request_timeout_s: float = 60.0  # whole request: headers and body read, then the service's work
    idle_timeout_s: float = 15.0  # a keep-alive connection with no request is closed after this
    # Docker's default stop timeout is 10 s and Kubernetes' terminationGracePeriodSeconds 30 s: the
    # drain must end before the SIGKILL, so the default fits under Docker's.
    drain_timeout_s: float = 8.0
    json_logs: bool = False

    def __post_init__(self) -> None:
        # Visible ASCII only: clients send header values as latin-1 (Python's http.client, requests) or
        # UTF-8 (curl), so a key outside ASCII matched one kind of client and not the other; a key
        # from a non-UTF-8 environment variable failed the start with a traceback.
        key = self.api_key
        if key is not None and not (key.isascii() and key.isprintable() and " " not in key):
            raise UsageError("the API key must be printable ASCII with no spaces (--api-key, --api-key-file "
                             "or their variables)")


def dumps(body) -> bytes:
    return orjson.dumps(body) if orjson is not None else json.dumps(body).encode()


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    return ApiError(status, message, param=param, code=code).body()


def _load_openapi() -> bytes:
    raw = OPENAPI_PATH.read_bytes()
    json.loads(raw)  # a broken document fails the start, not the first GET
    return raw


# path -> methods (besides OPTIONS, always allowed; HEAD wherever GET is)
ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/embeddings": ("POST",), "/embeddings": ("POST",), "/embed": ("POST",),
    "/v1/models": ("GET", "HEAD"), "/info": ("GET", "HEAD"), "/health": ("GET", "HEAD"),
    "/metrics": ("GET", "HEAD"), "/openapi.json": ("GET", "HEAD"),
}
EMBEDDING_ROUTES = ("/v1/embeddings", "/embeddings", "/embed")
# Bodies larger than this are parsed PARSE_CONCURRENCY at a time (Handler._read_json says why).
SMALL_BODY_BYTES = 64 * 1024
PARSE_CONCURRENCY = 1
MAX_EMPTY_LINES = 4  # empty lines ignored before a request line (RFC 9112 2.2)
OPEN_ROUTES = ("/health",)  # never need the key (container and load balancer health checks)


class _FramingError(Exception):
    """A request whose framing cannot be trusted: answered with status and the connection closed."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class _DeadlineReader(io.RawIOBase):
    """The socket as rfile's raw stream, each recv bounded by the handler's deadline, so the whole
    request (not each read) is bounded: a client sending a byte every few seconds is cut off."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.sock = handler.connection

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        h = self.handler
        left = h.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline")
        self.sock.settimeout(left)
        n = self.sock.recv_into(buffer)
        if h.waiting:  # the first bytes of a request: its whole-request deadline starts now
            h.waiting = False
            h.deadline = time.monotonic() + h.request_timeout
        return n


class _HeaderBudget:
    """rfile for the stdlib header parser: readline with a budget on the total header bytes, so 100
    header lines of 64 KiB each (the stdlib's own bounds) cannot be sent."""

    def __init__(self, rfile, budget: int):
        self.rfile, self.budget = rfile, budget

    def readline(self, limit: int = -1) -> bytes:
        line = self.rfile.readline(min(limit, self.budget + 1) if limit >= 0 else self.budget + 1)
        self.budget -= len(line)
        if self.budget < 0:
            raise _FramingError(431, "request headers are too large", "headers_too_large")
        end = -2 if line.endswith(b"\r\n") else -1 if line.endswith(b"\n") else len(line)
        if b"\r" in line[:end] or b"\0" in line:
            # The stdlib's parser splits header lines at a bare CR ("X: a\rContent-Length: 13" is two
            # headers to it, one to a proxy that keeps the CR): RFC 9112 2.2 says refuse.
            raise _FramingError(400, "a bare CR or a NUL in the request headers", "invalid_headers")
        if line[:1] in (b" ", b"\t"):
            # obs-fold (RFC 9112 5.2): the stdlib's parser joins the line to the header above, a proxy
            # may read it as a header of its own ("X: a\r\n Transfer-Encoding: chunked"): refused.
            raise _FramingError(400, "obsolete line folding in the request headers", "invalid_headers")
        return line


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # A subclass may set timeout: it then replaces options.request_timeout_s (the tests' short deadline).
    timeout = None
    service = None  # set on a subclass by make_server

    # --- connection set-up and the request loop ------------------------------------------------
    def setup(self):
        self.connection = self.request
        # Headers and body are two writes: with Nagle's algorithm on, the body waits for the client's
        # delayed ACK of the headers (40 ms on Linux) on every keep-alive response.
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # already reset by the peer: the first read ends the connection
            pass
        self.options: HttpOptions = self.server.options
        self.request_timeout = self.timeout if self.timeout is not None else self.options.request_timeout_s
        self.deadline, self.waiting = 0.0, True
        self.rfile = io.BufferedReader(_DeadlineReader(self), 64 * 1024)
        self.wfile = _SocketWriter(self.connection)
        self.busy = False  # a request is being read or answered (drain closes idle connections only)
        self.server.track(self, True)

    def finish(self):
        self.server.track(self, False)
        try:
            self.rfile.close()
        except OSError:
            pass

    def handle_one_request(self):
        self.command, self.requestline, self.request_version = None, "", "HTTP/1.1"
        self.headers, self.content_length, self.route = None, None, None
        self.keep_alive_10 = False
        self.started = time.monotonic()
        # Until a request's first byte the idle bound applies; _DeadlineReader starts the request's own.
        self.waiting, self.deadline = True, self.started + self.options.idle_timeout_s
        try:
            self.raw_requestline = self._read_request_line()
            if not self.raw_requestline:
                self.close_connection = True
                return
            self.busy = True
            if self.waiting:  # pipelined: the line came from the buffer, no read started the clock
                self.waiting, self.deadline = False, time.monotonic() + self.request_timeout
            if len(self.raw_requestline) > self.options.max_header_bytes:
                self.send_error(414, "request line is too long")
                return
            if len(self.raw_requestline.split()) < 3:
                # HTTP/0.9 ("GET /path") or an empty line: the stdlib would wait for headers first.
                self.send_error(400, "HTTP/0.9 and request lines without a version are not supported")
                return
            real_rfile, self.rfile = self.rfile, _HeaderBudget(self.rfile, self.options.max_header_bytes)
            try:
                parsed = self.parse_request()
            finally:
                self.rfile = real_rfile
            if not parsed:  # the stdlib has answered (through send_error)
                return
            if self.request_version == "HTTP/0.9":
                self.send_error(400, "HTTP/0.9 is not supported")
                return
            self.route = self.path.split("?", 1)[0]
            self._check_framing()
            self._dispatch()
        except _FramingError as err:
            self._send(err.status, error_body(err.status, err.message, err.code), close=True)
            if self.route in EMBEDDING_ROUTES:
                self.service.metrics.request_done(err.status, time.monotonic() - self.started)
        except TimeoutError:
            what = "body" if self.headers is not None else "request headers"
            self._send(408, error_body(408, f"{what} not received within {self.request_timeout:g}s",
                                       "request_timeout"), close=True)
        except ConnectionError:
            self.close_connection = True
        finally:
            self.busy = False
            if self.server.draining:
                self.close_connection = True

    def _read_request_line(self) -> bytes:
        """The request line; a few empty lines before it are skipped (RFC 9112 2.2: a client may send
        CRLF after a body). b"" when the peer left or idled out before a request: nobody to answer."""
        line = b""
        for _ in range(1 + MAX_EMPTY_LINES):
            try:
                line = self.rfile.readline(self.options.max_header_bytes + 1)
            except (TimeoutError, ConnectionError):
                if self.waiting:  # an idle keep-alive connection, or the peer left
                    return b""
                raise
            if line not in (b"\r\n", b"\n"):
                break
        return line

    def handle_expect_100(self):
        return True  # "100 Continue" is sent once auth and size passed, just before the body is read

    def _check_framing(self) -> None:
        """Refuse what could be read two ways (request smuggling behind a proxy)."""
        headers = self.headers
        # Connection is a list of options: "keep-alive, close" closes (the stdlib only knew "close").
        options = {t.strip().lower() for v in headers.get_all("Connection") or [] for t in v.split(",")}
        if "close" in options:
            self.close_connection = True
        # An HTTP/1.0 client keeps the connection only when the response says so.
        self.keep_alive_10 = self.request_version == "HTTP/1.0" and not self.close_connection
        if headers.defects:  # e.g. a line without a colon, which the parser would take as the body
            raise _FramingError(400, "malformed request headers", "invalid_headers")
        lengths = headers.get_all("Content-Length") or []
        encodings = headers.get_all("Transfer-Encoding") or []
        if encodings and lengths:
            raise _FramingError(400, "Content-Length and Transfer-Encoding together", "invalid_framing")
        if encodings:
            # Chunked bodies are refused rather than decoded: clients of an embeddings API send JSON
            # of known size, and one decoder less is one smuggling surface less.
            raise _FramingError(411, "Transfer-Encoding is not supported; send Content-Length",
                                "length_required")
        if len(lengths) > 1:
            raise _FramingError(400, "more than one Content-Length header", "invalid_content_length")
        self.content_length = None
        if lengths:
            value = lengths[0].strip(" \t")
            if not (value.isascii() and value.isdigit() and len(value) <= 18):
                message = ("Content-Length must not be negative" if value.startswith("-")
                           else "Content-Length must be a decimal number of bytes")
                raise _FramingError(400, message, "invalid_content_length")
            self.content_length = int(value)
            if self.content_length and self.command != "POST":
                self.close_connection = True  # a body no route reads: never parse it as the next request

    # --- dispatch ------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        path = self.route
        methods = ROUTES.get(path)
        if self.command == "OPTIONS":
            self._options(path, methods)
            return
        if not self._authorized(path):
            self._send(401, error_body(401, "missing or invalid API key (Authorization: Bearer <key>)",
                                       "invalid_api_key"),
                       headers={"WWW-Authenticate": "Bearer"}, close=self.command == "POST")
            return
        if methods is None:
            self._send(404, error_body(404, f"no route {self.command} {path}", "not_found"),
                       close=bool(self.content_length))
            return
        if self.command not in methods:
            self._send(405, error_body(405, f"method {self.command} not allowed on {path}", "method_not_allowed"),
                       headers={"Allow": _allow(methods)}, close=bool(self.content_length))
            return
        if self.command == "POST":
            self._post(path)
        else:
            self._get(path)

    def _authorized(self, path: str) -> bool:
        key = self.server.api_key_bytes
        if key is None or path in OPEN_ROUTES or (path == "/metrics" and not self.options.metrics_auth):
            return True
        values = self.headers.get_all("Authorization") or []
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(" ")
        # Header values are latin-1 decoded by the parser: encoding back gives the bytes sent.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1", "replace"), key)

    def _options(self, path: str, methods: tuple[str, ...] | None) -> None:
        if path == "*":
            allowed = "GET, HEAD, POST, OPTIONS"
        elif methods is None:
            self._send(404, error_body(404, f"no route OPTIONS {path}", "not_found"), close=bool(self.content_length))
            return
        else:
            allowed = _allow(methods)
        headers = {"Allow": allowed}
        if self.options.cors_origins and self.headers.get("Access-Control-Request-Method"):
            if self._cors_origin() is not None:  # a preflight from an allowed origin
                headers.update({"Access-Control-Allow-Methods": allowed,
                                "Access-Control-Allow-Headers": "Authorization, Content-Type",
                                "Access-Control-Max-Age": "600"})
        self._send(204, None, headers=headers)

    def _get(self, path: str) -> None:
        service = self.service
        try:
            if path == "/health":
                body = service.health()
            elif path == "/metrics":
                body = service.metrics.render()
                content_type = getattr(service.metrics, "CONTENT_TYPE", METRICS_CONTENT_TYPE)
                self._send(200, body, content_type)
                return
            elif path == "/v1/models":
                body = service.models()
            elif path == "/info":
                body = service.info()
            else:  # /openapi.json
                body = self.server.openapi
        except ApiError as err:
            self._send(err.status, err.body(), headers=getattr(err, "headers", None))
            return
        except Exception as exc:
            log.exception("GET %s failed", path)
            self._send(500, error_body(500, f"internal error: {type(exc).__name__}", "internal"))
            return
        self._send(200, body)

    def _post(self, path: str) -> None:
        status, tokens, inputs, body, headers = 200, 0, 0, None, None
        try:
            payload = self._read_json()
            deadline = self.deadline  # what is left of the whole-request time is the service's
            if path == "/embed":
                body, tokens = self.service.embed(payload, deadline=deadline, client_gone=self.client_gone)
                inputs = len(body)
            else:
                body, tokens = self.service.embeddings(payload, deadline=deadline, client_gone=self.client_gone)
                inputs = len(body["data"])
        except (_FramingError, TimeoutError, ConnectionError):  # answered (or not) by handle_one_request
            raise
        except ApiError as err:
            status, body, headers = err.status, err.body(), getattr(err, "headers", None)
        except Exception as exc:  # never drop the connection without an answer
            log.exception("embedding request failed")
            status, body = 500, error_body(500, f"internal error: {type(exc).__name__}", "internal")
        if status != 200 and self.client_gone():  # nobody to answer: the work was dropped
            self.close_connection = True
            self._access_log(499)
            self.service.metrics.request_done(499, time.monotonic() - self.started, tokens, inputs)
            return
        self._send(status, body, headers=headers)
        self.service.metrics.request_done(status, time.monotonic() - self.started, tokens, inputs)

    def _read_json(self):
        length = self.content_length
        if length is None:
            raise _FramingError(411, "Content-Length header required", "length_required")
        limit = self.service.limits.max_body_bytes
        if length > limit:
            raise _FramingError(413, f"body of {length} bytes exceeds {limit}", "body_too_large")
        if self.headers.get("Expect", "").lower() == "100-continue" and self.request_version >= "HTTP/1.1":
            self.send_response_only(100)
            self.end_headers()
        raw = self.rfile.read(length)
        if len(raw) < length:
            raise _FramingError(400, f"body has {len(raw)} bytes, Content-Length said {length}", "invalid_body")
        if len(raw) <= SMALL_BODY_BYTES:
            return self._parse(raw)
        # Parsed, a body takes up to ~20x its size ('[1],' x 1M: 4 MiB of JSON, ~50 MB of lists): many
        # large bodies parsed at once could take the container's memory. The parse holds the GIL, so
        # parsing them in turn costs no throughput; fields the route does not read are dropped at once.
        with self.server.parse_gate:
            payload = self._parse(raw)
            del raw
            # The shape check inside the gate too: a body with a million inputs is let go before the
            # next large body is parsed (the gate alone left ~4 parsed bodies alive at once).
            max_inputs = getattr(self.service.limits, "max_inputs", None)
            if max_inputs is not None and self.route in EMBEDDING_ROUTES:
                try:
                    parse_inputs(payload, max_inputs, "inputs" if self.route == "/embed" else "input")
                except ApiError as err:
                    payload = None
                    raise err.with_traceback(None) from None  # its frames would keep the payload alive
            return payload

    def _parse(self, raw: bytes):
        try:
            payload = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "body is nested too deeply", code="invalid_json") from None
        except ValueError as exc:  # e.g. an integer of more digits than int() converts
            raise ApiError(400, f"body is not valid JSON: {exc}", code="invalid_json") from None
        fields = (getattr(self.service, "REQUEST_FIELDS", None) or {}).get(self.route)
        if fields is not None and isinstance(payload, dict) and not payload.keys() <= fields:
            payload = {k: v for k, v in payload.items() if k in fields}  # ignored anyway; not kept till the end
        return payload

    def client_gone(self) -> bool:
        """True when the peer has closed its socket (for the service: drop queued work of a client that
        left). Readable with nothing to read is the peer's FIN; pipelined bytes mean it is still there."""
        sock = self.connection
        try:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
            if not poller.poll(0):
                return False
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):  # reset, or the socket is already closed
            return True

    # --- responses -----------------------------------------------------------------------------
    def _send(self, status: int, body, content_type: str = "application/json", headers: dict | None = None,
              close: bool = False) -> None:
        if body is None:
            raw = b""
        elif isinstance(body, bytes):
            raw = body
        elif isinstance(body, str):
            raw = body.encode()
        else:
            raw = dumps(body)
        # The last read may have left a short timeout on the socket: a response has its own bound.
        self.connection.settimeout(self.request_timeout)
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # always a status line
        self.send_response_only(status)
        self.send_header("Date", self.date_time_string())
        if status != 204:
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(raw)))
        if headers:
            for name, value in headers.items():
                self.send_header(name, value)
        if self.options.cors_origins:
            self._cors_headers()
        if close or self.server.draining:
            self.close_connection = True
        if self.close_connection:
            self.send_header("Connection", "close")
        elif self.keep_alive_10:
            self.send_header("Connection", "keep-alive")
        self.end_headers()
        if raw and self.command != "HEAD":
            self.wfile.write(raw)
        self._access_log(status)

    def _cors_origin(self) -> str | None:
        origin = self.headers.get("Origin") if self.headers is not None else None
        if origin is None:
            return None
        if "*" in self.options.cors_origins:
            return "*"
        return origin if origin in self.options.cors_origins else None

    def _cors_headers(self) -> None:
        allowed = self._cors_origin()
        if allowed is not None:
            self.send_header("Access-Control-Allow-Origin", allowed)
            self.send_header("Access-Control-Expose-Headers", "Retry-After")
        if "*" not in self.options.cors_origins:
            self.send_header("Vary", "Origin")  # the answer depends on Origin: caches must key on it

    def send_error(self, code, message=None, explain=None):
        """The stdlib's own errors (400 bad request line, 414, 431, 505) as OpenAI-format JSON."""
        text = message or self.responses.get(code, ("error",))[0]
        if explain and explain != text:
            text = f"{text}: {explain}"
        codes = {400: "bad_request", 414: "request_line_too_long", 431: "headers_too_large",
                 505: "http_version_not_supported"}
        self._send(code, error_body(code, text, codes.get(code, "bad_request")), close=True)

    def log_request(self, code="-", size="-"):
        pass  # the access log is written by _send, with the duration

    def log_message(self, fmt, *args):
        log.debug("%s - %s", self.address_string(), fmt % args)

    def _access_log(self, status: int) -> None:
        if access_log.isEnabledFor(logging.INFO):
            duration = round(1000 * (time.monotonic() - self.started), 2)
            path = self.route or ""
            access_log.info("%s %s %d %.2fms", self.command, path, status, duration,
                            extra={"method": self.command, "path": path, "status": status,
                                   "duration_ms": duration, "client": self.client_address[0]})


def _allow(methods: tuple[str, ...]) -> str:
    return ", ".join((*methods, "OPTIONS"))


class _SocketWriter(io.BufferedIOBase):
    """wfile: every write straight to the socket (sendall), as the stdlib's own _SocketWriter."""

    def __init__(self, sock):
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self._sock.sendall(b)
        return len(b)


class EmbeddingHTTPServer(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5: a burst of concurrent clients overflows it and
    # their connections are reset (seen with 16 clients on a loaded 2-core machine).
    request_queue_size = 1024
    daemon_threads = True  # serve() drains in-flight requests itself, within a bounded time
    block_on_close = False

    def __init__(self, address, handler, options: HttpOptions | None = None):
        self.options = options or HttpOptions()
        self.api_key_bytes = self.options.api_key.encode() if self.options.api_key else None
        self.openapi = _load_openapi()
        self.draining = False
        self.connections: dict[Handler, None] = {}
        self._lock = threading.Lock()
        self._active = 0  # accepted connections not yet closed (the cap counts these)
        self._fd_warned = 0.0
        self.parse_gate = threading.BoundedSemaphore(PARSE_CONCURRENCY)
        self.busy_503 = dumps(error_body(503, "too many connections; retry later", "server_busy"))
        super().__init__(address, handler)

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return  # the client went away mid-response: nothing to report
        log.exception("connection from %s failed", client_address[0])

    def track(self, handler: Handler, add: bool) -> None:
        with self._lock:
            if add:
                self.connections[handler] = None
            else:
                self.connections.pop(handler, None)

    def get_request(self):
        try:
            return super().get_request()
        except OSError as exc:
            # Out of file descriptors: the listening socket stays readable, so retrying at once
            # spins a core. Back off and say so once per interval.
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                now = time.monotonic()
                if now - self._fd_warned > 10:
                    self._fd_warned = now
                    log.warning("accept failed (%s): out of file descriptors or memory; backing off",
                                errno.errorcode.get(exc.errno, exc.errno))
                time.sleep(0.1)
            raise

    def process_request(self, request, client_address):
        with self._lock:
            full = self._active >= self.options.max_connections
            if not full:
                self._active += 1
        if full:  # answered here, on the accept thread, with no handler thread started
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            with self._lock:
                self._active -= 1
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._active -= 1

    def _refuse(self, request) -> None:
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(self.busy_503)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            request.setblocking(False)  # the accept thread never waits on one client
            request.send(head + self.busy_503)
            # Read what the client has sent already: closing with unread data resets the connection
            # and the client could lose the 503.
            request.recv(65536)
        except OSError:
            pass
        self.shutdown_request(request)

    def active_connections(self) -> int:
        with self._lock:
            return self._active

    def close_idle(self) -> None:
        """Close keep-alive connections waiting for a request (drain: in-flight ones close after
        their response)."""
        with self._lock:
            idle = [h for h in self.connections if not h.busy]
        for handler in idle:
            try:
                handler.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def make_server(service, host: str, port: int, options: HttpOptions | None = None) -> EmbeddingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"service": service})
    return EmbeddingHTTPServer((host, port), handler, options or HttpOptions())


def drain(server: EmbeddingHTTPServer, timeout: float) -> bool:
    """Stop accepting, close idle connections, wait for in-flight requests up to timeout; True when
    every connection ended in time."""
    server.draining = True
    server.socket.close()  # new connections are refused from here on
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        server.close_idle()
        if server.active_connections() == 0:
            return True
        time.sleep(0.05)
    return server.active_connections() == 0


def _engine_exit(service) -> str:
    code = getattr(getattr(service, "engine", None), "exitcode", None)  # EngineProcess; None in-process
    return f"exit code {code}" if code is not None else "exit code unknown"


def serve(service, host: str, port: int, options: HttpOptions | None = None, *,
          watchdog_interval_s: float = 0.5, install_signals: bool = True, ready=None) -> int:
    """Serve until SIGTERM/SIGINT (exit 0 after the drain) or until the engine worker dies (exit
    EXIT_ENGINE_DIED, so `docker --restart` and Kubernetes restart the container)."""
    options = options or HttpOptions()
    server = make_server(service, host, port, options)
    stop = threading.Event()
    server.stop_event = stop  # set() asks for the same drain as SIGTERM
    why: dict = {}

    def _signal(signum, _frame):
        why.setdefault("signal", signal.Signals(signum).name)
        stop.set()

    def _watchdog():
        while not stop.wait(watchdog_interval_s):
            try:
                alive = service.engine_alive()
            except Exception:  # noqa: BLE001  (a check that fails counts as a dead engine)
                log.exception("engine_alive failed")
                alive = False
            if not alive:
                why.setdefault("engine", _engine_exit(service))
                stop.set()

    if install_signals:
        signal.signal(signal.SIGTERM, _signal)
        signal.signal(signal.SIGINT, _signal)
    threads = [threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="mopt-accept",
                                daemon=True),
               threading.Thread(target=_watchdog, name="mopt-watchdog", daemon=True)]
    for t in threads:
        t.start()
    print(json.dumps({"event": "serving", "host": host, "port": server.server_address[1],
                      "model": service.model_name}), flush=True)
    if ready is not None:
        ready(server)
    try:
        while not stop.wait(0.5):  # a timed wait: signal handlers run on this thread in between
            pass
    except KeyboardInterrupt:
        why.setdefault("signal", "SIGINT")
    code = 0
    if "engine" in why:
        log.error("the engine worker died (%s): shutting down with exit code %d", why["engine"], EXIT_ENGINE_DIED)
        code = EXIT_ENGINE_DIED
    else:
        log.info("%s: draining (up to %gs)", why.get("signal", "stop"), options.drain_timeout_s)
    server.shutdown()  # the accept loop ends
    drained = drain(server, options.drain_timeout_s)
    if not drained:
        log.warning("drain timeout: %d connections still open", server.active_connections())
    server.server_close()
    try:
        service.close()
    except Exception:  # noqa: BLE001  (the exit code is what matters now)
        log.exception("closing the service failed")
    print(json.dumps({"event": "stopped", "exit_code": code, "reason": why.get("engine") or why.get("signal")}),
          flush=True)
    return code


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (+ the access-log fields)."""

    FIELDS = ("method", "path", "status", "duration_ms", "client")

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        out = {"time": when,
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for name in self.FIELDS:
            if name in record.__dict__:
                out[name] = record.__dict__[name]
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)



def configure_logging(json_logs: bool, level: str | int = "WARNING") -> None:
    """The root logger on stderr: JSON lines or the text format (stdout keeps the serving/stopped events)."""
    handler = logging.StreamHandler(sys.stderr)
    if json_logs:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
