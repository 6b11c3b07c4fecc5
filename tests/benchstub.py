"""A stand-in embeddings server on 127.0.0.1 for mopt bench's unit tests (tests/unit/test_bench.py):
it answers OpenAI's POST /v1/embeddings and TEI's POST /embed as those servers do, with a set delay,
and misbehaves on demand, so the bench's every error kind and every bound can be seen without Docker.
The real servers (the cpu image, vLLM's cpu image) are benched in tests/integration/test_vllm_cpu.py.

``mode``: ok | tei-only (no OpenAI route: 404) | status (answers ``status``) | garbage (not JSON) |
count (one vector too few) | ragged (vectors of two sizes) | strings (a later vector holds strings) | huge
(announces a huge body) | hangup (closes the connection without an answer) | redirect (307 to
``redirect_to``) | echo (401 quoting the Authorization header back) | escapes (400 with terminal escapes and
newlines). ``delay_s`` sleeps before answering; ``seen`` counts the requests, ``most_at_once`` the most
handled at the same time.
"""
from __future__ import annotations

import base64
import json
import struct
import threading
import time

from tests.stubserver import LoopbackStub, StubHandler

DIMENSION = 4


class BenchStub(LoopbackStub):
    def __init__(self, mode: str = "ok", delay_s: float = 0.0, status: int = 503, tokens_per_text: int = 3):
        super().__init__(_Handler, name="bench-stub")
        self.mode, self.delay_s, self.status, self.tokens_per_text = mode, delay_s, status, tokens_per_text
        self.seen = 0
        self.at_once = self.most_at_once = 0
        self.redirect_to = ""
        self.fail_after: int | None = None  # answer ``status`` once this many requests were seen
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self._count_lock = threading.Lock()

    def concurrent(self, step: int) -> None:
        with self._count_lock:
            self.at_once += step
            self.most_at_once = max(self.most_at_once, self.at_once)

    def count(self, body: dict, auth: str | None) -> None:
        with self._count_lock:
            self.seen += 1
            if len(self.bodies) < 64:
                self.bodies.append(body)
                self.auth.append(auth)


class _Handler(StubHandler):
    server_version = "bench-stub"

    def do_GET(self):  # noqa: N802
        self._send(200 if self.path in ("/ready", "/health") else 404, b"{}")

    def do_POST(self):  # noqa: N802
        self.server.stub.concurrent(1)
        try:
            self._post()
        finally:
            self.server.stub.concurrent(-1)

    def _post(self):
        stub = self.server.stub
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        stub.count(body, self.headers.get("Authorization"))
        tei = self.path == "/embed"
        if self.path not in ("/v1/embeddings", "/embed") or (stub.mode == "tei-only" and not tei):
            return self._send(404, b'{"error": "no route"}')
        if stub.delay_s:
            time.sleep(stub.delay_s)
        if stub.mode == "redirect":
            return self._send(307, b"", [("Location", stub.redirect_to + self.path)])
        if stub.mode == "echo":
            return self._send(401, json.dumps({"error": f"bad token: {self.headers.get('Authorization')}"}).encode())
        if stub.mode == "escapes":
            return self._send(400, b"line1\nline2 | x\n\x1b[2J\x1b[31mRED\x1b[0m\x1b]0;title\x07")
        texts = body.get("inputs" if tei else "input") or []
        vectors = [[0.5] * DIMENSION for _ in texts]
        if stub.mode == "status" or (stub.fail_after is not None and stub.seen > stub.fail_after):
            return self._send(stub.status, b'{"error": {"message": "busy"}}')
        if stub.mode == "garbage":
            return self._send(200, b"<html>not json</html>")
        if stub.mode == "count":
            vectors = vectors[1:]
        if stub.mode == "ragged" and vectors:
            vectors[-1] = [0.5] * (DIMENSION + 1)
        if stub.mode == "strings" and vectors:
            vectors[-1] = ["a"] * DIMENSION
        if stub.mode == "hangup":
            self.close_connection = True
            return self.connection.close()
        tokens = stub.tokens_per_text * len(texts)
        if tei:
            payload, headers = vectors, [("x-compute-tokens", str(tokens))]
        else:
            if body.get("encoding_format") == "base64":  # as OpenAI's API: float32, little-endian
                vectors = [base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() for v in vectors]
            payload = {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": v}
                                                  for i, v in enumerate(vectors)],
                       "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
            headers = []
        data = json.dumps(payload).encode()
        if stub.mode == "huge":
            return self._send(200, data, [("Content-Type", "application/json"), *headers], length=1 << 40)
        return self._send(200, data, [("Content-Type", "application/json"), *headers])
