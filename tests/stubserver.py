"""Server plumbing shared by the tests' local stand-ins for model hubs (tests/hubstub.py,
tests/msstub.py).  Standard library only.

``LoopbackStub`` owns a ``ThreadingHTTPServer`` on 127.0.0.1 (a free port) served from a daemon
thread while the stub is used as a context manager, its ``endpoint``, the thread-safe list of
``requests`` seen, and ``cut_after`` (truncated downloads).  ``StubHandler`` is the request
handler base: HTTP/1.1 keep-alive, quiet logging, ``_send`` (every response carries a
``Content-Length``) and ``send_file``, which serves a file body honouring ``Range`` (206 +
``Content-Range``, 416 when unsatisfiable) and a pending cut.  A subclass of each keeps only its
own API's routes, JSON shapes and error codes.
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
from collections import Counter
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class LoopbackStub:
    """Serves ``handler`` at ``self.endpoint`` inside ``with stub:``; handlers reach the stub as
    ``self.server.stub``.

    ``self.requests`` lists every request as ``(method, path_with_query, range_header_or_None,
    had_auth)``, appended by ``record``; token values are never recorded.
    """

    def __init__(self, handler: type[StubHandler], *, name: str):
        self._lock = threading.Lock()
        self._cuts: dict[str, list[int]] = {}  # filename -> [nbytes, times left]
        self._bodies: Counter = Counter()  # filename -> GET bodies started (cut or not)
        self._counter = 0
        self.requests: list[tuple[str, str, str | None, bool]] = []
        self._name = name
        self._server = _Server(("127.0.0.1", 0), handler)
        self._server.stub = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._server.serve_forever, name=self._name, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def record(self, method: str, path: str, range_header: str | None, had_auth: bool) -> None:
        """Append one request to ``self.requests``."""
        with self._lock:
            self.requests.append((method, path, range_header, had_auth))

    def cut_after(self, filename: str, nbytes: int, times: int = 1) -> None:
        """Make the next ``times`` GETs of ``filename`` (the name the handler serves it under, any
        repo) announce the full ``Content-Length`` but send only ``nbytes`` of the body, then hang up."""
        with self._lock:
            self._cuts[filename] = [nbytes, times]

    def _new_commit_id(self, key: str, files: dict[str, bytes]) -> str:
        """A fresh 40-hex id for committing ``files`` under ``key``; call with ``self._lock`` held."""
        self._counter += 1
        h = hashlib.sha1(f"{key}\0{self._counter}".encode())
        for name in sorted(files):
            h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        return h.hexdigest()

    def _take_cut(self, filename: str) -> int | None:
        """Count a GET body of ``filename`` about to be sent; return how many of its bytes to send
        before cutting, or None."""
        with self._lock:
            self._bodies[filename] += 1
            cut = self._cuts.get(filename)
            if not cut or cut[1] <= 0:
                return None
            cut[1] -= 1
            return cut[0]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    stub: LoopbackStub


class StubHandler(BaseHTTPRequestHandler):
    """Request handler base for a ``LoopbackStub``."""

    protocol_version = "HTTP/1.1"  # keep-alive, like the hubs; every response carries a Content-Length

    def log_message(self, *args):  # keep test output quiet
        pass

    def record(self, had_auth: bool) -> None:
        """Record this request in the stub's ``requests``."""
        self.server.stub.record(self.command, self.path, self.headers.get("Range"), had_auth)

    def _send(self, status, body=b"", headers=(), head=False, length=None):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def send_file(
        self,
        filename: str,
        data: bytes,
        headers: Iterable[tuple[str, str]] = (),
        *,
        head: bool = False,
        refusal_headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        """Answer with ``data`` (or the part the request's ``Range`` asks for: 206 + ``Content-Range``)
        and ``headers``; an unsatisfiable range is a 416 with ``refusal_headers`` + ``Content-Range``.
        ``head`` sends the headers only.  A GET of ``filename`` with a pending ``cut_after`` announces
        the full length, sends the prefix, then hangs up."""
        size, headers = len(data), list(headers)
        status, start, end = 200, 0, size - 1
        if self.headers.get("Range"):
            span = parse_range(self.headers["Range"], size)
            if span is None:
                return self._send(416, b"", [*refusal_headers, ("Content-Range", f"bytes */{size}")], head)
            status, (start, end) = 206, span
            headers.append(("Content-Range", f"bytes {start}-{end}/{size}"))
        body = data[start : end + 1]
        if head:
            return self._send(status, b"", headers, head=True, length=len(body))
        cut = self.server.stub._take_cut(filename)
        if cut is None:
            return self._send(status, body, headers)
        # Announce the full length, send a prefix, then hang up (FIN): the client sees a truncated body.
        self._send(status, body[:cut], headers, length=len(body))
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(first, last) byte of a single ``bytes=`` range, or None when unsatisfiable."""
    m = _RANGE.fullmatch(header.strip())
    if not m or not (m[1] or m[2]):
        return None
    if m[1]:
        start, end = int(m[1]), min(int(m[2]), size - 1) if m[2] else size - 1
    else:
        start, end = max(size - int(m[2]), 0), size - 1
    return (start, end) if start <= end and start < size else None
