"""The rendered Dockerfiles of issue 15's image side: ENTRYPOINT + CMD, the serve settings as MOPT_*
defaults, a HEALTHCHECK that reads MOPT_PORT, the engine and model owned by root, no setuid files
and no pip in the final image, no compiler in a torch-aot serving image (the toolchain stage has it),
and the compiler label. The real image is checked in tests/integration/test_hardened_image.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from builder.matrix import load_matrix
from builder.plan import make_plan
from builder.render import entrypoint, render_variant

REPO = Path(__file__).resolve().parent.parent.parent
DIGEST = "0" * 64


@pytest.fixture(scope="module")
def rendered():
    matrix = load_matrix(REPO / "matrix.yaml")
    variants = make_plan(matrix).variants

    def files(variant_id: str) -> dict[str, str]:
        variant = next(v for v in variants if v.id == variant_id)
        return render_variant(matrix, variant, REPO / "templates", DIGEST, variants).files

    return files


def _instruction(dockerfile: str, name: str) -> str:
    """The one NAME instruction's text, continuation lines joined."""
    joined = dockerfile.replace("\\\n", " ")
    found = [line for line in joined.splitlines() if line.startswith(name + " ")]
    assert len(found) == 1, (name, found)
    return found[0][len(name) + 1:].strip()


VARIANTS = ["minilm-embed:cpu", "qwen3-embed:cu130-sm90-aot", "qwen3-embed:cu128-sm90-vllm",
            "qwen3-chat:cu130-sm90-trtllm", "qwen3-embed:cu121-sm86"]


@pytest.mark.parametrize("variant_id", VARIANTS)
def test_entrypoint_is_the_serve_command_and_cmd_is_empty(rendered, variant_id):
    final = rendered(variant_id)["Dockerfile.final"]
    assert json.loads(_instruction(final, "ENTRYPOINT")) == ["python", "-m", "mopt_runtime", "serve"]
    assert json.loads(_instruction(final, "CMD")) == []
    assert "--port" not in _instruction(final, "ENTRYPOINT")  # the port comes from MOPT_PORT


def test_a_port_in_the_recipe_command_is_dropped():
    command = ("python", "-m", "mopt_runtime", "serve", "--engine-dir", "/opt/mopt/engine", "--port", "8000")
    assert entrypoint(command) == ["python", "-m", "mopt_runtime", "serve", "--engine-dir", "/opt/mopt/engine"]
    assert entrypoint(("serve", "--port=9000", "--max-batch", "4")) == ["serve", "--max-batch", "4"]
    assert entrypoint(("serve", "--port", "1", "--max-batch", "4", "--port", "2", "--x")) == [
        "serve", "--max-batch", "4", "--x"]


def test_serve_settings_reach_the_image_as_env_defaults(rendered):
    env = _instruction(rendered("minilm-embed:cpu")["Dockerfile.final"], "ENV")
    # images/minilm-embed/image.yaml: port 8000, max_inputs 2048, max_wait_ms 5
    for pair in ("MOPT_ENGINE_DIR=/opt/mopt/engine", "MOPT_PORT=8000", "MOPT_MAX_INPUTS=2048", "MOPT_MAX_WAIT_MS=5.0"):
        assert pair in env.split()
    qwen = rendered("qwen3-embed:cu130-sm90-aot")["Dockerfile.final"]
    assert "MOPT_MAX_INPUTS=2048 \\\n" in qwen and "MOPT_PORT=8000 \\\n" in qwen


@pytest.mark.parametrize("variant_id", VARIANTS)
def test_healthcheck_reads_the_port_when_it_runs(rendered, variant_id):
    check = _instruction(rendered(variant_id)["Dockerfile.final"], "HEALTHCHECK")
    argv = json.loads(check.split(" CMD ", 1)[1])
    assert argv[:2] == ["python", "-c"]
    assert "os.environ.get('MOPT_PORT'" in argv[2] and ":8000/" not in argv[2]
    # healthy = the engine has loaded (mopt's /ready); TensorRT-LLM's own server has /health only
    path = "/health" if variant_id.endswith("-trtllm") else "/ready"
    assert f"+ '{path}', timeout=4)" in argv[2]


@pytest.mark.parametrize("variant_id", VARIANTS)
def test_engine_and_model_are_copied_owned_by_root(rendered, variant_id):
    final = rendered(variant_id)["Dockerfile.final"]
    copies = [line for line in final.splitlines() if line.startswith("COPY ")]
    assert copies == ["COPY engine/ /opt/mopt/engine/", "COPY model/ /opt/mopt/model/"]
    # nothing goes to the serving user, vLLM's compile cache included (it is served through a mirror)
    assert [line for line in final.splitlines() if "chown" in line and not line.startswith("#")] == []
    # the user switch comes after the copies and the root-only RUN
    assert final.index("USER 10001:10001") > max(final.index(c) for c in copies)
    assert final.index("USER 10001:10001") > final.rindex("RUN ")


