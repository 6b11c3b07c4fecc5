"""Shared by the integration tests: the real daemon (skip with the reason where it is missing), the
mopt CLI run as users run it, a state directory shared by the session's builds, and a copy of the
repo's matrix that a test may edit."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from builder.dockerclient import find_docker
from builder.errors import MoptError
from builder.localregistry import find_registry_binary

REPO = Path(__file__).resolve().parents[2]
# Builds share one state directory, so a re-run on a machine that already built reuses the engines.
# scripts/test.sh gives the modules of its second lane a state dir of their own (one mopt per dir).
STATE = Path(os.environ.get("MOPT_TEST_STATE_DIR") or REPO / ".mopt" / "test-state")


@pytest.fixture(scope="session")
def docker_cli():
    try:
        cli = find_docker()
        find_registry_binary()
    except MoptError as exc:
        pytest.skip(f"needs the Docker daemon and docker-registry (bash scripts/setup.sh starts them): {exc}")
    return cli


def mopt_cli(*args: str, cwd: Path = REPO, docker_config: Path | None = None,
             timeout: int = 2400) -> subprocess.CompletedProcess:
    """`python -m builder ARGS` with the shared state dir; exit code and output as a user sees them."""
    env = dict(os.environ, MOPT_STATE_DIR=str(STATE), TESTCONTAINERS_RYUK_DISABLED="true")
    env.pop("MOPT_MATRIX", None)
    if docker_config:
        env["DOCKER_CONFIG"] = str(docker_config)
    return subprocess.run([sys.executable, "-m", "builder", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def copy_matrix(directory: Path) -> Path:
    """matrix.yaml, images/ and templates/ copied into DIRECTORY (the lock file is not copied)."""
    for name in ("matrix.yaml", "images", "templates"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, directory / name)
    return directory


@pytest.fixture(scope="session")
def cpu_demo_image(docker_cli) -> str:
    """The image id of the cpu MiniLM demo image, built (and smoke-tested) by `mopt build` as users
    build it; a session that already built or released it reuses the state dir's stages and engine."""
    from builder.state import StateDir

    result = mopt_cli("build", "--select", "minilm-embed:cpu")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return StateDir(STATE).read_record("minilm-embed", "cpu").image_id
