"""The connection layer under the ASGI app: uvicorn's httptools protocol with what uvicorn leaves out.

uvicorn parses HTTP/1.1 (llhttp, through httptools) and runs the app; it has no bound on how long a
client may take to send its request headers, none on their size, and its concurrency limit counts
idle connections, so a few hundred sockets that send nothing deny service to everyone. This
subclass adds, per connection:

- a header deadline (--header-timeout) from the connection's first moment, or from a keep-alive
  request's first byte, to the end of its headers; idle keep-alive connections close after
  --idle-timeout (uvicorn's timeout_keep_alive);
- a bound on the request line and headers together (--max-header-bytes; 431 beyond), counted as
  the bytes arrive, so an endless header is cut off before it is buffered;
- request targets in origin form (/path), absolute form (http://host/path) or OPTIONS *; others 400;
- a connection cap that never refuses a working client for an idle one: past --max-connections the
  connection idle the longest (no request under way: waiting for its first byte, or for the rest of
  its headers) is closed to make room; only when every connection has a request in progress is the
  new one answered 503 and closed;
- errors of the parser itself answered in the server's JSON error format.

The event loop holds every connection; none has a thread, so idle ones cost a few KiB each."""
from __future__ import annotations

import asyncio
import json
from collections import OrderedDict

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .httpinput import error_body


def error_bytes(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 error response in OpenAI's error format, with Connection: close."""
    body = json.dumps(error_body(status, message, code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n")
    return head.encode() + body


BUSY_503 = error_bytes(503, "Service Unavailable", "too many connections with requests in progress; retry later",
                       "server_busy", "retry-after: 1\r\n")
TIMEOUT_408 = error_bytes(408, "Request Timeout", "request headers not received in time", "request_timeout")
HEADERS_431 = error_bytes(431, "Request Header Fields Too Large", "request line and headers are too large",
                          "headers_too_large")
VERSION_400 = error_bytes(400, "Bad Request", "only HTTP/1.0 and HTTP/1.1 are served", "http_version_not_supported")
TARGET_400 = error_bytes(400, "Bad Request", "the request target must be a path (/v1/embeddings), an absolute "
                         "URL, or * for OPTIONS", "invalid_target")


class ConnectionTable:
    """Every open connection of one server, and which of them are idle (no request in progress), in the
    order they became idle: the eviction order. Touched only on the event loop's thread."""

    def __init__(self, max_connections: int):
        self.max_connections = max_connections
        self.open = 0
        self.idle: OrderedDict[GuardedProtocol, None] = OrderedDict()
        self.evicted = 0  # idle connections closed to make room (a counter for /metrics)
        self.refused = 0  # connections answered 503 at the cap

    def admit(self, proto: GuardedProtocol) -> bool:
        """Count a new connection; past the cap close the longest-idle one, or refuse this one."""
        self.open += 1
        if self.open <= self.max_connections:
            return True
        while self.idle:
            victim, _ = self.idle.popitem(last=False)
            if victim.close_idle():
                self.evicted += 1
                return True
        self.refused += 1
        return False

    def closed(self, proto: GuardedProtocol) -> None:
        self.open -= 1
        self.idle.pop(proto, None)

    def set_idle(self, proto: GuardedProtocol, idle: bool) -> None:
        if idle:
            self.idle[proto] = None
            self.idle.move_to_end(proto)
        else:
            self.idle.pop(proto, None)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's HttpToolsProtocol with the guards above. config.mopt (a ProtocolLimits) carries the
    limits and the shared ConnectionTable."""

    def __init__(self, config, server_state, app_state, _loop=None):
        super().__init__(config, server_state, app_state, _loop)
        self.limits = config.mopt
        self._timer: asyncio.TimerHandle | None = None
        self._in_headers = True  # between a request's first byte (or the connection's start) and its headers' end
        self._header_bytes = 0
        self._got_bytes = False  # any byte of the current request yet
        self._counted = False

    # --- the connection's life ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        table = self.limits.table
        self._counted = True
        if not table.admit(self):
            transport.write(BUSY_503)
            transport.close()
            return
        table.set_idle(self, True)
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._counted:
            self._counted = False
            self.limits.table.closed(self)
        super().connection_lost(exc)

    def close_idle(self) -> bool:
        """Close this connection if no request is in progress (eviction); False if one is."""
        if self.transport.is_closing():
            return False
        if self.cycle is not None and not self.cycle.response_complete:
            return False
        self.transport.close()
        return True

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._in_headers and self._got_bytes:
            self.transport.write(TIMEOUT_408)  # a request had begun: say why it ends
        self.transport.close()

    # --- bytes in ---------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._in_headers:
            if not self._got_bytes:
                self._got_bytes = True
                if self.cycle is not None and self.cycle.response_complete:
                    self._arm(self.limits.header_timeout_s)  # a keep-alive connection's next request
            self._header_bytes += len(data)
        super().data_received(data)
        # Still inside the headers after all of this data: every byte so far was request line and headers.
        if self._in_headers and self._header_bytes > self.limits.max_header_bytes and not self.transport.is_closing():
            self._refuse(HEADERS_431)

    def _refuse(self, response: bytes) -> None:
        self._disarm()
        self.transport.write(response)
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """The parser's own refusals (bad framing, bad request line) in the JSON error format."""
        self._disarm()
        self.transport.write(error_bytes(400, "Bad Request", f"invalid HTTP request: {msg}", "bad_request"))
        self.transport.close()

    # --- parser callbacks ---------------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self._in_headers, self._header_bytes = False, 0
        self._disarm()
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:  # a whole oversized block in one read
            self._refuse(HEADERS_431)
            return
        if self.parser.get_http_version() not in ("1.0", "1.1"):  # HTTP/0.9 ("GET /path"): no headers, no status
            self._refuse(VERSION_400)
            return
        url = self.url
        method = self.parser.get_method()
        if not (url.startswith((b"/", b"http://", b"https://")) or (url == b"*" and method == b"OPTIONS")):
            self._refuse(TARGET_400)
            return
        if url == b"*":
            self.url = b"/*"  # OPTIONS * reaches the app as the path "*" (scope["path"]); httptools cannot parse "*"
        self.limits.table.set_idle(self, False)
        self.scope["mopt.transport"] = self.transport  # the app's client_gone probe (server.Request)
        super().on_headers_complete()
        if url == b"*":
            self.scope["path"], self.scope["raw_path"] = "*", b"*"

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # Any byte after this request's body belongs to the next request's headers.
        self._in_headers, self._header_bytes, self._got_bytes = True, 0, False

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        # Between requests (uvicorn has armed its keep-alive timer): idle, so evictable.
        if not pipelined and not self.transport.is_closing():
            self.limits.table.set_idle(self, True)


class ProtocolLimits:
    """What GuardedProtocol reads from uvicorn's Config (config.mopt)."""

    def __init__(self, max_connections: int, max_header_bytes: int, header_timeout_s: float):
        self.table = ConnectionTable(max_connections)
        self.max_header_bytes = max_header_bytes
        self.header_timeout_s = header_timeout_s
