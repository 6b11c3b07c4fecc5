"""Runs a GitHub Actions workflow's own steps on this machine: the jobs in the order their `needs` give,
each matrix combination as its own job, each `run:` step in bash as GitHub runs it (`bash --noprofile
--norc -eo pipefail`), with GitHub's variables and files: GITHUB_OUTPUT, GITHUB_ENV, GITHUB_STEP_SUMMARY,
GITHUB_WORKSPACE, RUNNER_TEMP, the `${{ }}` expressions over github, inputs, vars, secrets, env, matrix,
strategy, needs and steps, step and job `if:`, job outputs, and secrets masked in what it keeps.

The `uses:` steps are replaced by their local equivalent (LOCAL_ACTIONS):
- actions/checkout: a clone of this repository's HEAD into the job's workspace, whose `.venv` is this
  checkout's (a self-hosted runner's tool cache: scripts/setup.sh finds it up to date);
- actions/upload-artifact / download-artifact: directories under the run's artifact store, one per name;
  a download with `pattern` puts each matching artifact in PATH/NAME, as GitHub does.

`runs-on` is recorded, not honoured: every job runs here. Used by tests/integration/test_release_workflow.py
to run release.yml against the local authenticated registry.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
EXPRESSION = re.compile(r"\$\{\{(.*?)\}\}", re.S)
TOKEN = re.compile(r"\s*(?:(?P<str>'(?:[^']|'')*')|(?P<num>\d+(?:\.\d+)?)|(?P<op>\|\||&&|==|!=|!|\(|\)|\[|\]|,|\.)"
                   r"|(?P<name>[A-Za-z_][A-Za-z0-9_-]*))")


class WorkflowError(Exception):
    """The workflow uses something this runner does not implement (named, not guessed)."""


# --------------------------------------------------------------------------- expressions
def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text.rstrip()):
        match = TOKEN.match(text, pos)
        if not match or match.end() == pos:
            raise WorkflowError(f"cannot read the expression {text!r} at {text[pos:pos + 20]!r}")
        kind = match.lastgroup
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


def truthy(value) -> bool:
    return value not in (None, False, 0, "", [], {})


def text(value) -> str:
    """A value as GitHub writes it into a string."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


class _Parser:
    def __init__(self, expression: str, context: dict, functions: dict):
        self.tokens, self.i, self.context, self.functions = _tokens(expression), 0, context, functions

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if token is None or (value is not None and token[1] != value):
            raise WorkflowError(f"expected {value!r} in the expression, found {token}")
        self.i += 1
        return token

    def parse(self):
        value = self.or_()
        if self.peek() is not None:
            raise WorkflowError(f"unexpected {self.peek()} in the expression")
        return value

    def or_(self):
        value = self.and_()
        while self.peek() == ("op", "||"):
            self.take()
            right = self.and_()
            value = value if truthy(value) else right
        return value

    def and_(self):
        value = self.compare()
        while self.peek() == ("op", "&&"):
            self.take()
            right = self.compare()
            value = right if truthy(value) else value
        return value

    def compare(self):
        value = self.unary()
        if self.peek() in (("op", "=="), ("op", "!=")):
            op = self.take()[1]
            right = self.unary()
            same = (value.lower() == right.lower()) if isinstance(value, str) and isinstance(right, str) \
                else value == right
            return same if op == "==" else not same
        return value

    def unary(self):
        if self.peek() == ("op", "!"):
            self.take()
            return not truthy(self.unary())
        return self.primary()

    def primary(self):
        kind, value = self.take()
        if kind == "str":
            return value[1:-1].replace("''", "'")
        if kind == "num":
            return float(value) if "." in value else int(value)
        if (kind, value) == ("op", "("):
            inner = self.or_()
            self.take(")")
            return inner
        if kind != "name":
            raise WorkflowError(f"unexpected {value!r} in the expression")
        if value in ("true", "false", "null"):
            return {"true": True, "false": False, "null": None}[value]
        if self.peek() == ("op", "("):
            self.take()
            args = []
            while self.peek() != ("op", ")"):
                args.append(self.or_())
                if self.peek() == ("op", ","):
                    self.take()
            self.take(")")
            if value.lower() not in self.functions:
                raise WorkflowError(f"the function {value}() is not implemented by this runner")
            return self.functions[value.lower()](*args)
        current = self.context.get(value)
        while self.peek() in (("op", "."), ("op", "[")):
            if self.take()[1] == ".":
                key = self.take()[1]
            else:
                key = self.or_()
                self.take("]")
            if isinstance(current, dict):
                current = current.get(key)
            elif isinstance(current, list) and isinstance(key, int) and 0 <= key < len(current):
                current = current[key]
            else:
                current = None
        return current


