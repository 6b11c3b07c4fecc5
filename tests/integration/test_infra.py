"""Infrastructure against the real Docker daemon and a real registry (scripts/setup.sh starts them).

Nothing is pulled: images are made with `docker import` (a one-file tar, or the mmdebstrap base).
"""
from __future__ import annotations

import json
import secrets
import subprocess
import tarfile
from pathlib import Path

import pytest

from builder.base import BaseSpec, ensure_base, state_path
from builder.dockerclient import DockerCli, candidate_paths, find_docker, run_docker
from builder.errors import EnvironmentProblem, PublishError
from builder.localregistry import LocalRegistry, docker_login

pytestmark = pytest.mark.integration

EPOCH = 1700000000
BASE_NAME = "mopt-test/base:infra"


@pytest.fixture(scope="module")
def docker() -> DockerCli:
    try:
        return find_docker()
    except EnvironmentProblem as exc:
        pytest.skip(f"no Docker daemon reachable with a BuildKit client (run scripts/setup.sh): {exc}")


def _rmi(docker: DockerCli, *refs: str) -> None:
    run_docker(["rmi", "-f", *refs], docker=docker, check=False)


def _file_contains(path: Path, needle: bytes, chunk: int = 1 << 20) -> bool:
    """Raw scan (docker save's layers are uncompressed tars, so this sees every file)."""
    tail = b""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if needle in tail + block:
                return True
            tail = block[-len(needle):]
    return False


# --------------------------------------------------------------------------- docker client
def test_docker_client_is_found_and_buildkit_capable(docker):
    assert docker.buildkit in ("buildx", "builtin")
    assert docker.path in candidate_paths()
    assert docker.version and docker.server_version
    assert find_docker() is docker  # cached per process
    res = run_docker(["info", "--format", "{{.ServerVersion}}"], docker=docker)
    assert res.stdout.strip() == docker.server_version


def test_broken_client_is_reported_not_used(docker, tmp_path):
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(EnvironmentProblem) as exc:
        find_docker([str(fake)], refresh=True)
    assert str(fake) in str(exc.value) and "apt-get install docker.io" in str(exc.value)
    assert exc.value.exit_code == 7


# --------------------------------------------------------------------------- base image
@pytest.fixture(scope="module")
def base_state(docker, tmp_path_factory):
    """Build the base from scratch (image removed first), then call again: must be skipped."""
    state_dir = tmp_path_factory.mktemp("bases")
    _rmi(docker, BASE_NAME)
    spec = BaseSpec(name=BASE_NAME, epoch=EPOCH)
    lines: list[str] = []
    first = ensure_base(spec, state_dir, docker, log=lines.append)
    second_lines: list[str] = []
    second = ensure_base(spec, state_dir, docker, log=second_lines.append)
    yield spec, state_dir, first, second, lines, second_lines
    _rmi(docker, BASE_NAME)


def test_base_built_then_skipped(base_state, docker):
    spec, state_dir, first, second, lines, second_lines = base_state
    assert not first.reused and first.tool in ("mmdebstrap", "debootstrap")
    assert first.build_seconds > 0 and first.size_bytes > 10_000_000
    assert any(ln.startswith("bash=") for ln in first.manifest)
    assert len(first.rootfs_sha256) == 64
    assert second.reused and second.image_id == first.image_id
    assert any("nothing to build" in ln for ln in second_lines)
    doc = json.loads(state_path(state_dir, spec.name).read_text())
    assert doc["key"] == spec.key and doc["image_id"] == first.image_id and doc["epoch"] == EPOCH
    res = run_docker(["run", "--rm", "--network=none", BASE_NAME, "sh", "-c",
                      ". /etc/os-release; echo $VERSION_CODENAME; echo $LANG"], docker=docker)
    assert res.stdout.split() == ["bookworm", "C.UTF-8"]


def test_base_state_lost_recovered_from_label(base_state, docker):
    spec, state_dir, first, *_ = base_state
    state_path(state_dir, spec.name).unlink()
    again = ensure_base(spec, state_dir, docker, log=lambda _: None)
    assert again.reused and again.image_id == first.image_id
    assert state_path(state_dir, spec.name).exists()


def test_base_retagged_when_tag_moved(base_state, docker, tmp_path):
    """Someone tags another image with the base's name: the recorded image is re-tagged, not rebuilt."""
    spec, state_dir, first, *_ = base_state
    (tmp_path / "f").write_text("decoy\n")
    with tarfile.open(tmp_path / "decoy.tar", "w") as tf:
        tf.add(tmp_path / "f", arcname="f")
    decoy = run_docker(["import", str(tmp_path / "decoy.tar"), BASE_NAME], docker=docker).stdout.strip()
    try:
        again = ensure_base(spec, state_dir, docker, log=lambda _: None)
        assert again.reused and again.image_id == first.image_id
        res = run_docker(["image", "inspect", "--format", "{{.Id}}", BASE_NAME], docker=docker)
        assert res.stdout.strip() == first.image_id
    finally:
        _rmi(docker, decoy)


# --------------------------------------------------------------------------- BuildKit secrets
def _build_with_secret(docker: DockerCli, tmp_path: Path, base_ref: str, run_line: str,
                       tag: str, secret: str) -> None:
    ctx = tmp_path / f"ctx-{tag.replace(':', '-').replace('/', '-')}"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"ARG BASE\nFROM ${{BASE}}\n{run_line}\n")
    secret_file = tmp_path / "token.txt"
    secret_file.write_text(secret)
    seen: list[str] = []
    # --no-cache: BuildKit's cache key ignores secret contents, so a cached RUN from an earlier
    # test run would carry the earlier secret (or none) and the checks would test nothing.
    run_docker([*docker.build_args(), "--progress=plain", "--network=none", "--no-cache",
                "--secret", f"id=token,src={secret_file}", "--build-arg", f"BASE={base_ref}",
                "-t", tag, str(ctx)], docker=docker, log=seen.append, redact=[secret], timeout=300)
    assert not any(secret in ln for ln in seen)


