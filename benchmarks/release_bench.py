"""Release benchmarks on the real Docker daemon (run after the cpu variants are built, e.g. by
`bash scripts/demo.sh` or `mopt build --select '*:cpu'`):

  1. cold start: `docker run` -> first embedding, for the built cpu image (engine compiled at
     build time) against a container of the same runtime image that compiles at start;
  2. wall time of a no-op re-release (`mopt release --select '*:cpu'`, nothing changed);
  3. image sizes of the base, runtime and final images.

Run: .venv/bin/python benchmarks/release_bench.py [--select minilm-embed:cpu] [--repeat 3]
Prints a table and writes benchmarks/results/release_bench.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from builder.dockerclient import find_docker, run_docker  # noqa: E402
from builder.state import StateDir  # noqa: E402

STATE = REPO / ".mopt"


def first_embedding_seconds(docker, argv: list[str], port: int, timeout: float = 600) -> float:
    name = f"mopt-bench-{port}"
    run_docker(["rm", "-f", name], docker=docker, check=False)
    start = time.monotonic()
    run_docker(["run", "-d", "--name", name, "--label", "io.mopt.bench=1", "-p", f"127.0.0.1:{port}:8000", *argv],
               docker=docker)
    try:
        while time.monotonic() - start < timeout:
            try:
                response = requests.post(f"http://127.0.0.1:{port}/v1/embeddings",
                                         json={"input": ["cold start probe"]}, timeout=5)
                if response.status_code == 200:
                    return time.monotonic() - start
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"no embedding within {timeout}s: {run_docker(['logs', name], docker=docker).stdout[-500:]}")
    finally:
        run_docker(["rm", "-f", name], docker=docker, check=False)


def size_mb(docker, ref: str) -> float:
    info = json.loads(run_docker(["image", "inspect", ref], docker=docker).stdout)[0]
    return info["Size"] / 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--select", default="minilm-embed:cpu")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    docker = find_docker()
    image, tag = args.select.split(":")
    record = StateDir(STATE).read_record(image, tag)
    stages = {s.name: s for s in record.stages}
    engine = json.loads((record.engine_dir / "engine.json").read_text())
    p = engine["params"]
    compile_then_serve = (
        "python -m mopt_runtime compile --model /opt/mopt/model --out /tmp/e --device cpu --precision fp32 "
        f"--max-batch {p['max_batch']} --max-seq-len {p['max_seq_len']} --pooling {p['pooling']} --no-verify "
        "&& exec python -m mopt_runtime serve --engine-dir /tmp/e --port 8000")
    prebuilt, at_start = [], []
    for i in range(args.repeat):  # interleaved, so machine noise hits both sides alike
        prebuilt.append(first_embedding_seconds(docker, [record.image_id], 18100 + i))
        # Same image, same model (/opt/mopt/model), but the engine is compiled when the container starts.
        at_start.append(first_embedding_seconds(
            docker, ["--entrypoint", "sh", record.image_id, "-c", compile_then_serve], 18200 + i))
    release = [sys.executable, "-m", "builder", "release", "--select", args.select]
    subprocess.run(release, cwd=REPO, capture_output=True, text=True)  # bring everything up to date first
    start = time.monotonic()
    noop = subprocess.run(release, cwd=REPO, capture_output=True, text=True)
    noop_s = time.monotonic() - start
    sizes = {"base": size_mb(docker, stages["base"].image), "runtime": size_mb(docker, stages["runtime"].image),
             "final": size_mb(docker, record.image_id)}
    results = {
        "variant": args.select,
        "cold_start_prebuilt_s": [round(x, 2) for x in prebuilt],
        "cold_start_compile_at_start_s": [round(x, 2) for x in at_start],
        "ratio_median": round(statistics.median(at_start) / statistics.median(prebuilt), 1),
        "noop_release_s": round(noop_s, 1), "noop_release_rc": noop.returncode,
        "noop_release_said_nothing_rebuilt": "nothing was rebuilt" in noop.stderr,
        "image_size_mb": {k: round(v) for k, v in sizes.items()},
    }
    print(f"variant                          {args.select}")
    for label, runs in (("prebuilt engine ", prebuilt), ("compile at start", at_start)):
        print(f"cold start, {label}     median {statistics.median(runs):6.2f} s  runs {[round(x, 2) for x in runs]}")
    print(f"ratio (compile-at-start/prebuilt) {results['ratio_median']}x")
    print(f"no-op re-release wall time       {noop_s:6.1f} s (exit {noop.returncode}, "
          f"said nothing rebuilt: {results['noop_release_said_nothing_rebuilt']})")
    print("image sizes                      " + ", ".join(f"{k} {v:.0f} MB" for k, v in sizes.items()))
    out = REPO / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "release_bench.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
