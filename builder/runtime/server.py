"""HTTP transport of the embeddings server: a plain ASGI app on uvicorn (httptools; uvloop where
installed), with the connection guards of protocol.py. Routes, auth, CORS, strict input, admission
before work, the drain on SIGTERM and the engine watchdog live here; the request logic in service.py,
the scheduling in batcher.py. serve() returns the process's exit code.

Why no framework: the app has eight routes and must control exactly when a body is read (after the
admission checks), so Starlette's request object would add a dependency and hide that moment.

A POST, in order: Host and target rules (protocol.py and here), route, method, API key, Content-Type
(application/json only: a cross-site "simple" POST cannot send it), Content-Encoding (identity only),
Content-Length (411 without, 413 past --max-body-bytes), then admission: the bytes of every body in
flight are held under --max-inflight-bytes, reserved from Content-Length before the body is read
(beyond: 503 + Retry-After, the body never read). Then the body is read under its deadline, parsed as
strict JSON (UTF-8, no duplicate keys, no NaN/Infinity), checked and tokenized (in a bounded thread
pool past --inline-body-bytes, so a large request never holds the event loop), queued under the token
budget (service.submit, 503 + Retry-After beyond) and awaited with the request's deadline while the
client is watched: a client that leaves has its work dropped before the engine."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import uvicorn

from .batcher import Dropped
from .errors import UsageError
from .httpinput import Refusal, check_entity, check_host, error_body, parse_json
from .metrics import Metrics
from .protocol import GuardedProtocol, ProtocolLimits
from .service import ApiError
from .tokenbatch import TokenBatches

try:  # optional (installed in the images): float vectors dominate responses; orjson writes them ~10x faster
    import orjson
except ImportError:
    orjson = None

log = logging.getLogger(__name__)
access_log = logging.getLogger(__name__ + ".access")

EXIT_ENGINE_DIED = 70  # EX_SOFTWARE: the engine worker is gone; a restart policy starts a fresh container
EXIT_ENGINE_STALLED = 71  # the engine worker stopped answering (heartbeat); the same restart is the cure
OPENAPI_PATH = Path(__file__).with_name("openapi.json")
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Bodies up to this size are tokenized in threads of their own (as many as --tokenizer-threads), apart
# from the larger ones: a normal request never waits behind a 4 MiB body's tokenizing.
SMALL_BODY_BYTES = 16 * 1024
SHUTDOWN_MESSAGE = "the server is shutting down; retry on another replica"
# After the drain every request has its answer: the batcher and the engine worker get this long each to
# stop (a worker still computing a call nobody waits for is then killed), so the process exits within
# --drain-timeout + about 1.5 s: under Docker's 10 s with the default 8 s drain.
CLOSE_AFTER_DRAIN_S = 0.5
# The drain answers queued work with 503 this long before its end, keeping room for the engine call
# under way (at least DRAIN_MARGIN_S, and twice the longest call seen, up to half the drain).
DRAIN_MARGIN_S = 1.0


@dataclass(frozen=True)
class HttpOptions:
    api_key: str | None = field(default=None, repr=False)  # None: no auth; repr=False: never in a log
    metrics_auth: bool = False  # /metrics open by default: scrapers rarely carry the key
    cors_origins: tuple[str, ...] = ()  # () no CORS headers; ("*",) any origin; else exact origins
    # Open connections; past it the longest-idle one is closed to make room (protocol.py), and only when
    # every one has a request in progress is a new one answered 503.
    max_connections: int = 2048
    max_header_bytes: int = 16 * 1024  # request line + headers (431 beyond)
    request_timeout_s: float = 60.0  # a request from its headers' end: reading its body, queueing, computing
    # From a connection's start (or a keep-alive request's first byte) to the end of its headers.
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 15.0  # a keep-alive connection with no request is closed after this
    # Docker's default stop timeout is 10 s and Kubernetes' terminationGracePeriodSeconds 30 s: the
    # drain must end before the SIGKILL, so the default fits under Docker's.
    drain_timeout_s: float = 8.0
    # Bytes of request bodies in flight, all requests together (reserved from Content-Length before the
    # body is read); a body alone may always be up to the service's max_body_bytes.
    max_inflight_bytes: int = 64 * 1024 * 1024
    tokenizer_threads: int = 2  # the pool that parses and tokenizes requests past inline_body_bytes
    # Bodies up to this size are parsed and tokenized on the event loop: no handover to a thread and back,
    # and a normal request is answered even while the tokenizer threads are busy with large bodies. 0:
    # every body in the threads, where the fast tokenizer runs without the GIL while the loop serves HTTP:
    # more throughput with many small clients on the H200, but with one pool for every body a normal
    # client waited 3.4-3.7 s under tokenizer amplification (docs/server.md has both measured).
    inline_body_bytes: int = 16 * 1024
    json_logs: bool = False

    def __post_init__(self) -> None:
        # Visible ASCII only: clients send header values as latin-1 (Python's http.client, requests) or
        # UTF-8 (curl), so a key outside ASCII matched one kind of client and not the other; a key
        # from a non-UTF-8 environment variable failed the start with a traceback.
        key = self.api_key
        if key is not None and not (key.isascii() and key.isprintable() and " " not in key):
            raise UsageError("the API key must be printable ASCII with no spaces (--api-key, --api-key-file "
                             "or their variables)")
        if self.max_connections < 1 or self.max_header_bytes < 1024 or self.tokenizer_threads < 1:
            raise UsageError("--max-connections and --tokenizer-threads must be >= 1, --max-header-bytes >= 1024")
        if min(self.request_timeout_s, self.header_timeout_s, self.idle_timeout_s, self.drain_timeout_s) <= 0:
            raise UsageError("--request-timeout, --header-timeout, --idle-timeout and --drain-timeout must be > 0")
        if self.inline_body_bytes < 0:
            raise UsageError("--inline-body-bytes must be >= 0")
        if self.max_inflight_bytes < 1:
            raise UsageError("--max-inflight-bytes must be >= 1")


def dumps(body) -> bytes:
    """JSON bytes; vectors may be float32 rows (numpy), written as the shortest text that reads back as
    the same float32, as text-embeddings-inference and OpenAI write them."""
    if orjson is not None:
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(body, default=_plain).encode()


def _plain(value):
    if hasattr(value, "tolist"):  # a numpy row without orjson
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _load_openapi() -> bytes:
    raw = OPENAPI_PATH.read_bytes()
    json.loads(raw)  # a broken document fails the start, not the first GET
    return raw


# path -> methods (besides OPTIONS, always allowed; HEAD wherever GET is)
ROUTES: dict[str, tuple[str, ...]] = {
    # "/" is TEI's route for the model's own task (huggingface_hub's InferenceClient posts there)
    "/v1/embeddings": ("POST",), "/embeddings": ("POST",), "/embed": ("POST",), "/": ("POST",),
    "/tokenize": ("POST",), "/decode": ("POST",),  # TEI's, with no engine call
    "/v1/models": ("GET", "HEAD"), "/info": ("GET", "HEAD"), "/health": ("GET", "HEAD"),
    "/ready": ("GET", "HEAD"), "/metrics": ("GET", "HEAD"), "/openapi.json": ("GET", "HEAD"),
}
EMBEDDING_ROUTES = ("/v1/embeddings", "/embeddings", "/embed", "/")
POST_ROUTES = (*EMBEDDING_ROUTES, "/tokenize", "/decode")  # counted in the request metrics by route
OPEN_ROUTES = ("/health", "/ready")  # never need the key (container, orchestrator and load balancer probes)
class Request:
    """What the app reads of an ASGI scope."""

    __slots__ = ("scope", "method", "path", "version", "headers", "started", "gone", "client", "transport",
                 "reserved")

    def __init__(self, scope):
        self.scope = scope
        self.method = scope["method"]
        self.path = scope["path"]
        self.version = scope.get("http_version", "1.1")
        headers: dict[bytes, list[bytes]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, []).append(value)
        self.headers = headers
        self.started = time.monotonic()
        self.gone = False  # the client is known to have left
        self.reserved = 0  # bytes it holds of --max-inflight-bytes (its body, then its answer), until answered
        self.transport = scope.get("mopt.transport")  # protocol.py puts the connection's transport here
        client = scope.get("client")
        self.client = client[0] if client else "-"

    def header(self, name: bytes) -> str | None:
        values = self.headers.get(name)
        return values[0].decode("latin-1") if values else None

    def client_gone(self) -> bool:
        """Whether the client closed its connection (called by the batcher's thread before each call)."""
        return self.gone or (self.transport is not None and self.transport.is_closing())


class Loading:
    """The service while the engine loads (serve(load=...)): the process is alive (/health 200,
    "loading"), not ready (/ready 503), and takes no work (503 + Retry-After); metrics are served."""

    batcher = None
    engine = None
    model_name = None

    def __init__(self, metrics=None):
        self.metrics = metrics if metrics is not None else Metrics()

    def health(self) -> dict:
        return {"status": "loading"}

    def engine_alive(self) -> bool:
        return True  # a worker that dies while loading fails the load itself

    def engine_stalled(self) -> None:
        return None

    def close(self, timeout: float = 10.0) -> None:
        pass


LOADING_ROUTES = ("/ready", "/v1/models", "/info")  # GET routes that need the engine
LOADING_RETRY_S = 2


class App:
    """The ASGI application: one per server."""

    def __init__(self, service, options: HttpOptions):
        self.service = service
        self.options = options
        self.key = options.api_key.encode() if options.api_key else None
        self.openapi = _load_openapi()
        self.pool = ThreadPoolExecutor(options.tokenizer_threads, thread_name_prefix="mopt-tokenize")
        self.small_pool = ThreadPoolExecutor(options.tokenizer_threads, thread_name_prefix="mopt-tokenize-small")
        self.token_batches = TokenBatches()  # the texts of small requests (tokenbatch.py says why)
        self.inflight_bytes = 0  # reserved body bytes of requests in flight (touched on the loop only)
        self.draining = False  # SIGTERM came: new requests 503, responses close their connection
        self.cut = False  # the drain's cut-off passed: nothing more is queued

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        req = Request(scope)
        try:
            await self._answer(req, receive, send)
        finally:
            self.inflight_bytes -= req.reserved  # the body and the answer are written: their bytes are free

    async def _answer(self, req: Request, receive, send) -> None:
        try:
            status, body, ctype, headers, close, counts = await self.handle(req, receive)
        except Refusal as ref:
            status, body, ctype, headers, close, counts = ref.status, ref.body, None, ref.headers, ref.close, None
        except asyncio.CancelledError:
            if not self.draining:
                raise
            # The drain's time ran out with this request still at the engine: uvicorn cancels it and would
            # answer 500 with a traceback in the log. It is a shutdown, and answered as one.
            status, body, ctype, headers, close, counts = (
                503, error_body(503, SHUTDOWN_MESSAGE, "shutting_down"), None,
                {"Retry-After": "1", "Connection": "close"}, True, None)
        if status == 499:  # the client left: nobody to answer
            self._done(req, status, counts)
            return
        await self._send(req, send, status, body, ctype, headers, close)
        self._done(req, status, counts)

    # --- routing ------------------------------------------------------------------------------------
    async def handle(self, req: Request, receive):
        check_host(req.version, req.headers)
        path, method = req.path, req.method
        methods = ROUTES.get(path)
        has_body = self._has_body(req)
        if method == "OPTIONS":
            return self._options(req, path, methods) + (None,)
        if not self._authorized(req):
            raise Refusal(401, "missing or invalid API key (Authorization: Bearer <key>)", "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"}, close=has_body)
        if methods is None:
            raise Refusal(404, f"no route {method} {path[:200]}", "not_found", close=has_body)
        if method not in methods:
            raise Refusal(405, f"method {method} not allowed on {path}", "method_not_allowed",
                           {"Allow": _allow(methods)}, close=has_body)
        if isinstance(self.service, Loading) and (method == "POST" or path in LOADING_ROUTES):
            raise Refusal(503, "the engine is loading", "loading", {"Retry-After": str(LOADING_RETRY_S)},
                          close=has_body)
        if method == "POST":
            return await self._post(req, receive)
        status, body, ctype, headers = self._get(path)
        return status, body, ctype, headers, has_body, None

    @staticmethod
    def _has_body(req: Request) -> bool:
        length = req.header(b"content-length")
        return bool(req.headers.get(b"transfer-encoding")) or (length is not None and length.strip() != "0")

    def _authorized(self, req: Request) -> bool:
        if self.key is None or req.path in OPEN_ROUTES or (req.path == "/metrics" and not self.options.metrics_auth):
            return True
        values = req.headers.get(b"authorization", [])
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    def _options(self, req: Request, path: str, methods):
        if path == "*":
            allowed = "GET, HEAD, POST, OPTIONS"
        elif methods is None:
            raise Refusal(404, f"no route OPTIONS {path[:200]}", "not_found", close=self._has_body(req))
        else:
            allowed = _allow(methods)
        headers = {"Allow": allowed}
        if self.options.cors_origins and req.header(b"access-control-request-method"):
            if self._cors_origin(req) is not None:  # a preflight from an allowed origin
                headers.update({"Access-Control-Allow-Methods": allowed,
                                "Access-Control-Allow-Headers": "Authorization, Content-Type",
                                "Access-Control-Max-Age": "600"})
        return 204, None, None, headers, self._has_body(req)

    def _get(self, path: str):
        service = self.service
        try:
            if path == "/health":
                return 200, service.health(), None, None
            if path == "/ready":
                if self.draining:
                    raise ApiError(503, "draining: the server is shutting down", code="draining")
                service.health()  # a dead or stalled engine is not ready either
                return 200, {"status": "ready"}, None, None
            if path == "/metrics":
                return 200, service.metrics.render(), getattr(service.metrics, "CONTENT_TYPE",
                                                              METRICS_CONTENT_TYPE), None
            if path == "/v1/models":
                return 200, service.models(), None, None
            if path == "/info":  # the transport's own limits, under TEI's names
                return 200, {**service.info(), "max_concurrent_requests": self.options.max_connections,
                             "tokenization_workers": self.options.tokenizer_threads}, None, None
            return 200, self.openapi, None, None
        except ApiError as err:
            return err.status, err.body(), None, err.headers
        except Exception as exc:  # noqa: BLE001
            log.exception("GET %s failed", path)
            return 500, error_body(500, f"internal error: {type(exc).__name__}", "internal"), None, None

    # --- POST ---------------------------------------------------------------------------------------
    async def _post(self, req: Request, receive):
        length = check_entity(req.headers, self.service.limits.max_body_bytes)
        if self.draining:
            raise Refusal(503, SHUTDOWN_MESSAGE, "shutting_down",
                           {"Retry-After": "1"}, close=True)
        if self.inflight_bytes and self.inflight_bytes + length > self.options.max_inflight_bytes:
            self.service.metrics.request_dropped("busy")
            raise Refusal(503, "the server is busy (request bodies in flight at their limit); retry shortly",
                           "server_busy", {"Retry-After": "1"}, close=True)
        self._reserve(req, length)
        return await self._embed(req, receive, length)

    def _reserve(self, req: Request, size: int) -> None:
        self.inflight_bytes += size
        req.reserved += size

    async def _embed(self, req: Request, receive, length: int):
        deadline = req.started + self.options.request_timeout_s
        raw = await self._read_body(receive, length, deadline)
        service, route = self.service, req.path
        try:
            if length <= self.options.inline_body_bytes:
                payload = _payload(service, route, raw)
                texts = service.texts_to_tokenize(route, payload)
                known = await self.token_batches.ids(service.engine.encoder, texts) if texts else None
                work = service.prepare(route, payload, known)
            else:
                pool = self.small_pool if length <= SMALL_BODY_BYTES else self.pool
                work = await asyncio.get_running_loop().run_in_executor(pool, _prepare, service, route, raw)
            del raw
            self._admit_answer(req, work)
            vectors = await self._compute(req, work, deadline) if work.seqs else None
            body = work.finish(vectors)
        except ApiError as err:
            return err.status, err.body(), None, err.headers, "Connection" in err.headers, None
        except Exception as exc:  # noqa: BLE001  (never leave a request without an answer)
            log.exception("embedding request failed")
            return 500, error_body(500, f"internal error: {type(exc).__name__}", "internal"), None, None, False, None
        return 200, body, None, None, False, (work.tokens, len(work.seqs))

    def _admit_answer(self, req: Request, work) -> None:
        """Reserve the answer's bytes (one input's vector as JSON text and as float32, times the inputs)
        under --max-inflight-bytes before the work is queued: 2,048 inputs of a 4,096-wide model answer
        about 170 MB. Beyond the budget, 503 at once; a request alone is always taken."""
        size = self.service.answer_bytes(work)
        if req.reserved < self.inflight_bytes and self.inflight_bytes + size > self.options.max_inflight_bytes:
            self.service.metrics.request_dropped("busy")
            raise ApiError(503, "the server is busy (answers in flight at their limit); retry shortly",
                           code="server_busy", headers={"Retry-After": "1"})
        self._reserve(req, size)

    async def _read_body(self, receive, length: int, deadline: float) -> bytes:
        chunks = bytearray()
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise Refusal(499, "the client closed the connection", "client_closed_request",
                                       close=True)
                    chunks += message.get("body", b"")
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise Refusal(408, f"body not received within {self.options.request_timeout_s:g}s",
                           "request_timeout", close=True) from None
        if len(chunks) != length:  # the parser frames by Content-Length; a mismatch means a broken peer
            raise Refusal(400, f"body has {len(chunks)} bytes, Content-Length said {length}", "invalid_body",
                           close=True)
        return bytes(chunks)

    async def _compute(self, req: Request, work, deadline: float):
        """Queue the work and wait for it until its deadline. A client that leaves is seen by the batcher
        (Request.client_gone) before each engine call: its work is dropped and this answers 499."""
        if self.cut:
            raise self.service.failure(Dropped("shutdown"))
        fut = self.service.submit(work.seqs, deadline, req.client_gone)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await asyncio.wrap_future(fut)  # cancelled at the deadline: so is fut (dropped)
        except TimeoutError:
            raise self.service.failure(Dropped("timeout")) from None
        except Exception as exc:  # noqa: BLE001  (dropped, or the engine failed this batch)
            error = self.service.failure(exc)
            if error.status == 499:
                req.gone = True
            raise error from None

    # --- responses ----------------------------------------------------------------------------------
    async def _send(self, req: Request, send, status: int, body, ctype, headers, close: bool) -> None:
        if body is None:
            raw = b""
        elif isinstance(body, bytes):
            raw = body
        else:
            raw = dumps(body)
        out = []
        if status != 204:
            out.append((b"content-type", (ctype or "application/json").encode()))
            out.append((b"content-length", str(len(raw)).encode()))
        close = close or self.draining
        for name, value in (headers or {}).items():
            if name.lower() == "connection":
                close = close or value.lower() == "close"
                continue
            out.append((name.lower().encode(), str(value).encode("latin-1")))
        if self.options.cors_origins:
            out.extend(self._cors_headers(req))
        if close:
            out.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": raw if req.method != "HEAD" else b""})

    def _cors_origin(self, req: Request) -> str | None:
        origin = req.header(b"origin")
        if origin is None:
            return None
        if "*" in self.options.cors_origins:
            return "*"
        return origin if origin in self.options.cors_origins else None

    def _cors_headers(self, req: Request) -> list:
        out = []
        allowed = self._cors_origin(req)
        if allowed is not None:
            out.append((b"access-control-allow-origin", allowed.encode("latin-1")))
            out.append((b"access-control-expose-headers", b"Retry-After"))
        if "*" not in self.options.cors_origins:
            out.append((b"vary", b"Origin"))  # the answer depends on Origin: caches must key on it
        return out

    def _done(self, req: Request, status: int, counts) -> None:
        seconds = time.monotonic() - req.started
        if req.path in POST_ROUTES and req.method == "POST":
            tokens, inputs = counts or (0, 0)
            self.service.metrics.request_done(status, seconds, tokens, inputs, route=req.path)
        if access_log.isEnabledFor(logging.INFO):
            duration = round(1000 * seconds, 2)
            path = req.path if req.path in ROUTES else "(unknown)"
            access_log.info("%s %s %d %.2fms", req.method, path, status, duration,
                            extra={"method": req.method, "path": path, "status": status,
                                   "duration_ms": duration, "client": req.client})


