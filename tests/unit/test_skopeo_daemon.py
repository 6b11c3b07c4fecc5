"""skopeo reaches the daemon docker uses: its docker-daemon: transport reads /var/run/docker.sock unless
told, so with DOCKER_HOST set (rootless Docker, a second daemon) a push would copy from the wrong daemon."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from builder.dockerclient import skopeo_daemon_host
from builder.registry import push


def test_no_docker_host_adds_nothing():
    assert skopeo_daemon_host("src", env={}) == []


def test_docker_host_is_passed_on_either_side():
    env = {"DOCKER_HOST": "unix:///tmp/other/docker.sock"}
    assert skopeo_daemon_host("src", env=env) == ["--src-daemon-host", "unix:///tmp/other/docker.sock"]
    assert skopeo_daemon_host("dest", env=env) == ["--dest-daemon-host", "unix:///tmp/other/docker.sock"]


def _published_argv(monkeypatch, tmp_path: Path) -> list[str]:
    """copy_image's skopeo command line, skopeo itself replaced by one that writes a digest."""
    seen = {}

    def fake_run(argv, **kwargs):
        seen["argv"] = argv
        Path(argv[argv.index("--digestfile") + 1]).write_text("sha256:" + "a" * 64)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(push.shutil, "which", lambda name: "/usr/bin/skopeo")
    monkeypatch.setattr(push.subprocess, "run", fake_run)
    digest = push.copy_image("sha256:" + "b" * 64, "127.0.0.1:5000/mopt/x:t", tmp_path, insecure=True,
                             log=lambda _: None)
    assert digest == "sha256:" + "a" * 64
    return seen["argv"]


def test_publish_copies_from_the_daemon_docker_host_names(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("DOCKER_HOST", "unix:///tmp/other/docker.sock")
    argv = _published_argv(monkeypatch, tmp_path)
    at = argv.index("--src-daemon-host")
    assert argv[at + 1] == "unix:///tmp/other/docker.sock"
    assert at < argv.index("docker-daemon:sha256:" + "b" * 64)


@pytest.mark.parametrize("host", ["", None])
def test_publish_without_docker_host_uses_skopeos_default(monkeypatch, tmp_path: Path, host):
    if host is None:
        monkeypatch.delenv("DOCKER_HOST", raising=False)
    else:
        monkeypatch.setenv("DOCKER_HOST", host)
    assert not any(arg.endswith("-daemon-host") for arg in _published_argv(monkeypatch, tmp_path))
