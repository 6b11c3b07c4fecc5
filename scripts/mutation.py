#!/usr/bin/env python3
"""The mutation check: do the tests catch a small break in the core's behaviour?

mutmut makes small changes (mutants) to the core modules named in tests/mutation/targets.yaml and
runs the fast unit tests against each. A mutant the tests do not fail on "survives". This script
runs mutmut in a scratch copy of the working tree (.mopt/mutation/, so the checkout is untouched
and mutmut's cache is reused between runs), then prints the score per target and every survivor
that a file of tests/mutation/accepted/ does not explain.

    .venv/bin/python scripts/mutation.py                      # every target
    .venv/bin/python scripts/mutation.py --target guard       # one target (repeatable)
    .venv/bin/python scripts/mutation.py --changed-since REV  # targets whose files changed since REV
    .venv/bin/python scripts/mutation.py --sample 150 --seed 7  # a random subset of every target's mutants

Exit status: 0 when the score is at least --min-score (percent of mutants killed, survivors that
tests/mutation/accepted/ lists counting as survivors) and no survivor is unexplained; 1 otherwise; 2 on bad
arguments or configuration.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "tests" / "mutation"
TARGETS = CONFIG_DIR / "targets.yaml"
TIMEOUT_MULTIPLIER = 5
ACCEPTED = CONFIG_DIR / "accepted"  # one YAML list per target: <target>.yaml
WORK = REPO / ".mopt" / "mutation"
MUTMUT = Path(sys.executable).with_name("mutmut")
# Data the tests read beside the code (mutmut copies the source tree itself).
ALSO_COPY = ["matrix.yaml", "images", "templates", "tests", "docs", "mopt.lock.json", ".github", "benchmarks",
             "scripts"]
# mutmut's exit codes per mutant (mutmut/stats.py).
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", 37: "killed",
          -11: "segfault", -9: "segfault", None: "not checked"}
# A mutant counts as caught when the tests failed, hung past the timeout or crashed.
CAUGHT = {"killed", "timeout", "segfault"}


class UsageError(Exception):
    pass


@dataclass(frozen=True)
class Target:
    name: str
    files: tuple[str, ...]
    functions: tuple[str, ...]

    def owns(self, mutant: str) -> bool:
        return any(fnmatch.fnmatchcase(mutant, glob) for glob in self.functions)


@dataclass(frozen=True)
class Accepted:
    function: str
    change: str
    reason: str


def load_config() -> tuple[list[Target], list[str], list[dict], list[Accepted]]:
    data = yaml.safe_load(TARGETS.read_text())
    targets = [Target(name, tuple(spec["files"]), tuple(spec["functions"])) for name, spec in data["targets"].items()]
    accepted = []
    for file in sorted(ACCEPTED.glob("*.yaml")):
        for i, entry in enumerate(yaml.safe_load(file.read_text()) or []):
            if not all(isinstance(entry.get(k), str) and entry[k].strip() for k in ("function", "change", "reason")):
                raise UsageError(f"{file.relative_to(REPO)} entry {i}: needs function, change and reason")
            accepted.append(Accepted(entry["function"], normalise_change(entry["change"]), entry["reason"]))
    return targets, list(data["tests"]), list(data.get("do_not_mutate") or []), accepted


def normalise_change(text: str) -> str:
    return "\n".join(line.strip() for line in text.strip().splitlines() if line.strip())


def function_of(mutant: str) -> str:
    """builder.yamlio.x_format_path__mutmut_6 -> builder.yamlio.format_path; methods as Class.method."""
    module, _, mangled = mutant.rpartition(".")
    mangled = mangled.rsplit("__mutmut_", 1)[0]
    if mangled.startswith("xǁ"):
        _, cls, method = mangled.split("ǁ", 2)
        return f"{module}.{cls}.{method}"
    return f"{module}.{mangled[2:]}"


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                         capture_output=True).stdout.decode()
    return [p for p in out.split("\0") if p and (REPO / p).is_file()]


def sync_work_copy(files: list[str]) -> None:
    """Mirror the working tree into WORK (changed files only), leaving mutmut's own state alone."""
    WORK.mkdir(parents=True, exist_ok=True)
    wanted = set(files)
    for rel in files:
        src, dst = REPO / rel, WORK / rel
        if dst.is_file() and dst.stat().st_size == src.stat().st_size and dst.read_bytes() == src.read_bytes():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    for path in WORK.rglob("*"):
        rel = path.relative_to(WORK).as_posix()
        if rel.split("/")[0] in ("mutants", ".venv", "setup.cfg") or not path.is_file():
            continue
        if rel not in wanted and "__pycache__" not in rel:
            path.unlink()
    venv = WORK / ".venv"
    if not venv.exists():
        venv.symlink_to(REPO / ".venv")