def _leaks(docker: DockerCli, tag: str, secret: str, tmp_path: Path) -> tuple[bool, bool]:
    hist = run_docker(["history", "--no-trunc", tag], docker=docker)
    saved = tmp_path / f"{tag.replace(':', '-').replace('/', '-')}.tar"
    run_docker(["save", "-o", str(saved), tag], docker=docker, timeout=300)
    assert saved.stat().st_size > 0
    return secret in hist.stdout, _file_contains(saved, secret.encode())


def test_build_with_secret_leaves_no_trace(base_state, docker, tmp_path):
    secret = "mopt-secret-" + secrets.token_hex(16)
    tag = "mopt-test/secret:ok"
    try:
        _build_with_secret(
            docker, tmp_path, BASE_NAME,
            "RUN --mount=type=secret,id=token test -s /run/secrets/token "
            "&& wc -c < /run/secrets/token > /secret-bytes", tag, secret)
        res = run_docker(["run", "--rm", "--network=none", tag, "cat", "/secret-bytes"], docker=docker)
        assert res.stdout.strip() == str(len(secret))  # the RUN really saw the secret
        in_history, in_layers = _leaks(docker, tag, secret, tmp_path)
        assert not in_history
        assert not in_layers
    finally:
        _rmi(docker, tag)


def test_leak_detector_positive_control(base_state, docker, tmp_path):
    """The same scan does find a secret that a careless RUN copies into a layer."""
    secret = "mopt-leak-" + secrets.token_hex(16)
    tag = "mopt-test/secret:leaky"
    try:
        _build_with_secret(docker, tmp_path, BASE_NAME,
                           "RUN --mount=type=secret,id=token cp /run/secrets/token /leaked", tag, secret)
        _, in_layers = _leaks(docker, tag, secret, tmp_path)
        assert in_layers
    finally:
        _rmi(docker, tag)


# --------------------------------------------------------------------------- registry
@pytest.fixture
def registry(tmp_path):
    with LocalRegistry(tmp_path / "registry", user="ci", password="pw-" + secrets.token_hex(12)) as reg:
        yield reg
    assert not reg.running


@pytest.fixture
def tiny_image(docker, registry, tmp_path):
    """A one-file image made with `docker import` (never pulled), tagged for the registry."""
    payload = tmp_path / "hello.txt"
    payload.write_text("hello from mopt\n")
    tar_path = tmp_path / "tiny.tar"
    with tarfile.open(tar_path, "w") as tf:
        tf.add(payload, arcname="hello.txt")
    ref = f"{registry.address}/mopt-test/tiny:1"
    run_docker(["import", str(tar_path), ref], docker=docker)
    yield ref
    _rmi(docker, ref)


def test_registry_answers_401_without_credentials(registry):
    assert registry.running
    assert registry.check_credentials()
    assert not registry.check_credentials(password="wrong")
    assert registry.password not in registry.config_path.read_text()
    assert registry.password not in registry.htpasswd_path.read_text()


def test_push_rejected_without_login_then_accepted(docker, registry, tiny_image, tmp_path):
    empty_cfg = tmp_path / "docker-empty"
    empty_cfg.mkdir()
    denied = run_docker(["push", tiny_image], docker=docker, check=False,
                        env={"DOCKER_CONFIG": str(empty_cfg)}, timeout=120)
    assert denied.returncode != 0
    text = (denied.stdout + denied.stderr).lower()
    assert "no basic auth credentials" in text or "401" in text or "unauthorized" in text

    cfg = tmp_path / "docker-cfg"
    cfg_file = docker_login(registry.address, registry.user, registry.password, config_dir=cfg)
    assert cfg_file == cfg / "config.json"
    assert oct(cfg_file.stat().st_mode & 0o777) == "0o600"
    pushed = run_docker(["push", tiny_image], docker=docker, env={"DOCKER_CONFIG": str(cfg)},
                        timeout=120, redact=[registry.password])
    assert "digest: sha256:" in pushed.stdout
    digest = pushed.stdout.split("digest: ")[1].split()[0]

    # Independent check with skopeo, credentials from the auth file (not the command line).
    insp = subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--authfile", str(cfg_file),
                           f"docker://{tiny_image}"], capture_output=True, text=True, timeout=60)
    assert insp.returncode == 0, insp.stderr
    assert json.loads(insp.stdout)["Digest"] == digest
    assert registry.password not in registry.log_path.read_text()


def test_login_via_cli_and_wrong_password(docker, registry, tiny_image, tmp_path):
    cfg = tmp_path / "docker-cli-cfg"
    path = docker_login(registry.address, registry.user, registry.password, config_dir=cfg,
                        use_cli=True, docker=docker)
    assert registry.address in json.loads(path.read_text())["auths"]
    pushed = run_docker(["push", tiny_image], docker=docker, env={"DOCKER_CONFIG": str(cfg)}, timeout=120)
    assert "digest: sha256:" in pushed.stdout

    with pytest.raises(PublishError) as exc:
        docker_login(registry.address, registry.user, "not-the-password", config_dir=tmp_path / "bad")
    assert "not-the-password" not in str(exc.value)
    with pytest.raises(PublishError) as exc:
        docker_login(registry.address, registry.user, "not-the-password", config_dir=tmp_path / "bad2",
                     use_cli=True, docker=docker)
    assert "not-the-password" not in str(exc.value)
