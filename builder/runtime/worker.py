"""The engine in its own process, for the server: the guard, the load and every forward pass run
in a worker; the HTTP process keeps only the tokenizer, the batcher and the request threads.

Why: a forward pass launches hundreds of kernels from Python (Inductor's wrapper), and every
launch gives up the GIL. In one process, request threads (JSON, base64, HTTP) take it at each
launch and the engine waits for it back. Two processes share no GIL (docs/performance.md has the
served-vs-raw figures). The worker answers each batch with the raw
float32 bytes of the embeddings.

Protocol over a multiprocessing pipe: the worker sends ("ready", engine_dir, engine.json) or
("error", exit_code, message) once; then for each list of token-id lists it receives it answers
("ok", bytes) or ("failed", message); None asks it to exit.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from array import array
from pathlib import Path

from .engine import engine_encoder
from .errors import RuntimeToolError
from .params import EngineParams
from .tokenization import TextEncoder

ENGINE_CHECK_S = 0.5  # how often an idle worker checks its engine (a backend's server child)
EXIT_ENGINE_CHILD_DIED = 70  # the worker's exit code when that child died (the server's watchdog logs it)


def _worker_main(out_dir: str, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process handles Ctrl-C and SIGTERM
    # No TorchScript is served, but importing Inductor compiles torch.utils.mkldnn's script methods,
    # seconds of a start. Set before torch is imported.
    os.environ.setdefault("PYTORCH_JIT", "0")
    try:
        from .engine import Engine
        from .guard import resolve

        engine_dir, data = resolve(out_dir)
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
            while not conn.poll(ENGINE_CHECK_S):
                if not engine.alive():  # a backend's server child died (vllm): so does this worker
                    print(f"mopt_runtime: the engine's server process exited with code {engine.exitcode}",
                          file=sys.stderr, flush=True)
                    os._exit(EXIT_ENGINE_CHILD_DIED)
            seqs = conn.recv()
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
    """What the server needs of an Engine (params, encoder, info, dim, embed_ids), with the engine
    in a worker process. start() returns once the worker's guard passed and the engine loaded."""

    def __init__(self, out_dir: str | Path):
        self.out_dir = str(out_dir)
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked CUDA or threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, args=(self.out_dir, child), name="mopt-engine", daemon=True)
        self._child_conn = child
        self.params: EngineParams | None = None
        self.encoder: TextEncoder | None = None
        self.info: dict = {}

    def start(self) -> EngineProcess:
        self._proc.start()
        self._child_conn.close()
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                raise RuntimeToolError(f"the engine process exited with code {self._proc.exitcode} while loading")
        try:
            msg = self._conn.recv()
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

    def embed_ids(self, seqs: list[list[int]]) -> list[list[float]]:
        """Called by the batcher's single thread only (one request in flight on the pipe)."""
        try:
            self._conn.send(seqs)
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            # The pipe breaks before the process is reaped: wait for it (bounded), so alive() is False
            # when the service decides between 503 engine_down and 500 (and the exit code is known).
            self._proc.join(WORKER_REAP_S)
            raise RuntimeError(f"the engine process is gone (exit code {self._proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"the engine process failed this batch: {payload}")
        flat = array("f")
        flat.frombytes(payload)
        dim = self.dim
        return [flat[i * dim:(i + 1) * dim].tolist() for i in range(len(seqs))]

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
