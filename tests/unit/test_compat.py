"""builder.compat: the knowledge base (data + schema) and one test per rule, each from a sourced fact."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from builder import compat
from builder.compat import Combo, check, knowledge_base, load_knowledge_base, min_driver, require_cuda_env
from builder.errors import ConfigError, IncompatibleError

DATA = Path(compat.__file__).parent / "data" / "compat.yaml"
SCHEMA = Path(compat.__file__).parent / "schemas" / "compat.schema.json"


def _ok(**kw) -> compat.Verdict:
    v = check(Combo(**kw))
    assert v.compatible, v.reasons
    return v


def _bad(*needles: str, **kw) -> compat.Verdict:
    v = check(Combo(**kw))
    assert not v.compatible, f"expected a rejection for {kw}"
    text = " ".join(v.reasons)
    for n in needles:
        assert n in text, f"{n!r} not in {v.reasons}"
    assert all("source:" in r or "knowledge base" in r or "torch" in r for r in v.reasons)
    return v


# ------------------------------------------------------------------------------ the data itself

def test_yaml_validates_against_schema():
    data = yaml.safe_load(DATA.read_text())
    jsonschema.Draft202012Validator.check_schema(json.loads(SCHEMA.read_text()))
    jsonschema.validate(data, json.loads(SCHEMA.read_text()))


def test_knowledge_base_is_cached():
    assert knowledge_base() is knowledge_base()


def _rows(node, path=()):
    """Every mapping inside a list (a table row), with its path."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _rows(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if isinstance(v, dict):
                yield (*path, i), v
            yield from _rows(v, (*path, i))


def test_every_row_has_a_resolvable_source():
    data = knowledge_base().data
    rows = [(p, r) for p, r in _rows({k: v for k, v in data.items() if k != "sources"})
            if "clauses" not in p]           # NVIDIA_REQUIRE_CUDA clauses belong to their sourced row
    assert len(rows) > 80
    for path, row in rows:
        assert row.get("source"), f"row {path} has no source"
        for ref in row["source"].split(";"):
            head = ref.strip().split(" ")[0]
            assert head in data["sources"] or head.startswith("https://"), (path, head)


def test_unconfirmed_facts_are_marked():
    data = knowledge_base().data
    assert any(r.get("confirmed") is False for r in data["tensorrt"]["cuda_builds"])      # 11.x
    assert any(r.get("confirmed") is False for r in data["tensorrt_llm"]["pins"])         # 1.2
    assert any(r.get("variants_confirmed") is False for r in data["torch"]["builds"])     # 2.12-2.13
    assert data["cuda"]["unconfirmed"][0]["versions"] == ">=13.3"


@pytest.mark.parametrize("table,key", [
    (("tensorrt", "cuda_builds"), "tensorrt"),
    (("tensorrt_llm", "pins"), "tensorrt_llm"),
    (("vllm", "torch_pins"), "vllm"),
    (("torch", "builds"), "torch"),
])
def test_lookup_tables_do_not_overlap(table, key):
    kb = knowledge_base()
    probes = set()
    for row in kb.rows(*table):
        for term in compat.parse_range(row[key]).terms:
            probes.update(x for x in (term.a, term.b) if x)
    for probe in probes:
        assert len(kb.match_rows(table, key, probe)) <= 1, probe


def _broken(tmp_path, mutate) -> Path:
    data = yaml.safe_load(DATA.read_text())
    mutate(data)
    path = tmp_path / "compat.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_broken_kb_missing_source_names_key_path(tmp_path):
    path = _broken(tmp_path, lambda d: d["cuda"]["toolkits"][3].pop("source"))
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(path)
    assert exc.value.key == "cuda.toolkits[3]"
    assert "source" in str(exc.value) and str(path) in str(exc.value)
    assert exc.value.exit_code == 2


def test_broken_kb_bad_driver_names_key_path(tmp_path):
    path = _broken(tmp_path, lambda d: d["cuda"]["toolkits"][0].update(min_driver="abc"))
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(path)
    assert exc.value.key == "cuda.toolkits[0].min_driver"


def test_broken_kb_bad_range_names_key_path(tmp_path):
    path = _broken(tmp_path, lambda d: d["tensorrt"]["cuda_builds"][2]["cuda"].__setitem__(1, "12.9-12.0"))
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(path)
    assert exc.value.key == "tensorrt.cuda_builds[2].cuda[1]"


