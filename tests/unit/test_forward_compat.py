"""CUDA forward compatibility (issue 19): a data-center GPU runs a newer CUDA image on an older driver
branch through the image's cuda-compat libraries; consumer GPUs do not. compat, pick, plan and doctor
take --gpu-brand (auto: detected), and the images carry the package and say so in labels.

No GPU here: doctor's detection reads a stand-in nvidia-smi on PATH (the NVIDIA driver cannot run on
these machines); everything else is the real knowledge base, CLI and renderer."""
from __future__ import annotations

import json
import os
import stat

import pytest

from builder import compat
from builder.compat import Combo, check, driver_path, forward_compat, gpu_brand_of
from builder.doctor import Gpu, HostFacts, pick, resolve_gpu_brand
from builder.errors import ConfigError
from builder.matrix import load_matrix
from builder.plan import make_plan
from tests.conftest import REPO, run_mopt

BRANCHES_12_8 = [470, 535, 550, 560, 565]
FORWARD_12_8 = ("driver branch 535 is below CUDA 12.8's minimum driver 570.26, but {kind} runs CUDA 12.8 on it "
                "through forward compatibility: the image carries cuda-compat-12-8 and loads it from "
                "/usr/local/cuda-12.8/compat at start, and its NVIDIA_REQUIRE_CUDA admits brand=tesla on branch 535 "
                "(source: FWD; NVCUDA-IMG).")


@pytest.fixture(scope="module")
def plan():
    return make_plan(load_matrix(REPO / "matrix.yaml"))


def test_the_issue_case_a_datacenter_gpu_on_r535_runs_cuda_12_8():
    verdict = check(Combo(cuda="12.8", driver="535", gpu_brand="datacenter"))
    assert verdict.compatible and verdict.reasons == () and verdict.warnings == ()
    assert verdict.notes == (FORWARD_12_8.format(kind="a data-center GPU"),)
    assert verdict.resolved["driver_path"] == "forward"
    assert verdict.resolved["forward_compat"] == {"package": "cuda-compat-12-8", "path": "/usr/local/cuda-12.8/compat",
                                                  "branches": BRANCHES_12_8}
    # Jetson's forward compatibility follows JetPack's table, not these x86_64 branches: not assumed
    verdict = check(Combo(cuda="12.8", driver="535", gpu_brand="embedded"))
    assert not verdict.compatible and verdict.notes == ()
    assert verdict.reasons[0].endswith(" On Jetson, forward compatibility follows JetPack's own support table "
                                       "(cuda-compat for L4T), which this knowledge base does not hold, and mopt's "
                                       "images are built for x86_64 hosts; it is not assumed (source: FWD; "
                                       "NVCUDA-IMG).")


@pytest.mark.parametrize("sm,driver,first", [("100", "535", ("12.8", "570.26")), ("120", "565", ("12.8", "570.26")),
                                             ("90", "470", ("11.8", "520.61.05"))])
def test_forward_compatibility_does_not_serve_a_gpu_the_driver_predates(sm, driver, first):
    cuda = "12.8"
    verdict = check(Combo(cuda=cuda, sm=sm, driver=driver, gpu_brand="datacenter"))
    assert not verdict.compatible and verdict.notes == () and verdict.resolved["driver_path"] == "none"
    assert verdict.reasons[0].endswith(
        f" Driver branch {driver} predates sm_{sm}: CUDA {first[0]}, the first to support it, needs driver >= "
        f"{first[1]} (source: CMAKE; RN13.2 Table 3), and forward compatibility replaces only the user-mode driver, "
        "not the kernel driver that must know the GPU (source: FWD; NVCUDA-IMG).")
    # the same branch serves a GPU it knows
    assert check(Combo(cuda=cuda, sm="80", driver=driver, gpu_brand="datacenter")).compatible
    # an arch of the oldest toolkit's baseline has no known first driver: not held against the branch
    assert compat.driver_path(cuda, "470", "datacenter", sm="75").path == "forward"


@pytest.mark.parametrize("brand,tail", [
    ("consumer", " Forward compatibility (cuda-compat) does not apply: it works only on data-center GPUs; a consumer "
                 "GPU fails with cudaErrorCompatNotSupportedOnDevice (804) (source: FWD; NVCUDA-IMG)."),
    ("workstation", " Forward compatibility works only on select NGC Server Ready RTX SKUs, so it is not assumed; on a "
                    "data-center GPU it would run through forward compatibility (cuda-compat-12-8): give --gpu-brand "
                    "datacenter if it is one (source: FWD; NVCUDA-IMG)."),
    (None, " The GPU's product line is unknown, so forward compatibility is not assumed; on a data-center GPU it "
           "would run through forward compatibility (cuda-compat-12-8): give --gpu-brand datacenter if it is one "
           "(source: FWD; NVCUDA-IMG)."),
])
def test_other_gpus_are_refused_and_told_why(brand, tail):
    verdict = check(Combo(cuda="12.8", driver="535", gpu_brand=brand))
    assert not verdict.compatible and verdict.notes == ()
    (reason,) = verdict.reasons
    assert reason.startswith("driver branch 535 is below CUDA 12.8's minimum driver 570.26; the container would stop")
    assert reason.endswith(tail)
    assert verdict.resolved["driver_path"] == "none"


