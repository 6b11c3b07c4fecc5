"""Plan expansion: crossing, include/exclude, newest picks, compat rejections, tags, select."""
from pathlib import Path

import pytest
import yaml

from builder.errors import ConfigError
from builder.matrix import load_matrix
from builder.plan import make_plan


def shipped_plan(repo):
    return make_plan(load_matrix(repo / "matrix.yaml"))


def edit(workdir: Path, fn) -> Path:
    path = workdir / "matrix.yaml"
    data = yaml.safe_load(path.read_text())
    fn(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_shipped_plan_shape(repo):
    plan = shipped_plan(repo)
    ids = {v.id for v in plan.variants}
    assert "qwen3-embed:cu121-sm86" in ids
    assert "qwen3-embed:cpu" in ids and "minilm-embed:cpu" in ids
    assert "qwen3-embed:cu128-sm90-vllm" in ids and "qwen3-embed:cu130-sm90-aot" in ids
    # Blackwell needs CUDA 12.8: rejected by the knowledge base, not hand-excluded.
    rejected = {r.id: r for r in plan.rejected}
    assert "qwen3-embed:cu121-sm100" in rejected and "qwen3-embed:cu124-sm120" in rejected
    assert "12.8" in rejected["qwen3-embed:cu121-sm100"].reasons[0]
    assert "qwen3-embed:cu128-sm100" in ids and "qwen3-embed:cu130-sm120" in ids


def test_tags_and_resolved(repo):
    plan = shipped_plan(repo)
    v = next(v for v in plan.variants if v.id == "qwen3-embed:cu121-sm86")
    assert v.tag == "cu121-sm86" and v.repository == "mopt/qwen3-embed"
    assert v.long_tag.startswith("cu121-sm86-cuda12.1-trt") and v.long_tag.endswith("-b1")
    assert v.resolved.min_driver == "530.30.02"
    assert v.resolved.require_cuda.startswith("cuda>=12.1")
    assert v.resolved.backend_version == v.resolved.tensorrt
    cpu = next(v for v in plan.variants if v.id == "qwen3-embed:cpu")
    assert cpu.tag == "cpu" and cpu.axes.cuda is None and cpu.resolved.torch == "2.13.0"


def test_vllm_torch_resolved_from_pin(repo):
    plan = shipped_plan(repo)
    v = next(v for v in plan.variants if v.id == "qwen3-embed:cu128-sm90-vllm")
    # vLLM 0.11.0 pins torch 2.8.0 (PyPI requires_dist); vLLM 0.26's wheels are CUDA 13 builds.
    assert (v.resolved.vllm, v.resolved.torch) == ("0.11.0", "2.8.0")


def test_newest_pick_prefers_confirmed(repo):
    plan = shipped_plan(repo)
    v = next(v for v in plan.variants if v.id == "qwen3-embed:cu121-sm86")
    # torch 2.13's CUDA 12.1 build is UNCONFIRMED; 2.5.1 has a confirmed cu121 build.
    assert v.resolved.torch == "2.5.1"


def test_exclude_and_include(workdir):
    def change(d):
        f = d["images"]["qwen3-embed"]["flavours"]["tensorrt"]
        f["exclude"] = [{"cuda": "12.1"}]
        f["include"] = [{"cuda": "12.1", "sm": 86}]
    plan = make_plan(load_matrix(edit(workdir, change)))
    ids = {v.id for v in plan.variants}
    assert "qwen3-embed:cu121-sm86" in ids  # included back
    assert "qwen3-embed:cu121-sm80" not in ids  # excluded
    assert not any(r.id.startswith("qwen3-embed:cu121-sm100") for r in plan.rejected)


def test_driver_floor_rejects(workdir):
    plan = make_plan(load_matrix(edit(workdir, lambda d: d["images"]["qwen3-embed"]["flavours"]["tensorrt"]
                                      ["set"].__setitem__("driver", "535"))))
    cuda = {v.resolved.cuda for v in plan.variants if v.flavour == "tensorrt"}
    assert cuda == {"12.1"}
    reason = next(r for r in plan.rejected if r.id == "qwen3-embed:cu124-sm86").reasons[0]
    assert "550.54.14" in reason and "cuda>=12.4" in reason


def test_tag_collision_is_a_config_error(workdir):
    path = edit(workdir, lambda d: d["images"]["qwen3-embed"]["flavours"]["vllm"].__setitem__(
        "tag", "cu{cuda_nodot}-sm{sm}"))
    with pytest.raises(ConfigError, match="same tag qwen3-embed:cu128-sm80"):
        make_plan(load_matrix(path))


def test_tag_variable_missing_in_flavour(workdir):
    path = edit(workdir, lambda d: d["images"]["minilm-embed"]["flavours"]["cpu"].__setitem__(
        "tag", "cpu-cu{cuda_nodot}"))
    with pytest.raises(ConfigError, match=r"uses \{cuda_nodot\}, which this flavour does not have"):
        make_plan(load_matrix(path))


def test_select_globs(repo):
    matrix = load_matrix(repo / "matrix.yaml")
    plan = make_plan(matrix, ("qwen3-embed:cu128-*", "minilm-embed:*"))
    assert plan.variants and all(v.id.startswith(("qwen3-embed:cu128-", "minilm-embed:")) for v in plan.variants)
    with pytest.raises(ConfigError, match="--select 'nothing:\\*' matches no variant"):
        make_plan(matrix, ("nothing:*",))


def test_base_python_mismatch_rejected(workdir):
    plan = make_plan(load_matrix(edit(workdir, lambda d: d["images"]["minilm-embed"]["flavours"]["cpu"]["set"]
                                      .__setitem__("python", "3.10"))))
    rejected = next(r for r in plan.rejected if r.image == "minilm-embed")
    assert "base debian12 ships Python 3.11, not 3.10" in rejected.reasons


def test_large_matrix_plans(workdir):
    """1,000+ raw combinations expand and check (benchmarks/plan_speed.py measures how fast)."""
    def big(d):
        d["axes"]["driver"] = ["525", "535", "550", "570", "580"]
        d["axes"]["python"] = ["3.10", "3.11"]
        f = d["images"]["qwen3-embed"]["flavours"]["tensorrt"]
        f["axes"] = {"cuda": "all", "sm": "all", "driver": "all", "tensorrt": "all"}
        f["newest"] = ["torch"]
        f["tag"] = "cu{cuda_nodot}-sm{sm}-trt{tensorrt}-drv{driver}"
        d["images"]["qwen3-embed"]["flavours"]["aot"]["axes"] = {"cuda": "all", "sm": "all", "torch": "all",
                                                                 "driver": "all"}
        d["images"]["qwen3-embed"]["flavours"]["aot"].pop("newest")
        d["images"]["qwen3-embed"]["flavours"]["aot"]["tag"] = "cu{cuda_nodot}-sm{sm}-t{torch}-d{driver}-aot"
    matrix = load_matrix(edit(workdir, big))
    plan = make_plan(matrix)
    assert plan.combinations >= 1000
    assert len(plan.variants) + len(plan.rejected) == plan.combinations
    assert any("driver" in reason for r in plan.rejected for reason in r.reasons)


def test_variants_carry_typed_records_one_field_per_axis(repo):
    """Axes declares exactly the matrix's axes, in their order; every variant's records read by attribute and
    serialise to the plan's JSON (the base as an object)."""
    import dataclasses

    from builder.axes import AXES
    from builder.plan import Axes, BaseImage, Resolved

    assert tuple(f.name for f in dataclasses.fields(Axes)) == AXES
    plan = shipped_plan(repo)
    for v in plan.variants:
        assert isinstance(v.axes, Axes) and isinstance(v.resolved, Resolved)
        assert isinstance(v.resolved.base, BaseImage) and v.resolved.backend_version
        data = v.to_json()
        assert data["resolved"]["base"] == {"name": v.resolved.base.name, "kind": v.resolved.base.kind,
                                            "ref": v.resolved.base.ref}
        assert data["axes"] == {axis: getattr(v.axes, axis) for axis in AXES if getattr(v.axes, axis) is not None}
    aot = next(v for v in plan.variants if v.id == "qwen3-embed:cu130-sm90-aot")
    assert (aot.axes.cuda, aot.axes.sm, aot.resolved.cc, aot.resolved.require_cuda.split()[0]) == (
        "13.0", "90", "9.0", "cuda>=13.0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        aot.resolved.torch = "0"  # type: ignore[misc]


def test_a_fact_the_record_does_not_declare_is_an_error_not_a_silent_key():
    from builder.plan import BaseImage, Resolved

    base = BaseImage("debian12", "rootfs", "mopt/base:debian12")
    with pytest.raises(TypeError, match="torch_flavour"):
        Resolved.of({"torch": "2.13.0", "torch_flavour": "cpu"}, python="3.11", base=base,
                    backend_version="2.13.0", runtime_source="pypi")
    assert Resolved.of({"torch": "2.13.0"}, python="3.11", base=base, backend_version="2.13.0",
                       runtime_source="pypi").torch == "2.13.0"
