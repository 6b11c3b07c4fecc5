"""The vllm flavour's engine behind mopt's server, without vLLM: the in-process client against a
stand-in for the vLLM functions it calls (vLLM does not install beside this venv's torch; it runs in
the image), the writable mirror of a read-only compile cache, and the worker's exit when the engine's
process dies. vLLM itself behind mopt's server runs in tests/integration/test_vllm_cpu.py."""
from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from builder.runtime import worker
from builder.runtime.backends import vllm_backend as vb
from builder.runtime.engine import Engine
from builder.runtime.params import EngineParams

# A stand-in for the part of vLLM 0.32 that InProcess calls (vLLM itself runs in the image:
# tests/integration/test_vllm_cpu.py). Its engine answers each token-id sequence with the vector
# [len, first id] after a delay that makes later sequences finish first, records every request id, and
# can die (DEAD): then encode raises and errored is true, as AsyncLLM's are once EngineCore is gone.
FAKE_VLLM = {
    "vllm/__init__.py": """
        class PoolingParams:
            def __init__(self, task):
                self.task, self.verified = task, None
            def verify(self, model_config):
                self.verified = model_config
    """,
    "vllm/inputs/__init__.py": "",
    "vllm/inputs/engine.py": """
        def tokens_input(ids):
            return {"type": "token", "prompt_token_ids": ids}
    """,
    "vllm/utils/__init__.py": "",
    "vllm/utils/argparse_utils.py": """
        import argparse
        class FlexibleArgumentParser(argparse.ArgumentParser):
            pass
    """,
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/launchers/__init__.py": "",
    "vllm/entrypoints/launchers/cli_args.py": """
        def make_arg_parser(parser):
            for flag in ("--model", "--runner", "--dtype", "--max-model-len", "--max-num-seqs",
                         "--max-num-batched-tokens", "--seed", "--distributed-executor-backend",
                         "--served-model-name"):
                parser.add_argument(flag)
            return parser
        def validate_parsed_serve_args(args):
            args.validated = True
    """,
    "vllm/entrypoints/launchers/api_server/__init__.py": "",
    "vllm/entrypoints/launchers/api_server/entry.py": """
        import asyncio, contextlib, types
        ENGINES = []
        class Process:
            exitcode = None
            pid = None
        class FakeLLM:
            def __init__(self, args):
                self.args, self.request_ids, self.dead, self.shut = args, [], False, False
                self.hold, self.cancelled, self.pings = False, [], 0
                self.model_config = "model-config"
                self.engine_core = types.SimpleNamespace(resources=types.SimpleNamespace(
                    engine_manager=types.SimpleNamespace(processes=[Process()])))
            @property
            def errored(self):
                return self.dead
            async def encode(self, prompt, params, request_id):
                assert params.verified == "model-config" and prompt["type"] == "token"
                self.request_ids.append(request_id)
                if self.dead:
                    raise RuntimeError("EngineDeadError")
                ids = prompt["prompt_token_ids"]
                try:
                    await asyncio.sleep(0.05 / len(ids))
                    while self.hold:  # a stalled engine: nothing comes back
                        await asyncio.sleep(0.01)
                except asyncio.CancelledError:  # as AsyncLLM.encode: a cancelled request is aborted
                    self.cancelled.append(request_id)
                    raise
                import torch
                yield types.SimpleNamespace(outputs=types.SimpleNamespace(
                    data=torch.tensor([len(ids), ids[0]], dtype=torch.bfloat16)))
            async def is_sleeping(self):  # a utility call: EngineCore answers it from its own loop
                self.pings += 1
                while self.hold:
                    await asyncio.sleep(0.01)
                return False
        @contextlib.asynccontextmanager
        async def build_async_engine_client(args):
            llm = FakeLLM(args)
            ENGINES.append(llm)
            try:
                yield llm
            finally:
                llm.shut = True
    """,
}


