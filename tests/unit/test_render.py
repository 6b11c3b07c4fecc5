"""Rendering: golden files, byte-identical re-runs, strict templates, labels and NVIDIA env."""
import os
import shutil
from pathlib import Path

import pytest

from builder.errors import ConfigError
from builder.matrix import load_matrix
from builder.plan import make_plan
from builder.render import render, render_variant

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
GOLDEN_IDS = ["qwen3-embed:cu121-sm86", "qwen3-embed:cu128-sm90-vllm", "qwen3-embed:cu130-sm90-aot",
              "qwen3-embed:cpu", "minilm-embed:cpu", "qwen3-chat:cu130-sm90-trtllm", "minilm-embed:cpu-vllm",
              "qwen3-embed:cu130-sm90-aot-debian", "qwen3-embed:cu130-sm90-vllm-debian"]
FIXED_RUNTIME_DIGEST = "0" * 64  # golden files must not change whenever the runtime code does


@pytest.fixture(scope="module")
def planned(request):
    repo = Path(__file__).resolve().parent.parent.parent
    matrix = load_matrix(repo / "matrix.yaml")
    return repo, matrix, make_plan(matrix)


@pytest.mark.parametrize("variant_id", GOLDEN_IDS)
def test_golden(planned, variant_id):
    repo, matrix, plan = planned
    variant = next(v for v in plan.variants if v.id == variant_id)
    rendered = render_variant(matrix, variant, repo / "templates", FIXED_RUNTIME_DIGEST, plan.variants)
    directory = GOLDEN / variant.image / variant.tag
    if os.environ.get("MOPT_UPDATE_GOLDEN") == "1":
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        for name, text in rendered.files.items():
            (directory / name).write_text(text)
    expected = {p.name: p.read_text() for p in directory.iterdir()}
    assert sorted(expected) == sorted(rendered.files)
    for name, text in rendered.files.items():
        assert text == expected[name], f"{variant_id}/{name} differs from tests/golden (MOPT_UPDATE_GOLDEN=1)"


def test_rerender_is_byte_identical(planned, tmp_path):
    repo, matrix, plan = planned
    first = render(matrix, plan.variants, tmp_path / "a", all_variants=plan.variants)
    render(matrix, plan.variants, tmp_path / "b", all_variants=plan.variants)
    assert len(first) == len(plan.variants)
    for directory in first:
        rel = directory.relative_to(tmp_path / "a")
        for f in directory.iterdir():
            assert f.read_bytes() == (tmp_path / "b" / rel / f.name).read_bytes()


def test_final_stage_labels_and_nvidia_env(planned):
    repo, matrix, plan = planned
    variant = next(v for v in plan.variants if v.id == "qwen3-embed:cu128-sm90-aot")
    final = render_variant(matrix, variant, repo / "templates", FIXED_RUNTIME_DIGEST).files["Dockerfile.final"]
    for label in ('org.opencontainers.image.version="cu128-sm90-aot-', 'io.mopt.cuda="12.8"', 'io.mopt.sm="90"',
                  'io.mopt.driver.min="570.26"', 'io.mopt.backend="torch-aot"',
                  'io.mopt.backend.version="2.11.0"'):
        assert label in final
    assert 'ENV NVIDIA_REQUIRE_CUDA="cuda>=12.8' in final
    assert "NVIDIA_VISIBLE_DEVICES=all" in final and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in final
    assert "USER 10001:10001" in final
    cpu = next(v for v in plan.variants if v.id == "minilm-embed:cpu")
    cpu_files = render_variant(matrix, cpu, repo / "templates", FIXED_RUNTIME_DIGEST).files
    assert "NVIDIA_REQUIRE_CUDA" not in cpu_files["Dockerfile.final"]
    # AOTInductor's C++ build on CUDA needs the CUDA headers and libcuda's link stub, in the toolchain
    # stage (compile only); the cpu image needs neither, and no runtime stage of torch-aot has a compiler
    files = render_variant(matrix, variant, repo / "templates", FIXED_RUNTIME_DIGEST).files
    assert "for p in g++ python3-dev cuda-cudart-dev-12-8 cuda-driver-dev-12-8; do" in files["Dockerfile.toolchain"]
    assert "CUDA_HOME=/usr/local/cuda" in files["Dockerfile.toolchain"]
    assert "g++" not in files["Dockerfile.runtime"] and "CUDA_HOME" not in files["Dockerfile.runtime"]
    cpu_toolchain = cpu_files["Dockerfile.toolchain"]
    assert "for p in g++ python3-dev; do" in cpu_toolchain and "CUDA_HOME" not in cpu_toolchain


def test_no_syntax_directive_and_secrets_only_as_mounts(planned):
    repo, matrix, plan = planned
    for variant in plan.variants:
        files = render_variant(matrix, variant, repo / "templates", FIXED_RUNTIME_DIGEST).files
        for name, text in files.items():
            assert "# syntax=" not in text  # the frontend image would be pulled, and cannot be
            if name.startswith("Dockerfile"):
                assert "COPY ca" not in text and "ADD " not in text