def evaluate(expression: str, context: dict, succeeded: bool = True):
    functions = {"always": lambda: True, "success": lambda: succeeded, "failure": lambda: not succeeded,
                 "cancelled": lambda: False, "fromjson": lambda s: json.loads(s), "tojson": lambda v: json.dumps(v),
                 "contains": lambda hay, needle: (needle in hay) if hay is not None else False}
    expression = expression.strip()
    whole = EXPRESSION.fullmatch(expression)
    return _Parser(whole.group(1) if whole else expression, context, functions).parse()


def interpolate(value: str, context: dict) -> str:
    """Every `${{ expr }}` in VALUE replaced by its text; a value that is one expression keeps its type."""
    whole = EXPRESSION.fullmatch(value.strip()) if isinstance(value, str) else None
    if whole:
        return evaluate(whole.group(1), context)
    return EXPRESSION.sub(lambda m: text(evaluate(m.group(1), context)), value) if isinstance(value, str) else value


# --------------------------------------------------------------------------- running
@dataclass
class StepResult:
    name: str
    outcome: str  # success, failure, skipped
    output: str = ""


@dataclass
class JobResult:
    job: str
    name: str
    runs_on: object
    result: str  # success, failure, skipped
    outputs: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    summary: str = ""


@dataclass
class Run:
    """One run of a workflow: its jobs' results (a matrix job once per combination)."""
    jobs: list = field(default_factory=list)

    def of(self, job: str) -> list[JobResult]:
        return [j for j in self.jobs if j.job == job]


def _order(jobs: dict) -> list[str]:
    done: list[str] = []
    while len(done) < len(jobs):
        ready = [name for name, job in jobs.items() if name not in done
                 and all(n in done for n in _needs(job))]
        if not ready:
            raise WorkflowError(f"the jobs' needs form a cycle: {sorted(set(jobs) - set(done))}")
        done += ready
    return done


def _needs(job: dict) -> list[str]:
    needs = job.get("needs", [])
    return [needs] if isinstance(needs, str) else list(needs)


