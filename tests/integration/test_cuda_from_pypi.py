"""CUDA images with no registry to pull from: qwen3-embed's aot-debian and vllm-debian lines (the project's
Debian 12 rootfs, torch's or vLLM's CUDA 13.0 build and their nvidia-* wheels from PyPI, the driver from the
host) built here for real: the aot line's runtime and toolchain stages, the vLLM line's runtime stage. The
engine compile needs the target GPU, which these machines lack (docs/cuda-from-pypi.md says what is
checked here and what only a GPU runner can show).

On a cold daemon: about 3 minutes and 6 GB of images for the aot line, 4 minutes and 9.4 GB for the vLLM
line (wheels from PyPI); the layers stay in the daemon's cache for the next run."""
import json
import subprocess

import pytest

from builder.build import Builder, BuildOptions, default_ca_bundle, default_find_links
from builder.matrix import load_matrix
from builder.plan import make_plan
from tests.integration.conftest import REPO, STATE
from tests.unit.test_gpu_problem import cuda_engine

pytestmark = pytest.mark.integration
VARIANT = "qwen3-embed:cu130-sm90-aot-debian"
VLLM_VARIANT = "qwen3-embed:cu130-sm90-vllm-debian"
SITE = "/opt/venv/lib/python3.11/site-packages"


def _builder(docker_cli, variant_id: str):
    matrix = load_matrix(REPO / "matrix.yaml")
    plan = make_plan(matrix)
    (variant,) = [v for v in plan.variants if v.id == variant_id]
    options = BuildOptions(state_dir=STATE, templates=REPO / "templates", ca_bundle=default_ca_bundle(),
                           find_links=default_find_links())
    return Builder(matrix, plan.variants, options, log=lambda line: None, docker=docker_cli), variant


@pytest.fixture(scope="module")
def stages(docker_cli):
    """(runtime image id, toolchain image id), built as `mopt build` builds them, unlocked."""
    builder, variant = _builder(docker_cli, VARIANT)
    made = builder.runtime(variant)
    return made.runtime.image_id, builder.compiler(variant, made).image_id


@pytest.fixture(scope="module")
def vllm_runtime(docker_cli):
    builder, variant = _builder(docker_cli, VLLM_VARIANT)
    return builder.runtime(variant).runtime.image_id


def run(docker_cli, image: str, *argv: str, env: dict | None = None, volume: str | None = None,
        entrypoint: str = "python") -> subprocess.CompletedProcess:
    cmd = [docker_cli.path, "run", "--rm", "--network", "none", "--entrypoint", entrypoint]
    for key, value in (env or {}).items():
        cmd += ["-e", f"{key}={value}"]
    if volume:
        cmd += ["-v", volume]
    return subprocess.run([*cmd, image, *argv], capture_output=True, text=True, timeout=300)


def test_torch_is_pypis_cuda_13_build(docker_cli, stages):
    runtime, _ = stages
    out = run(docker_cli, runtime, "-c", "import torch; print(torch.__version__, torch.version.cuda, "
                                         "torch.cuda.is_available())")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2.11.0+cu130", "13.0", "False"]  # no GPU on this machine


def test_the_image_says_what_nvidias_images_say(docker_cli, stages):
    runtime, _ = stages
    info = json.loads(subprocess.run([docker_cli.path, "image", "inspect", runtime], capture_output=True,
                                     text=True, check=True).stdout)[0]["Config"]
    env = dict(line.split("=", 1) for line in info["Env"])
    assert (env["NVIDIA_VISIBLE_DEVICES"], env["NVIDIA_DRIVER_CAPABILITIES"]) == ("all", "compute,utility")
    assert env["NVIDIA_REQUIRE_CUDA"].startswith("cuda>=13.0")
    assert "/usr/local/nvidia/lib64" in env["LD_LIBRARY_PATH"].split(":")
    assert info["Labels"]["com.nvidia.volumes.needed"] == "nvidia_driver"
    assert info["Labels"]["com.nvidia.cuda.version"] == "13.0"


def test_every_library_torch_links_resolves_in_the_image_but_the_drivers(docker_cli, stages):
    """What the engine loader needs: torch's CUDA libraries resolve from the nvidia-* wheels; only the
    driver's libcuda.so.1 is missing here, which the NVIDIA container toolkit mounts at run time."""
    runtime, _ = stages
    script = (f"cd {SITE}/torch/lib && for f in libtorch_cuda.so libtorch_cpu.so libc10_cuda.so libtorch_python.so "
              "libcaffe2_nvrtc.so; do ldd $f | grep 'not found' | sed \"s|^|$f:|\"; done; echo done")
    out = run(docker_cli, runtime, "-c", script, entrypoint="sh")
    assert out.returncode == 0 and out.stdout.strip().endswith("done"), out.stderr[-2000:]
    missing = [line.split(":")[1].split("=>")[0].strip() for line in out.stdout.splitlines()[:-1]]
    assert set(missing) <= {"libcuda.so.1"}, out.stdout