def params(**kw) -> EngineParams:
    base = dict(backend="vllm", device="cpu", precision="fp32", max_batch=4, max_seq_len=16, pooling="mean",
                model_dir="/opt/mopt/model", model_name="mopt/minilm-embed")
    return EngineParams(**{**base, **kw})


@pytest.fixture
def in_process(tmp_path, monkeypatch):
    """InProcess over the stand-in vLLM (FAKE_VLLM), its environment changes undone afterwards."""
    for name, text in FAKE_VLLM.items():
        path = tmp_path / "fake" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    engines = []

    def start():
        engine = vb.InProcess(str(tmp_path / "model"), tmp_path / "cache", params(), timeout=30)
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        engine.close()
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def _fake_llm(engine):
    return sys.modules["vllm.entrypoints.launchers.api_server.entry"].ENGINES[-1]


def test_vllm_gets_the_argv_of_vllm_serve_and_its_environment(in_process, tmp_path):
    engine = in_process()
    args = _fake_llm(engine).args
    assert args.validated and args.model == str(tmp_path / "model")
    assert args.max_num_seqs == "4" and args.served_model_name == "mopt/minilm-embed"
    assert (args.dtype, args.distributed_executor_backend, args.max_model_len) == ("float32", "uni", "16")
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "cache")
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # this process has threads: no fork
    assert engine.alive() and engine.exitcode() is None and engine.start_seconds >= 0


