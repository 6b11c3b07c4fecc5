"""The GitHub Actions workflows: valid against the workflow schema (check-jsonschema's vendored
SchemaStore copy) and consistent with the CLI they call."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from builder.cli import cli

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
CHECKER = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))


def validate(paths) -> subprocess.CompletedProcess:
    if CHECKER is None:
        pytest.skip("check-jsonschema is not installed (pip install -e '.[test]')")
    return subprocess.run([CHECKER, "--builtin-schema", "vendor.github-workflows", *map(str, paths)],
                          capture_output=True, text=True)


def test_workflows_exist():
    assert {p.name for p in WORKFLOWS} == {"ci.yml", "release.yml"}


def test_workflows_match_the_schema():
    result = validate(WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_check_catches_a_broken_workflow(tmp_path):
    text = (REPO / ".github/workflows/ci.yml").read_text()
    assert "    runs-on: [self-hosted, linux, x64, debian-12]\n" in text
    path = tmp_path / "broken.yml"
    path.write_text(text.replace("    runs-on: [self-hosted, linux, x64, debian-12]\n", ""))  # a job needs runs-on
    assert validate([path]).returncode != 0


def test_every_mopt_command_in_the_workflows_exists():
    used = set()
    for path in WORKFLOWS:
        used |= set(re.findall(r"\bmopt (\w[\w-]*)", path.read_text()))
    assert used and used <= set(cli.commands), used - set(cli.commands)


def test_release_matrix_comes_from_mopt_and_runners_from_sm():
    release = yaml.safe_load((REPO / ".github/workflows/release.yml").read_text())
    job = release["jobs"]["build-test-publish"]
    assert job["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert job["runs-on"] == "${{ matrix.runner }}"
    assert "mopt matrix --github" in str(release["jobs"]["plan"]["steps"])
    steps = [s.get("name") for s in job["steps"]]
    assert steps.index("Build and smoke-test") < steps.index("Publish (only images whose smoke test passed)")
    assert "GITHUB_STEP_SUMMARY" in str(job["steps"])