@pytest.mark.parametrize("cuda,driver,why", [
    # a branch the compat package does not support (530 is not among 12.8's)
    ("12.8", "530", "forward compatibility for CUDA 12.8 supports driver branches 470, 535, 550, 560, 565, not 530"),
    # CUDA 13.0: no sourced branches (its image admits none)
    ("13.0", "535", "the knowledge base has no sourced forward-compatibility branches for CUDA 13.0, and the image's "
                    "NVIDIA_REQUIRE_CUDA (cuda>=13.0) admits no older branch"),
])
def test_a_datacenter_gpu_on_an_unsupported_branch_is_refused(cuda, driver, why):
    (reason,) = check(Combo(cuda=cuda, driver=driver, gpu_brand="datacenter")).reasons
    assert reason.endswith(" " + why[0].upper() + why[1:] + " (source: FWD; NVCUDA-IMG).")


def test_driver_paths():
    assert driver_path("12.8", "570.26").path == "native"
    assert driver_path("12.8", "580", "consumer").path == "native"
    assert driver_path("12.8", "570.20", "datacenter").path == "none"     # branch 570 is not a forward branch
    way = driver_path("12.8", "535.104.05", "datacenter")
    assert (way.path, way.min_driver) == ("forward", "570.26")
    assert driver_path("12.8", "535.104.05", "consumer").path == "none"
    # a branch no forward compatibility could change: nothing to explain
    assert driver_path("12.8", "520").detail == ""
    # the 12.1 image admits the tesla brand on R450 alone
    assert driver_path("12.1", "450", "datacenter").path == "forward"
    assert forward_compat("12.1")["branches"] == [450, 470, 510, 515, 525]
    assert forward_compat("13.0") == {"package": "cuda-compat-13-0", "path": "/usr/local/cuda-13.0/compat",
                                      "branches": []}
    with pytest.raises(ConfigError, match="GPU brand 'tesla'"):
        check(Combo(cuda="12.8", driver="535", gpu_brand="tesla"))


@pytest.mark.parametrize("name,nvml_brand,kind", [
    ("NVIDIA H100 80GB HBM3", None, "datacenter"), ("NVIDIA A100-SXM4-80GB", None, "datacenter"),
    ("Tesla T4", None, "datacenter"), ("NVIDIA A10", None, "datacenter"), ("NVIDIA L40S", None, "datacenter"),
    ("NVIDIA GeForce RTX 4090", None, "consumer"), ("NVIDIA RTX A6000", None, "workstation"),
    ("Jetson Orin", None, "embedded"),
    # not in the table: the NVML brand, else a brand word in the name
    ("Tesla P100-PCIE-16GB", None, "datacenter"), ("NVIDIA GeForce GTX 1080", None, "consumer"),
    ("Quadro RTX 8000", None, "workstation"), ("NVIDIA Foo", "tesla", "datacenter"),
    ("NVIDIA Foo", "geforcertx", "consumer"),
    # "nvidia" names data-center and workstation cards alike: not decided
    ("NVIDIA Foo", "nvidia", None), ("NVIDIA Foo", None, None),
])
def test_gpu_product_lines(name, nvml_brand, kind):
    assert gpu_brand_of(name, nvml_brand) == kind


def test_gpu_names_as_nvidia_smi_writes_them_have_a_compute_capability():
    assert compat.gpu_compute_capability("NVIDIA A100-SXM4-80GB") == "8.0"
    assert compat.gpu_compute_capability("NVIDIA A10") == "8.6"          # A10, not A100
    assert compat.gpu_compute_capability("NVIDIA L40S") == "8.9"
    with pytest.raises(ConfigError):
        compat.gpu_compute_capability("NVIDIA A1000X")


def test_resolve_gpu_brand():
    h100, rtx = Gpu(0, "NVIDIA H100 80GB HBM3", "9.0"), Gpu(1, "NVIDIA GeForce RTX 4090", "8.9")
    assert resolve_gpu_brand("auto", (h100,)) == ("datacenter", "detected: NVIDIA H100 80GB HBM3")
    assert resolve_gpu_brand("auto", (Gpu(0, "NVIDIA Foo", "9.0", "tesla"),))[0] == "datacenter"
    assert resolve_gpu_brand("auto", (h100, rtx))[0] is None              # mixed: not assumed
    assert resolve_gpu_brand("auto", ()) == (None, "no GPU detected")
    assert resolve_gpu_brand("datacenter", (h100,)) == ("datacenter", "given")
    assert resolve_gpu_brand("consumer", ()) == ("consumer", "given")
    assert resolve_gpu_brand("unknown", (h100,))[0] is None
    # a given brand that a GPU's known product line contradicts is refused, naming how it is known
    with pytest.raises(ConfigError, match=r"^--gpu-brand consumer contradicts NVIDIA H100 80GB HBM3, a datacenter GPU "
                                          r"by the knowledge base's GPU table \(sm.gpus\); leave --gpu-brand at auto, "
                                          r"or name the GPU you mean$"):
        resolve_gpu_brand("consumer", (h100,))
    with pytest.raises(ConfigError, match=r"contradicts NVIDIA Foo, a consumer GPU by NVML brand geforce;"):
        resolve_gpu_brand("datacenter", (Gpu(0, "NVIDIA Foo", "9.0", "geforce"),))
    assert resolve_gpu_brand("datacenter", (Gpu(0, "NVIDIA Foo", "9.0"),)) == ("datacenter", "given")  # unknown


