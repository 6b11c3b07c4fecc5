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

from builder import yamlio
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


@pytest.mark.timeout(30)
def test_the_alias_bound_refuses_before_anything_expands():
    """Fails fast, not by hanging, when the expansion bound is gone: composing builds the node graph with
    each alias shared (no expansion), so without the bound compose_bounded returns at once; and a bomb five
    times the bound, which unbounded parse_yaml loads in about a second, must be refused."""
    huge = alias_bomb(levels=40)  # 9 ** 40 values once expanded
    start = time.monotonic()
    with pytest.raises(ConfigError, match="expands to more than 100,000 values through anchors and aliases"):
        yamlio.compose_bounded(huge, "m.yaml")
    assert time.monotonic() - start < 2  # the check costs what the file holds, not what it expands to
    over = alias_bomb(levels=6)  # 9 ** 6 = 531,441 values
    assert 9 ** 6 > 5 * MAX_VALUES
    with pytest.raises(ConfigError, match="expands to more than 100,000 values"):
        parse_yaml(over, "matrix.yaml")
    with pytest.raises(ConfigError, match="expands to more than 100,000 values"):
        safe_load_bounded(over, "compat.yaml")


# Unbounded, parse_yaml walks the alias bomb's 9 ** 9 expanded values (many minutes, and gigabytes for the
# line table) before any assertion runs: a per-test timeout turns that hang into a failure naming the test.
@pytest.mark.timeout(30)
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


def _refusal(text: str) -> ConfigError | None:
    try:
        parse_yaml(text, "m.yaml")
    except ConfigError as exc:
        return exc
    return None


def test_the_bounds_are_exact_and_errors_name_file_and_line(monkeypatch):
    """Small bounds (the module's own, patched) so each edge is cheap to reach."""
    monkeypatch.setattr(yamlio, "MAX_DEPTH", 3)
    monkeypatch.setattr(yamlio, "MAX_VALUES", 10)
    # Nesting in the text: three collection levels pass (an empty innermost one too), four do not.
    assert _refusal("a: [[1]]\n") is None and _refusal("a: [[]]\n") is None
    exc = _refusal("k: 1\na:\n  - [[1]]\n")
    assert (str(exc), exc.file, exc.line) == ("m.yaml:3: nests deeper than 3 levels", "m.yaml", 3)
    # Nesting through aliases, counted the same way: the alias adds the levels it names.
    assert _refusal("x: &x [1]\ny: [*x]\n") is None
    exc = _refusal("x: &x [1]\ny:\n  - [*x]\n")
    assert (str(exc), exc.line) == ("m.yaml:1: nests deeper than 3 levels through anchors and aliases", 1)
    # Values: the root, keys, collections and scalars each count once per place they appear.
    assert _refusal("a: [1, 2, 3, 4, 5, 6, 7]\n") is None  # 1 + 1 + 1 + 7 = 10
    exc = _refusal("a: [1, 2, 3, 4, 5, 6, 7, 8]\n")
    assert (str(exc), exc.line) == ("m.yaml:1: expands to more than 10 values through anchors and aliases", 1)
    # [*s, *s, *s] is 1 + 3 x 3 = 10 values; b's list (from line 3) is 1 + 3 + 10: the first past the bound.
    exc = _refusal("k: v\nb:\n  - &s [1, 2]\n  - [*s, *s, *s]\n")
    assert str(exc).startswith("m.yaml:3: expands to more than 10 values") and exc.line == 3
    exc = _refusal("k: v\nb: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n")  # the list alone is 11 values
    assert exc.line == 2
    # A cycle names the line of the value the alias refers to (PyYAML gives an alias its node's position).
    exc = _refusal("k: v\na: &a\n  - 1\n  - *a\n")
    assert (str(exc), exc.file, exc.line) == (
        "m.yaml:2: an alias refers to the value that contains it (a recursive structure)", "m.yaml", 2)


def test_a_value_named_twice_is_not_a_cycle():
    doc = parse_yaml("a: &a [1]\nb: [*a, *a]\nc: *a\n", "m.yaml")
    assert doc.data == {"a": [1], "b": [[1], [1]], "c": [1]}


def test_json_bounds_are_exact_and_strings_do_not_nest(monkeypatch):
    monkeypatch.setattr(yamlio, "MAX_DEPTH", 3)
    assert parse_json_bounded("[[[1]]]", "l.json") == [[[1]]]
    with pytest.raises(ConfigError) as caught:
        parse_json_bounded('{"a": [[[1]]]}', "l.json")
    assert (str(caught.value), caught.value.file) == ("l.json: nests deeper than 3 levels", "l.json")
    # Brackets inside strings, escaped quotes included, are not nesting; closing ones do not hide depth.
    assert parse_json_bounded('["[[[[", "\\"[[[[", "]]]]"]', "l.json") == ["[[[[", '"[[[[', "]]]]"]
    with pytest.raises(ConfigError, match="nests deeper than 3 levels"):
        parse_json_bounded('["]]]]]]", [[[1]]]]', "l.json")
    assert parse_json_bounded('[["\\\\"], [[2]]]', "l.json") == [["\\"], [[2]]]  # an escaped backslash ends
    monkeypatch.setattr(yamlio, "MAX_BYTES", 8)
    assert parse_json_bounded('"123456"', "l.json") == "123456"  # 8 bytes: at the bound
    with pytest.raises(ConfigError) as caught:
        parse_json_bounded('"1234567"', "l.json")
    assert (str(caught.value), caught.value.file) == ("l.json: larger than 0 MiB", "l.json")


def test_an_oversized_yaml_file_is_refused_by_size(monkeypatch):
    monkeypatch.setattr(yamlio, "MAX_BYTES", 8)
    assert parse_yaml("a: 1234\n", "m.yaml").data == {"a": 1234}  # 8 bytes
    with pytest.raises(ConfigError) as caught:
        parse_yaml("a: 12345\n", "m.yaml")
    assert (str(caught.value), caught.value.file) == ("m.yaml: larger than 0 MiB", "m.yaml")
    monkeypatch.setattr(yamlio, "MAX_BYTES", 4 * 1024 * 1024)
    with pytest.raises(ConfigError, match=r"^m.yaml: larger than 4 MiB$"):
        parse_yaml("#" * (4 * 1024 * 1024 + 1), "m.yaml")


def test_depth_falls_back_when_a_collection_closes(monkeypatch):
    """Siblings do not add up, and a collection's close takes off exactly its own level."""
    monkeypatch.setattr(yamlio, "MAX_DEPTH", 3)
    assert _refusal("a: [[1], [1]]\nb: [[1]]\n") is None
    assert str(_refusal("a: [[1], [[1]]]\n")) == "m.yaml:1: nests deeper than 3 levels"
    assert parse_json_bounded("[[1], [2]]", "l.json") == [[1], [2]]
    with pytest.raises(ConfigError, match="nests deeper than 3 levels"):
        parse_json_bounded("[[[1], [[1]]]]", "l.json")
    # A string ending in an escaped backslash closes; what follows it nests as usual.
    with pytest.raises(ConfigError, match="nests deeper than 3 levels"):
        parse_json_bounded('["\\\\", [[[1]]]]', "l.json")
    # Only brackets and braces nest: other characters outside strings neither add nor take off depth.
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_json_bounded("X" * 10, "l.json")
    with pytest.raises(ConfigError, match="nests deeper than 3 levels"):
        parse_json_bounded("X" * 10 + "[[[[1]]]]", "l.json")