class WorkflowRunner:
    def __init__(self, workflow: Path, work: Path, *, event: str, inputs: dict, vars: dict, secrets: dict,
                 env: dict | None = None, step_timeout_s: float = 1800):
        self.doc = yaml.safe_load(workflow.read_text())
        self.work, self.event, self.inputs = work, event, inputs
        self.vars, self.secrets, self.extra_env = vars, secrets, env or {}
        self.step_timeout_s = step_timeout_s
        self.artifacts = work / "artifacts"
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self.counter = 0

    def mask(self, value: str) -> str:
        for secret in self.secrets.values():
            for line in str(secret).splitlines():
                if len(line.strip()) >= 4:
                    value = value.replace(line.strip(), "***")
        return value

    def run(self) -> Run:
        run = Run()
        needs: dict[str, dict] = {}
        jobs = self.doc["jobs"]
        for name in _order(jobs):
            job = jobs[name]
            base = self._context({}, needs, {}, {})
            need_results = [needs[n]["result"] for n in _needs(job)]
            condition = job.get("if", "success()")
            if not truthy(evaluate(str(condition), base, succeeded=all(r == "success" for r in need_results))):
                run.jobs.append(JobResult(name, name, job.get("runs-on"), "skipped"))
                needs[name] = {"result": "skipped", "outputs": {}}
                continue
            matrix = job.get("strategy", {}).get("matrix")
            combos = self._combinations(interpolate(matrix, base) if matrix else None)
            results = [self._job(name, job, needs, combo, index) for index, combo in enumerate(combos)]
            run.jobs += results
            outputs: dict = {}
            for r in results:
                outputs.update(r.outputs)
            needs[name] = {"result": "success" if all(r.result == "success" for r in results) else "failure",
                           "outputs": outputs}
        return run

    @staticmethod
    def _combinations(matrix) -> list[dict | None]:
        if matrix is None:
            return [None]
        if set(matrix) - {"include"}:
            raise WorkflowError("only `include` matrices are implemented by this runner")
        return list(matrix.get("include", []))

    def _context(self, env: dict, needs: dict, steps: dict, matrix, index: int = 0) -> dict:
        return {"github": {"event_name": self.event, "event": {"inputs": self.inputs}, "ref": "refs/heads/main",
                           "workspace": ""},
                "inputs": self.inputs, "vars": self.vars, "secrets": self.secrets, "env": env, "needs": needs,
                "steps": steps, "matrix": matrix or {}, "strategy": {"job-index": index}, "runner": {"os": "Linux"}}

    def _job(self, name: str, job: dict, needs: dict, combo, index: int) -> JobResult:
        self.counter += 1
        root = self.work / f"job-{self.counter}-{name}"
        workspace, temp = root / "workspace", root / "tmp"
        temp.mkdir(parents=True)
        env = {k: text(interpolate(v, self._context({}, needs, {}, combo, index)))
               for k, v in (self.doc.get("env") or {}).items()}
        context = self._context(env, needs, {}, combo, index)
        env.update({k: text(interpolate(v, context)) for k, v in (job.get("env") or {}).items()})
        display = text(interpolate(job.get("name", name), context))
        result = JobResult(name, display, interpolate(job.get("runs-on"), context), "success")
        steps: dict = {}
        for number, step in enumerate(job.get("steps", [])):
            context = self._context(env, needs, steps, combo, index)
            ok = result.result == "success"
            if not truthy(evaluate(str(step.get("if", "success()")), context, succeeded=ok)):
                result.steps.append(StepResult(step.get("name", f"step {number}"), "skipped"))
                continue
            outcome, output, outputs, summary, added_env = self._step(step, context, env, workspace, temp)
            result.steps.append(StepResult(text(interpolate(step.get("name", step.get("uses", f"step {number}")),
                                                            context)), outcome, self.mask(output)))
            result.summary += self.mask(summary)
            env.update(added_env)
            if "id" in step:
                steps[step["id"]] = {"outputs": outputs, "outcome": outcome, "conclusion": outcome}
            if outcome == "failure":
                result.result = "failure"
        context = self._context(env, needs, steps, combo, index)
        result.outputs = {k: text(interpolate(v, context)) for k, v in (job.get("outputs") or {}).items()}
        return result

    def _step(self, step: dict, context: dict, env: dict, workspace: Path, temp: Path):
        step_env = {**env, **{k: text(interpolate(v, context)) for k, v in (step.get("env") or {}).items()}}
        if "uses" in step:
            action = step["uses"].split("@")[0]
            handler = LOCAL_ACTIONS.get(action)
            if handler is None:
                raise WorkflowError(f"no local equivalent for the action {action}")
            with_ = {k: text(interpolate(v, {**context, "env": step_env}))
                     for k, v in (step.get("with") or {}).items()}
            try:
                output = handler(self, with_, workspace)
            except WorkflowError as exc:
                return "failure", str(exc), {}, "", {}
            return "success", output, {}, "", {}
        script = interpolate(step["run"], {**context, "env": step_env})
        files = {name: temp / f"{name.lower()}-{self.counter}-{id(step)}" for name in
                 ("GITHUB_OUTPUT", "GITHUB_ENV", "GITHUB_STEP_SUMMARY")}
        for path in files.values():
            path.write_text("")
        script_path = temp / f"step-{id(step)}.sh"
        script_path.write_text(script)
        process_env = {**os.environ, **self.extra_env, **step_env, "GITHUB_ACTIONS": "true", "CI": "true",
                       "GITHUB_WORKSPACE": str(workspace), "RUNNER_TEMP": str(temp), "GITHUB_EVENT_NAME": self.event,
                       **{name: str(path) for name, path in files.items()}}
        try:
            done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script_path)],
                                  cwd=workspace, env=process_env, capture_output=True, text=True,
                                  timeout=self.step_timeout_s)
            outcome, output = ("success" if done.returncode == 0 else "failure"), done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            outcome, output = "failure", f"timed out after {self.step_timeout_s} s: {exc}"
        return (outcome, output, _key_values(files["GITHUB_OUTPUT"].read_text()),
                files["GITHUB_STEP_SUMMARY"].read_text(), _key_values(files["GITHUB_ENV"].read_text()))