def test_pick_takes_forward_compatibility_on_datacenter_gpus_only(plan):
    h100 = HostFacts(driver="535.104.05", gpus=(Gpu(0, "NVIDIA H100 80GB HBM3", "9.0"),))
    tag, why = pick(plan, "qwen3-embed", h100, gpu_brand="datacenter")
    assert tag == "cu128-sm90"
    expected = FORWARD_12_8.format(kind="a data-center GPU").removesuffix(" (source: FWD; NVCUDA-IMG).")
    assert why[-1] == ("cu128-sm90 runs through forward compatibility: "
                       + expected.replace("driver branch 535", "driver 535.104.05"))
    assert any(line.startswith("cu130-sm90: CUDA 13.0 needs driver >= 580.65.06, this host has 535.104.05; the "
                               "knowledge base has no sourced") for line in why)
    # unknown product line: the newest CUDA the driver runs natively (12.2 is R535's; the matrix has 12.1)
    assert pick(plan, "qwen3-embed", h100)[0] == "cu121-sm90"
    rtx = HostFacts(driver="535.104.05", gpus=(Gpu(0, "NVIDIA GeForce RTX 4090", "8.9"),))
    tag, why = pick(plan, "qwen3-embed", rtx, gpu_brand="consumer")
    assert tag == "cu121-sm89"
    assert any("cu128-sm89: CUDA 12.8 needs driver >= 570.26, this host has 535.104.05; forward compatibility "
               "(cuda-compat) does not apply" in line for line in why)


def test_compat_cli_explains_the_path():
    result = run_mopt("compat", "--cuda", "12.8", "--driver", "535", "--gpu-brand", "datacenter", "--format", "json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["compatible"] and out["notes"] == [FORWARD_12_8.format(kind="a data-center GPU")]
    result = run_mopt("compat", "--cuda", "12.8", "--driver", "535", "--gpu-brand", "consumer")
    assert result.returncode == 3 and "cudaErrorCompatNotSupportedOnDevice (804)" in result.stdout
    result = run_mopt("compat", "--cuda", "12.8", "--driver", "535", "--gpu-brand", "datacenter")
    assert result.returncode == 0 and "note: driver branch 535 is below" in result.stdout
    result = run_mopt("compat", "--cuda", "12.8", "--gpu-brand", "tesla")
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_plan_markdown_names_the_forward_branches_for_datacenter_gpus():
    args = ("plan", "--select", "qwen3-embed:cu128-sm90", "--format", "markdown")
    with_fwd = run_mopt(*args, "--gpu-brand", "datacenter")
    assert with_fwd.returncode == 0, with_fwd.stderr
    assert "| 570.26 (R535/R550/R560/R565 via cuda-compat-12-8) |" in with_fwd.stdout
    plain = run_mopt(*args, "--gpu-brand", "unknown")
    assert "| 570.26 |" in plain.stdout and "cuda-compat" not in plain.stdout


def test_plan_is_the_same_on_every_machine_unless_asked_to_detect(tmp_path):
    env = _fake_nvidia_smi(tmp_path, "0, NVIDIA H100 80GB HBM3, 9.0, 535.104.05")
    args = ("plan", "--select", "qwen3-embed:cu128-sm90", "--format", "markdown")
    assert "| 570.26 |" in run_mopt(*args, env=env).stdout
    assert "| 570.26 (R535/R550/R560/R565 via cuda-compat-12-8) |" in run_mopt(*args, "--gpu-brand", "auto",
                                                                                     env=env).stdout


def _fake_nvidia_smi(tmp_path, line: str) -> dict:
    """A stand-in nvidia-smi on PATH (no NVIDIA driver can run here) answering doctor's one query."""
    tool = tmp_path / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\necho '{line}'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{tmp_path}:{os.environ['PATH']}"}


def test_doctor_detects_the_product_line_and_lists_the_cuda_paths(tmp_path):
    env = _fake_nvidia_smi(tmp_path, "0, NVIDIA H100 80GB HBM3, 9.0, 535.104.05")
    result = run_mopt("doctor", "--format", "json", env=env)
    out = json.loads(result.stdout)
    assert out["gpus"] == [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "cc": "9.0", "sm": "90",
                            "brand": "datacenter", "nvml_brand": None}]
    check_ = next(c for c in out["checks"] if c["name"] == "cuda-versions")
    assert check_["status"] == "ok"
    assert check_["detail"] == (
        "product line datacenter (detected: NVIDIA H100 80GB HBM3); driver 535.104.05: CUDA 11.8, 12.0, 12.1, 12.2 "
        "natively; CUDA 12.4, 12.6, 12.8 through forward compatibility (images carry cuda-compat-12-8 and the like)")
    assert run_mopt("pick", "qwen3-embed", env=env).stdout.strip() == "mopt/qwen3-embed:cu128-sm90"
    # the same host told it is a consumer card: the GPU table says otherwise, so both refuse the contradiction
    contradiction = ("--gpu-brand consumer contradicts NVIDIA H100 80GB HBM3, a datacenter GPU by the knowledge "
                     "base's GPU table (sm.gpus); leave --gpu-brand at auto, or name the GPU you mean")
    result = run_mopt("doctor", "--format", "json", "--gpu-brand", "consumer", env=env)
    assert result.returncode != 0
    check_ = next(c for c in json.loads(result.stdout)["checks"] if c["name"] == "cuda-versions")
    assert (check_["status"], check_["detail"]) == ("fail", contradiction)
    refused = run_mopt("pick", "qwen3-embed", "--gpu-brand", "consumer", env=env)
    assert (refused.returncode, refused.stdout) == (2, "") and contradiction in refused.stderr
    assert "Traceback" not in refused.stderr
    # a GPU of unknown product line told it is a consumer card: native versions only, the CUDA 12.1 tag
    env = _fake_nvidia_smi(tmp_path, "0, NVIDIA Foo, 9.0, 535.104.05")
    result = run_mopt("doctor", "--format", "json", "--gpu-brand", "consumer", env=env)
    detail = next(c for c in json.loads(result.stdout)["checks"] if c["name"] == "cuda-versions")["detail"]
    assert detail == "product line consumer (given); driver 535.104.05: CUDA 11.8, 12.0, 12.1, 12.2 natively"
    assert run_mopt("pick", "qwen3-embed", "--gpu-brand", "consumer", env=env).stdout.strip() == \
        "mopt/qwen3-embed:cu121-sm90"


