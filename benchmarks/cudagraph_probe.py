"""Whether an AOTInductor packed engine can be captured into CUDA graphs, step by step, each way in a
fresh process (a failed capture can poison the CUDA context), with native stacks on a crash:

    CXX=g++ PYTHONUNBUFFERED=1 python3 benchmarks/cudagraph_probe.py ENGINE_DIR --out $OUT

Ways: `own` (the graphs' own container, one model instance per graph: what cudagraphs.py does),
`shared` (the direct runner's container), `one` (own container, a single graph); `-exit` after a way:
the process exits normally (destructors
run) instead of os._exit. Each prints what it
reached; the summary goes to cudagraph_probe.json."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import faulthandler, json, os, sys, time
faulthandler.enable()
sys.path.insert(0, sys.argv[3])
os.environ["MOPT_CUDA_GRAPHS"] = "0"
import torch
from builder.runtime import cudagraphs
from builder.runtime.backends import torch_aot
from builder.runtime.fingerprint import read
from builder.runtime.params import EngineParams
from pathlib import Path
engine_dir, way = Path(sys.argv[1]) / "engine", sys.argv[2]
normal_exit = way.endswith("-exit")
way = way.removesuffix("-exit")
params = EngineParams.from_dict(read(sys.argv[1])["params"])
def step(msg): print("STEP", msg, flush=True)
def opener(models=1):
    return torch_aot._library_runner(engine_dir / torch_aot.UNPACKED, "cuda", models)
direct_raw = opener(1)
direct = lambda *t: direct_raw(*(x.to("cuda").contiguous() for x in t))
with torch.no_grad():
    ids = torch.randint(0, 100, (1, 300)); lens = torch.tensor([100, 200], dtype=torch.int32)
    ref = direct(ids, lens, torch.zeros(200, dtype=torch.int8)).float()
    step("direct call ok")
    if way == "one":
        cudagraphs.GRAPH_TOKENS, cudagraphs.GRAPH_SEQUENCES = (512,), (4,)
    if way == "shared":
        open_runner = lambda models: direct_raw
    else:
        open_runner = opener
    t = time.perf_counter()
    g = cudagraphs.GraphedPackedRunner(direct, open_runner, params.max_batch, params.batch_tokens, params.max_seq_len)
    step(f"captured {len(g.graphs)} graphs in {time.perf_counter() - t:.2f}s")
    got = g(ids, lens, torch.zeros(200, dtype=torch.int8)).float()
    step(f"replay cosine {float(torch.nn.functional.cosine_similarity(got, ref).min()):.6f}")
    again = direct(ids, lens, torch.zeros(200, dtype=torch.int8)).float()
    step(f"direct after capture cosine {float(torch.nn.functional.cosine_similarity(again, ref).min()):.6f}")
    step(f"probe worst cosine {g.probe(100):.6f}")
    for n, tok in ((1, 60), (16, 1500), (32, 3000)):
        lens = torch.tensor([tok // n] * n, dtype=torch.int32); ids = torch.randint(0, 100, (1, int(lens.sum())))
        ml = torch.zeros(int(lens.max()), dtype=torch.int8)
        for name, fn in (("graph", g), ("direct", direct)):
            for _ in range(3): fn(ids, lens, ml).cpu()
            ts = []
            for _ in range(20):
                t = time.perf_counter(); fn(ids, lens, ml).cpu(); ts.append(time.perf_counter() - t)
            ts.sort()
            step(f"{name} {n} seqs {tok} tokens: {ts[10] * 1000:.3f} ms")
step("done")
sys.stdout.flush()
if not normal_exit:
    os._exit(0)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine_dir")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--ways", default="own,own-exit,one,shared")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for way in a.ways.split(","):
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", _CHILD, a.engine_dir, way, str(REPO)], capture_output=True,
                              text=True, timeout=300)
        steps = [line[5:] for line in proc.stdout.splitlines() if line.startswith("STEP ")]
        summary[way] = {"rc": proc.returncode, "steps": steps, "seconds": round(time.monotonic() - t, 1),
                        "stderr_tail": proc.stderr.strip().splitlines()[-25:]}
        print(way, json.dumps(summary[way], indent=1), flush=True)
    (out / "cudagraph_probe.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
