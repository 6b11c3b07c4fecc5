"""Start-up cost of the weights, old path vs new, side by side in fresh processes on this machine:

    .venv/bin/python benchmarks/weights_load.py [--layers 28] [--device cpu] [--reps 3]

old: import transformers + AutoModel.from_pretrained (what the loader did before, and still does
for the cache form); new: safetensors.load_file of the graph-tensor shards straight to the device
(the torch-inductor artifact path: no nn.Module, no transformers). Same bytes: a random-weight
Qwen3-Embedding-0.6B-shaped model in bf16, seed 0. Prints the medians and their ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

OLD = r'''
import sys, time; import torch; t = time.monotonic()
from builder.runtime.pooling import load_body
m = load_body(sys.argv[1], torch.bfloat16, sys.argv[2])
print(time.monotonic() - t)
'''
NEW = r'''
import sys, time, json; import torch; t = time.monotonic()
from pathlib import Path
from builder.runtime.backends.torch_inductor import load_graph_tensors
d = Path(sys.argv[1]); files = sorted(p.name for p in d.glob("graph-tensors-*.safetensors"))
ts = load_graph_tensors(d, files, sys.argv[2])
print(time.monotonic() - t)
'''


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--work", default="/tmp/mopt-weights-load")
    a = p.parse_args()
    import torch
    from gpu_bench import make_model

    from builder.runtime.backends.torch_inductor import save_graph_tensors

    work = Path(a.work)
    model = work / "model"
    if not (model / "config.json").is_file():
        make_model(model, a.layers, tiny=False)
    shards = work / "shards"
    if not any(shards.glob("graph-tensors-*")):
        shards.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import load_file
        tensors = {}
        for f in sorted(model.glob("*.safetensors")):
            tensors.update({f"body.{k}": v for k, v in load_file(str(f)).items()})
        save_graph_tensors(tensors, shards)
        del tensors
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(a.reps):  # interleaved, so drift hits both alike
        for name, code, arg in (("old", OLD, model), ("new", NEW, shards)):
            out = subprocess.run([sys.executable, "-c", code, str(arg), a.device], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout
            times[name].append(float(out.strip().splitlines()[-1]))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"layers": a.layers, "device": a.device, "torch": torch.__version__,
              "old_transformers_from_pretrained_s": times["old"], "new_safetensors_shards_s": times["new"],
              "median_old_s": round(med["old"], 3), "median_new_s": round(med["new"], 3),
              "ratio_old_over_new": round(med["old"] / med["new"], 2)}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