def test_manifest_keys_change_with_inputs(planned):
    repo, matrix, plan = planned
    variant = next(v for v in plan.variants if v.id == "minilm-embed:cpu")
    a = render_variant(matrix, variant, repo / "templates", "0" * 64).manifest
    b = render_variant(matrix, variant, repo / "templates", "1" * 64).manifest
    keys_a = {s["name"]: s["key"] for s in a["stages"]}
    keys_b = {s["name"]: s["key"] for s in b["stages"]}
    assert keys_a["base"] == keys_b["base"]  # the runtime code is not in the base stage
    assert keys_a["runtime"] != keys_b["runtime"] and keys_a["final"] != keys_b["final"]


def test_undefined_template_variable_is_config_error(planned, tmp_path):
    repo, matrix, plan = planned
    templates = tmp_path / "templates"
    shutil.copytree(repo / "templates", templates)
    path = templates / "final.Dockerfile.j2"
    path.write_text(path.read_text() + "LABEL x={{ no_such_variable }}\n")
    with pytest.raises(ConfigError, match="final.Dockerfile.j2: template variable error: 'no_such_variable'"):
        render(matrix, plan.variants[:1], tmp_path / "out", templates)
    assert not (tmp_path / "out").exists()  # nothing half-rendered


def test_guard_knows_every_tag_of_the_flavour(planned):
    repo, matrix, plan = planned
    variant = next(v for v in plan.variants if v.id == "qwen3-embed:cu128-sm90-aot")
    info = render_variant(matrix, variant, repo / "templates", "0" * 64, plan.variants).files["image-info.json"]
    assert '"86": "cu128-sm86-aot"' in info and '"120": "cu128-sm120-aot"' in info


def test_no_pip_step_adds_an_index_where_one_index_serves_it(planned):
    """torch's CUDA builds come from PyTorch's index as the step's only index (--index-url): an extra index
    lets a same-named package on another index win. Only NVIDIA's wheels, whose PyPI entries are source
    stubs that fetch from NVIDIA's index, keep an extra index (every plan's runtime checked)."""
    repo, matrix, plan = planned
    seen_torch = seen_nvidia = 0
    for variant in plan.variants:
        runtime = render_variant(matrix, variant, repo / "templates", FIXED_RUNTIME_DIGEST,
                                 plan.variants).files["Dockerfile.runtime"]
        for line in runtime.splitlines():
            if "download.pytorch.org" in line:
                assert "--index-url https://download.pytorch.org/whl/cu" in line and "--extra-index" not in line, line
                seen_torch += 1
            if "--extra-index-url" in line:
                assert "--extra-index-url https://pypi.nvidia.com " in line, line
                seen_nvidia += 1
    assert seen_torch and seen_nvidia  # both kinds were rendered


def _files(planned, variant_id: str) -> dict:
    repo, matrix, plan = planned
    variant = next(v for v in plan.variants if v.id == variant_id)
    return render_variant(matrix, variant, repo / "templates", FIXED_RUNTIME_DIGEST).files


@pytest.mark.parametrize("variant_id", ["minilm-embed:cpu", "qwen3-embed:cu130-sm90-aot"])
def test_a_serving_only_runtime_prunes_in_each_install_and_its_toolchain_installs_it_again(planned, variant_id):
    from builder.render import defaults

    prune = defaults()["serving_prune"]
    files = _files(planned, variant_id)
    runs = [run for run in files["Dockerfile.runtime"].split("\nRUN ") if "pip install" in run]
    assert len(runs) == 2
    for run in runs:  # in the installing RUN itself: a later RUN would leave the files in a lower layer
        assert "pip uninstall -y -q " + " ".join(prune["packages"]) in run
        assert "rm -rf " + " ".join(prune["torch_paths"]) in run
    toolchain = files["Dockerfile.toolchain"]
    torch_arg = next(a for a in runs[0].split() if a.startswith("torch==")).rstrip(";")
    fetched = [line for line in toolchain.splitlines() if "pip download" in line]
    assert any(torch_arg in line for line in fetched)  # torch's headers from the same wheel, not a reinstall
    assert any("--require-hashes --no-deps -d /tmp/torch-wheel -r /tmp/torch.txt" in line for line in fetched)
    assert "--force-reinstall" not in toolchain  # the runtime's torch binaries stay the ones that compile
    assert "extractall" in toolchain and " ".join(prune["restored_torch_paths"]) in toolchain
    assert "transformers==" in toolchain.split("pip download")[-1]
    assert 'io.mopt.model.weights="in-engine"' in files["Dockerfile.final"]


@pytest.mark.parametrize("variant_id", ["minilm-embed:cpu-vllm", "qwen3-embed:cu128-sm90-vllm",
                                        "qwen3-embed:cu121-sm86"])
def test_runtimes_that_compile_or_serve_with_their_packages_keep_them(planned, variant_id):
    files = _files(planned, variant_id)
    assert "pip uninstall -y -q transformers" not in files["Dockerfile.runtime"]
    assert "Dockerfile.toolchain" not in files
    assert 'io.mopt.model.weights="in-model-dir"' in files["Dockerfile.final"]
