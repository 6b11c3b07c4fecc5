"""scripts/setup.sh per purpose, run for real on a copy of the scripts beside a small project of its own
(its venv is made by the real script with the real pip; apt is skipped, the Docker daemon must answer):
the demo's venv holds the project alone, the tests' adds the extras, a tests' venv serves the demo
as it is, and an unknown purpose exits 2 before touching anything."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

PYPROJECT = """[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "setup-probe"
version = "0"
dependencies = []

[project.optional-dependencies]
test = []
runtime = []

[tool.setuptools]
py-modules = []
"""


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    return tmp_path


def setup(project: Path, *purpose: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOPT_SKIP_APT": "1", "MOPT_SKIP_DOCKERD": "1"}
    return subprocess.run(["bash", str(project / "scripts" / "setup.sh"), *purpose], env=env,
                          capture_output=True, text=True, timeout=240)


def stamp(project: Path) -> str:
    return (project / ".venv" / ".mopt-setup-key").read_text()


@pytest.mark.timeout(600)
def test_each_purpose_installs_its_own_set_and_a_test_venv_serves_the_demo(project):
    demo = setup(project, "demo")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "pip install -e '.'" in demo.stdout and stamp(project).endswith(" \n")
    again = setup(project, "demo")
    assert "venv: up to date (demo)" in again.stdout, again.stdout
    test = setup(project, "test")  # the demo's venv lacks the test extras: pip runs again
    assert test.returncode == 0, test.stdout + test.stderr
    assert "pip install -e '.[test,runtime]'" in test.stdout and stamp(project).endswith(" [test,runtime]\n")
    for purpose in ("demo", "test"):
        assert f"venv: up to date ({purpose})" in setup(project, purpose).stdout
    assert "venv: up to date (test)" in setup(project).stdout  # no purpose: the tests'


@pytest.mark.timeout(60)
def test_an_unknown_purpose_exits_2_before_anything(project):
    result = setup(project, "everything")
    assert result.returncode == 2 and "unknown purpose everything (demo or test)" in result.stderr
    assert not (project / ".venv").exists()


def test_the_readme_commands_pass_their_purpose():
    assert "bash scripts/setup.sh demo\n" in (REPO / "scripts" / "demo.sh").read_text()
    assert "bash scripts/setup.sh test\n" in (REPO / "scripts" / "test.sh").read_text()
