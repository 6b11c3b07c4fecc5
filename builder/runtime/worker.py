"""The engine in its own process, for the server: the guard, the load and every forward pass run
in a worker; the HTTP process keeps only the tokenizer, the batcher and the request threads.

Why: a forward pass launches hundreds of kernels from Python (Inductor's wrapper), and every
launch gives up the GIL. In one process, request threads (JSON, base64, HTTP) take it at each
launch and the engine waits for it back. Two processes share no GIL (docs/performance.md has the
served-vs-raw figures). The worker answers each batch with the raw
float32 bytes of the embeddings.

Protocol over two one-way multiprocessing pipes (batches in, answers out): the worker sends
("ready", engine_dir, engine.json) or ("error", exit_code, message) once; then for each list of token-id
lists it receives it answers ("ok", bytes) or ("failed", message); None asks it to exit.
"""
from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import sys
import threading
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from .engine import engine_encoder
from .errors import RuntimeToolError
from .params import EngineParams
from .tokenization import TextEncoder

ENGINE_CHECK_S = 0.5  # how often an idle worker checks its engine (a backend's server child)
EXIT_ENGINE_CHILD_DIED = 70  # the worker's exit code when that child died (the server's watchdog logs it)
# Each pipe's buffer (Linux's default is 64 KiB). An answer of 64 rows x 1,024 floats is 256 KiB: through a
# 64 KiB pipe the worker's send waits for the server's receiver thread, which needs the GIL back between
# reads while the event loop holds it, and the GPU idles meanwhile. 1 MiB (the unprivileged ceiling,
# /proc/sys/fs/pipe-max-size) takes such an answer, or a batch of 64 x 2,048 token ids, in one write.
PIPE_BYTES = 1 << 20


def _widen(conn) -> None:
    try:
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (OSError, AttributeError):  # a lower pipe-max-size, or no F_SETPIPE_SZ: the default buffer
        pass


def _worker_main(target, batches, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process handles Ctrl-C and SIGTERM
    # No TorchScript is served, but importing Inductor compiles torch.utils.mkldnn's script methods,
    # seconds of a start. Set before torch is imported.
    os.environ.setdefault("PYTORCH_JIT", "0")
    try:
        from .engine import Engine
        from .modelcache import locate

        engine_dir, data = locate(target)  # an engine dir through the guard, or a mounted model's cache entry
        engine = Engine.from_info(engine_dir, data)
    except RuntimeToolError as err:
        conn.send(("error", err.exit_code, err.message))
        return
    except Exception as exc:  # noqa: BLE001  (reported to the server process, which exits with it)
        conn.send(("error", 1, f"engine load failed: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", str(engine_dir), data))
    while True:
        try:
            while not batches.poll(ENGINE_CHECK_S):
                if not engine.alive():  # a backend's server child died (vllm): so does this worker
                    print(f"mopt_runtime: the engine's server process exited with code {engine.exitcode}",
                          file=sys.stderr, flush=True)
                    os._exit(EXIT_ENGINE_CHILD_DIED)
            seqs = batches.recv()
        except EOFError:  # the server process is gone
            seqs = None
        if seqs is None:
            engine.close()
            return
        try:
            conn.send(("ok", engine.embed_tensor(seqs).contiguous().numpy().tobytes()))
        except Exception as exc:  # noqa: BLE001  (fails these requests; the worker lives on)
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))


WORKER_REAP_S = 2.0  # how long a request waits for a worker whose pipe broke to be reaped