@pytest.mark.parametrize("variant_id", VARIANTS)
def test_final_stage_strips_setuid_and_removes_pip(rendered, variant_id):
    joined = rendered(variant_id)["Dockerfile.final"].replace("\\\n", " ")
    run = next(line for line in joined.splitlines() if line.startswith("RUN "))  # the first, as root
    assert "find / -xdev -perm /6000 -type f -exec chmod a-s {} +" in run
    assert "/opt/venv/bin/python -m pip uninstall -y -q pip" in run


@pytest.mark.parametrize("variant_id", ["minilm-embed:cpu", "qwen3-embed:cu130-sm90-aot", "qwen3-embed:cpu"])
def test_torch_aot_serving_stage_has_no_compiler_and_the_toolchain_stage_has(rendered, variant_id):
    files = rendered(variant_id)
    steps = "\n".join(line for line in files["Dockerfile.runtime"].splitlines() if not line.startswith("#"))
    assert not re.search(r"\bg\+\+|python3-dev|cuda-cudart-dev", steps)
    assert "for p in g++ python3-dev" in files["Dockerfile.toolchain"]
    assert _instruction(files["Dockerfile.toolchain"], "FROM") == "${RUNTIME_IMAGE}"
    final = files["Dockerfile.final"]
    assert 'io.mopt.compiler="none"' in final and "io.mopt.compiler.reason" not in final
    stages = json.loads(files["manifest.json"])["stages"]
    assert [(s["name"], s.get("parent")) for s in stages] == [
        ("base", None), ("runtime", "base"), ("toolchain", "runtime"), ("compile", "toolchain"),
        ("final", "runtime")]


def test_flavours_that_compile_at_run_time_keep_the_compiler_and_say_why(rendered):
    vllm = rendered("qwen3-embed:cu128-sm90-vllm")
    assert "Dockerfile.toolchain" not in vllm
    assert 'io.mopt.compiler="g++"' in vllm["Dockerfile.final"]
    assert re.search(r'io\.mopt\.compiler\.reason="[^"]+torch\.compile', vllm["Dockerfile.final"])
    assert "g++" in vllm["Dockerfile.runtime"]


def test_tensorrt_llm_says_its_image_carries_gcc(rendered):
    final = rendered("qwen3-chat:cu130-sm90-trtllm")["Dockerfile.final"]
    assert 'io.mopt.compiler="gcc"' in final and "gfortran" in final
    assert 'io.mopt.compiler="none"' in rendered("qwen3-embed:cu121-sm86")["Dockerfile.final"]  # tensorrt


def test_our_servers_get_prometheus_client(rendered):
    for variant_id in ("minilm-embed:cpu", "qwen3-embed:cu130-sm90-aot", "qwen3-embed:cu121-sm86"):
        assert "prometheus_client==" in rendered(variant_id)["Dockerfile.runtime"], variant_id


@pytest.mark.parametrize("changed,moved", [
    ("runtime-torch-aot.Dockerfile.j2", {"runtime", "toolchain", "compile", "final"}),
    ("toolchain-torch-aot.Dockerfile.j2", {"toolchain", "compile", "final"}),
    ("final.Dockerfile.j2", {"final"}),
])
def test_toolchain_stage_key_chain(tmp_path, changed, moved):
    """The compile key hangs on the toolchain's, which hangs on the runtime's: a changed compiler
    recompiles the engine; the final image does not depend on the toolchain but on the engine."""
    import shutil

    matrix = load_matrix(REPO / "matrix.yaml")
    variants = make_plan(matrix).variants
    variant = next(v for v in variants if v.id == "minilm-embed:cpu")

    def keys(root: Path) -> dict[str, str]:
        return {s["name"]: s["key"] for s in render_variant(matrix, variant, root, DIGEST).manifest["stages"]}

    shutil.copytree(REPO / "templates", tmp_path / "a")
    shutil.copytree(REPO / "templates", tmp_path / "b")
    (tmp_path / "b" / changed).write_text((tmp_path / "b" / changed).read_text() + "\n# changed\n")
    a, b = keys(tmp_path / "a"), keys(tmp_path / "b")
    assert {name for name in a if a[name] != b[name]} == moved
