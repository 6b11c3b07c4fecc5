"""OpenAI-compatible embeddings server on the stdlib (ThreadingHTTPServer), with batching,
bounded inputs, Prometheus metrics and graceful SIGTERM shutdown."""
from __future__ import annotations

import base64
import json
import logging
import signal
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .batcher import Batcher
from .metrics import Metrics

try:  # optional (installed in the images): float vectors dominate responses; orjson writes them ~10x faster
    import orjson
except ImportError:
    orjson = None

log = logging.getLogger(__name__)


def dumps(body) -> bytes:
    return orjson.dumps(body) if orjson is not None else json.dumps(body).encode()


@dataclass(frozen=True)
class ServerLimits:
    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_inputs: int = 256
    max_input_tokens: int | None = None  # None: the engine's max_seq_len
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 120.0


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def parse_inputs(payload, max_inputs: int) -> tuple[list, bool]:
    """Return (inputs, are_token_ids). Accepts a string, a list of strings, a list of token ids,
    or a list of token-id lists, as OpenAI does."""
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    if "input" not in payload:
        raise ApiError(400, "'input' is required", param="input", code="missing_input")
    raw = payload["input"]
    if isinstance(raw, str):
        raw = [raw]
    elif isinstance(raw, list) and raw and all(type(x) is int for x in raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'input' must be a non-empty string or a non-empty list", param="input",
                       code="invalid_input")
    if len(raw) > max_inputs:
        raise ApiError(400, f"too many inputs: {len(raw)} > {max_inputs}", param="input",
                       code="too_many_inputs")
    if all(isinstance(x, str) for x in raw):
        if any(not x for x in raw):
            raise ApiError(400, "'input' contains an empty string", param="input", code="empty_input")
        return raw, False
    if all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in raw):
        return raw, True
    raise ApiError(400, "'input' must be strings or lists of token ids, not a mix or other types",
                   param="input", code="invalid_input")


class EmbeddingService:
    """Request logic, independent of HTTP so tests can call it directly."""

    def __init__(self, engine, limits: ServerLimits, metrics: Metrics | None = None):
        self.engine = engine
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.max_tokens = min(limits.max_input_tokens or engine.params.max_seq_len, engine.params.max_seq_len)
        self.model_name = engine.params.model_name or "mopt-embedding"
        self.batcher = Batcher(engine.embed_ids, limits.max_batch, limits.max_wait_ms, self.metrics)

    def health(self) -> dict:
        alive = getattr(self.engine, "alive", None)
        if alive is not None and not alive():
            raise ApiError(503, "the engine process has exited", code="engine_down")
        info, p = self.engine.info, self.engine.params
        return {"status": "ok", "model": self.model_name, "backend": info["backend"],
                "device": info["device"], "target_sm": info["target_sm"], "torch": info["torch"],
                "engine_sha256": info["engine_sha256"], "embedding_dim": self.engine.dim,
                "max_batch": p.max_batch, "max_seq_len": p.max_seq_len, "max_input_tokens": self.max_tokens,
                "pooling": p.pooling, "normalize": p.normalize, "image": info.get("image")}

    def embeddings(self, payload) -> tuple[dict, int]:
        inputs, are_ids = parse_inputs(payload, self.limits.max_inputs)
        fmt = payload.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise ApiError(400, "encoding_format must be 'float' or 'base64'", param="encoding_format",
                           code="invalid_encoding_format")
        dims = payload.get("dimensions")
        if dims is not None and dims != self.engine.dim:
            raise ApiError(400, f"this model only produces {self.engine.dim} dimensions",
                           param="dimensions", code="invalid_dimensions")
        input_type = payload.get("input_type", "document")  # extension: "query" adds the instruction
        if input_type not in ("query", "document"):
            raise ApiError(400, "input_type must be 'query' or 'document'", param="input_type",
                           code="invalid_input_type")
        enc = self.engine.encoder
        if are_ids:
            vocab = enc.vocab_size
            if any(t < 0 or t >= vocab for seq in inputs for t in seq):
                raise ApiError(400, f"token ids must be in 0..{vocab - 1}", param="input",
                               code="invalid_token_id")
            seqs = inputs
        else:
            texts = [enc.format_query(t) for t in inputs] if input_type == "query" else inputs
            try:
                seqs = enc.encode(texts)
            except (UnicodeError, ValueError, TypeError) as exc:  # e.g. a lone surrogate in the text
                raise ApiError(400, f"'input' cannot be tokenized: {type(exc).__name__}", param="input",
                               code="invalid_input") from None
        for i, s in enumerate(seqs):
            if len(s) > self.max_tokens:
                raise ApiError(400, f"input {i} has {len(s)} tokens, more than the maximum {self.max_tokens}",
                               param="input", code="context_length_exceeded")
        try:
            vectors = self.batcher.submit(seqs).result(timeout=self.limits.request_timeout_s)
        except TimeoutError:
            raise ApiError(503, "timed out waiting for the engine", code="timeout") from None
        tokens = sum(len(s) for s in seqs)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, fmt)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, tokens

    def close(self) -> None:
        self.batcher.close()
        close_engine = getattr(self.engine, "close", None)
        if close_engine is not None:
            close_engine()


def _encode(vec: list[float], fmt: str):
    if fmt == "base64":  # OpenAI's base64: little-endian float32
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    return vec


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
