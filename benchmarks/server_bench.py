"""Served vs raw engine on the same texts, side by side, on any engine directory:

    .venv/bin/python benchmarks/server_bench.py --engine-dir DIR [--clients 16] [--requests 8] [--format base64]
        [--no-engine-process]
    .venv/bin/python benchmarks/server_bench.py --tiny            # compiles a tiny Qwen3 cpu engine first

Raw: the engine in-process (tokenise + embed, max_batch texts per call). Served: `python -m
builder.runtime serve` on loopback with CLIENTS concurrent clients sending REQUESTS requests each
(8 texts of 4..120 words). Prints tokens/s of both, the ratio and p50/p99 (the issue's goal: served
>= 80% of raw). A tiny engine makes the engine nearly free, so what is left is the server's own cost.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engine-dir")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--work", default="/tmp/mopt-server-bench")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--seq", type=int, default=512, help="texts are at most seq/2 words")
    p.add_argument("--port", type=int, default=18080)
    p.add_argument("--format", choices=("float", "base64"), default="float", help="response encoding_format")
    p.add_argument("--no-engine-process", action="store_true", help="serve with the engine in the server process")
    p.add_argument("--out", default=None, help="also write the result JSON here")
    a = p.parse_args()
    if not a.engine_dir and not a.tiny:
        p.error("give --engine-dir or --tiny")
    from gpu_bench import server_bench

    engine = Path(a.engine_dir) if a.engine_dir else Path(a.work) / "engine"
    if a.tiny and not (engine / "engine.json").is_file():
        from builder.runtime.tiny_qwen3 import make_tiny_qwen3

        model = make_tiny_qwen3(Path(a.work) / "model", 0)
        subprocess.run([sys.executable, "-m", "builder.runtime", "compile", "--model", str(model), "--out",
                        str(engine), "--backend", "torch-aot", "--max-batch", "64", "--max-seq-len", "512",
                        "--pooling", "last"], cwd=REPO, check=True, capture_output=True)
    res = server_bench(engine, a, a.format, in_process=a.no_engine_process, port=a.port)
    res["engine"] = json.loads((engine / "engine.json").read_text())["backend"]
    print(json.dumps(res, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
