"""The vllm flavour's engine behind mopt's server, without vLLM: the loopback client against a
stand-in for vLLM's OpenAI server (a real child process, started the way Server starts vLLM's), the
writable mirror of a read-only compile cache, and the worker's exit when that child dies. The real
vLLM server behind mopt's runs in tests/integration/test_vllm_cpu.py."""
from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from builder.runtime import worker
from builder.runtime.backends import vllm_backend as vb
from builder.runtime.engine import Engine
from builder.runtime.params import EngineParams

# A stand-in for vLLM's server: /health, and /v1/embeddings answering each token-id list with the
# vector [len, first id] in base64 float32, in reverse order (the client must sort by index); 401
# without the key vLLM got in its environment. POST /exit ends the process with code 9.
STUB = textwrap.dedent('''
    import base64, json, os, struct, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    KEY = os.environ["VLLM_API_KEY"]
    port = int(sys.argv[sys.argv.index("--port") + 1])

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *args):
            pass
        def _send(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            self._send(200, {})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/exit":
                os._exit(9)
            if self.headers.get("Authorization") != "Bearer " + KEY:
                return self._send(401, {"error": "bad key"})
            if "model" in body or body.get("encoding_format") != "base64":
                return self._send(400, {"error": "unexpected fields"})
            rows = [{"index": i, "embedding": base64.b64encode(struct.pack("<2f", len(s), s[0])).decode()}
                    for i, s in enumerate(body["input"])]
            self._send(200, {"data": rows[::-1]})

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


def params(**kw) -> EngineParams:
    base = dict(backend="vllm", device="cpu", precision="fp32", max_batch=4, max_seq_len=16, pooling="mean",
                model_dir="/opt/mopt/model", model_name="mopt/minilm-embed")
    return EngineParams(**{**base, **kw})


@pytest.fixture
def stub_server(tmp_path, monkeypatch):
    script = tmp_path / "stub_vllm.py"
    script.write_text(STUB)
    monkeypatch.setattr(vb, "serve_argv", lambda model, p, host, port, python=None:
                        [sys.executable, str(script), "--model", model, "--port", str(port)])
    servers = []

    def start():
        server = vb.Server(str(tmp_path), tmp_path / "cache", params(), timeout=30)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def test_client_sends_token_ids_with_its_key_and_orders_rows(stub_server):
    server = stub_server()
    assert server.embed([[5, 6, 7], [9]]) == [[3.0, 5.0], [1.0, 9.0]]
    assert server.embed([[1]] * 3) == [[1.0, 1.0]] * 3  # the kept connection serves the next batch
    import torch

    ids = torch.tensor([[5, 6, 7, 0], [9, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert server(ids, mask).tolist() == [[3.0, 5.0], [1.0, 9.0]]  # the engine call: padding dropped
    # the key is in the child's environment, never on its command line
    assert not any(server._key in arg for arg in server.proc.args)


def test_a_wrong_key_is_an_engine_error(stub_server):
    server = stub_server()
    server._key = "not-the-key"
    with pytest.raises(RuntimeError, match="answered 401"):
        server.embed([[1]])


def test_a_dead_server_is_seen_as_dead(stub_server):
    server = stub_server()
    assert server.alive()
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        conn.request("POST", "/exit", b"{}", {"Content-Length": "2"})
        conn.getresponse()
    server.proc.wait(10)
    assert not server.alive() and server.proc.returncode == 9
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        server.embed([[1]])


def _shipped(tmp_path):
    shipped = tmp_path / "engine" / vb.CACHE_SUBDIR
    (shipped / "torchinductor" / "ab").mkdir(parents=True)
    (shipped / "torchinductor" / "ab" / "kernel.so").write_bytes(b"ELF")
    (shipped / "torchinductor" / "locks").mkdir()
    (shipped / "torchinductor" / "locks" / "x.lock").write_bytes(b"")
    (shipped.parent / vb.ARTIFACT).write_text(json.dumps({"cache_root": "/opt/mopt/engine/engine/vllm-cache"}))
    return shipped


def test_a_writable_shipped_cache_is_served_in_place(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    shipped = _shipped(tmp_path)
    assert vb._cache_for_serving(shipped) == shipped


def test_a_read_only_cache_is_served_through_a_writable_mirror(tmp_path, monkeypatch):
    shipped = _shipped(tmp_path)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(shipped))  # the image's setting
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    real_access = os.access
    monkeypatch.setattr(vb.os, "access", lambda path, mode: False if str(path) == str(shipped)
                        else real_access(path, mode))  # as on a read-only root (tests run as root)
    mirror = vb._cache_for_serving(shipped)
    assert mirror.parent == tmp_path / "tmp" and mirror.name.startswith("mopt-vllm-cache-")
    kernel = mirror / "torchinductor" / "ab" / "kernel.so"
    assert kernel.is_symlink() and kernel.resolve() == (shipped / "torchinductor" / "ab" / "kernel.so").resolve()
    assert (mirror / "torchinductor" / "locks").is_dir()  # lock files are made afresh, not linked
    assert list((mirror / "torchinductor" / "locks").iterdir()) == []
    (mirror / "torchinductor" / "ab" / "new.so").write_bytes(b"x")  # vLLM may add entries
    assert not (shipped / "torchinductor" / "ab" / "new.so").exists()


def test_the_verify_step_serves_a_fresh_copy_at_the_compile_path(tmp_path, monkeypatch):
    shipped = _shipped(tmp_path)
    final = tmp_path / "final" / "vllm-cache"
    (shipped.parent / vb.ARTIFACT).write_text(json.dumps({"cache_root": str(final)}))
    final.mkdir(parents=True)
    (final / "stale").write_text("from the compile run")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(final))
    assert vb._cache_for_serving(shipped) == final
    assert not (final / "stale").exists() and (final / "torchinductor" / "ab" / "kernel.so").read_bytes() == b"ELF"


def test_a_users_own_cache_root_is_used_as_it_is(tmp_path, monkeypatch):
    shipped = _shipped(tmp_path)
    own = tmp_path / "volume"
    own.mkdir()
    (own / "keep").write_text("mine")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(own))
    assert vb._cache_for_serving(shipped) == own
    assert (own / "keep").read_text() == "mine"  # never emptied or overwritten


class _Run:
    """An engine callable whose server child can die (what vllm_backend.load returns)."""

    def __init__(self):
        self.up, self.closed = True, False

    def __call__(self, input_ids, attention_mask):
        raise AssertionError("not called")

    def alive(self):
        return self.up

    def exitcode(self):
        return None if self.up else -9

    def close(self):
        self.closed = True


def test_engine_reports_its_server_child():
    run = _Run()
    engine = Engine(params(), encoder=None, run=run, info={})
    assert engine.alive() and engine.exitcode is None
    run.up = False
    assert not engine.alive() and engine.exitcode == -9
    engine.close()
    assert run.closed
    plain = Engine(params(), encoder=None, run=lambda ids, mask: None, info={})
    assert plain.alive() and plain.exitcode is None
    plain.close()  # nothing to close


@pytest.fixture
def fake_worker_engine(monkeypatch):
    """_worker_main on a thread (it sets a signal handler, which only the main thread may) over a _Run."""
    from builder.runtime import guard

    run = _Run()
    monkeypatch.setattr(guard, "resolve", lambda out_dir: (out_dir, {"params": params().to_dict()}))
    monkeypatch.setattr(Engine, "from_info", classmethod(lambda cls, d, data: cls(params(), None, run, data)))
    monkeypatch.setattr(worker.signal, "signal", lambda *a: None)
    return run


def _ready(conn) -> str:
    assert conn.poll(10), "the worker did not answer"
    return conn.recv()[0]


def test_worker_exits_when_its_engines_server_child_dies(fake_worker_engine, monkeypatch):
    """The worker ends with EXIT_ENGINE_CHILD_DIED, so the server's watchdog ends the container."""
    import multiprocessing

    run = fake_worker_engine
    monkeypatch.setattr(worker, "ENGINE_CHECK_S", 0.01)
    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(worker.os, "_exit", fake_exit)
    parent, child = multiprocessing.Pipe()
    thread = threading.Thread(target=lambda: pytest.raises(SystemExit, worker._worker_main, "/engine", child, child),
                              daemon=True)
    thread.start()
    assert _ready(parent) == "ready"
    run.up = False
    thread.join(10)
    assert exits == [worker.EXIT_ENGINE_CHILD_DIED]


def test_worker_closes_its_engine_when_told_to_stop(fake_worker_engine):
    import multiprocessing

    run = fake_worker_engine
    parent, child = multiprocessing.Pipe()
    thread = threading.Thread(target=worker._worker_main, args=("/engine", child, child), daemon=True)
    thread.start()
    assert _ready(parent) == "ready"
    parent.send(None)
    thread.join(10)
    assert not thread.is_alive() and run.closed


def test_token_ids_go_to_vllm_as_they_are_and_come_back_float32(stub_server):
    server = stub_server()
    out = server.embed_ids([[5, 6, 7], [9]])
    assert str(out.dtype) == "torch.float32" and out.tolist() == [[3.0, 5.0], [1.0, 9.0]]


class _Direct:
    """A backend that takes unpadded sequences itself (what vllm_backend.Server is to Engine)."""

    def __init__(self):
        self.calls: list[list[list[int]]] = []

    def embed_ids(self, seqs):
        import torch

        self.calls.append(seqs)
        return torch.tensor([[float(len(s)), float(s[0])] for s in seqs])

    def __call__(self, input_ids, attention_mask):
        raise AssertionError("the padded call is not used")


def test_the_engine_hands_vllm_the_sequences_without_padding():
    run = _Direct()
    engine = Engine(params(), encoder=None, run=run, info={"embedding_dim": 2})
    assert engine.embed_tensor([[5, 6, 7], [9]]).tolist() == [[3.0, 5.0], [1.0, 9.0]]
    assert run.calls == [[[5, 6, 7], [9]]]  # one call, in the request's order, nothing padded
    assert engine.embed_tensor([]).shape == (0, 2) and len(run.calls) == 1  # an empty call never reaches vLLM
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.embed_tensor([[1] * 17])


def test_only_an_engine_that_batches_calls_itself_is_called_concurrently():
    assert Engine(params(), encoder=None, run=_Direct(), info={}).concurrent_calls is True
    assert Engine(params(backend="torch-aot"), encoder=None, run=_Direct(), info={}).concurrent_calls is False


def test_writable_mirror_at_a_given_dir(tmp_path):
    """torch-inductor's form: the mirror at MOPT_COMPILE_CACHE_DIR/cache, links to resolved paths."""
    from builder.runtime.cachemirror import writable_mirror

    shipped = _shipped(tmp_path)
    (tmp_path / "alias").symlink_to(shipped)
    dest = tmp_path / "rt" / "cache"
    assert writable_mirror(tmp_path / "alias", dest) == dest
    kernel = dest / "torchinductor" / "ab" / "kernel.so"
    assert kernel.is_symlink() and Path(os.readlink(kernel)) == shipped.resolve() / "torchinductor" / "ab" / "kernel.so"
    assert not any((dest / "torchinductor" / "locks").iterdir())