def _payload(service, route: str, raw: bytes):
    payload = parse_json(raw)
    fields = getattr(service, "REQUEST_FIELDS", {}).get(route)
    if fields is not None and isinstance(payload, dict) and not payload.keys() <= fields:
        payload = {k: v for k, v in payload.items() if k in fields}  # ignored anyway; not kept till the end
    return payload


def _prepare(service, route: str, raw: bytes):
    return service.prepare(route, _payload(service, route, raw))


def _allow(methods: tuple[str, ...]) -> str:
    return ", ".join((*methods, "OPTIONS"))


def _engine_exit(service) -> str:
    code = getattr(getattr(service, "engine", None), "exitcode", None)  # the worker's, or vLLM's EngineCore's
    return f"exit code {code}" if code is not None else "exit code unknown"


def _engine_death(service) -> str:
    """What ended, as the engine names it: the worker process (EngineProcess), or the process that runs
    the forward passes of an engine whose client is in this process (Engine: vLLM's EngineCore)."""
    return getattr(getattr(service, "engine", None), "DEATH", "the engine died")


class _Server(uvicorn.Server):
    """uvicorn's server with mopt's stop: SIGTERM/SIGINT begin the drain (no re-raise of the signal
    afterwards: the exit code is ours), and every tick runs the drain's cut-off and the watchdog."""

    def __init__(self, config, app: App, service, install_signals: bool, watchdog_interval_s: float, ready,
                 load=None):
        super().__init__(config)
        self.app, self.service = app, service
        self.install_signals = install_signals
        self.watchdog_interval = watchdog_interval_s
        self.ready = ready
        self.load = load
        self.load_error: BaseException | None = None
        self.handover = threading.Lock()  # the loaded service goes to the app, or is closed if too late
        self.closed = False  # serve() is done with the service it has
        self.exit_code = 0
        self.reason: str | None = None
        self.cutoff_at: float | None = None
        self._next_watch = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: threading.Thread | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if not self.install_signals or threading.current_thread() is not threading.main_thread():
            yield
            return
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, _frame) -> None:
        if self.should_exit and signum == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        self.stop(signal.Signals(signum).name)

    def stop(self, reason: str) -> None:
        """Begin the drain (any thread; also the tests' way to stop a server)."""
        if self.loop_thread is not None and threading.current_thread() is not self.loop_thread:
            with contextlib.suppress(RuntimeError):  # the loop has closed: the server has stopped already
                self.loop.call_soon_threadsafe(self.stop, reason)
            return
        if self.reason is None:
            self.reason = reason
            self.app.draining = True
            drain = self.config.timeout_graceful_shutdown
            longest = getattr(getattr(self.service, "batcher", None), "longest_call_s", 0.0)
            margin = min(max(DRAIN_MARGIN_S, 2 * longest), drain / 2)
            self.cutoff_at = time.monotonic() + drain - margin
            log.info("%s: draining (up to %gs; queued work answered 503 after %gs)", reason, drain, drain - margin)
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        self.loop, self.loop_thread = asyncio.get_running_loop(), threading.current_thread()
        await super().startup(sockets)
        if not self.started:
            return
        self.port = self.servers[0].sockets[0].getsockname()[1]
        if self.load is None:
            self._serving()
        else:  # listening already: probes see "loading" while the engine loads
            print(json.dumps({"event": "loading", "host": self.config.host, "port": self.port}), flush=True)
            threading.Thread(target=self._load, name="mopt-load", daemon=True).start()
        if self.ready is not None:
            self.ready(self, self.port)

    def _serving(self) -> None:
        print(json.dumps({"event": "serving", "host": self.config.host, "port": self.port,
                          "model": self.service.model_name}), flush=True)

    def _load(self) -> None:
        """The engine load, on its own thread. The service is handed over here (the app reads
        app.service once per request), unless the server stopped meanwhile: then it is closed unused."""
        try:
            service = self.load()
        except BaseException as exc:  # noqa: BLE001  (serve() raises it once the server has stopped)
            self.load_error = exc
            self.exit_code = getattr(exc, "exit_code", 1)
            with contextlib.suppress(RuntimeError):  # the loop is closed already: the server has stopped
                self.stop("load failed")
            return
        with self.handover:
            unused = self.closed or self.should_exit
            if not unused:
                self.app.service = self.service = service
        if unused:
            service.close()
        else:
            self._serving()

    async def on_tick(self, counter: int) -> bool:
        now = time.monotonic()
        if now >= self._next_watch:
            self._next_watch = now + self.watchdog_interval
            self._watch()
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        # uvicorn closes the listeners, closes idle connections, marks busy ones to close after their
        # response and waits for them; the cut-off answers what is still queued before its end.
        task = asyncio.ensure_future(self._cutoff())
        try:
            await super().shutdown(sockets)
        finally:
            task.cancel()

    async def _cutoff(self) -> None:
        while True:
            if self.cutoff_at is not None and time.monotonic() >= self.cutoff_at:
                self.cutoff_at = None
                self.app.cut = True
                failed = self._fail_queued(Dropped("shutdown"))
                if failed:
                    log.warning("drain: %d queued requests answered 503", failed)
            self._watch()
            await asyncio.sleep(0.05)

    def _fail_queued(self, exc) -> int:
        batcher = getattr(self.service, "batcher", None)
        return batcher.fail_queued(exc) if batcher is not None else 0

    def _watch(self) -> None:
        """The watchdog: a dead or stalled engine stops the server with its exit code."""
        if self.exit_code:
            return
        try:
            alive = self.service.engine_alive()
            stalled = self.service.engine_stalled() if alive else None
        except Exception:  # noqa: BLE001  (a check that fails counts as a dead engine)
            log.exception("the engine check failed")
            alive, stalled = False, None
        if alive and stalled is None:
            return
        if not alive:
            self.exit_code = EXIT_ENGINE_DIED
            log.error("%s (%s): shutting down with exit code %d", _engine_death(self.service),
                      _engine_exit(self.service), EXIT_ENGINE_DIED)
        else:
            self.exit_code = EXIT_ENGINE_STALLED
            log.error("the engine worker has not answered for %.1fs: shutting down with exit code %d", stalled,
                      EXIT_ENGINE_STALLED)
            kill = getattr(self.service.engine, "kill", None)
            if kill is not None:
                kill()  # its pending call fails at once, so the requests waiting on it are answered
        self._fail_queued(Dropped("engine_down"))
        self.config.timeout_graceful_shutdown = min(self.config.timeout_graceful_shutdown, 2.0)
        self.stop("engine")


