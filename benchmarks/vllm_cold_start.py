"""Cold start of the vllm-cpu image to its first embedding: with the compile cache shipped in the
image (VLLM_CACHE_ROOT=/opt/mopt/engine/engine/vllm-cache) against an empty VLLM_CACHE_ROOT (a tmpfs
that vLLM fills while it starts). Runs are interleaved (shipped, empty, shipped, empty, ...) so the
machine's drift hits both equally. Each run is a fresh `docker run` of the final image through its
normal entry point (`python -m mopt_runtime serve`: guard, then `vllm serve`).

Run after the image is built (`mopt build --select minilm-embed:cpu-vllm`):
  .venv/bin/python benchmarks/vllm_cold_start.py [--image mopt/minilm-embed:cpu-vllm] [--repeat 3]
Prints each run, the medians and the command; writes benchmarks/results/vllm_cold_start.json.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from builder.dockerclient import find_docker, run_docker  # noqa: E402

EMPTY_CACHE = "/tmp/vllm-empty-cache"


def _warmup_seconds(text: str) -> float | None:
    """Seconds between vLLM's "Warming up model for the compilation" and "Warming up done" lines."""
    stamp = r"(\d\d-\d\d \d\d:\d\d:\d\d)"
    start = re.search(stamp + r" \S+ Warming up model for the compilation", text)
    done = re.search(stamp + r" \S+ Warming up done", text)
    if not (start and done):
        return None
    fmt = "%m-%d %H:%M:%S"
    return (datetime.strptime(done[1], fmt) - datetime.strptime(start[1], fmt)).total_seconds()


def first_embedding(docker, image: str, port: int, empty_cache: bool, timeout: float = 600) -> dict:
    name = f"mopt-vllm-bench-{port}"
    run_docker(["rm", "-f", name], docker=docker, check=False)
    extra = ["--tmpfs", f"{EMPTY_CACHE}:exec,uid=10001,gid=10001,mode=0700", "-e", f"VLLM_CACHE_ROOT={EMPTY_CACHE}"] \
        if empty_cache else []
    start = time.monotonic()
    run_docker(["run", "-d", "--name", name, "--label", "io.mopt.bench=1", "-p", f"127.0.0.1:{port}:8000",
                *extra, image], docker=docker)
    try:
        while time.monotonic() - start < timeout:
            state = run_docker(["inspect", "-f", "{{.State.Status}}", name], docker=docker, check=False).stdout
            if state.strip() == "exited":
                logs = run_docker(["logs", name], docker=docker, check=False)
                raise RuntimeError(f"the container exited: {(logs.stdout + logs.stderr)[-800:]}")
            try:
                response = requests.post(f"http://127.0.0.1:{port}/v1/embeddings",
                                         json={"input": ["cold start probe"]}, timeout=5)
                if response.status_code == 200:
                    seconds = time.monotonic() - start
                    logs = run_docker(["logs", name], docker=docker, check=False)
                    text = logs.stdout + logs.stderr
                    init = re.findall(r"init engine .*? took ([0-9.]+) s", text)
                    return {"first_embedding_s": round(seconds, 2),
                            "engine_init_s": float(init[-1]) if init else None,
                            "warmup_s": _warmup_seconds(text)}
            except requests.RequestException:
                pass
            time.sleep(0.25)
        logs = run_docker(["logs", name], docker=docker, check=False)
        raise RuntimeError(f"no embedding within {timeout}s: {(logs.stdout + logs.stderr)[-800:]}")
    finally:
        run_docker(["rm", "-f", name], docker=docker, check=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--image", default="mopt/minilm-embed:cpu-vllm")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--port", type=int, default=18090)
    args = parser.parse_args()
    docker = find_docker()
    runs: dict[str, list[dict]] = {"shipped cache": [], "empty VLLM_CACHE_ROOT": []}
    for i in range(args.repeat):
        for label, empty in (("shipped cache", False), ("empty VLLM_CACHE_ROOT", True)):
            result = first_embedding(docker, args.image, args.port, empty)
            runs[label].append(result)
            print(f"run {i + 1} {label:>22}: first embedding {result['first_embedding_s']:6.1f} s "
                  f"(engine init {result['engine_init_s']} s, compile warm-up {result['warmup_s']} s)", flush=True)
    summary = {label: {key: round(statistics.median(r[key] for r in rs if r[key] is not None), 2)
                       if any(r[key] is not None for r in rs) else None
                       for key in ("first_embedding_s", "engine_init_s", "warmup_s")}
               for label, rs in runs.items()}
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/vllm_cold_start.py", *sys.argv[1:]])
    print(f"\n{'':>22}  first embedding  engine init  compile warm-up   (medians of {args.repeat}, interleaved)")
    for label, s in summary.items():
        print(f"{label:>22}  {s['first_embedding_s']!s:>15}  {s['engine_init_s']!s:>11}  {s['warmup_s']!s:>15}")
    print(f"command: {command}")
    out = REPO / "benchmarks" / "results" / "vllm_cold_start.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"image": args.image, "repeat": args.repeat, "runs": runs, "median": summary,
                               "command": command}, indent=2) + "\n")


if __name__ == "__main__":
    main()
