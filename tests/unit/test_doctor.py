"""mopt pick: which published tag fits a host (driver floor, sm); mopt doctor on this GPU-less host."""
import json
import shutil
from pathlib import Path

import pytest

from builder.doctor import Gpu, HostFacts, facts_override, pick
from builder.errors import ConfigError, IncompatibleError
from builder.matrix import load_matrix
from builder.plan import make_plan
from tests.conftest import run_mopt


@pytest.fixture(scope="module")
def plan(request):
    from pathlib import Path

    return make_plan(load_matrix(Path(__file__).resolve().parents[2] / "matrix.yaml"))


def test_pick_newest_cuda_the_driver_runs(plan):
    facts = HostFacts(driver="550.54.14", gpus=(Gpu(0, "NVIDIA A10", "8.6"),))
    tag, why = pick(plan, "qwen3-embed", facts)
    assert tag == "cu124-sm86"  # 12.8 needs 570.26, 13.0 needs 580.65.06
    assert any("cu128-sm86: CUDA 12.8 needs driver >= 570.26" in line for line in why)


def test_pick_flavour(plan):
    facts = HostFacts(driver="580.82.07", gpus=(Gpu(0, "NVIDIA H200", "9.0"),))
    assert pick(plan, "qwen3-embed", facts)[0] == "cu130-sm90"
    assert pick(plan, "qwen3-embed", facts, "vllm")[0] == "cu130-sm90-vllm"


def test_pick_unsupported_arch_refuses_unless_the_cpu_fallback_is_asked_for(plan):
    facts = HostFacts(driver="580.82.07", gpus=(Gpu(0, "Tesla P100", "6.0"),))
    with pytest.raises(IncompatibleError) as exc:
        pick(plan, "qwen3-embed", facts)
    assert exc.value.exit_code == 3 and exc.value.message == (
        "no published tag of qwen3-embed fits this host: no tag is built for sm_60 (engines are tied to the GPU "
        "arch; built: sm_75, sm_80, sm_86, sm_89, sm_90, sm_100, sm_120); cpu would run on the CPU: pass "
        "--cpu-fallback to take it")
    tag, why = pick(plan, "qwen3-embed", facts, cpu_fallback=True)
    assert tag == "cpu" and "no tag is built for sm_60" in why[0]
    assert why[-1] == "no GPU tag fits this host (--cpu-fallback): using the cpu variant"


def test_pick_without_cpu_variant_is_incompatible(plan):
    facts = HostFacts(driver="470.82.01", gpus=(Gpu(0, "NVIDIA A10", "8.6"),))
    with pytest.raises(Exception) as exc:
        pick(plan, "qwen3-embed", facts, "vllm")
    assert exc.value.exit_code == 3 and exc.value.message == (
        "no published tag of qwen3-embed fits this host: cu128-sm86-vllm: CUDA 12.8 needs driver >= 570.26, this "
        "host has 470.82.01; the GPU's product line is unknown, so forward compatibility is not assumed; on a "
        "data-center GPU it would run through forward compatibility (cuda-compat-12-8): give --gpu-brand datacenter "
        "if it is one (source: FWD; NVCUDA-IMG); cu130-sm86-vllm: CUDA 13.0 needs driver >= 580.65.06, this host has "
        "470.82.01")
    with pytest.raises(Exception) as exc:
        pick(plan, "qwen3-embed", HostFacts(), "vllm")
    assert exc.value.message == ("no published tag of qwen3-embed fits this host: no NVIDIA GPU on this host and "
                                 "the image has no cpu variant")


def test_pick_unknown_image(plan):
    with pytest.raises(ConfigError) as exc:
        pick(plan, "nope", HostFacts())
    assert exc.value.message == "image 'nope' is not in the matrix (images: minilm-embed, qwen3-chat, qwen3-embed)"
    with pytest.raises(ConfigError) as exc:
        pick(plan, "qwen3-embed", HostFacts(), "nope")
    assert exc.value.message == ("image 'qwen3-embed' has no flavour 'nope' (flavours: aot, aot-debian, cpu, "
                                 "tensorrt, vllm, vllm-debian)")


def test_overrides_from_gpu_name_and_sm():
    assert facts_override(HostFacts(), "L4", None, "550.54.14").gpus[0].sm == "89"
    assert facts_override(HostFacts(), None, "sm_120", None).gpus[0].cc == "12.0"
    with pytest.raises(ConfigError):
        facts_override(HostFacts(), None, None, "five-three-five")


