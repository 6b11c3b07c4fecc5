"""The torch-inductor image path on the real Docker daemon, on the CPU: the runtime-torch-inductor
template, the standalone Inductor artifact compiled in a container of the exact runtime image,
the final image and its smoke test (health, dimension, cosine vs reference, guard, non-root), and
the image run hardened (read-only root, noexec /tmp: its kernels ship built, in the engine dir).

The CUDA `aot` flavour ships this backend; no GPU with Docker exists here, so the same template
and compile step are built for a cpu variant added to a copy of the matrix (the shipped matrix
has no such variant). The H200 run of the same backend is in docs/performance.md.
"""
from __future__ import annotations

import json

import pytest

from builder.state import StateDir
from tests.integration.conftest import STATE, copy_matrix
from tests.integration.conftest import mopt_cli as mopt
from tests.integration.served import ServedContainer, embed

pytestmark = pytest.mark.integration
VARIANT = "minilm-embed:cpu-inductor"
FLAVOUR = '''      cpu-inductor:
        backend: torch-inductor
        device: cpu
        set: {base: debian12, python: "3.11", torch: "2.13.0"}
        tag: cpu-inductor
'''


@pytest.fixture(scope="module")
def inductor_release(docker_cli, tmp_path_factory):
    work = copy_matrix(tmp_path_factory.mktemp("inductor"))
    matrix = work / "matrix.yaml"
    text = matrix.read_text()
    anchor = "      # vLLM's CPU build"
    assert anchor in text, "matrix.yaml changed: put the test flavour next to minilm-embed's cpu flavours"
    matrix.write_text(text.replace(anchor, FLAVOUR + anchor, 1))
    result = mopt("release", "--matrix", str(matrix), "--select", VARIANT, cwd=work)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((STATE / "reports" / "latest.json").read_text())
    return result, report


def test_inductor_image_is_built_and_smoke_tested(inductor_release):
    _, report = inductor_release
    row = next(v for v in report["variants"] if v["id"] == VARIANT)
    assert row["status"] == "tested" and row["tested"] is True


def test_inductor_engine_is_the_standalone_artifact(inductor_release):
    record = StateDir(STATE).read_record("minilm-embed", "cpu-inductor")
    engine = record.engine_dir
    info = json.loads((engine / "engine.json").read_text())
    assert info["backend"] == "torch-inductor" and info["device"] == "cpu"
    files = info["engine_files"]
    assert {"inductor-artifact.bin", "graph.json", "graph-tensors-00001.safetensors"} <= set(files)
    # the kernels a load of the artifact builds, built at compile time and shipped
    assert any(f.startswith("inductor-cache/") and f.endswith(".so") for f in files)
    manifest = json.loads((engine / "engine" / "compile_cache.json").read_text())
    assert manifest["form"] == "artifact" and manifest["artifact"]["check_cosine"] >= 0.99


def test_inductor_image_serves_hardened_and_writes_no_kernel(docker_cli, inductor_release):
    """Read-only root, plain (noexec) /tmp, no capabilities: the shipped kernels load through links."""
    _, report = inductor_release
    row = next(v for v in report["variants"] if v["id"] == VARIANT)
    served = ServedContainer(docker_cli.path, row["image_id"], docker_args=("--user", "4242:4242"))
    try:
        served.start(health_timeout_s=240)
        status, body = embed(served.port, {"input": ["a", "bb"]})
        assert status == 200 and [len(d["embedding"]) for d in body["data"]] == [384, 384], body
        assert served.exec("find", "/tmp", "-type", "f", "-name", "*.so") == ""
        link = served.exec("sh", "-c", "find /tmp -type l -name '*.so' | head -1 | xargs readlink")
        assert link.startswith("/opt/mopt/engine/engine/inductor-cache/"), link
    finally:
        served.stop()
