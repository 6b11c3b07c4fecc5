"""mopt lock, build --locked (hash-checked installs, stale-lock error) and verify-repro on the cpu
demo variant, against the real daemon. Works in a copy of the repo's matrix so the repo's own lock
file is untouched; builds share .mopt/test-state."""
import json
import subprocess

import pytest

from builder.dockerclient import find_docker
from builder.render import defaults
from builder.state import StateDir
from tests.integration.conftest import STATE, copy_matrix
from tests.integration.conftest import mopt_cli as mopt

pytestmark = pytest.mark.integration
VARIANT = "minilm-embed:cpu"


@pytest.fixture(scope="module")
def work(docker_cli, tmp_path_factory):
    work = copy_matrix(tmp_path_factory.mktemp("lock"))
    result = mopt("lock", "--select", VARIANT, cwd=work)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return work


def test_lock_pins_hashes_versions_and_base(work):
    lock = json.loads((work / "mopt.lock.json").read_text())
    (entry,) = [e for e in lock["runtimes"].values() if VARIANT in e["variants"]]
    assert VARIANT in entry["variants"]
    torch = next(line for line in entry["python"] if line.startswith("torch=="))
    assert torch.startswith("torch==2.13.0+cpu --hash=sha256:") and len(torch.split("sha256:")[1]) == 64
    assert all(" --hash=sha256:" in line for line in entry["python"])
    assert any(line.startswith("python3.11=") for line in entry["debian"])
    assert entry["base"]["kind"] == "rootfs" and len(entry["base"]["rootfs_sha256"]) == 64


def test_a_variant_that_cannot_be_built_here_is_locked_partly_and_a_locked_build_refuses_it(work):
    cuda = "qwen3-embed:cu121-sm86"  # its nvidia/cuda base cannot be pulled on these machines
    result = mopt("lock", "--select", VARIANT, "--select", cuda, cwd=work)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "2 runtimes (1 complete, 1 partial)" in result.stdout
    assert f"partial: {cuda}: missing the Python packages' hashes" in result.stdout
    lock = json.loads((work / "mopt.lock.json").read_text())
    (partial,) = [e for e in lock["runtimes"].values() if cuda in e["variants"]]
    assert partial["pins"]["tensorrt"] and partial["pins"]["cuda"] == "12.1" and partial["python"] == []
    assert any("nvidia/cuda" in why for why in partial["missing"])
    complete = [e for e in lock["runtimes"].values() if VARIANT in e["variants"]]
    assert complete and all(not e.get("missing") and e["python"] for e in complete)
    refused = mopt("build", "--locked", "--select", cuda, cwd=work)
    assert refused.returncode == 2, refused.stderr[-1500:]
    assert f"pins {cuda} only partly" in refused.stderr and "docker build ->" not in refused.stderr


def test_locked_build_installs_exactly_the_lock(work):
    result = mopt("build", "--locked", "--select", VARIANT, cwd=work)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "locked: " in result.stderr
    record = StateDir(STATE).read_record("minilm-embed", "cpu")
    docker = find_docker()

    def frozen(image: str) -> list[str]:
        return sorted(subprocess.run([docker.path, "run", "--rm", "--entrypoint", "python", image, "-m", "pip",
                                      "freeze", "--all"], capture_output=True, text=True, check=True).stdout.split())

    (entry,) = [e for e in json.loads((work / "mopt.lock.json").read_text())["runtimes"].values()
                if VARIANT in e["variants"]]
    locked = sorted(line.split(" ")[0] for line in entry["python"])
    # The toolchain holds the whole locked set; the serving-only runtime all of it but serving_prune's.
    assert frozen(record.stage("toolchain").image_id) == locked
    pruned = {n.lower().replace("_", "-") for n in defaults()["serving_prune"]["packages"]}
    assert frozen(record.stage("runtime").image_id) == [
        line for line in locked if line.split("==")[0].lower().replace("_", "-") not in pruned]


def test_stale_lock_fails_clearly(work):
    template = work / "templates" / "runtime-torch-aot.Dockerfile.j2"
    original = template.read_text()
    template.write_text(original + "ENV MOPT_CHANGED=1\n")
    try:
        result = mopt("build", "--locked", "--select", VARIANT, cwd=work)
        released = mopt("release", "--locked", "--select", VARIANT, cwd=work)
    finally:
        template.write_text(original)
    for res in (result, released):  # the release path takes the lock the same way
        assert res.returncode == 2, res.stderr[-1500:]
        assert "is stale for minilm-embed:cpu" in res.stderr and "run mopt lock" in res.stderr
        assert "docker build ->" not in res.stderr  # refused before building anything


def test_verify_repro_of_the_cpu_variant(work):
    """The locked build above against one build from scratch (--against-built: one build, where the default's
    two builds from scratch cost about two more minutes; tests/unit/test_repro.py holds the default's)."""
    result = mopt("verify-repro", "--locked", "--against-built", "--select", VARIANT, cwd=work, timeout=3000)
    report = json.loads((STATE / "reports" / "repro-minilm-embed-cpu.json").read_text())
    assert report["files"] > 10000 and report["first_build"] == "as built"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1500:]
    assert "build a of 2, as built" in result.stdout and "build b of 2, from scratch" in result.stdout
    assert report["reproducible"] and report["differences"] == []
