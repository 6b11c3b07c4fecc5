"""How fast `mopt plan` expands and checks a large matrix.

Run: .venv/bin/python benchmarks/plan_speed.py
Prints raw combinations, variants, rejections and the best/median wall time of make_plan over
several runs (a fresh compat cache each run), plus the time to load and validate the matrix.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from builder import plan as plan_module  # noqa: E402
from builder.matrix import load_matrix  # noqa: E402


def big_matrix(tmp: Path) -> Path:
    data = yaml.safe_load((REPO / "matrix.yaml").read_text())
    data["axes"]["driver"] = ["525", "535", "550", "570", "580"]
    trt = data["images"]["qwen3-embed"]["flavours"]["tensorrt"]
    trt["axes"] = {"cuda": "all", "sm": "all", "driver": "all", "tensorrt": "all"}
    trt["newest"] = ["torch"]
    trt["tag"] = "cu{cuda_nodot}-sm{sm}-trt{tensorrt}-drv{driver}"
    aot = data["images"]["qwen3-embed"]["flavours"]["aot"]
    aot["axes"] = {"cuda": "all", "sm": "all", "torch": "all", "driver": "all"}
    aot.pop("newest")
    aot["tag"] = "cu{cuda_nodot}-sm{sm}-t{torch}-d{driver}-aot"
    for name in ("images",):
        (tmp / name).symlink_to(REPO / name)
    path = tmp / "matrix.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = big_matrix(Path(tmp))
        start = time.perf_counter()
        matrix = load_matrix(path)
        load_s = time.perf_counter() - start
        times = []
        for _ in range(7):
            plan_module._check.cache_clear()
            start = time.perf_counter()
            result = plan_module.make_plan(matrix)
            times.append(time.perf_counter() - start)
    print(f"raw combinations : {result.combinations}")
    print(f"variants         : {len(result.variants)}")
    print(f"rejected         : {len(result.rejected)}")
    print(f"load+validate    : {load_s * 1000:.1f} ms")
    print(f"make_plan        : best {min(times) * 1000:.1f} ms, median {statistics.median(times) * 1000:.1f} ms "
          f"over {len(times)} runs (cold compat cache each run)")


if __name__ == "__main__":
    main()