def sync_mutants_copy(files: list[str], targets: list[Target]) -> None:
    """mutmut copies the source tree and ALSO_COPY once and then only regenerates the mutated modules:
    bring every other file (schemas, data, templates, tests) in its copy up to date with the tree."""
    mutants = WORK / "mutants"
    if not mutants.is_dir():
        return  # the first run copies everything itself
    mutated = {f for t in targets for f in t.files}
    for rel in mutated:  # a file that became a target: its plain copy must go, or mutmut never mutates it
        if not (mutants / f"{rel}.meta").exists():
            (mutants / rel).unlink(missing_ok=True)
    for rel in files:
        if rel in mutated or not (rel.startswith("builder/") or rel.split("/")[0] in ALSO_COPY):
            continue
        src, dst = REPO / rel, mutants / rel
        if dst.is_file() and dst.read_bytes() == src.read_bytes():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def write_mutmut_config(targets: list[Target], tests: list[str], do_not_mutate: list[dict]) -> None:
    files = sorted({f for t in targets for f in t.files})
    patterns = [entry["pattern"] for entry in do_not_mutate]
    lines = ["[mutmut]", "source_paths = builder", "only_mutate =", *[f"    {f}" for f in files],
             "pytest_add_cli_args_test_selection =", *[f"    {t}" for t in tests],
             "pytest_add_cli_args =", "    -p", "    no:cacheprovider", "    -q", "    -x",
             # A mutant's CPU limit is (its tests' time + 1 s) x this x 2. mutmut's default, 15, let the five
             # mutants of CI's sample for b37c2e5 that loop (pooling, fp8 forward) burn 383-388 CPU-s each:
             # 1,930 of the sample's 2,527 s, beside Docker builds, and the unit files beside phase 3 wait on it.
             # A timeout still counts as caught, so the limit must hold a mutant's whole run: each child runs
             # torch on one thread (mutmut(), below), where 10x its tests' time holds them all.
             f"timeout_multiplier = {TIMEOUT_MULTIPLIER}",
             "also_copy =", *[f"    {p}" for p in ALSO_COPY if (REPO / p).exists()]]
    if patterns:
        lines += ["do_not_mutate_patterns =", *[f"    {p}" for p in patterns]]
    text = "\n".join(lines) + "\n"
    cfg = WORK / "setup.cfg"
    if not cfg.is_file() or cfg.read_text() != text:
        cfg.write_text(text)
    # setup.cfg wins only when pyproject.toml has no [tool.mutmut]; make sure it has none.
    if "[tool.mutmut]" in (WORK / "pyproject.toml").read_text():
        raise UsageError("pyproject.toml must not carry [tool.mutmut]: tests/mutation/targets.yaml is the config")