def test_pick_cli_on_this_host():
    result = run_mopt("pick", "minilm-embed", "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["reference"] == "mopt/minilm-embed:cpu"
    # an A100 is a data-center GPU: on the R535 branch it runs the CUDA 12.8 image through forward
    # compatibility (docs/matrix.md); on a GPU of unknown product line the newest native tag is CUDA 12.1's
    result = run_mopt("pick", "qwen3-embed", "--gpu", "A100", "--driver", "535.54.03")
    assert result.returncode == 0 and result.stdout.strip() == "mopt/qwen3-embed:cu128-sm80", result.stderr
    assert "cu128-sm80 runs through forward compatibility" in result.stderr
    result = run_mopt("pick", "qwen3-embed", "--sm", "80", "--driver", "535.54.03")
    assert result.returncode == 0 and result.stdout.strip() == "mopt/qwen3-embed:cu121-sm80"
    assert run_mopt("pick", "qwen3-embed", "--gpu", "Voodoo 3").returncode == 2


def test_doctor_without_a_daemon(tmp_path):
    """The real Docker client pointed at a socket nobody serves: Debian's docker 20.10 exits 0 there
    and reports the error inside its JSON. doctor says the daemon does not answer, exits 1, and
    shows no traceback."""
    if shutil.which("docker") is None and not Path("/usr/bin/docker").exists():
        pytest.skip("no docker client on this machine")
    result = run_mopt("doctor", "--format", "json", env={"DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock"})
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    names = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert names["docker"]["status"] == "fail"
    assert names["docker"]["detail"].startswith("the daemon does not answer: ")
    assert "no-daemon.sock" in names["docker"]["detail"] and "dockerd" in names["docker"]["fix"]


@pytest.mark.integration
def test_doctor_on_a_host_without_gpu():
    result = run_mopt("doctor", "--format", "json")
    data = json.loads(result.stdout)
    names = {c["name"]: c for c in data["checks"]}
    assert {"docker", "buildkit", "nvidia-driver", "shm", "disk"} <= set(names)
    assert names["docker"]["status"] == "ok", names["docker"]
    assert data["gpus"] == [] and names["nvidia-driver"]["status"] == "info"
    assert result.returncode == 0


def test_candidates_from_labels_skip_long_tags_and_foreign_images():
    from builder.doctor import Candidate, pick_among

    labels = {"org.opencontainers.image.ref.name": "cu130-sm90", "io.mopt.flavour": "aot", "io.mopt.device": "cuda",
              "io.mopt.cuda": "13.0", "io.mopt.sm": "90", "io.mopt.driver.min": "580.65.06"}
    short = Candidate.of_labels("cu130-sm90", labels)
    assert short == Candidate("cu130-sm90", "aot", "cuda", "90", "13.0", "580.65.06")
    assert Candidate.of_labels("cu130-sm90-aot-torch2.13.0-b1", labels) is None  # a long tag: same image
    assert Candidate.of_labels("latest", {}) is None  # not a mopt image
    assert Candidate.of_labels("x", {"org.opencontainers.image.ref.name": "x", "io.mopt.device": "tpu"}) is None
    cpu = Candidate.of_labels("cpu", {"org.opencontainers.image.ref.name": "cpu", "io.mopt.device": "cpu",
                                      "io.mopt.sm": "none", "io.mopt.cuda": "none", "io.mopt.flavour": "cpu"})
    assert (cpu.sm, cpu.cuda, cpu.min_driver) == (None, None, None)
    h200 = HostFacts(driver="580.82.07", gpus=(Gpu(0, "NVIDIA H200", "9.0"),))
    assert pick_among([cpu, short], "qwen3-embed", h200) == ("cu130-sm90", [])
    old_driver = HostFacts(driver="570.86.10", gpus=(Gpu(0, "NVIDIA H200", "9.0"),))
    with pytest.raises(IncompatibleError, match="cpu would run on the CPU: pass --cpu-fallback"):
        pick_among([cpu, short], "qwen3-embed", old_driver)


def test_registry_labels_of_the_wrong_shape_or_an_unknown_cuda_do_not_stop_pick():
    from builder.doctor import Candidate, pick_among

    def labels(tag, **over):
        base = {"org.opencontainers.image.ref.name": tag, "io.mopt.flavour": "aot", "io.mopt.device": "cuda",
                "io.mopt.cuda": "13.0", "io.mopt.sm": "90", "io.mopt.driver.min": "580.65.06"}
        return {**base, **{f"io.mopt.{k.replace('_', '.')}": v for k, v in over.items()}}

    assert Candidate.of_labels("x", labels("x", sm="latest")) is None
    assert Candidate.of_labels("x", labels("x", cuda="thirteen")) is None
    assert Candidate.of_labels("x", labels("x", driver_min="new")) is None
    good = Candidate.of_labels("cu130-sm90", labels("cu130-sm90"))
    newer = Candidate.of_labels("cu139-sm90", labels("cu139-sm90", cuda="13.9"))  # a later release's tag
    h200 = HostFacts(driver="580.82.07", gpus=(Gpu(0, "NVIDIA H200", "9.0"),))
    tag, why = pick_among([good, newer], "qwen3-embed", h200)
    assert tag == "cu130-sm90" and why[0].startswith("cu139-sm90: CUDA 13.9")
    assert pick_among([newer, good], "qwen3-embed", h200)[0] == "cu130-sm90"  # the next tags are still weighed
    plain = Candidate.of_labels("cu130-sm90", {k: v for k, v in labels("cu130-sm90", driver_min="").items()
                                               if k != "io.mopt.flavour"})
    assert (plain.flavour, plain.min_driver) == ("", None)  # an empty label is no label


def test_the_tag_list_pages_are_followed_and_bounded():
    from builder.registry.api import TAG, _next_page

    assert _next_page('</v2/mopt/x/tags/list?n=2&last=b>; rel="next"') == "/v2/mopt/x/tags/list?n=2&last=b"
    assert _next_page('<https://r.example:5000/v2/mopt/x/tags/list?last=b>; rel="next"') == \
        "/v2/mopt/x/tags/list?last=b"
    assert _next_page("") == "" and _next_page("<https://elsewhere/login>") == ""
    assert _next_page("<https://r:5000/v2/x/tags/list?last=a://b>") == "/v2/x/tags/list?last=a://b"
    assert TAG.fullmatch("cu130-sm90") and not TAG.fullmatch("-x") and not TAG.fullmatch("a/b")
