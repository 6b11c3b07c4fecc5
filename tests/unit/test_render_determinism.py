"""Rendering does not depend on the interpreter's hash seed, and the runtime code digest does not depend on the
order in which the filesystem lists files."""
from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from builder.hashing import tree_digest

REPO = Path(__file__).resolve().parent.parent.parent

# Renders the whole shipped matrix (every planned variant) into argv[2].
RENDER_ALL = """
import sys
from pathlib import Path
from builder.matrix import load_matrix
from builder.plan import make_plan
from builder.render import render
matrix = load_matrix(Path(sys.argv[1]))
plan = make_plan(matrix)
render(matrix, plan.variants, Path(sys.argv[2]), all_variants=plan.variants)
"""


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_render_is_byte_identical_across_hash_seeds(tmp_path):
    # One process has one hash seed: a set iterated into a file would pass any in-process re-render test.
    procs = {}
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        env.pop("MOPT_MATRIX", None)
        procs[seed] = subprocess.Popen([sys.executable, "-c", RENDER_ALL, str(REPO / "matrix.yaml"),
                                        str(tmp_path / seed)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    for seed, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"PYTHONHASHSEED={seed}: {out}"
    one, two = _files(tmp_path / "1"), _files(tmp_path / "2")
    assert len(one) > 100 and sum(name.endswith("/manifest.json") for name in one) > 50
    assert sorted(one) == sorted(two)
    for name, data in one.items():
        assert data == two[name], f"{name} differs between PYTHONHASHSEED=1 and 2"


@pytest.fixture
def tree(tmp_path) -> Path:
    root = tmp_path / "runtime"
    (root / "pkg").mkdir(parents=True)
    (root / "a.py").write_bytes(b"A")
    (root / "notes.txt").write_bytes(b"N")
    (root / "pkg" / "b.py").write_bytes(b"B")
    return root


def _expected(entries: dict[str, bytes]) -> str:
    """The digest's definition: per file in path order, its relative path, NUL, the sha256 of its bytes."""
    digest = hashlib.sha256()
    for rel in sorted(entries):
        digest.update(rel.encode() + b"\0")
        digest.update(hashlib.sha256(entries[rel]).digest())
    return digest.hexdigest()


def test_tree_digest_value(tree):
    # the digest is recorded in manifests and locks: its definition must not drift
    assert tree_digest(tree) == _expected({"a.py": b"A", "notes.txt": b"N", "pkg/b.py": b"B"})
    assert tree_digest(tree, "**/*.py") == _expected({"a.py": b"A", "pkg/b.py": b"B"})


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_tree_digest_ignores_listing_order(tree, monkeypatch, order):
    for i in range(20):
        (tree / "pkg" / f"m{i:02}.py").write_text(f"x = {i}\n")
    want = tree_digest(tree)
    real_glob = Path.glob
    calls = []

    def listing(self, pattern):
        found = list(real_glob(self, pattern))
        calls.append(found)
        if order == "reversed":
            return iter(found[::-1])
        random.Random(7).shuffle(found)
        return iter(found)

    monkeypatch.setattr(Path, "glob", listing)
    assert tree_digest(tree) == want
    assert calls and len(calls[0]) > 20       # the patched listing was the one used


def test_tree_digest_changes_with_content_and_name(tree):
    before = tree_digest(tree)
    (tree / "pkg" / "b.py").write_bytes(b"B2")
    changed = tree_digest(tree)
    assert changed != before
    (tree / "pkg" / "b.py").rename(tree / "pkg" / "c.py")
    assert tree_digest(tree) not in (before, changed)
    (tree / "pkg" / "c.py").write_bytes(b"B")
    assert tree_digest(tree) != before           # same bytes under another name
    (tree / "pkg" / "c.py").rename(tree / "pkg" / "b.py")
    assert tree_digest(tree) == before


def test_tree_digest_skips_dotfiles_caches_and_directories(tree):
    before = tree_digest(tree)
    (tree / ".hidden.py").write_text("secret")
    (tree / "pkg" / ".swp").write_text("editor")
    (tree / "__pycache__").mkdir()
    (tree / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0bytecode")
    (tree / "pkg" / "__pycache__").mkdir()
    (tree / "pkg" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\0bytecode")
    (tree / "empty").mkdir()
    assert tree_digest(tree) == before
    assert tree_digest(tree, "**/*.py") == _expected({"a.py": b"A", "pkg/b.py": b"B"})