def mutmut(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    # One intra-op thread per mutant's tests: mutmut runs --max-children of them on the machine's cores, and
    # torch's OpenMP threads, more than the cores, spin: CPU time tripled (equivalent pooling mutants ran
    # 35 s and hit their 71 CPU-s limit, counted caught by timeout; their tests take 23 CPU-s alone).
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    env.pop("MOPT_MATRIX", None)
    return subprocess.run([str(MUTMUT), *args], cwd=WORK, env=env, text=True,
                          capture_output=capture, check=False)


def forget_survivors() -> None:
    """Make mutmut test its survivors again: a new or changed test may kill them now. (mutmut keeps a
    verdict while the mutated function is unchanged, whatever happened to the tests.)"""
    for meta in (WORK / "mutants").rglob("*.meta"):
        data = json.loads(meta.read_text())
        codes = data["exit_code_by_key"]
        if any(code not in (1, 3, 37, None) for code in codes.values()):
            data["exit_code_by_key"] = {k: (c if c in (1, 3, 37) else None) for k, c in codes.items()}
            meta.write_text(json.dumps(data, indent=4))


def results() -> tuple[dict[str, str], dict[str, str]]:
    """(mutant name -> status, mutant name -> source path), read from mutmut's per-file records."""
    status: dict[str, str] = {}
    paths: dict[str, str] = {}
    for meta in (WORK / "mutants").rglob("*.meta"):
        data = json.loads(meta.read_text())
        source = meta.relative_to(WORK / "mutants").as_posix().removesuffix(".meta")
        for name, code in data["exit_code_by_key"].items():
            status[name] = STATUS.get(code, "suspicious")
            paths[name] = source
    return status, paths


def all_mutants(targets: list[Target]) -> list[str]:
    """Every mutant name mutmut generated for the targets' files."""
    return sorted(n for n in results()[0] if any(t.owns(n) for t in targets))


_DIFFS = r"""
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
print(json.dumps({name: get_diff_for_mutant(name, path=path) for name, path in json.load(sys.stdin).items()}))
"""


def diffs_of(mutants: dict[str, str]) -> dict[str, str]:
    """mutant name -> its unified diff, computed in one process (mutmut show costs a second each)."""
    if not mutants:
        return {}
    proc = subprocess.run([sys.executable, "-c", _DIFFS], cwd=WORK, input=json.dumps(mutants), text=True,
                          capture_output=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"computing the survivors' diffs failed: {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout)


def added_lines(diff: str) -> str:
    return normalise_change("\n".join(line[1:] for line in diff.splitlines()
                                      if line.startswith("+") and not line.startswith("+++")))


def changed_targets(targets: list[Target], since: str) -> list[Target]:
    proc = subprocess.run(["git", "diff", "--name-only", since, "--"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UsageError(f"--changed-since {since}: {proc.stderr.strip()}")
    changed = set(proc.stdout.split()) | set(subprocess.run(
        ["git", "ls-files", "-o", "--exclude-standard"], cwd=REPO, capture_output=True, text=True).stdout.split())
    tests_changed = any(p.startswith("tests/") for p in changed)
    return [t for t in targets if tests_changed or set(t.files) & changed]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", action="append", default=[], help="a target of targets.yaml (repeatable)")
    p.add_argument("--changed-since", metavar="REV", help="only targets whose files (or any test) changed since REV")
    p.add_argument("--sample", type=int, default=0, help="run only N mutants, drawn at random across the targets")
    p.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    p.add_argument("--min-score", type=float, default=90.0, help="percent of mutants the tests must catch")
    p.add_argument("--json", type=Path, help="also write the figures and survivors here")
    p.add_argument("--fresh", action="store_true", help="forget every earlier verdict (what CI does on a clean clone)")
    p.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        targets, tests, do_not_mutate, accepted = load_config()
        known = {t.name for t in targets}
        unknown = sorted(set(args.target) - known)
        if unknown:
            raise UsageError(f"unknown target {unknown[0]!r} (targets: {', '.join(sorted(known))})")
        selected = [t for t in targets if not args.target or t.name in args.target]
        if args.changed_since:
            selected = changed_targets(selected, args.changed_since)
        if not MUTMUT.is_file():
            raise UsageError(f"{MUTMUT} not found: install the test extras (pip install -e '.[test]')")
    except (UsageError, OSError, yaml.YAMLError, KeyError) as exc:
        print(f"mutation: {exc}", file=sys.stderr)
        return 2
    if not selected:
        print("mutation: no target's files changed; nothing to run")
        return 0
    started = time.monotonic()
    if args.fresh:
        shutil.rmtree(WORK / "mutants", ignore_errors=True)
    files = tracked_files()
    sync_work_copy(files)
    sync_mutants_copy(files, targets)
    forget_survivors()
    try:
        write_mutmut_config(targets, tests, do_not_mutate)
    except UsageError as exc:
        print(f"mutation: {exc}", file=sys.stderr)
        return 2
    globs = [g for t in selected for g in t.functions] if selected != targets else []
    names: list[str] = []
    if args.sample:
        # Generate the mutants without running them (a filter that matches nothing), then draw names.
        mutmut("run", "--max-children", str(args.max_children), "no-such-mutant", capture=True)
        names = all_mutants(selected)
        if args.sample < len(names):
            names = sorted(random.Random(args.seed).sample(names, args.sample))
        globs = names
    run = mutmut("run", "--max-children", str(args.max_children), *globs, capture=True)
    if run.returncode not in (0, 1):
        print(run.stdout[-3000:], run.stderr[-3000:], sep="\n", file=sys.stderr)
        print(f"mutation: mutmut run failed (exit {run.returncode})", file=sys.stderr)
        return 2
    status, paths = results()
    names = names or all_mutants(selected)
    if names and all(status.get(n, "not checked") == "not checked" for n in names):
        # mutmut stops before any mutant when the tests fail on the unmutated code: that is no pass.
        print(run.stdout[-3000:], run.stderr[-3000:], sep="\n", file=sys.stderr)
        print("mutation: no mutant was checked (do the tests pass on the unmutated code?)", file=sys.stderr)
        return 2
    return report(selected, names, status, paths, accepted, args, time.monotonic() - started)


def report(targets: list[Target], names: list[str], status: dict[str, str], paths: dict[str, str],
           accepted: list[Accepted], args: argparse.Namespace, seconds: float) -> int:
    rows, unexplained, explained = [], [], []
    survivors = [n for n in names if status.get(n) not in CAUGHT | {"not checked", "skipped"}]
    diffs = diffs_of({n: paths[n] for n in survivors})
    total_caught = total = 0
    for target in targets:
        mine = [n for n in names if target.owns(n)]
        counts: dict[str, int] = {}
        for name in mine:
            counts[status.get(name, "not checked")] = counts.get(status.get(name, "not checked"), 0) + 1
        caught = sum(counts.get(s, 0) for s in CAUGHT)
        counted = len(mine) - counts.get("not checked", 0) - counts.get("skipped", 0)
        total_caught += caught
        total += counted
        rows.append((target.name, counted, caught, counts))
        for name in mine:
            if status.get(name) in CAUGHT or status.get(name) in ("not checked", "skipped"):
                continue
            diff = diffs[name]
            change = added_lines(diff)
            match = next((a for a in accepted if a.function == function_of(name) and a.change == change), None)
            (explained if match else unexplained).append({"mutant": name, "status": status.get(name),
                                                          "function": function_of(name), "change": change,
                                                          "reason": match.reason if match else None,
                                                          "diff": diff})
    print(f"{'target':<22}{'mutants':>8}{'caught':>8}{'score':>8}  other")
    for name, counted, caught, counts in rows:
        other = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in CAUGHT)
        score = 100.0 * caught / counted if counted else 100.0
        print(f"{name:<22}{counted:>8}{caught:>8}{score:>7.1f}%  {other}")
    score = 100.0 * total_caught / total if total else 100.0
    print(f"{'all':<22}{total:>8}{total_caught:>8}{score:>7.1f}%  ({len(explained)} survivors explained in "
          f"tests/mutation/accepted/, {len(unexplained)} unexplained; {seconds:.0f} s)")
    for item in unexplained:
        print(f"\nSURVIVED ({item['status']}): {item['mutant']}\n{item['diff'].strip()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "score": round(score, 2), "mutants": total, "caught": total_caught, "seconds": round(seconds),
            "targets": {n: {"mutants": c, "caught": k, "counts": counts} for n, c, k, counts in rows},
            "explained": [{k: v for k, v in i.items() if k != "diff"} for i in explained],
            "unexplained": unexplained}, indent=2) + "\n")
    used = {(i["function"], i["change"]) for i in explained}
    functions_run = {function_of(n) for n in names}
    stale = [] if args.sample else [a for a in accepted if a.function in functions_run
                                    and (a.function, a.change) not in used]
    for entry in stale:
        print(f"note: accepted but no longer a survivor (delete it): {entry.function}: {entry.change}")
    ok = score >= args.min_score and not unexplained
    if not ok:
        print(f"\nmutation: FAILED (score {score:.1f}% vs minimum {args.min_score}%, "
              f"{len(unexplained)} unexplained survivors)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
