"""A mounted model's first and warm start (issue 33): `serve --model-id M --cache-dir C` as a plain
program, the code path of the model runtime images. The first start compiles the engine into the
cache (a child `compile`, the accuracy gate included); the next ones find it, pass the guard and load.
Times are from the process's start to /ready answering 200; `import torch` alone is timed in fresh
processes beside them (the "beyond importing torch" figure subtracts its median).

    python benchmarks/model_cache_start.py --out OUT [--tiny] [--device cuda] [--warm-starts 3]

Qwen3-Embedding-0.6B's shape with random weights (no hub here) and the tiny Qwen3's tokenizer; --tiny:
the tiny Qwen3 (CPU)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def wait_ready(proc: subprocess.Popen, port: int, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.02)
    raise SystemExit("not ready in time")


def embed(port: int) -> int:
    body = json.dumps({"input": ["a mounted model", "served from its cache"]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return len(json.loads(r.read())["data"][0]["embedding"])


def start(argv: list[str], port: int, log: Path, timeout: float) -> dict:
    t0 = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "builder.runtime", "serve", *argv, "--port", str(port)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            wait_ready(proc, port, timeout)
            ready = time.monotonic() - t0
            dim = embed(port)
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=60)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    cache = next((e for e in events if e.get("event") == "engine-cache"), {})
    return {"ready_s": round(ready, 2), "dim": dim, "outcome": cache.get("outcome"),
            "cache_seconds": cache.get("seconds"), "parts": cache.get("parts"), "exit": proc.returncode}


def torch_import_s() -> float:
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120)
    return time.monotonic() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--warm-starts", type=int, default=3)
    p.add_argument("--port", type=int, default=18300)
    a = p.parse_args()
    out = Path(a.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    if a.tiny:
        from builder.runtime.tiny_qwen3 import make_tiny_qwen3

        model = make_tiny_qwen3(work / "model", 0)
    else:
        from benchmarks.packed_bench import make_model

        model = make_model(work / "model", "qwen3", a.layers)
    precision = "bf16" if a.device == "cuda" else "fp32"
    argv = ["--model-id", str(model), "--cache-dir", str(work / "cache"), "--device", a.device,
            "--precision", precision, "--max-seq-len", "512", "--max-batch", "64", "--max-batch-tokens",
            str(64 * 512), "--input", "packed", "--pooling", "last", "--normalize"]  # served_vs_raw's engine
    results = {"model": "tiny qwen3" if a.tiny else f"Qwen3-0.6B shape, {a.layers} layers, random weights",
               "argv": argv, "host_cpus": os.cpu_count()}
    torch_times = [torch_import_s() for _ in range(3)]
    results["first"] = start(argv, a.port, out / "first.log", 1800)
    print("first", results["first"], flush=True)
    results["warm"] = []
    for i in range(a.warm_starts):
        torch_times.append(torch_import_s())
        results["warm"].append(start(argv, a.port + 1 + i, out / f"warm{i}.log", 300))
        print("warm", results["warm"][-1], flush=True)
    results["torch_import_s"] = [round(t, 2) for t in torch_times]
    median_torch = statistics.median(torch_times)
    results["warm_beyond_torch_s"] = [round(w["ready_s"] - median_torch, 2) for w in results["warm"]]
    (out / "model_cache_start.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("torch_import_s", "warm_beyond_torch_s")}))


if __name__ == "__main__":
    main()
