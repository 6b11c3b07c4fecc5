"""HTTP transport of the embeddings server on the stdlib (ThreadingHTTPServer): routes, framing,
graceful SIGTERM shutdown. The request logic lives in service.py."""
from __future__ import annotations

import json
import logging
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .service import ApiError, EmbeddingService

try:  # optional (installed in the images): float vectors dominate responses; orjson writes them ~10x faster
    import orjson
except ImportError:
    orjson = None

log = logging.getLogger(__name__)


def dumps(body) -> bytes:
    return orjson.dumps(body) if orjson is not None else json.dumps(body).encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 60  # seconds a client may take to send a request (StreamRequestHandler sets it on the socket)
    service: EmbeddingService  # set on a subclass by make_server

    def log_message(self, fmt, *args):  # route access logs through logging, not stderr
        log.debug("%s - %s", self.address_string(), fmt % args)

    def _send(self, status: int, body, content_type="application/json", close=False) -> None:
        raw = body.encode() if isinstance(body, str) else dumps(body)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path == "/health":
            try:
                self._send(200, self.service.health())
            except ApiError as err:
                self._send(err.status, err.body())
        elif path == "/metrics":
            self._send(200, self.service.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._send(404, ApiError(404, f"no route GET {path}", code="not_found").body())

    def do_POST(self):
        started = time.monotonic()
        path = self.path.split("?", 1)[0]
        status, tokens, inputs, close = 200, 0, 0, False
        payload = None
        try:
            if path not in ("/v1/embeddings", "/embeddings"):
                raise ApiError(404, f"no route POST {path}", code="not_found")
            payload = self._read_json()
            body, tokens = self.service.embeddings(payload)
            inputs = len(body["data"])
        except ApiError as err:
            status, body = err.status, err.body()
            close = payload is None  # the body may be unread or cut short: drop the connection
        except Exception as exc:  # never drop the connection without an answer
            log.exception("embedding request failed")
            status, body = 500, ApiError(500, f"internal error: {type(exc).__name__}", code="internal").body()
        self._send(status, body, close=close)
        if path in ("/v1/embeddings", "/embeddings"):
            self.service.metrics.request_done(status, time.monotonic() - started, tokens, inputs)

    def _read_json(self):
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(411, "Content-Length header required", code="length_required") from None
        if length < 0:
            raise ApiError(400, "Content-Length must not be negative", code="invalid_content_length")
        if length > self.service.limits.max_body_bytes:
            raise ApiError(413, f"body of {length} bytes exceeds {self.service.limits.max_body_bytes}",
                           code="body_too_large")
        try:
            raw = self.rfile.read(length)
        except TimeoutError:  # a client that announced more than it sent must not hold a thread forever
            raise ApiError(408, f"body not received within {self.timeout}s", code="request_timeout") from None
        if len(raw) < length:
            raise ApiError(400, f"body has {len(raw)} bytes, Content-Length said {length}", code="invalid_body")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "body is nested too deeply", code="invalid_json") from None


class EmbeddingHTTPServer(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5: a burst of concurrent clients overflows it and
    # their connections are reset (seen with 16 clients on a loaded 2-core machine).
    request_queue_size = 1024
    daemon_threads = False  # let in-flight requests finish on shutdown
    block_on_close = True


def make_server(service: EmbeddingService, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"service": service})
    return EmbeddingHTTPServer((host, port), handler)


def serve(service: EmbeddingService, host: str, port: int) -> None:
    server = make_server(service, host, port)

    def _stop(signum, _frame):
        log.info("signal %s: shutting down", signum)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(json.dumps({"event": "serving", "host": host, "port": server.server_address[1],
                      "model": service.model_name}), flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        service.close()
        print(json.dumps({"event": "stopped"}), flush=True)