def make_config(app: App, host: str, port: int, options: HttpOptions) -> uvicorn.Config:
    config = uvicorn.Config(app, host=host, port=port, http=GuardedProtocol, loop="auto", lifespan="off",
                            ws="none", interface="asgi3", log_config=None, access_log=False, server_header=False,
                            proxy_headers=False, timeout_keep_alive=options.idle_timeout_s,
                            timeout_graceful_shutdown=options.drain_timeout_s, backlog=2048)
    config.mopt = ProtocolLimits(options.max_connections, options.max_header_bytes, options.header_timeout_s)
    return config


def serve(service, host: str, port: int, options: HttpOptions | None = None, *,
          watchdog_interval_s: float = 0.5, install_signals: bool = True, ready=None, load=None,
          metrics=None) -> int:
    """Serve until SIGTERM/SIGINT (exit 0 after the drain) or until the engine worker dies or stalls
    (exit EXIT_ENGINE_DIED / EXIT_ENGINE_STALLED, so `docker --restart` and Kubernetes restart it).
    With service None, load() makes the service on a thread of its own while the server already
    listens and answers as Loading (with METRICS); an exception from load() stops the server and is
    raised here. ready(server, port) is called once listening; server.stop(reason) begins the drain."""
    options = options or HttpOptions()
    # uvicorn logs each malformed request at WARNING: under a flood of them that is a log flood. They are
    # answered 400 and closed; the server's own errors still log.
    logging.getLogger("uvicorn.error").setLevel(logging.ERROR)
    if service is None:
        service = Loading(metrics)
    app = App(service, options)
    server = _Server(make_config(app, host, port, options), app, service, install_signals, watchdog_interval_s, ready,
                     load)
    # Threads hand the GIL over every 5 ms by default: the batcher's thread would wait that long for it
    # after each engine call while the event loop runs. 1 ms keeps the engine fed.
    sys.setswitchinterval(0.001)
    try:
        server.run()
    finally:
        app.pool.shutdown(wait=False, cancel_futures=True)
        app.small_pool.shutdown(wait=False, cancel_futures=True)
        app.token_batches.close()
    code = server.exit_code
    with server.handover:
        server.closed = True
        service = server.service
    try:
        service.close(CLOSE_AFTER_DRAIN_S)
    except Exception:  # noqa: BLE001  (the exit code is what matters now)
        log.exception("closing the service failed")
    print(json.dumps({"event": "stopped", "exit_code": code, "reason": server.reason}), flush=True)
    if server.load_error is not None:
        raise server.load_error
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
