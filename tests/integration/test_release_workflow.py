"""release.yml as shipped, run step by step on this machine (tests/workflow_runner.py) against the local
authenticated registry, for the cpu variants: the plan job, one build-test-publish job per variant (each
publishing its signed long tag and uploading its record), and the promote job, which verifies every long
tag and its signatures before any short tag moves.

Run 1 releases qwen3-embed:cpu and minilm-embed:cpu. qwen3-embed's model (the Hub's) is out of reach here,
so its job builds the substitute, which publish refuses without --allow-substitute: the job fails, and
promote moves no short tag of the release. Run 2 releases minilm-embed:cpu alone: promoted, signed.
The images come from the integration tests' state dir (vars.MOPT_RUNNER_STATE_DIR), as a runner's do.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from builder.localregistry import LocalRegistry
from tests.integration.conftest import REPO, STATE
from tests.integration.test_attest import keypair
from tests.integration.test_publish import docker  # noqa: F401
from tests.workflow_runner import WorkflowRunner

pytestmark = pytest.mark.integration
WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
PASSWORD = "pw-Workflow-9431"


def digest_of(reg: LocalRegistry, repo: str, tag: str) -> str | None:
    response = requests.head(f"http://{reg.address}/v2/{repo}/manifests/{tag}", auth=(reg.user, reg.password),
                             headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"}, timeout=10)
    return response.headers.get("Docker-Content-Digest") if response.status_code == 200 else None


def release(tmp: Path, name: str, select: str, reg: LocalRegistry, private: Path, public: Path):
    runner = WorkflowRunner(
        WORKFLOW, tmp / name, event="workflow_dispatch", inputs={"select": select, "locked": False},
        vars={"MOPT_REGISTRY": f"{reg.address}/wf", "MOPT_RUNNER_STATE_DIR": str(STATE),
              "MOPT_VERIFY_KEY": public.read_text()},
        secrets={"MOPT_REGISTRY_USER": reg.user, "MOPT_REGISTRY_PASSWORD": reg.password,
                 "MOPT_SIGN_KEY": private.read_text()},
        env={"DOCKER_CONFIG": str(tmp / "docker-config")}, step_timeout_s=1200)
    return runner.run()


def output(job) -> str:
    return "\n".join(f"--- {s.name} ({s.outcome})\n{s.output[-3000:]}" for s in job.steps)


def test_release_yml_releases_signs_and_promotes_and_a_failed_variant_moves_no_short_tag(docker, tmp_path):  # noqa: F811
    private, public = keypair(tmp_path, "release")
    (tmp_path / "docker-config").mkdir()
    with LocalRegistry(tmp_path / "registry", user="ci", password=PASSWORD) as reg:
        first = release(tmp_path, "run-1", "*:cpu", reg, private, public)
        (plan,) = first.of("plan")
        assert plan.result == "success", output(plan)
        assert "| minilm-embed:cpu | torch-aot |" in plan.summary  # the step summary is Markdown, not a Rich table
        builds = {job.name: job for job in first.of("build-test-publish")}
        assert set(builds) == {"minilm-embed:cpu", "qwen3-embed:cpu"}
        assert builds["minilm-embed:cpu"].runs_on == ["ubuntu-24.04"]
        assert builds["minilm-embed:cpu"].result == "success", output(builds["minilm-embed:cpu"])
        failed = builds["qwen3-embed:cpu"]
        assert failed.result == "failure"
        assert [s.outcome for s in failed.steps if s.name.startswith("Publish the long tag")] == ["failure"]
        assert "substitute" in output(failed)
        (promote,) = first.of("promote")
        assert promote.result == "failure" and "no long-tag record for qwen3-embed:cpu" in output(promote)
        long_tag = json.loads(subprocess.run(
            [sys.executable, "-m", "builder", "plan", "--format", "json", "--select", "minilm-embed:cpu"], cwd=REPO,
            capture_output=True, text=True, check=True).stdout)["variants"][0]["tags"][1]
        long_digest = digest_of(reg, "wf/minilm-embed", long_tag)
        assert long_digest and digest_of(reg, "wf/minilm-embed", "cpu") is None  # long tag only: nothing moved

        second = release(tmp_path, "run-2", "minilm-embed:cpu", reg, private, public)
        assert [j.result for j in second.jobs] == ["success"] * 3, [output(j) for j in second.jobs]
        assert digest_of(reg, "wf/minilm-embed", "cpu") == long_digest
        (promote,) = second.of("promote")
        assert f"| minilm-embed:cpu | {long_tag} | cpu |" in promote.summary, promote.summary
        assert f"wf/minilm-embed:{long_tag} = {long_digest}" in output(promote)
        assert "signatures verified" in output(promote), output(promote)
        # What was published is signed: mopt verify with the public key, for the short tag promote moved.
        verified = subprocess.run([sys.executable, "-m", "builder", "verify", f"{reg.address}/wf/minilm-embed:cpu",
                                   "--key", str(public), "--format", "json"], cwd=REPO, capture_output=True,
                                  text=True, timeout=300, env={**__import__("os").environ,
                                                               "DOCKER_CONFIG": str(tmp_path / "docker-config")})
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert f"{reg.address}/wf/minilm-embed:cpu" in json.loads(verified.stdout)["signed_for"]
        # No secret in anything the run kept (the runner masks, as GitHub does, and mopt never prints them).
        kept = "\n".join(output(j) + j.summary for run in (first, second) for j in run.jobs)
        assert PASSWORD not in kept and private.read_text().splitlines()[1] not in kept