def _key_values(content: str) -> dict:
    """GITHUB_OUTPUT / GITHUB_ENV: NAME=VALUE lines and NAME<<DELIMITER blocks."""
    out, lines, i = {}, content.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delimiter = line.split("<<", 1)
            end = lines.index(delimiter, i + 1)
            out[name] = "\n".join(lines[i + 1:end])
            i = end + 1
            continue
        if "=" in line:
            name, value = line.split("=", 1)
            out[name] = value
        i += 1
    return out


# --------------------------------------------------------------------------- local equivalents of actions
def _checkout(runner: WorkflowRunner, with_: dict, workspace: Path) -> str:
    """A clone of HEAD, and the runner's tool cache: a venv of the workspace's own whose site-packages see
    this checkout's installed packages (a .pth line), so the workflow's `scripts/setup.sh` only installs
    the workspace itself (editable) and never writes into this checkout's venv."""
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(workspace)], check=True,
                   capture_output=True, timeout=300)
    venv = workspace / ".venv"
    subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "venv", str(venv)], check=True,
                   capture_output=True, timeout=300)
    shared = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", "import sysconfig; "
                             "print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True,
                            text=True, timeout=60).stdout.strip()
    own = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; "
                          "print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True, text=True,
                         timeout=60).stdout.strip()
    Path(own, "runner-tool-cache.pth").write_text(shared + "\n")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=workspace, capture_output=True, text=True).stdout
    return f"cloned {REPO} at {head.strip()}"


def _upload(runner: WorkflowRunner, with_: dict, workspace: Path) -> str:
    source, target = workspace / with_["path"], runner.artifacts / with_["name"]
    if not source.exists() or (source.is_dir() and not any(source.iterdir())):
        if with_.get("if-no-files-found", "warn") == "error":
            raise WorkflowError(f"upload-artifact: no files at {with_['path']}")
        return f"upload-artifact: nothing at {with_['path']}"
    if target.exists():
        raise WorkflowError(f"upload-artifact: an artifact named {with_['name']} exists already")
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        target.mkdir(parents=True)
        shutil.copy2(source, target / source.name)
    return f"uploaded {with_['path']} as {with_['name']}"


def _download(runner: WorkflowRunner, with_: dict, workspace: Path) -> str:
    target = workspace / with_.get("path", ".")
    names = sorted(p.name for p in runner.artifacts.iterdir())
    if "pattern" in with_:
        chosen = [n for n in names if fnmatch.fnmatchcase(n, with_["pattern"])]
        for name in chosen:
            shutil.copytree(runner.artifacts / name, target / name, dirs_exist_ok=True)
    else:
        chosen = [with_["name"]]
        if with_["name"] not in names:
            raise WorkflowError(f"download-artifact: no artifact named {with_['name']}")
        shutil.copytree(runner.artifacts / with_["name"], target, dirs_exist_ok=True)
    return f"downloaded {', '.join(chosen) or 'nothing'}"


LOCAL_ACTIONS = {"actions/checkout": _checkout, "actions/upload-artifact": _upload,
                 "actions/download-artifact": _download}


def temporary_work() -> Path:
    return Path(tempfile.mkdtemp(prefix="mopt-workflow-"))
