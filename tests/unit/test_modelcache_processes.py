"""The engine cache's processes (builder/runtime/modelcache.py): two processes on one cache compile once,
and a server stopped during its first compile leaves no compile running. Apart from test_modelcache.py, whose
other compiles share one filled cache, so that pytest-xdist runs the two files' compiles side by side
(scripts/test.sh)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the runtime needs torch")
pytest.importorskip("transformers", reason="the runtime needs transformers")

from builder.runtime import modelcache  # noqa: E402
from builder.runtime.tiny_qwen3 import make_tiny_qwen3  # noqa: E402
from tests.unit.test_modelcache import FLAGS, REPO, outcome_of, source, warm  # noqa: E402

pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("mounted") / "model", seed=3)


def test_two_processes_on_one_cache_compile_once(tiny, tmp_path):
    cache = tmp_path / "shared"
    procs = [warm(tiny, cache), warm(tiny, cache)]
    results = [outcome_of(p) for p in procs]
    assert sorted(r["outcome"] for r in results) == ["compiled", "hit"]
    assert results[0]["engine_dir"] == results[1]["engine_dir"]
    assert len([p for p in (cache / "engines").iterdir() if p.is_dir()]) == 1


def compiling(model: Path) -> list[int]:
    """Processes whose command line is a compile of MODEL (read from /proc: no procps needed)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"compile" in argv and str(model).encode() in argv:
            found.append(int(cmdline.parent.name))
    return found


def test_a_server_stopped_during_its_first_compile_leaves_no_compile_running(tiny, tmp_path):
    """SIGTERM while the first start compiles: the server exits 0 and its compile child dies with it
    (PR_SET_PDEATHSIG); the next start sweeps the remains and compiles."""
    import signal
    import time

    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-m", "builder.runtime", "serve", "--model-id", str(tiny),
                             "--cache-dir", str(cache), *FLAGS, "--host", "127.0.0.1", "--port", "0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((cache / "engines").glob(".tmp-*/")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)
        assert compiling(tiny), "the compile child was running"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and '"event": "stopped"' in out
    time.sleep(1)
    assert not compiling(tiny)
    assert modelcache.resolve_cached(source(tiny, cache)).outcome == "compiled"
    assert not list((cache / "engines").glob(".tmp-*"))