def test_the_guard_without_a_gpu_names_the_missing_driver(docker_cli, stages, tmp_path):
    """The runtime's start-up guard, in the real image without a GPU: exit 3 and one line that says why."""
    runtime, _ = stages
    out_dir = cuda_engine(tmp_path / "engine-dir", "2.11.0+cu130", "13.0")
    for path in (out_dir, *out_dir.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    out = run(docker_cli, runtime, "-m", "mopt_runtime", "check", "--engine-dir", "/engine",
              volume=f"{out_dir}:/engine:ro")
    assert out.returncode == 3, out.stdout[-1000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "engine built for sm_90 (NVIDIA H200) but this host has no usable CUDA GPU (no NVIDIA driver in this " \
           "container (libcuda.so.1 not found): start it with --gpus all" in lines[0]


def test_doctor_in_the_image_reports_the_missing_driver(docker_cli, stages):
    """`doctor` in the real image without a GPU: what it found as JSON, the problem as one line, exit 3."""
    runtime, _ = stages
    out = run(docker_cli, runtime, "-m", "mopt_runtime", "doctor", env={"MOPT_ENGINE_DIR": ""})
    assert out.returncode == 3, out.stdout[-1000:] + out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: no NVIDIA driver in this container (libcuda.so.1 not found)"), line
    found = json.loads(out.stdout)
    assert (found["torch"], found["torch_cuda"], found["sm"], found["engine"]) == ("2.11.0+cu130", "13.0", None, None)
    assert found["image_requires"].startswith("cuda>=13.0")


def test_the_toolchain_has_a_cuda_prefix_from_pypi(docker_cli, stages):
    """What AOTInductor's CUDA build reads: CUDA_HOME with the runtime headers and nvcc (cuda-toolkit's nvcc
    extra at the release torch pins), and -lcuda pointed at where the toolkit mounts the driver."""
    _, toolchain = stages
    script = ('set -e; echo "$CUDA_HOME"; test -f "$CUDA_HOME/include/cuda_runtime_api.h"; '
              'test -f "$CUDA_HOME/include/crt/host_defines.h"; "$CUDA_HOME/bin/nvcc" --version | tail -2; '
              'readlink "$CUDA_HOME/lib/stubs/libcuda.so"; '
              "python -c 'import torch.utils.cpp_extension as c; print(c.CUDA_HOME)'")
    out = run(docker_cli, toolchain, "-c", script, entrypoint="sh")
    assert out.returncode == 0, out.stdout[-1000:] + out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == f"{SITE}/nvidia/cu13"
    assert "release 13.0" in out.stdout
    assert "/usr/lib/x86_64-linux-gnu/libcuda.so.1" in lines and lines[-1] == lines[0]


def test_the_vllm_line_imports_vllm_on_pypis_cuda_13_build(docker_cli, vllm_runtime):
    """vLLM 0.32.0 and the torch it pins, CUDA 13.0, both from PyPI; its compiled extensions link nothing the
    image lacks but the driver (they link libcuda.so.1 itself, so they load only with a GPU)."""
    probe = "import torch, vllm; print(vllm.__version__, torch.__version__, torch.version.cuda)"
    out = run(docker_cli, vllm_runtime, "-c", probe, env={"VLLM_NO_USAGE_STATS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["0.32.0", "2.13.0+cu130", "13.0"]
    # vLLM's extensions find torch's libraries in the process (torch is imported first), not by a path of
    # their own: ldd is given the same directories.
    script = (f"export LD_LIBRARY_PATH={SITE}/torch/lib:{SITE}/nvidia/cu13/lib; cd {SITE}/vllm && "
              "for f in $(find . -maxdepth 2 -name '*.so'); do ldd $f | grep 'not found' | "
              "sed \"s|^|$f:|\"; done; echo done")
    out = run(docker_cli, vllm_runtime, "-c", script, entrypoint="sh")
    assert out.returncode == 0 and out.stdout.strip().endswith("done"), out.stderr[-2000:]
    missing = [line.split(":")[1].split("=>")[0].strip() for line in out.stdout.splitlines()[:-1]]
    assert set(missing) <= {"libcuda.so.1"}, out.stdout
