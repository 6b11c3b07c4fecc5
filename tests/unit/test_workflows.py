"""The GitHub Actions workflows: valid against the workflow schema (check-jsonschema's vendored
SchemaStore copy) and consistent with the CLI they call."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

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
    assert {p.name for p in WORKFLOWS} == {"ci.yml", "kb-check.yml", "release.yml"}


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
    assert steps.index("Build and smoke-test") < steps.index(
        "Publish the long tag, signed (only images whose smoke test passed)") < steps.index("Keep the long-tag record")
    assert "GITHUB_STEP_SUMMARY" in str(job["steps"])


def test_release_fans_out_long_tags_and_fans_in_to_one_promote():
    """Each variant's job pushes only its long tag and uploads its record; one job, after all of them
    (also when one failed, to report it), promotes: short tags move only there."""
    release = yaml.safe_load((REPO / ".github/workflows/release.yml").read_text())
    jobs = release["jobs"]
    runs = {name: " ".join(str(step.get("run", "")) for step in job["steps"]) for name, job in jobs.items()}
    assert "--long-only" in runs["build-test-publish"] and "mopt promote" not in runs["build-test-publish"]
    assert "mopt promote" in runs["promote"] and "--records" in runs["promote"]
    assert jobs["promote"]["needs"] == ["plan", "build-test-publish"] and "always()" in jobs["promote"]["if"]
    uploads = [s for s in jobs["build-test-publish"]["steps"] if "upload-artifact" in s.get("uses", "")]
    downloads = [s for s in jobs["promote"]["steps"] if "download-artifact" in s.get("uses", "")]
    assert uploads[0]["with"]["name"].startswith("long-tag-") and downloads[0]["with"]["pattern"] == "long-tag-*"
    # The state dir outlives the workspace (actions/checkout cleans it): engines are not recompiled.
    assert jobs["build-test-publish"]["env"]["MOPT_STATE_DIR"].startswith("${{ vars.MOPT_RUNNER_STATE_DIR")
    assert "--format markdown" in runs["plan"]


def test_release_shares_the_layer_cache_and_can_build_locked():
    release = yaml.safe_load((REPO / ".github/workflows/release.yml").read_text())
    (build,) = [s for s in release["jobs"]["build-test-publish"]["steps"] if "mopt release" in s.get("run", "")]
    assert build["env"]["MOPT_CACHE_REGISTRY"] == "${{ vars.MOPT_CACHE_REGISTRY }}"
    assert build["env"]["LOCKED"] == "${{ inputs.locked && '--locked' || '' }}" and "$LOCKED" in build["run"]
    assert release[True]["workflow_dispatch"]["inputs"]["locked"]["type"] == "boolean"  # YAML 1.1 reads `on` as True
    # The variable the step sets is the one the CLI reads.
    res = CliRunner().invoke(cli, ["release", "--help"])
    assert "env var: MOPT_CACHE_REGISTRY" in res.output


def test_third_party_actions_are_pinned_by_commit():
    for path in WORKFLOWS:
        for job in yaml.safe_load(path.read_text())["jobs"].values():
            for step in job.get("steps", []):
                if "uses" in step:
                    assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", step["uses"]), (path.name, step["uses"])


def test_kb_check_runs_weekly_and_on_demand_into_the_job_summary():
    """The scheduled knowledge-base check: a weekly cron and a manual trigger, read-only, its Markdown
    findings appended to the job summary (findings are for a person to review, never committed by CI)."""
    workflow = yaml.safe_load((REPO / ".github/workflows/kb-check.yml").read_text())
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert triggers["schedule"][0]["cron"].split()[2:] == ["*", "*", "1"] and "workflow_dispatch" in triggers
    assert workflow["permissions"] == {"contents": "read"}
    steps = workflow["jobs"]["kb-check"]["steps"]
    runs = [s.get("run", "") for s in steps]
    assert any("mopt kb check --format markdown" in r and '>> "$GITHUB_STEP_SUMMARY"' in r for r in runs)
    assert not any("--write" in r or "git push" in r or "git commit" in r for r in runs)
    assert "scripts/setup.sh" in " ".join(runs)
