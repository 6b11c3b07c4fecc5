"""`mopt bench` on the GPU machine, against the runtime run as a plain server (no Docker there):

    PYTHONPATH=/tmp/site CXX=g++ python3 benchmarks/bench_gpu.py --out $OUT -- [mopt bench options]
    .venv/bin/python benchmarks/bench_gpu.py --tiny --device cpu --out /tmp/bg -- --clients 2 --duration 2   # here

Compiles the packed torch-aot engine of Qwen3-Embedding-0.6B's shape (bf16, random weights: no hub
there; benchmarks/served_vs_raw.py's make_engine), starts `python -m builder.runtime serve` on it as
an image would, runs `python -m builder bench gpu=http://127.0.0.1:PORT` with the options after `--`,
and leaves bench.json, bench.md, bench.png and bench.html in OUT. The host side's dependencies
(click, rich, aiohttp, matplotlib) are carried as wheels into /tmp/site.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.served_vs_raw import make_engine, serve, stop  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/mopt-bench-gpu")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--tiny", action="store_true", help="the tiny Qwen3 (a check of this script on any machine)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--port", type=int, default=18190)
    a = p.parse_args(ours)
    engine = make_engine(argparse.Namespace(tiny=a.tiny, device=a.device, layers=a.layers, compile_graphs=None),
                         Path(a.work))
    server, ready_s = serve(engine, a.port, [], None)
    print(f"serving after {ready_s}s", flush=True)
    try:
        started = time.monotonic()
        code = subprocess.call([sys.executable, "-m", "builder", "bench", f"gpu=http://127.0.0.1:{a.port}",
                                "--out", a.out, *bench_args], cwd=REPO)
        print(f"mopt bench: exit {code} after {time.monotonic() - started:.0f}s", flush=True)
        return code
    finally:
        stop(server)


if __name__ == "__main__":
    raise SystemExit(main())
