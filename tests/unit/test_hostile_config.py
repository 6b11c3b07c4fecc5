"""Hostile configuration is refused quickly with one message and exit 2: YAML that expands
exponentially through anchors and aliases ("billion laughs"), nests past any real file, or refers to
itself, in matrix.yaml and image.yaml; a lock or bundle.json nested past Python's recursion limit.
Unbounded, the alias bomb below took over 60 s and 1.5 GB and the nesting raised RecursionError."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builder.errors import ConfigError
from builder.lock import read_lock
from builder.yamlio import MAX_DEPTH, MAX_VALUES, parse_json_bounded, parse_yaml, safe_load_bounded
from tests.unit.test_bad_config_fuzz import REPO, setup_tree


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """width ** levels values from a dozen lines."""
    lines = ["l0: &l0 [" + ", ".join(["x"] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


HOSTILE = {
    "alias bomb": (alias_bomb(), "expands to more than 100,000 values through anchors and aliases"),
    "deep flow nesting": ("a: " + "[" * 5000 + "]" * 5000 + "\n", f"nests deeper than {MAX_DEPTH} levels"),
    "deep block nesting": ("".join("  " * i + f"k{i}:\n" for i in range(MAX_DEPTH + 1)) + "  " * (MAX_DEPTH + 1)
                           + "v: 1\n", f"nests deeper than {MAX_DEPTH} levels"),
    "deep through aliases": ("a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 70)),
                             f"nests deeper than {MAX_DEPTH} levels through anchors and aliases"),
    "recursive alias": ("a: &a [1, *a]\n", "an alias refers to the value that contains it"),
    "recursive mapping": ("a: &a {b: *a}\n", "an alias refers to the value that contains it"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_yaml_is_one_config_error_quickly(name):
    text, message = HOSTILE[name]
    start = time.monotonic()
    with pytest.raises(ConfigError, match=message) as caught:
        parse_yaml(text, "matrix.yaml")
    assert time.monotonic() - start < 5  # unbounded: a minute and more (see the module docstring)
    assert "\n" not in str(caught.value) and str(caught.value).startswith("matrix.yaml")
    with pytest.raises(ConfigError, match=message):
        safe_load_bounded(text, "compat.yaml")


def test_anchors_within_bounds_still_load():
    """Anchors and aliases are legitimate YAML: a shared block reused stays allowed."""
    doc = parse_yaml("base: &b {cuda: '12.1', sm: [80, 86]}\nvariants: [*b, *b]\n", "matrix.yaml")
    assert doc.data["variants"] == [{"cuda": "12.1", "sm": [80, 86]}] * 2
    wide = alias_bomb(levels=5, width=9)  # 9**5 = 59,049 values: under the bound
    assert 9 ** 5 < MAX_VALUES and parse_yaml(wide, "matrix.yaml").data["l4"][0][0][0][0] == ["x"] * 9
    nested = "a: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "\n"  # the mapping is one more level
    assert parse_yaml(nested, "matrix.yaml").data["a"] is not None


def run_mopt(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "builder", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("name", ["alias bomb", "deep flow nesting", "recursive alias"])
def test_mopt_plan_refuses_a_hostile_matrix_and_recipe(name, tmp_path):
    text, message = HOSTILE[name]
    setup_tree(tmp_path, text)
    proc = run_mopt("plan", "--matrix", "matrix.yaml", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mopt: error: matrix.yaml:") and message in lines[0]
    # The same text as a recipe (image.yaml) under a valid matrix.
    setup_tree(tmp_path, (REPO / "matrix.yaml").read_text(), text)
    proc = run_mopt("plan", "--matrix", "matrix.yaml", cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "image.yaml" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_deeply_nested_lock_or_bundle_is_refused(tmp_path):
    lock = tmp_path / "mopt.lock.json"
    lock.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=f"nests deeper than {MAX_DEPTH} levels"):
        read_lock(lock)
    # Brackets inside strings are not nesting; a real lock still reads.
    lock.write_text(json.dumps({"schema": 1, "runtimes": {"k": {"note": "[[[[{{{{" * 100, "pins": [[1]]}}}))
    assert read_lock(lock)["runtimes"]["k"]["pins"] == [[1]]
    (tmp_path / "a-dir.json").mkdir()
    with pytest.raises(ConfigError, match=r"a-dir.json: cannot read: \[Errno 21\] Is a directory"):
        read_lock(tmp_path / "a-dir.json")
    with pytest.raises(ConfigError, match="larger than 4 MiB"):
        parse_json_bounded(" " * (4 * 1024 * 1024 + 1), "bundle.json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_json_bounded('{"a": 1', "bundle.json")


def test_a_lock_reads_as_utf8_whatever_the_locale(tmp_path, ascii_locale):
    lock = tmp_path / "mopt.lock.json"
    lock.write_text(json.dumps({"schema": 1, "runtimes": {"k": {"note": "café"}}}, ensure_ascii=False),
                    encoding="utf-8")
    assert read_lock(lock)["runtimes"]["k"]["note"] == "café"