def test_broken_kb_unknown_source_names_key_path(tmp_path):
    path = _broken(tmp_path, lambda d: d["vllm"]["torch_pins"][0].update(source="a blog"))
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(path)
    assert exc.value.key == "vllm.torch_pins[0].source"


def test_broken_kb_invalid_yaml_gives_line(tmp_path):
    path = tmp_path / "compat.yaml"
    path.write_text("schema_version: 1\ncuda: [unclosed\n")
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(path)
    assert exc.value.line is not None


# ------------------------------------------------------------------------------ CUDA / driver

def test_min_driver_per_toolkit_and_update():
    assert min_driver("12.1") == "530.30.02"
    assert min_driver("12.8") == "570.26"
    assert min_driver("12.2.2") == "535.104.05"     # 12.2 Update 2
    assert min_driver("cu130") == "580.65.06"
    assert compat.min_driver_mvc("12.4") == "525.60.13"
    assert compat.min_driver_mvc("11.8") == "450.80.02"
    assert compat.min_driver_mvc("13.1") == "580.65.06"


def test_cuda_12_7_does_not_exist():
    _bad("CUDA 12.7 does not exist", cuda="12.7")
    with pytest.raises(IncompatibleError):
        min_driver("12.7")


def test_unknown_cuda_rejected():
    _bad("unknown to the compatibility knowledge base", cuda="12.10")


def test_driver_branch_below_toolkit_minimum_rejected():
    v = _bad("530.30.02", "nvidia-container-cli: requirement error: unsatisfied condition: cuda>=12.1",
             cuda="12.1", driver="525")
    assert "Minor version compatibility" in v.reasons[0]


def test_driver_at_toolkit_minimum_ok():
    v = _ok(cuda="12.1", driver="530.30.02")
    assert v.resolved["min_driver"] == "530.30.02"
    assert v.resolved["min_driver_mvc"] == "525.60.13"
    assert v.resolved["cuda_major"] == 12


def test_full_driver_below_minimum_rejected():
    _bad("cuda>=12.8", cuda="12.8", driver="565.57.01")
    _ok(cuda="12.8", driver="570.26")


def test_driver_branch_equal_to_minimum_branch_warns():
    v = _ok(cuda="12.2", driver="535")
    assert any("535.54.03" in w for w in v.warnings)


def test_unconfirmed_cuda_warns_not_rejects():
    v = _ok(cuda="13.3")
    assert any(w.startswith("UNCONFIRMED") for w in v.warnings)


def test_require_cuda_env_matches_nvidia_image():
    # verbatim from nvidia/cuda 12.1.0 base (gitlab nvidia/container-images/cuda dist/12.1.0)
    brands = "tesla unknown nvidia nvidiartx geforce geforcertx quadro quadrortx titan titanrtx".split()
    expected = ["cuda>=12.1", "brand=tesla,driver>=450,driver<451"]
    for br in (470, 510, 515, 525):
        expected += [f"brand={b},driver>={br},driver<{br + 1}" for b in brands]
    assert require_cuda_env("12.1") == " ".join(expected)
    assert require_cuda_env("12.8.1").startswith("cuda>=12.8 brand=unknown,driver>=470,driver<471 brand=grid")
    assert require_cuda_env("13.0") == "cuda>=13.0"          # no sourced brand table: plain form


# ------------------------------------------------------------------------------ SM x CUDA

def test_sm100_on_cuda124_rejected():
    _bad("added in CUDA 12.8", cuda="12.4", sm="100")


def test_sm100_on_cuda128_ok():
    v = _ok(cuda="12.8", sm="sm_100")
    assert v.resolved["cc"] == "10.0"
    assert v.resolved["sm"] == "100"


def test_sm70_on_cuda130_rejected():
    _bad("dropped in CUDA 13.0", cuda="13.0", sm="70")


def test_sm35_on_cuda12_rejected_but_ok_on_118():
    _bad("dropped in CUDA 12.0", cuda="12.0", sm="35")
    _ok(cuda="11.8", sm="35")


def test_sm101_renamed_in_130():
    v = _bad("renamed sm_110", cuda="13.0", sm="101")
    assert v.resolved["sm_renamed_to"] == "110"
    _ok(cuda="12.9", sm="101")
    _ok(cuda="13.0", sm="110")