class EngineProcess:
    """What the server needs of an Engine (params, encoder, info, dim, embed_ids, submit), with the
    engine in a worker process. start() returns once the worker's guard passed and the engine loaded.

    submit() sends a batch at once and returns a Future; a receiver thread reads the answers, which
    come in the order the batches were sent, so the batcher can send the next batch while the worker
    still computes the one before (the pipe holds it): the worker never waits for the server."""

    DEATH = "the engine worker died"  # what the server logs when alive() turns False

    def __init__(self, target):
        """TARGET: an engine dir, or a modelcache.ModelSource (compiled into its cache on a miss)."""
        self.target = target if not isinstance(target, Path) else str(target)
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked CUDA or threads
        batches_in, self._conn = ctx.Pipe(duplex=False)  # this process sends batches on _conn
        self._answers, answers_out = ctx.Pipe(duplex=False)  # and reads the worker's answers on _answers
        for conn in (self._conn, self._answers):
            _widen(conn)
        self._proc = ctx.Process(target=_worker_main, args=(self.target, batches_in, answers_out),
                                 name="mopt-engine", daemon=True)
        self._child_conns = (batches_in, answers_out)
        self.params: EngineParams | None = None
        self.encoder: TextEncoder | None = None
        self.info: dict = {}
        self._pending: deque[tuple[Future, int]] = deque()  # sent, not answered: (future, rows)
        self._send_lock = threading.Lock()
        self._receiver: threading.Thread | None = None
        self._broken: RuntimeError | None = None  # set once the pipe broke

    def start(self) -> EngineProcess:
        self._proc.start()
        for conn in self._child_conns:
            conn.close()
        while not self._answers.poll(0.5):
            if not self._proc.is_alive():
                raise RuntimeToolError(f"the engine process exited with code {self._proc.exitcode} while loading")
        try:
            msg = self._answers.recv()
        except EOFError:
            raise RuntimeToolError("the engine process exited while loading") from None
        if msg[0] == "error":
            self._proc.join(10)
            err = RuntimeToolError(msg[2])
            err.exit_code = msg[1]
            raise err
        _, engine_dir, self.info = msg
        self.params = EngineParams.from_dict(self.info["params"])
        self.encoder = engine_encoder(engine_dir, self.params)
        return self

    @property
    def dim(self) -> int:
        return int(self.info["embedding_dim"])

    def alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        """The worker's exit code once it has exited (negative: killed by that signal)."""
        return self._proc.exitcode

    def embed_ids(self, seqs: list[list[int]]):
        """The vectors of seqs, float32 rows (blocking)."""
        return self.submit(seqs).result()

    def submit(self, seqs: list[list[int]]) -> Future:
        """Send one batch; the Future gets a float32 array [len(seqs), dim], or the worker's error."""
        fut: Future = Future()
        with self._send_lock:
            if self._broken is not None:  # the pipe broke: every later batch fails at once
                fut.set_exception(self._broken)
                return fut
            self._pending.append((fut, len(seqs)))
            if self._receiver is None:
                self._receiver = threading.Thread(target=self._receive, name="mopt-engine-pipe", daemon=True)
                self._receiver.start()
            try:
                self._conn.send(seqs)
            except (OSError, ValueError):
                self._pending.remove((fut, len(seqs)))
                fut.set_exception(self._gone())
        return fut

    def _gone(self) -> RuntimeError:
        # The pipe breaks before the process is reaped: wait for it (bounded), so alive() is False when
        # the service decides between 503 engine_down and 500 (and the exit code is known).
        self._proc.join(WORKER_REAP_S)
        return RuntimeError(f"the engine process is gone (exit code {self._proc.exitcode})")

    def _receive(self) -> None:
        dim = self.dim
        while True:
            try:
                status, payload = self._answers.recv()
            except (EOFError, OSError):
                err = self._gone()
                with self._send_lock:
                    self._broken = err
                    while self._pending:
                        fut, _ = self._pending.popleft()
                        fut.set_exception(err)
                return
            fut, rows = self._pending.popleft()
            if status != "ok":
                fut.set_exception(RuntimeError(f"the engine process failed this batch: {payload}"))
            else:
                fut.set_result(np.frombuffer(payload, dtype=np.float32).reshape(rows, dim))

    def kill(self) -> None:
        """End a stalled worker at once (SIGKILL reaches a stopped process too)."""
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(WORKER_REAP_S)

    def close(self, timeout: float = 10.0) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (OSError, ValueError):
                pass
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout)
        self._conn.close()
        self._answers.close()
