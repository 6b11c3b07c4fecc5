"""The embeddings server (builder/runtime/server.py) run in a thread on 127.0.0.1 for tests, and a
raw-socket client: every wait bounded."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time

from builder.runtime.server import HttpOptions, serve

WAIT = 20  # seconds any start, stop or socket may take before the test fails


class Running:
    """serve() in a thread; .port once listening, .stop() drains it and returns the exit code."""

    def __init__(self, service, watchdog_interval_s: float = 0.1, load=None, **options):
        self.service = service
        self.load = load  # with service None: serve() loads it while listening
        self.server = None
        self.port = 0
        self.code: int | None = None
        self.error: BaseException | None = None  # what serve() raised (a failed load)
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(HttpOptions(**options), watchdog_interval_s),
                                       daemon=True)
        self.thread.start()
        if not self._ready.wait(WAIT):
            raise RuntimeError("the server did not start")

    def _run(self, options, interval):
        def ready(server, port):
            self.server, self.port = server, port
            self._ready.set()

        try:
            self.code = serve(self.service, "127.0.0.1", 0, options, install_signals=False,
                              watchdog_interval_s=interval, ready=ready, load=self.load)
        except Exception as exc:  # noqa: BLE001  (the test reads it)
            self.error = exc
        finally:
            self._ready.set()

    def stop(self, timeout: float = WAIT) -> int | None:
        if self.thread.is_alive() and self.server is not None:
            self.server.stop("test")
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server did not stop"
        return self.code

    def wait_exit(self, timeout: float = WAIT) -> int | None:
        self.thread.join(timeout)
        return None if self.thread.is_alive() else self.code


def wait_for(predicate, timeout: float = WAIT) -> bool:
    """Poll predicate until it is true or timeout passes; whether it became true."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def request(port: int, method: str, path: str, body=None, headers: dict | None = None,
            timeout: float = WAIT) -> tuple[int, dict, bytes]:
    """One request on its own connection: (status, headers lower-cased, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def raw_exchange(port: int, data: bytes, wait: float = 2.0, shut: bool = False, timeout: float = WAIT) -> bytes:
    """Send bytes as they are; read until the server closes, `wait` seconds pass without a byte or
    `timeout` seconds in all."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        sock.settimeout(wait)
        out = b""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            out += chunk
        return out


def statuses(raw: bytes) -> list[int]:
    """The status codes of every response in a raw exchange, in order."""
    return [int(line.split()[1]) for line in raw.split(b"\r\n") if line.startswith(b"HTTP/1.")]


def error_code(raw: bytes) -> str | None:
    """The JSON error code of the last response in a raw exchange."""
    body = raw.rsplit(b"\r\n\r\n", 1)[-1]
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