def test_fields_nvidia_smi_cannot_read_are_reported_not_fatal(tmp_path):
    # nvidia-smi prints [N/A] for what it cannot read: doctor reports the rest, pick says what to pass
    env = _fake_nvidia_smi(tmp_path, "[N/A], NVIDIA Foo, [N/A], [N/A]")
    result = run_mopt("doctor", "--format", "json", env=env)
    assert "Traceback" not in result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert (checks["nvidia-driver"]["status"], checks["nvidia-driver"]["detail"]) == (
        "warn", "the driver reported no readable version ('[N/A]', via nvidia-smi)")
    assert (checks["gpu0"]["status"], checks["gpu0"]["detail"]) == (
        "warn", "NVIDIA Foo: compute capability not reported, and the name is not in the GPU table; no tag can be "
                "matched to it")
    assert checks["cuda-versions"]["status"] == "warn" and {"docker", "shm", "disk"} <= set(checks)
    refused = run_mopt("pick", "qwen3-embed", env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert ("this host's driver reports version '[N/A]', which is not a driver version; pass --driver "
            "(e.g. --driver 535.104.05)") in refused.stderr
    # with --driver given, a GPU of unknown arch is not answered with the cpu tag: pick asks for --sm
    refused = run_mopt("pick", "qwen3-embed", "--driver", "535.104.05", env=env)
    assert (refused.returncode, refused.stdout) == (2, "")
    assert ("no GPU of this host has a known arch (GPU 0 (NVIDIA Foo, compute capability unknown)): its compute "
            "capability was not reported and its name is not in the GPU table; pass --sm (e.g. --sm 90)"
            ) in refused.stderr
    assert run_mopt("pick", "qwen3-embed", "--sm", "90", env=env).returncode == 2  # the driver still unreadable
    ok = run_mopt("pick", "qwen3-embed", "--sm", "90", "--driver", "535.104.05", "--gpu-brand", "datacenter", env=env)
    assert ok.stdout.strip() == "mopt/qwen3-embed:cu128-sm90"
    # a GPU the table knows by name: its arch comes from there when the compute capability is not reported
    env = _fake_nvidia_smi(tmp_path, "0, NVIDIA H100 80GB HBM3, [N/A], 535.104.05")
    gpu0 = next(c for c in json.loads(run_mopt("doctor", "--format", "json", env=env).stdout)["checks"]
                if c["name"] == "gpu0")
    assert (gpu0["status"], gpu0["detail"]) == ("ok", "NVIDIA H100 80GB HBM3, compute capability not reported, 9.0 "
                                                      "by the GPU table (sm_90), product line datacenter")
    assert run_mopt("pick", "qwen3-embed", env=env).stdout.strip() == "mopt/qwen3-embed:cu128-sm90"
    # a name with a comma in it: the fields around it are still found
    env = _fake_nvidia_smi(tmp_path, "0, NVIDIA H100, Rev 2, 9.0, 535.104.05")
    out = json.loads(run_mopt("doctor", "--format", "json", env=env).stdout)
    assert out["gpus"][0]["name"] == "NVIDIA H100, Rev 2" and out["gpus"][0]["sm"] == "90"


def test_pick_with_sm_or_gpu_keeps_the_hosts_driver(tmp_path):
    env = _fake_nvidia_smi(tmp_path, "0, NVIDIA H100 80GB HBM3, 9.0, 535.104.05")
    # CUDA 13.0 needs 580.65.06: the host's R535 still rules out cu130 when only the GPU is pretended
    assert run_mopt("pick", "qwen3-embed", "--gpu", "RTX 4090", env=env).stdout.strip() == \
        "mopt/qwen3-embed:cu121-sm89"
    assert run_mopt("pick", "qwen3-embed", "--sm", "89", env=env).stdout.strip() == "mopt/qwen3-embed:cu121-sm89"
    # --sm of the host's own GPU keeps that GPU (its product line: forward compatibility)
    assert run_mopt("pick", "qwen3-embed", "--sm", "90", env=env).stdout.strip() == "mopt/qwen3-embed:cu128-sm90"
    assert run_mopt("pick", "qwen3-embed", "--gpu", "H100", "--driver", "580.65.06",
                    env=env).stdout.strip() == "mopt/qwen3-embed:cu130-sm90"
    for flag in ("--gpu", "--sm", "--driver"):
        empty = run_mopt("pick", "qwen3-embed", flag, " ", env=env)
        assert (empty.returncode, empty.stdout) == (2, "") and f"{flag} is empty" in empty.stderr
    # surrounding white space is dropped: no raw newline reaches the reasons
    newline = run_mopt("pick", "qwen3-embed", "--driver", "535\n", "--format", "json", env=env)
    assert any(line.startswith("cu130-sm90: CUDA 13.0 needs driver >= 580.65.06, this host has 535;")
               for line in json.loads(newline.stdout)["rejected"])
    # a GPU whose product line the table knows contradicts a given brand: refused, not served by 804
    refused = run_mopt("pick", "qwen3-embed", "--gpu", "RTX 4090", "--driver", "535", "--gpu-brand", "datacenter")
    assert refused.returncode == 2 and "--gpu-brand datacenter contradicts RTX 4090, a consumer GPU" in refused.stderr
    # an arch that is no GPU's, and a GPU named with another arch than --sm: bad input
    bad = run_mopt("pick", "qwen3-embed", "--sm", "999", env=env)
    assert bad.returncode == 2 and "--sm '999': not a GPU architecture (compute capability 99.9)" in bad.stderr
    bad = run_mopt("pick", "qwen3-embed", "--gpu", "RTX 4090", "--sm", "90", env=env)
    assert bad.returncode == 2 and "--gpu 'RTX 4090' is sm_89, not sm_90: give one of them" in bad.stderr


def test_pick_on_a_host_of_mixed_archs_picks_for_the_first_and_says_so(tmp_path):
    env = _fake_nvidia_smi(tmp_path, "0, NVIDIA H100 80GB HBM3, 9.0, 535.104.05\n"
                                     "1, NVIDIA GeForce RTX 4090, 8.9, 535.104.05")
    result = run_mopt("pick", "qwen3-embed", "--format", "json", env=env)
    out = json.loads(result.stdout)
    # the H100 (GPU 0) is the target: its product line (data center) admits forward compatibility
    assert out["tag"] == "cu128-sm90"
    assert out["rejected"][0] == ("this host's GPUs differ (GPU 0 (NVIDIA H100 80GB HBM3, sm_90); GPU 1 (NVIDIA "
                                  "GeForce RTX 4090, sm_89)): picked for sm_90, the arch of GPU 0; for the others "
                                  "pass --sm 89")
    # the RTX 4090 asked for by arch: a consumer card gets no forward compatibility
    assert run_mopt("pick", "qwen3-embed", "--sm", "89", env=env).stdout.strip() == "mopt/qwen3-embed:cu121-sm89"


def test_images_carry_the_compat_package_and_say_so(tmp_path):
    out = tmp_path / "r"
    result = run_mopt("render", "--select", "qwen3-embed:cu128-sm90", "--select", "minilm-embed:cpu",
                      "--out", str(out))
    assert result.returncode == 0, result.stderr
    cuda = out / "qwen3-embed" / "cu128-sm90"
    base = (cuda / "Dockerfile.base").read_text()
    assert "for p in ca-certificates python3 python3-venv cuda-compat-12-8; do" in base
    final = (cuda / "Dockerfile.final").read_text()
    assert "ENV MOPT_CUDA_COMPAT_DIR=/usr/local/cuda-12.8/compat \\\n    MOPT_CUDA_MIN_DRIVER=570.26\n" in final
    assert 'io.mopt.cuda.forward-compat="cuda-compat-12-8"' in final
    # the branches that know an sm_90 GPU: R470 predates it
    assert 'io.mopt.cuda.forward-compat.branches="535,550,560,565"' in final
    cpu = out / "minilm-embed" / "cpu"
    assert "cuda-compat" not in (cpu / "Dockerfile.base").read_text()
    cpu_final = (cpu / "Dockerfile.final").read_text()
    assert 'io.mopt.cuda.forward-compat="none"' in cpu_final and "MOPT_CUDA_COMPAT_DIR" not in cpu_final


# ------------------------------------------------------------------------------ every branch, word for word

FWD_SRC = "(source: FWD; NVCUDA-IMG)"


def test_driver_path_values():
    from builder.compat import DriverPath

    assert driver_path("12.8", "570.26") == DriverPath("native", "570.26", "driver 570.26 meets CUDA 12.8's minimum "
                                                                          "driver 570.26")
    # a branch is compared as a branch: 570 is CUDA 12.8's floor branch (570.26), so it is native
    assert driver_path("12.8", "570").path == "native"
    assert driver_path("12.8", "530", "datacenter") == DriverPath(
        "none", "570.26", "forward compatibility for CUDA 12.8 supports driver branches 470, 535, 550, 560, 565, "
                          f"not 530 {FWD_SRC}", FWD_SRC)
    assert driver_path("12.8", "535", "consumer") == DriverPath(
        "none", "570.26", "forward compatibility (cuda-compat) does not apply: it works only on data-center GPUs; a "
                          f"consumer GPU fails with cudaErrorCompatNotSupportedOnDevice (804) {FWD_SRC}", FWD_SRC)
    assert driver_path("12.8", "535") == DriverPath(
        "none", "570.26", "the GPU's product line is unknown, so forward compatibility is not assumed; on a "
                          "data-center GPU it would run through forward compatibility (cuda-compat-12-8): give "
                          f"--gpu-brand datacenter if it is one {FWD_SRC}", FWD_SRC)
    assert driver_path("12.8", "520", "datacenter") == DriverPath(
        "none", "570.26", "forward compatibility for CUDA 12.8 supports driver branches 470, 535, 550, 560, 565, "
                          f"not 520 {FWD_SRC}", FWD_SRC)
    assert driver_path("12.8", "520") == DriverPath("none", "570.26", "")
    forward = driver_path("12.8", "535", "datacenter")
    assert (forward.path, forward.min_driver, forward.source) == ("forward", "570.26", FWD_SRC)
    assert forward_compat("12.8.1")["package"] == "cuda-compat-12-8"


@pytest.mark.parametrize("cuda,message", [
    ("12.7", "CUDA 12.7 does not exist: NVIDIA released no CUDA 12.7 (12.6 was followed by 12.8) (source: RN13.2 "
             "Table 3)."),
    ("13.3", "CUDA 13.3: CUDA 13.3 and later are not in the sourced release-notes table; minimum driver unknown "
             "(source: RN13.2 Table 3)."),
])
def test_driver_path_of_a_cuda_without_a_minimum_driver(cuda, message):
    from builder.errors import IncompatibleError

    with pytest.raises(IncompatibleError) as exc:
        driver_path(cuda, "535", "datacenter")
    assert exc.value.message == message


def test_the_knowledge_base_given_is_the_one_read():
    """An edited knowledge base (here: NVIDIA admits branch 530 for CUDA 12.8) decides, not the packaged one."""
    def edit(d):
        row = next(r for r in d["cuda"]["container_requirement"]["rows"] if r["cuda"] == "12.8")
        row["clauses"] = [{"brands": ["tesla"], "branches": [530]}]
    import copy

    data = copy.deepcopy(compat.knowledge_base().data)
    edit(data)
    kb = compat.KnowledgeBase(data=data, path="edited/compat.yaml")
    verdict = check(Combo(cuda="12.8", driver="530", gpu_brand="datacenter"), kb)
    assert verdict.compatible and verdict.resolved["forward_compat"]["branches"] == [530]
    assert not check(Combo(cuda="12.8", driver="535", gpu_brand="datacenter"), kb).compatible


def test_a_bad_gpu_brand_names_the_choices():
    with pytest.raises(ConfigError) as exc:
        check(Combo(gpu_brand="geforce"))
    assert exc.value.message == "GPU brand 'geforce': expected one of datacenter, workstation, consumer, embedded"


def test_gpu_names_with_a_brand_word_first():
    assert compat.gpu_compute_capability("Tesla T4") == "7.5"
    assert compat.gpu_compute_capability("NVIDIA GeForce RTX 4090") == "8.9"
    assert compat.gpu_compute_capability("NVIDIA RTX 4060 Laptop GPU") == "8.9"  # the longer name of the two


def test_resolve_gpu_brand_explains_itself():
    assert resolve_gpu_brand("unknown", ()) == (None, "given as unknown")
    assert resolve_gpu_brand("auto", (Gpu(0, "NVIDIA Foo", "9.0", "tesla"),)) == (
        "datacenter", "detected: NVIDIA Foo (NVML brand tesla)")
    assert resolve_gpu_brand("auto", (Gpu(0, "NVIDIA H100", "9.0"), Gpu(1, "NVIDIA GeForce RTX 4090", "8.9"))) == (
        None, "detected GPUs of unknown or mixed product lines: NVIDIA H100, NVIDIA GeForce RTX 4090")


def test_doctor_cuda_paths_check():
    from builder.doctor import Check, cuda_paths_check

    assert cuda_paths_check("535.104.05", ("datacenter", "given")) == Check(
        "cuda-versions", "ok", "product line datacenter (given); driver 535.104.05: CUDA 11.8, 12.0, 12.1, 12.2 "
                               "natively; CUDA 12.4, 12.6, 12.8 through forward compatibility (images carry "
                               "cuda-compat-12-8 and the like)")
    assert cuda_paths_check("535.104.05", (None, "no GPU detected")) == Check(
        "cuda-versions", "ok", "product line unknown (no GPU detected); driver 535.104.05: CUDA 11.8, 12.0, 12.1, 12.2 "
                               "natively",
        "if this is a data-center GPU, pass --gpu-brand datacenter to see its forward-compatible CUDA versions")
    # a consumer card: nothing forward, no hint
    assert cuda_paths_check("535.104.05", ("consumer", "given")).fix == ""
    # a driver older than every toolkit of the knowledge base
    assert cuda_paths_check("450.80.02", ("consumer", "given")) == Check(
        "cuda-versions", "warn", "product line consumer (given); driver 450.80.02: CUDA none natively")
    assert cuda_paths_check(None, ("datacenter", "given")) == Check(
        "cuda-versions", "warn", "the driver did not report its version: the CUDA versions it runs are unknown",
        "nvidia-smi should print the driver version")


def test_pick_lines_word_for_word(plan):
    h100 = Gpu(0, "NVIDIA H100 80GB HBM3", "9.0")
    # no driver reported: every tag of the arch fits, the newest CUDA wins
    assert pick(plan, "qwen3-embed", HostFacts(driver=None, gpus=(h100,)), gpu_brand="datacenter") == (
        "cu130-sm90", [])
    # a branch no forward compatibility could change: the reason names the floor and nothing more
    tag, why = pick(plan, "qwen3-embed", HostFacts(driver="520.61.05", gpus=(h100,)), cpu_fallback=True)
    assert tag == "cpu" and "cu128-sm90: CUDA 12.8 needs driver >= 570.26, this host has 520.61.05" in why
    assert why[-1] == "no GPU tag fits this host (--cpu-fallback): using the cpu variant"
    tag, why = pick(plan, "qwen3-embed", HostFacts(driver="535", gpus=(Gpu(0, "NVIDIA P40", "6.1"),)),
                    cpu_fallback=True)
    assert (tag, why) == ("cpu", [
        "no tag is built for sm_61 (engines are tied to the GPU arch; built: sm_75, sm_80, sm_86, sm_89, sm_90, "
        "sm_100, sm_120)", "no GPU tag fits this host (--cpu-fallback): using the cpu variant"])
    assert pick(plan, "qwen3-embed", HostFacts()) == ("cpu", ["no GPU on this host: using the cpu variant"])
    # several archs: the first GPU's is picked for, the others named in compute-capability order (sm_80
    # before sm_110, not after it as text); one whose arch is unknown is left out
    three = HostFacts(driver="535", gpus=(Gpu(0, "NVIDIA P40", "6.1"), Gpu(1, "Jetson Thor", "11.0"),
                                          Gpu(2, "NVIDIA A100", "8.0"), Gpu(3, "NVIDIA Foo", None)))
    assert pick(plan, "qwen3-embed", three, cpu_fallback=True)[1][:2] == [
        "this host's GPUs differ (GPU 0 (NVIDIA P40, sm_61); GPU 1 (Jetson Thor, sm_110); GPU 2 (NVIDIA A100, sm_80); "
        "GPU 3 (NVIDIA Foo, compute capability unknown)): picked for sm_61, the arch of GPU 0; for the others pass "
        "--sm 80 or --sm 110",
        "no tag is built for sm_61 (engines are tied to the GPU arch; built: sm_75, sm_80, sm_86, sm_89, sm_90, "
        "sm_100, sm_120)"]
    # an image with no GPU tags says so on a GPU host (seen on the H200: benchmarks/gpu_host_probe.py)
    assert pick(plan, "minilm-embed", HostFacts(driver="580.159.04", gpus=(Gpu(0, "NVIDIA H200", "9.0"),)),
                cpu_fallback=True) == (
        "cpu", ["minilm-embed has no GPU tags", "no GPU tag fits this host (--cpu-fallback): using the cpu variant"])
    # GPUs of one arch with one whose arch is unknown: still a note, and no --sm to suggest
    odd = HostFacts(driver="580.65.06", gpus=(Gpu(0, "NVIDIA Foo", None), Gpu(1, "NVIDIA H100", "9.0")))
    tag, why = pick(plan, "qwen3-embed", odd)
    assert tag == "cu130-sm90" and why == [
        "this host's GPUs differ (GPU 0 (NVIDIA Foo, compute capability unknown); GPU 1 (NVIDIA H100, sm_90)): "
        "picked for sm_90, the arch of GPU 1"]


def test_make_plan_checks_every_variant_for_the_gpu_brand_given():
    matrix = load_matrix(REPO / "matrix.yaml")
    (given,) = make_plan(matrix, ("qwen3-embed:cu128-sm90",), "datacenter").variants
    (plain,) = make_plan(matrix, ("qwen3-embed:cu128-sm90",)).variants
    assert (given.resolved.gpu_brand, plain.resolved.gpu_brand) == ("datacenter", None)


# ------------------------------------------------------------------------------ the host as pick sees it, in process

def test_gpu_arch_and_description():
    assert Gpu(0, "NVIDIA H100", "9.0").sm == "90"
    assert Gpu(3, "NVIDIA H100", "9.0").describe() == "GPU 3 (NVIDIA H100, sm_90)"
    for cc in (None, "", "9.x"):  # not reported, or not one: unknown, not an error
        assert Gpu(1, "NVIDIA Foo", cc).sm is None
        assert Gpu(1, "NVIDIA Foo", cc).describe() == "GPU 1 (NVIDIA Foo, compute capability unknown)"


def test_valid_driver():
    from builder.doctor import valid_driver

    assert valid_driver(" 535.104.05 ") == "535.104.05"
    assert valid_driver("535") == "535"
    for bad in (None, "", "[N/A]", "535.104.05.1", "1000.10.01"):
        assert valid_driver(bad) is None


def test_target_gpus():
    from builder.doctor import target_gpus

    h100, h200 = Gpu(0, "NVIDIA H100", "9.0"), Gpu(1, "NVIDIA H200", "9.0")
    rtx, odd = Gpu(2, "NVIDIA GeForce RTX 4090", "8.9"), Gpu(3, "NVIDIA Foo", None)
    assert target_gpus(()) == ((), "")
    assert target_gpus((odd,)) == ((), "")
    assert target_gpus((h100, h200)) == ((h100, h200), "")
    assert target_gpus((rtx, h100, h200)) == ((rtx,), (
        "this host's GPUs differ (GPU 2 (NVIDIA GeForce RTX 4090, sm_89); GPU 0 (NVIDIA H100, sm_90); GPU 1 (NVIDIA "
        "H200, sm_90)): picked for sm_89, the arch of GPU 2; for the others pass --sm 90"))
    assert target_gpus((odd, h100)) == ((h100,), "this host's GPUs differ (GPU 3 (NVIDIA Foo, compute capability "
                                                 "unknown); GPU 0 (NVIDIA H100, sm_90)): picked for sm_90, the arch "
                                                 "of GPU 0")


def test_facts_override():
    from builder.doctor import Check, facts_override

    host = HostFacts(driver="535.104.05", gpus=(Gpu(0, "NVIDIA H100 80GB HBM3", "9.0"),), docker_server="26.1",
                     runtimes=("nvidia",), checks=(Check("docker", "ok", "daemon 26.1"),))
    assert facts_override(host, None, None, None) == host
    # --gpu or --sm: the GPUs change, the driver and the rest stay the host's
    assert facts_override(host, " RTX 4090 ", None, None) == HostFacts(
        driver="535.104.05", gpus=(Gpu(0, "RTX 4090", "8.9"),), docker_server="26.1", runtimes=("nvidia",),
        checks=host.checks)
    # an arch-specific target is its GPU's arch: --gpu H100 --sm 90a agree
    assert facts_override(host, "H100", "90a", None).gpus == (Gpu(0, "H100", "9.0"),)
    assert facts_override(host, None, "sm_89", None).gpus == (Gpu(0, "sm_89", "8.9"),)
    assert facts_override(host, "A100", "80", None).gpus == (Gpu(0, "A100", "8.0"),)  # --gpu and --sm agree
    with pytest.raises(ConfigError) as exc:
        facts_override(host, "A100", "86", None)
    assert exc.value.message == "--gpu 'A100' is sm_80, not sm_86: give one of them"
    # --sm of a host GPU's arch keeps that GPU; --sm 90a is the H100 as well
    assert facts_override(host, None, "90", None).gpus == host.gpus
    with pytest.raises(ConfigError) as exc:
        facts_override(host, None, "999", None)
    assert exc.value.message == "--sm '999': not a GPU architecture (compute capability 99.9)"
    # --driver: normalised, white space dropped
    assert facts_override(host, None, None, " 580.65.06\n").driver == "580.65.06"
    for flag, args in (("--gpu", (" ", None, None)), ("--sm", (None, "", None)), ("--driver", (None, None, "\t"))):
        with pytest.raises(ConfigError) as exc:
            facts_override(host, *args)
        assert exc.value.message == f"{flag} is empty"
    with pytest.raises(ConfigError) as exc:
        facts_override(host, None, None, "5" * 100)
    assert exc.value.message == f"--driver '{'5' * 59}...: expected a branch (535) or a version like 535.54.03"
    # a host driver nobody can read: refused where a tag would be picked by it, unless --driver replaces it
    unread = HostFacts(driver="[N/A]", gpus=host.gpus)
    with pytest.raises(ConfigError) as exc:
        facts_override(unread, None, "90", None)
    assert exc.value.message == ("this host's driver reports version '[N/A]', which is not a driver version; pass "
                                 "--driver (e.g. --driver 535.104.05)")
    assert facts_override(unread, None, None, "535").driver == "535"
    # no GPU: no driver to read, nothing refused
    assert facts_override(HostFacts(driver="[N/A]"), None, None, None).driver is None


def test_pick_and_doctor_hold_forward_compatibility_to_the_gpus_arch(plan):
    from builder.doctor import cuda_paths_check

    # a B200 on R535: no CUDA through forward compatibility (the branch predates sm_100)
    assert cuda_paths_check("535.104.05", ("datacenter", "given"), "100").detail == (
        "product line datacenter (given); driver 535.104.05: CUDA 11.8, 12.0, 12.1, 12.2 natively")
    b200 = HostFacts(driver="535.104.05", gpus=(Gpu(0, "NVIDIA B200", "10.0"),))
    tag, why = pick(plan, "qwen3-embed", b200, gpu_brand="datacenter", cpu_fallback=True)
    assert tag == "cpu" and any(line.startswith("cu128-sm100: CUDA 12.8 needs driver >= 570.26, this host has "
                                                "535.104.05; driver 535.104.05 predates sm_100") for line in why)


def test_pick_without_any_known_arch_says_what_to_pass(plan):
    unknown = HostFacts(driver="535.104.05", gpus=(Gpu(0, "NVIDIA Foo", None), Gpu(1, "NVIDIA Bar", None)))
    with pytest.raises(ConfigError) as exc:
        pick(plan, "qwen3-embed", unknown)
    assert exc.value.message == (
        "no GPU of this host has a known arch (GPU 0 (NVIDIA Foo, compute capability unknown); GPU 1 (NVIDIA Bar, "
        "compute capability unknown)): its compute capability was not reported and its name is not in the GPU "
        "table; pass --sm (e.g. --sm 90)")
    # a name the GPU table knows gives the arch
    assert pick(plan, "qwen3-embed", HostFacts(driver="580.65.06", gpus=(Gpu(0, "NVIDIA H100", None),)))[0] == \
        "cu130-sm90"


def test_compat_on_a_gpu_host_asks_about_its_gpu(tmp_path):
    # auto: the host's product line, and for a driver its arch too (a B200 on R535 has no forward path)
    env = _fake_nvidia_smi(tmp_path, "0, NVIDIA B200, 10.0, 535.104.05")
    out = json.loads(run_mopt("compat", "--cuda", "12.8", "--driver", "535", "--format", "json", env=env).stdout)
    assert not out["compatible"] and out["resolved"]["sm"] == "100" and out["resolved"]["gpu_brand"] == "datacenter"
    assert out["notes"] == ["GPU arch sm_100 is this host's (GPU 0 (NVIDIA B200, sm_100)): forward compatibility "
                            "depends on it; pass --sm (or --gpu-brand) to ask about another GPU."]
    assert "predates sm_100" in out["reasons"][0]
    # --sm given: the host GPU of that arch gives the product line; without a driver, no arch is added
    assert json.loads(run_mopt("compat", "--cuda", "12.8", "--sm", "90", "--driver", "535", "--format", "json",
                               env=env).stdout)["resolved"]["gpu_brand"] is None
    no_driver = run_mopt("compat", "--cuda", "12.8", "--format", "json", env=env)
    assert json.loads(no_driver.stdout)["resolved"]["sm"] is None
    # a mixed host: --sm picks the GPU whose line counts
    env = _fake_nvidia_smi(tmp_path, "0, NVIDIA GeForce RTX 4090, 8.9, 535.104.05\n"
                                     "1, NVIDIA H100 80GB HBM3, 9.0, 535.104.05")
    out = json.loads(run_mopt("compat", "--cuda", "12.8", "--sm", "90", "--driver", "535", "--format", "json",
                              env=env).stdout)
    assert out["compatible"] and out["resolved"]["gpu_brand"] == "datacenter" and out["notes"][0].startswith(
        "driver branch 535 is below CUDA 12.8's minimum driver 570.26, but a data-center GPU runs")
    # a given brand is a question about another GPU: no host arch, no contradiction check
    out = json.loads(run_mopt("compat", "--cuda", "12.8", "--driver", "535", "--gpu-brand", "datacenter", "--format",
                              "json", env=env).stdout)
    assert out["compatible"] and out["resolved"]["sm"] is None
