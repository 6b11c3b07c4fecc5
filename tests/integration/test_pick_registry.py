"""`mopt pick HOST/NAMESPACE/NAME` reads the published tags and their labels from a real authenticated
registry, run from a directory without this repository's files (no matrix.yaml): a host with a GPU
gets the tag of its arch and driver, or exit 3 unless --cpu-fallback.

No CUDA image can be built here (issue 34), so the CUDA tags are stand-ins: one-file `docker import`s
carrying the labels templates/final.Dockerfile.j2 writes (the test checks the template still writes
each label it uses). The cpu tag is the real demo image's labels on the same stand-in."""
from __future__ import annotations

import io
import json
import os
import secrets
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from builder.dockerclient import run_docker
from builder.localregistry import LocalRegistry, docker_login

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SUFFIX = secrets.token_hex(4)
LABELS = ("org.opencontainers.image.ref.name", "io.mopt.flavour", "io.mopt.device", "io.mopt.cuda", "io.mopt.sm",
          "io.mopt.driver.min")
PUBLISHED = {  # tag -> (flavour, device, cuda, sm, driver floor), as the release of qwen3-embed labels them
    "cu128-sm90": ("tensorrt", "cuda", "12.8", "90", "570.26"),
    "cu130-sm90": ("tensorrt", "cuda", "13.0", "90", "580.65.06"),
    "cu130-sm86": ("tensorrt", "cuda", "13.0", "86", "580.65.06"),
    "cpu": ("cpu", "cpu", "none", "none", "none"),
}


def stand_in(docker, tmp: Path, name: str, labels: dict[str, str]) -> None:
    tar_path = tmp / "layer.tar"
    with tarfile.open(tar_path, "w") as tar:
        info = tarfile.TarInfo("hello.txt")
        info.size, info.mtime = 6, 1700000000
        tar.addfile(info, io.BytesIO(b"hello\n"))
    changes = [x for k, v in labels.items() for x in ("--change", f"LABEL {k}={v}")]
    run_docker(["import", *changes, str(tar_path), name], docker=docker, timeout=60)


@pytest.fixture(scope="module")
def published(docker_cli, tmp_path_factory):
    """A registry holding qwen3-embed's tags (short and one long) and the docker config to read it."""
    tmp = tmp_path_factory.mktemp("pick")
    template = (REPO / "templates" / "final.Dockerfile.j2").read_text()
    assert all(f"{label}=" in template for label in LABELS), "the final image no longer writes these labels"
    with LocalRegistry(tmp / "registry", user="reader", password="pw-" + secrets.token_hex(8)) as reg:
        config = tmp / "docker-config"
        docker_login(reg.address, reg.user, reg.password, config_dir=config)
        names = []
        for tag, (flavour, device, cuda, sm, floor) in PUBLISHED.items():
            labels = dict(zip(LABELS, (tag, flavour, device, cuda, sm, floor), strict=True))
            for pushed in (tag, f"{tag}-b{SUFFIX}"):  # a long tag names the same image: not a candidate
                name = f"{reg.address}/mopt/qwen3-embed:{pushed}"
                stand_in(docker_cli, tmp, name, labels)
                run_docker(["--config", str(config), "push", name], docker=docker_cli, timeout=120)
                names.append(name)
        yield reg, config, tmp
        run_docker(["rmi", "-f", *names], docker=docker_cli, check=False)


def pick(published, *args: str, config: Path | None = None) -> subprocess.CompletedProcess:
    reg, default_config, tmp = published
    cwd = tmp / "elsewhere"
    cwd.mkdir(exist_ok=True)
    assert not (cwd / "matrix.yaml").exists()
    env = {**os.environ, "DOCKER_CONFIG": str(config or default_config)}
    env.pop("MOPT_MATRIX", None)
    return subprocess.run([sys.executable, "-m", "builder", "pick", f"{reg.address}/mopt/qwen3-embed", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(600)
def test_pick_reads_the_registry_without_a_checkout(published):
    reg = published[0]
    got = pick(published, "--sm", "90", "--driver", "580.82.07", "--format", "json")
    assert got.returncode == 0, got.stderr
    answer = json.loads(got.stdout)
    assert answer["reference"] == f"{reg.address}/mopt/qwen3-embed:cu130-sm90"
    older = pick(published, "--sm", "90", "--driver", "575.51.03")
    assert older.returncode == 0 and older.stdout.strip() == f"{reg.address}/mopt/qwen3-embed:cu128-sm90"
    assert "cu130-sm90: CUDA 13.0 needs driver >= 580.65.06" in older.stderr
    assert pick(published, "--sm", "86", "--driver", "580.82.07").stdout.strip().endswith(":cu130-sm86")


@pytest.mark.timeout(600)
def test_a_gpu_no_tag_fits_is_exit_3_unless_the_cpu_fallback_is_asked_for(published):
    refused = pick(published, "--sm", "75", "--driver", "580.82.07")
    assert refused.returncode == 3 and refused.stdout == ""
    assert "no tag is built for sm_75" in refused.stderr and "--cpu-fallback" in refused.stderr
    assert "Traceback" not in refused.stderr
    taken = pick(published, "--sm", "75", "--driver", "580.82.07", "--cpu-fallback")
    assert taken.returncode == 0 and taken.stdout.strip().endswith("/mopt/qwen3-embed:cpu")
    # no GPU at all (this machine): the cpu tag is the answer, not a fallback
    assert pick(published).stdout.strip().endswith("/mopt/qwen3-embed:cpu")


@pytest.mark.timeout(600)
def test_registry_errors_are_one_line(published, tmp_path):
    empty = tmp_path / "no-credentials"
    empty.mkdir()
    denied = pick(published, "--sm", "90", config=empty)
    assert denied.returncode != 0 and "Traceback" not in denied.stderr
    assert "credentials" in denied.stderr.lower() or "401" in denied.stderr
    reg, config, tmp = published
    missing = subprocess.run([sys.executable, "-m", "builder", "pick", f"{reg.address}/mopt/no-such-image"],
                             cwd=tmp, env={**os.environ, "DOCKER_CONFIG": str(config)}, capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "no-such-image" in missing.stderr