def test_token_ids_go_to_vllm_as_they_are_and_come_back_float32_in_order(in_process):
    engine = in_process()
    out = engine.embed_ids([[5, 6, 7], [9], [4, 4]])  # the one-token sequence finishes first
    assert str(out.dtype) == "torch.float32" and out.tolist() == [[3.0, 5.0], [1.0, 9.0], [2.0, 4.0]]
    import torch

    ids = torch.tensor([[5, 6, 7, 0], [9, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert engine(ids, mask).tolist() == [[3.0, 5.0], [1.0, 9.0]]  # the padded engine call: padding dropped
    assert engine.embed([[1]]) == [[1.0, 1.0]]
    ids_seen = _fake_llm(engine).request_ids
    assert len(ids_seen) == len(set(ids_seen)) == 6  # a request id of its own for every sequence


def test_calls_from_several_threads_run_side_by_side(in_process):
    """mopt's engine threads call at once; both calls are in vLLM's scheduler together."""
    from concurrent.futures import ThreadPoolExecutor

    engine = in_process()
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda k: engine.embed_ids([[k] * 1] * 8).tolist(), range(1, 5)))
    assert outs == [[[1.0, float(k)]] * 8 for k in range(1, 5)]


def test_a_dead_engine_is_seen_as_dead_and_its_calls_fail(in_process):
    engine = in_process()
    llm = _fake_llm(engine)
    llm.dead = True
    llm.engine_core.resources.engine_manager.processes[0].exitcode = -9
    assert not engine.alive() and engine.exitcode() == -9
    with pytest.raises(RuntimeError, match="EngineDeadError"):
        engine.embed_ids([[1]])


def _pending_call(engine):
    """A call from an engine thread that vLLM never answers, and a way to see how it ended."""
    from concurrent.futures import ThreadPoolExecutor

    _fake_llm(engine).hold = True
    pool = ThreadPoolExecutor(1)
    call = pool.submit(engine.embed_ids, [[1, 2], [3]])
    deadline = time.monotonic() + 5
    while len(_fake_llm(engine).request_ids) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not call.done()
    return call, pool


def test_close_fails_a_call_in_flight_at_once(in_process):
    """vLLM's shutdown alone would leave it waiting forever (and Python's exit joining its thread)."""
    engine = in_process()
    llm = _fake_llm(engine)
    call, pool = _pending_call(engine)
    started = time.monotonic()
    engine.close()
    with pytest.raises(RuntimeError, match="shut down with this call in flight"):
        call.result(5)
    assert time.monotonic() - started < 3
    assert sorted(llm.cancelled) == sorted(llm.request_ids) and llm.shut  # aborted in vLLM, then shut down
    pool.shutdown()


def test_a_call_whose_loop_is_gone_does_not_wait_forever(in_process, monkeypatch):
    engine = in_process()
    call, pool = _pending_call(engine)
    monkeypatch.setattr(engine, "_fail_calls", lambda: __import__("asyncio").sleep(0))  # nothing fails it
    engine._loop.call_soon_threadsafe(engine._loop.stop)
    engine._thread.join(5)
    with pytest.raises(RuntimeError, match="shut down with this call in flight"):
        call.result(5)  # the slice check sees the loop's thread gone
    pool.shutdown()
    engine._loop.run_until_complete(vb.InProcess._fail_calls(engine))  # the test's own cleanup


def test_kill_fails_the_calls_and_kills_enginecore(in_process):
    """The watchdog's kill for a stalled engine: SIGKILL reaches a stopped EngineCore too."""
    import subprocess

    engine = in_process()
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc = _fake_llm(engine).engine_core.resources.engine_manager.processes[0]
        proc.pid = core.pid
        call, pool = _pending_call(engine)
        engine.kill()
        assert not engine.alive()  # at once: the failed calls are answered 503 engine_down, not 500
        assert core.wait(5) == -9
        with pytest.raises(RuntimeError, match="shut down with this call in flight"):
            call.result(5)
        pool.shutdown()
    finally:
        core.kill()
        core.wait()


def test_the_engine_passes_kill_on_and_names_its_death():
    killed = []

    class Run(_Run):
        def kill(self):
            killed.append(True)

    Engine(params(), encoder=None, run=Run(), info={}).kill()
    Engine(params(), encoder=None, run=_Run(), info={}).kill()  # nothing to kill: nothing happens
    assert killed == [True]
    assert Engine.DEATH == "the engine's own process exited" and worker.EngineProcess.DEATH == "the engine worker died"


def test_close_shuts_vllm_down_and_ends_the_loop(in_process):
    engine = in_process()
    llm = _fake_llm(engine)
    engine.close()
    assert llm.shut and not engine._thread.is_alive() and not engine.alive()
    engine.close()  # twice is harmless


def test_a_start_that_fails_leaves_no_loop_behind(in_process, monkeypatch):
    monkeypatch.setattr(vb, "engine_argv", lambda model, p: ["--no-such-flag"])
    threads = {t.name for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="vLLM refused the engine arguments"):  # argparse's exit, caught
        in_process()
    assert "mopt-vllm" not in {t.name for t in threading.enumerate()} - threads


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


class _Direct:
    """A backend that takes unpadded sequences itself (what vllm_backend.InProcess is to Engine)."""

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
    assert engine.embed_tensor([]).shape == (0, 2) and len(run.calls) == 1  # an empty call embeds nothing
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.embed_tensor([[1] * 17])


def test_the_batchers_ping_reaches_the_backends_engine_process(in_process):
    """An empty call (the batcher's idle ping) is a round trip to EngineCore (a utility call), so the
    watchdog sees an EngineCore that hangs while idle; it used to return at once, and a stopped
    EngineCore was reported healthy for as long as no request came (found when CI's stall test failed)."""
    from builder.runtime.batcher import Batcher

    run = in_process()
    llm = _fake_llm(run)
    engine = Engine(params(), encoder=None, run=run, info={"embedding_dim": 2})
    assert engine.embed_tensor([]).shape == (0, 2) and llm.pings == 1 and llm.request_ids == []
    llm.hold = True  # EngineCore stops answering
    batcher = Batcher(engine.embed_ids, max_batch=4, max_wait_ms=1, ping_interval_s=0.05, stall_timeout_s=0.3,
                      concurrent=engine.concurrent_calls)
    try:
        deadline = time.monotonic() + 5
        while batcher.stalled() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert batcher.stalled() is not None and llm.pings >= 2
    finally:
        run.kill()  # the ping in flight fails (the slice check sees the engine closed)
        batcher.close(5)


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