def test_unknown_sm_rejected():
    _bad("sm_99 is unknown", cuda="12.8", sm="99")


def test_junk_sm_is_config_error():
    with pytest.raises(ConfigError):
        check(Combo(cuda="12.8", sm="8.x"))


def test_supported_sms_and_gpu_table():
    assert "100" not in compat.supported_sms("12.4")
    assert "70" not in compat.supported_sms("13.0")
    assert {"75", "110", "121"} <= set(compat.supported_sms("13.0"))
    assert compat.gpu_compute_capability("A10") == "8.6"
    assert compat.gpu_compute_capability("NVIDIA RTX 4060 Laptop") == "8.9"
    assert compat.gpu_compute_capability("GB10") == "12.1"
    with pytest.raises(ConfigError):
        compat.gpu_compute_capability("Voodoo2")


def test_cubin_rule():
    assert compat.cubin_runs_on("80", "86")
    assert compat.cubin_runs_on("80", "89")
    assert not compat.cubin_runs_on("80", "90")
    assert not compat.cubin_runs_on("86", "80")
    assert compat.cubin_runs_on("90a", "90")
    assert not compat.cubin_runs_on("90a", "100")


# ------------------------------------------------------------------------------ TensorRT

def test_trt_10_13_2_drops_cuda_11():
    _bad("TensorRT dropped CUDA 11 in 10.13.2", cuda="11.8", tensorrt="10.13.2")
    _bad("TensorRT dropped CUDA 11 in 10.13.2", cuda="11.8", tensorrt="10.14.1")  # and later versions inherit it
    _ok(cuda="13.0", tensorrt="10.13.2")


def test_trt_8_6_1_cuda_builds():
    _ok(cuda="11.8", tensorrt="8.6.1")
    _ok(cuda="12.1", tensorrt="8.6.1")
    _bad("no build for CUDA 12.2", cuda="12.2", tensorrt="8.6.1")


def test_trt_10_5_plus_needs_sm75():
    _bad("needs sm >= 75", cuda="12.6", tensorrt="10.6", sm="70")
    _ok(cuda="12.6", tensorrt="10.6", sm="75")


def test_trt_blackwell_needs_10_8():
    v = check(Combo(cuda="12.8", tensorrt="10.3", sm="120"))
    assert not v.compatible
    assert any("TensorRT 10.3 does not support sm_120" in r for r in v.reasons)
    _ok(cuda="12.8", tensorrt="10.8.0", sm="120")


def test_trt_maxwell_dropped_in_9():
    _bad("needs sm >= 60", cuda="12.4", tensorrt="10.3", sm="52")
    _ok(cuda="11.8", tensorrt="8.6.1", sm="52")


def test_trt_unconfirmed_cuda_build_warns():
    v = _ok(cuda="11.8", tensorrt="10.6", sm="86")
    assert any("UNCONFIRMED" in w and "11.8" in w for w in v.warnings)


def test_trt_11_unconfirmed_row_warns_not_rejects():
    v = _ok(cuda="12.9", tensorrt="11.0", sm="86")
    assert any(w.startswith("UNCONFIRMED") for w in v.warnings)


def test_unknown_trt_rejected():
    _bad("TensorRT 9.3 is unknown to the compatibility knowledge base", cuda="12.4", tensorrt="9.3")


# ------------------------------------------------------------------------------ TensorRT-LLM

def test_trtllm_resolves_pins():
    v = _ok(tensorrt_llm="0.12.0", sm="90")
    assert v.resolved["tensorrt"] == "10.3"
    assert v.resolved["cuda"] == "12.5"
    assert v.resolved["torch"] == "2.4.0"


def test_trtllm_conflicting_tensorrt_rejected():
    _bad("pinned to TensorRT 10.3", tensorrt_llm="0.12", tensorrt="10.6", cuda="12.5")


def test_trtllm_conflicting_cuda_rejected():
    _bad("built for CUDA 13.0", tensorrt_llm="1.1", cuda="12.8")


def test_trtllm_conflicting_torch_rejected():
    _bad("requires torch >=2.7.1,<=2.8.0a0", tensorrt_llm="1.0", torch="2.8.0")
    _ok(tensorrt_llm="1.0", cuda="12.8", torch="2.7.1")


