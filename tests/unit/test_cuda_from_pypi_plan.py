"""CUDA variants on a base without CUDA (the project's Debian 12 rootfs): CUDA's libraries come from torch's
and vLLM's PyPI wheels alone. The plan holds each package's PyPI CUDA build to the variant's CUDA and each
backend to what it declares (cuda_from_pypi); the render installs exactly PyPI's build, gives the image
what NVIDIA's images set, and gives the toolchain a CUDA prefix made of PyPI wheels."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from builder import compat
from builder.backends import backend
from builder.matrix import load_matrix
from builder.plan import make_plan
from builder.render import defaults, render_variant

REPO = Path(__file__).resolve().parents[2]
DIGEST = "0" * 64


@pytest.fixture(scope="module")
def shipped():
    matrix = load_matrix(REPO / "matrix.yaml")
    return matrix, make_plan(matrix)


def plan_with(workdir: Path, flavour: dict):
    path = workdir / "matrix.yaml"
    data = yaml.safe_load(path.read_text())
    data["images"]["qwen3-embed"]["flavours"] = {"probe": flavour}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return make_plan(load_matrix(path), ("qwen3-embed:*",))


def test_the_shipped_debian_lines_take_pypis_cuda_13_builds(shipped):
    _, plan = shipped
    aot = [v for v in plan.variants if v.flavour == "aot-debian"]
    vllm = [v for v in plan.variants if v.flavour == "vllm-debian"]
    assert len(aot) == 7 and len(vllm) == 6
    for v in aot + vllm:
        assert (v.resolved.base.name, v.resolved.base.kind, v.resolved.cuda) == ("debian12", "rootfs", "13.0")
        assert v.resolved.torch_default_cuda == "13.0" and v.resolved.min_driver
        assert v.resolved.cuda_from_pypi is True
    assert {v.resolved.cuda_from_pypi for v in plan.variants if v.flavour in ("aot", "vllm", "cpu")} == {False}
    assert {(v.resolved.torch, v.resolved.torch_default_cuda_full) for v in aot} == {("2.11.0", "13.0.2")}
    assert {(v.resolved.vllm, v.resolved.torch, v.resolved.vllm_wheel_cuda) for v in vllm} == {
        ("0.32.0", "2.13.0", "13.0")}


def test_compat_holds_torchs_pypi_build_to_the_cuda_asked_for():
    # torch 2.9's PyPI wheel is CUDA 12.8; its CUDA 13.0 build is only on download.pytorch.org.
    assert compat.check(compat.Combo(cuda="12.8", torch="2.9.0", cuda_from_pypi=True)).compatible
    assert compat.check(compat.Combo(cuda="13.0", torch="2.9.0")).compatible
    refused = compat.check(compat.Combo(cuda="13.0", torch="2.9.0", cuda_from_pypi=True))
    assert not refused.compatible
    assert refused.reasons[0].startswith("on a base without CUDA, torch and CUDA's libraries come from PyPI, whose "
                                         "torch 2.9.0 is built for CUDA 12.8, not 13.0 (its other CUDA builds are "
                                         "on download.pytorch.org")


def test_compat_holds_vllms_pypi_wheels_to_the_cuda_asked_for():
    refused = compat.check(compat.Combo(cuda="12.8", vllm="0.32.0", python="3.11", cuda_from_pypi=True))
    assert any(r.startswith("on a base without CUDA, vLLM and CUDA's libraries come from PyPI, whose vLLM 0.32.0 "
                            "wheels are built for CUDA 13.0, not 12.8") for r in refused.reasons), refused.reasons
    # With a CUDA base it stays a warning: the image's own CUDA is another matter.
    assert not any(r.startswith("on a base without CUDA") for r in compat.check(
        compat.Combo(cuda="12.8", vllm="0.32.0", python="3.11")).reasons)


def test_newest_picks_a_torch_whose_pypi_build_fits(workdir):
    plan = plan_with(workdir, {"backend": "torch-aot", "device": "cuda", "axes": {"cuda": ["13.0"], "sm": [90]},
                               "newest": ["torch"], "set": {"base": "debian12", "python": "3.11"},
                               "tag": "cu{cuda_nodot}-sm{sm}-x"})
    (v,) = plan.variants
    assert v.resolved.torch_default_cuda == "13.0" and v.resolved.torch in ("2.11.0", "2.13.0")


def test_a_backend_that_cannot_is_refused_with_its_reason(workdir):
    plan = plan_with(workdir, {"backend": "tensorrt", "device": "cuda", "axes": {"cuda": ["13.0"], "sm": [90]},
                               "newest": ["tensorrt", "torch"], "set": {"base": "debian12", "python": "3.11"},
                               "tag": "cu{cuda_nodot}-sm{sm}-x", "runtime_source": "nvidia-pip"})
    assert not plan.variants
    why = backend("tensorrt").cuda_from_pypi_why
    assert f"backend tensorrt cannot build on base debian12, which has no CUDA of its own: {why}" in \
        plan.rejected[0].reasons
    assert "pypi.nvidia.com" in why


def test_torch_aot_needs_cuda_13_from_pypi(workdir):
    plan = plan_with(workdir, {"backend": "torch-aot", "device": "cuda", "axes": {"cuda": ["12.8"], "sm": [90]},
                               "set": {"base": "debian12", "python": "3.11", "torch": "2.9.0"},
                               "tag": "cu{cuda_nodot}-sm{sm}-x"})
    assert not plan.variants
    (reason,) = plan.rejected[0].reasons  # torch 2.9's PyPI build is CUDA 12.8: only the backend's rule
    assert reason.startswith("backend torch-aot builds on a base without CUDA from CUDA 13.0 on, not 12.8: "
                             "AOTInductor compiles a C++ wrapper")


def _files(shipped, variant_id: str) -> dict:
    matrix, plan = shipped
    variant = next(v for v in plan.variants if v.id == variant_id)
    return render_variant(matrix, variant, REPO / "templates", DIGEST).files


def test_the_runtime_installs_exactly_pypis_build(shipped):
    runtime = _files(shipped, "qwen3-embed:cu130-sm90-aot-debian")["Dockerfile.runtime"]
    # === : a wheelhouse's 2.11.0+cpu satisfies ==2.11.0, not ===2.11.0
    assert "pip install --find-links /wheelhouse torch===2.11.0;" in runtime
    assert "--index-url" not in runtime and "download.pytorch.org" not in runtime
    vllm = _files(shipped, "qwen3-embed:cu130-sm90-vllm-debian")["Dockerfile.runtime"]
    assert "pip install --find-links /wheelhouse torch===2.13.0 vllm==0.32.0;" in vllm


def test_a_cuda_image_leaves_triton_out_and_a_cpu_image_has_none_to_leave(shipped):
    cuda = _files(shipped, "qwen3-embed:cu130-sm90-aot-debian")["Dockerfile.runtime"]
    cpu = _files(shipped, "minilm-embed:cpu")["Dockerfile.runtime"]
    prune = defaults()["serving_prune"]
    assert prune["cuda_packages"] == ["triton"]
    assert cuda.count(" ".join(prune["packages"] + ["triton"]) + " 2>&1") == 2  # both installing RUNs
    assert "triton" not in cpu and cpu.count(" ".join(prune["packages"]) + " 2>&1") == 2


def test_the_base_says_what_nvidias_images_say(shipped):
    base = _files(shipped, "qwen3-embed:cu130-sm90-aot-debian")["Dockerfile.base"]
    assert "ARG BASE_IMAGE=mopt/base:debian12" in base
    for line in ("NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
                 'NVIDIA_REQUIRE_CUDA="cuda>=13.0', "LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
                 'com.nvidia.volumes.needed="nvidia_driver"', 'com.nvidia.cuda.version="13.0"'):
        assert line in base, line
    nvidia = _files(shipped, "qwen3-embed:cu130-sm90-aot")["Dockerfile.base"]
    assert "NVIDIA_VISIBLE_DEVICES" not in nvidia  # NVIDIA's own base sets them
    cpu = _files(shipped, "minilm-embed:cpu")["Dockerfile.base"]
    assert "NVIDIA_" not in cpu


def test_the_toolchain_makes_a_cuda_prefix_of_pypi_wheels(shipped):
    toolchain = _files(shipped, "qwen3-embed:cu130-sm90-aot-debian")["Dockerfile.toolchain"]
    assert "'cuda-toolkit[nvcc]==13.0.2'" in toolchain  # the release torch 2.11.0 pins
    assert "ENV CUDA_HOME=/opt/venv/lib/python3.11/site-packages/nvidia/cu13" in toolchain
    assert 'ln -sf /usr/lib/x86_64-linux-gnu/libcuda.so.1 "$CUDA_HOME/lib/stubs/libcuda.so"' in toolchain
    assert "cuda-cudart-dev" not in toolchain and "/usr/local/cuda" not in toolchain
    nvidia = _files(shipped, "qwen3-embed:cu130-sm90-aot")["Dockerfile.toolchain"]
    assert "cuda-cudart-dev-13-0" in nvidia and "ENV CUDA_HOME=/usr/local/cuda" in nvidia
    assert "cuda-toolkit[nvcc]" not in nvidia


def test_a_torch_that_another_pin_implies_is_only_warned_about():
    """TensorRT-LLM 1.1 implies torch 2.9.0 (PyPI CUDA 12.8); its releases ship their own torch build, so
    the rule warns, with the reason, and does not refuse."""
    verdict = compat.check(compat.Combo(tensorrt_llm="1.1", cuda="13.0", cuda_from_pypi=True))
    assert verdict.compatible and verdict.resolved["torch_from"] == "tensorrt_llm"
    (warning,) = [w for w in verdict.warnings if w.startswith("on a base without CUDA")]
    assert "torch 2.9.0 is built for CUDA 12.8, not 13.0" in warning and "not enforced" in warning


def test_compat_resolves_the_exact_cuda_release_torch_pins():
    for torch, full in (("2.11.0", "13.0.2"), ("2.13.0", "13.0.3"), ("2.9.0", None)):
        verdict = compat.check(compat.Combo(cuda="13.0", torch=torch, cuda_from_pypi=torch != "2.9.0"))
        assert verdict.resolved["torch_default_cuda_full"] == full, torch


def test_the_plan_passes_the_base_to_the_newest_pick(workdir):
    """On a base without CUDA the newest torch whose PyPI build is CUDA 12.8 wins (2.9.0); on NVIDIA's base
    the newest with a confirmed CUDA 12.8 build on PyTorch's index (2.11.0)."""
    from builder.plan import _combo, _pick_newest

    assert _combo({"cuda": "12.8", "base": "debian12"}, True).cuda_from_pypi is True
    assert _combo({"cuda": "12.8", "base": "debian12"}, False).cuda_from_pypi is False
    path = workdir / "matrix.yaml"
    data = yaml.safe_load(path.read_text())
    flavour = {"backend": "torch-aot", "device": "cuda", "axes": {"cuda": ["12.8"], "sm": [90]}, "newest": ["torch"],
               "tag": "cu{cuda_nodot}-sm{sm}-x"}
    data["images"]["qwen3-embed"]["flavours"] = {
        "deb": {**flavour, "set": {"base": "debian12", "python": "3.11"}},
        "nv": {**flavour, "set": {"base": "nvidia-cuda", "python": "3.10"}, "tag": "cu{cuda_nodot}-sm{sm}-y"}}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    matrix = load_matrix(path)
    picked = {}
    for f in matrix.image("qwen3-embed").flavours:
        combo = {"cuda": "12.8", "sm": "90", **f.fixed}
        reasons, _ = _pick_newest(matrix, f, combo)
        picked[f.name] = (reasons, combo["torch"])
    assert picked == {"deb": ([], "2.9.0"), "nv": ([], "2.11.0")}
    fixed = {"cuda": "13.0", "sm": "90", "base": "debian12", "python": "3.11", "torch": "2.9.0"}
    deb = next(f for f in matrix.image("qwen3-embed").flavours if f.name == "deb")
    reasons, _ = _pick_newest(matrix, deb, dict(fixed))
    assert reasons and reasons[0].startswith("on a base without CUDA, torch and CUDA's libraries come from PyPI")


def test_an_undeclared_fact_is_named_exactly():
    from builder.plan import BaseImage, Resolved

    with pytest.raises(TypeError) as exc:
        Resolved.of({"b_fact": 1, "a_fact": 2, "torch": "2.11.0"}, python="3.11",
                    base=BaseImage("debian12", "rootfs", "mopt/base:debian12"), backend_version="2.11.0",
                    runtime_source="pypi")
    assert str(exc.value) == "compat.check resolved a_fact, b_fact, which plan.Resolved does not declare"