def test_trtllm_volta_removed_in_0_15():
    _bad("TensorRT-LLM 0.15 needs sm >= 75", tensorrt_llm="0.15", sm="70")


def test_trtllm_unconfirmed_row_warns():
    v = _ok(tensorrt_llm="1.2", sm="90")
    assert v.resolved["torch"] == "2.9.1"
    assert any(w.startswith("UNCONFIRMED") for w in v.warnings)


# ------------------------------------------------------------------------------ vLLM / torch

def test_vllm_resolves_torch():
    v = _ok(vllm="0.10.0")
    assert v.resolved["torch"] == "2.7.1"
    assert v.resolved["vllm_wheel_cuda"] == "12.8"


def test_vllm_range_row_resolves_torch():
    assert _ok(vllm="0.12.0").resolved["torch"] == "2.9.0"
    assert _ok(vllm="0.26.0", cuda="13.0").resolved["torch"] == "2.11.0"


def test_vllm_torch_conflict_rejected():
    _bad("vLLM 0.10.0 pins torch==2.7.1", vllm="0.10.0", torch="2.8.0")
    _ok(vllm="0.10.0", torch="2.7.1+cu128", cuda="12.8")


def test_unknown_vllm_rejected():
    _bad("vLLM 0.5.0 is unknown", vllm="0.5.0")


def test_torch_not_built_for_cuda_rejected():
    _bad("torch 2.8.0 has no CUDA 13.0 build", cuda="13.0", torch="2.8.0")
    _ok(cuda="12.9", torch="2.8.0")


def test_vllm_implied_torch_not_built_for_cuda_rejected():
    _bad("torch 2.7.1 has no CUDA 12.4 build", vllm="0.10.0", cuda="12.4")


def test_torch_2_8_cu128_dropped_volta():
    _bad("no kernels for sm_70", cuda="12.8", torch="2.8.0", sm="70")
    _ok(cuda="12.6", torch="2.8.0", sm="70")


def test_torch_2_11_arch_lists():
    _bad("no kernels for sm_70", cuda="12.8", torch="2.11.0", sm="70")
    _ok(cuda="12.6", torch="2.11.0", sm="70")
    _ok(cuda="13.0", torch="2.11.0", sm="121")      # 12.0 cubin runs on 12.1 (cubin rule)


def test_torch_local_version_cpu_and_cuda():
    _ok(torch="2.13.0+cpu")
    _bad("CPU-only build", torch="2.13.0+cpu", cuda="13.0")
    _bad("built for CUDA 12.6", torch="2.8.0+cu126", cuda="12.8")


def test_torch_unconfirmed_variants_warn():
    v = _ok(cuda="12.8", torch="2.12.0")
    assert any(w.startswith("UNCONFIRMED") for w in v.warnings)


def test_unknown_torch_rejected():
    _bad("torch 2.3.0 is unknown", torch="2.3.0")


# ------------------------------------------------------------------------------ Verdict

def test_verdict_raise_for_incompatible():
    v = check(Combo(cuda="12.4", sm="100"))
    with pytest.raises(IncompatibleError) as exc:
        v.raise_for_incompatible()
    assert exc.value.exit_code == 3
    _ok(cuda="12.8", sm="100").raise_for_incompatible()


def test_full_stack_combo_ok_and_json_serialisable():
    v = _ok(cuda="12.8", sm="89", driver="570.124.06", vllm="0.9.0", tensorrt="10.8.0")
    json.dumps(v.resolved)
    assert v.resolved["torch"] == "2.7.0"
    assert v.resolved["cc"] == "8.9"


def test_combo_is_hashable():
    assert hash(Combo(cuda="12.1", sm="86")) == hash(Combo(cuda="12.1", sm="86"))


@pytest.mark.parametrize(("text", "message"), [
    ("schema_version: 1\ncuda: !foo x\n", ":2: malformed YAML: could not determine a constructor for the tag '!foo'"),
    ("schema_version: !!int abc\n", ": malformed YAML: invalid literal for int() with base 10: 'abc'"),
    ("schema_version: !!bool maybe\n", ": malformed YAML: a value its tag cannot hold (KeyError: 'maybe')"),
])
def test_broken_kb_a_tag_it_cannot_construct_is_one_config_error(tmp_path, text, message):
    path = tmp_path / "compat.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(path)
    assert str(exc.value) == f"{path}{message}" and exc.value.exit_code == 2
