"""Why the exported graph (the engines' input) compiles to more kernels than torch.compile of the module.

    PYTHONUNBUFFERED=1 python3 benchmarks/fusion_probe.py --out $OUT [--device cuda] [--variants ...]

Builds a 1-layer Qwen3-0.6B-shaped model (random weights) and compiles it with torch.compile
(dynamic shapes) in one fresh process per variant, with Inductor's caches off and its post-grad graph
and output code logged to OUT/<variant>.log. Prints, per variant, the generated kernels (Triton on
CUDA, C++ on CPU) and the number of kernels that compute an RMSNorm's mean(x^2) without its rsqrt
(a reduction that did not fuse with its normalisation).

Variants (VARIANT[+OPTION], OPTION one of OPTIONS: an Inductor config patch): module (the eager
module, as JIT users compile it), exported (torch.export as the engines
do, export's dtype asserts stripped), asserts (exported, asserts kept), strict (torch.export
strict=True, asserts stripped), decomposed (exported, then run_decompositions()), scalars
(exported, with RMSNorm's eps and RoPE's scaling as 0-d tensors: Dynamo's graph takes them as run-time
inputs, export's as constants, the one difference between the two post-grad graphs), rotary and
modulerotary (exported and module with the rotary tables as the engines compute them, rotary.py;
every other variant keeps transformers' own). Each variant also times the 1-layer model at 64 x 512.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("module", "exported", "asserts", "strict", "decomposed", "scalars", "rotary", "modulerotary")
# VARIANT+OPTION compiles with an Inductor config patch as well, e.g. exported+fuse
OPTIONS = {"fuse": {"triton.tiling_prevents_reduction_fusion": False}, "notile": {"triton.max_tiles": 1}}

CHILD = r'''
import json, re, sys, torch
sys.path.insert(0, sys.argv[4])
from builder.runtime.backends.torch_common import DTYPES, build_module, example_inputs, export_graph
from builder.runtime.params import EngineParams
from builder.runtime.sdpa import sdpa_kernels
from torch._inductor.utils import run_and_get_code
variant, model_dir, device = sys.argv[1], sys.argv[2], sys.argv[3]
options = json.loads(sys.argv[5])
precision = "bf16" if device == "cuda" else "fp32"
# The export's dims range up to the timed shape, 64 x 512; the example (the tuning hint) is smaller.
params = EngineParams(device=device, precision=precision, pooling="last", max_batch=64, max_seq_len=512,
                      backend="torch-aot", attention="causal")
# transformers' own rotary tables unless the variant is the engines' product form (rotary.py)
module = build_module(model_dir, params, DTYPES[precision], device, model_rotary="rotary" not in variant)
if variant == "modulerotary":
    variant = "module"
if variant == "rotary":
    variant = "exported"
if variant == "scalars":  # RMSNorm eps and RoPE scaling as 0-d tensors, read at run time as in Dynamo's graph
    for m in module.modules():
        for name in ("variance_epsilon", "attention_scaling"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, torch.tensor(getattr(m, name), dtype=torch.float32, device=device))
example = example_inputs(8, 128, device, params.pad_left)
with torch.no_grad(), (sdpa_kernels() if device == "cuda" else torch.no_grad()):
    if variant == "module":
        fn = module
    else:
        exported, _ = export_graph(module, example, params, strip_asserts=variant != "asserts") if variant != "strict" \
            else (torch.export.export(module, example, dynamic_shapes={k: {0: torch.export.Dim("b", min=1, max=64),
                  1: torch.export.Dim("s", min=2, max=512)} for k in ("input_ids", "attention_mask")}, strict=True), 0)
        if variant == "strict":
            from builder.runtime.backends.torch_common import strip_dtype_asserts
            strip_dtype_asserts(exported)
        if variant == "decomposed":
            exported = exported.run_decompositions()
        fn = exported.module()
    compiled = torch.compile(fn, dynamic=True, options=options or None)
    _, code = run_and_get_code(compiled, *example)
    # One layer at the benchmark shape, after a call at it (dynamic shapes: no recompile).
    import time
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    n = 20 if device == "cuda" else 1
    ids = torch.randint(0, 500, (64, 512), device=device); mask = torch.ones_like(ids)
    compiled(ids, mask); sync(); t = time.monotonic()
    for _ in range(n): compiled(ids, mask)
    sync(); res = {"ms_64x512": round((time.monotonic() - t) / n * 1000, 3)}
src = "\n".join(code)
kernels = sorted(set(re.findall(r"(?:triton|cpp)_(?:poi|per|red|fused)\w*", src)))
alone = [k for k in kernels if "mean" in k and "pow" in k and "rsqrt" not in k]
res.update(kernels=[k for k in kernels if not k.endswith(("numel",))], norm_reductions_alone=alone)
print("PROBE " + json.dumps(res), flush=True)
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "probe-out"))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--variants", default=",".join(VARIANTS))
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from benchmarks.gpu_bench import make_model

    model_dir = make_model(out / "model-1layer", 1, tiny=False)
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", TORCH_LOGS="post_grad_graphs,output_code")
    results = {}
    for variant in a.variants.split(","):
        graph, _, option = variant.partition("+")
        proc = subprocess.run([sys.executable, "-c", CHILD, graph, str(model_dir), a.device, str(REPO),
                               json.dumps(OPTIONS[option] if option else {})], cwd=REPO,
                              capture_output=True, text=True, timeout=600, env=env)
        (out / f"{variant}.log").write_text(proc.stderr)
        line = next((s for s in proc.stdout.splitlines() if s.startswith("PROBE ")), None)
        results[variant] = json.loads(line[6:]) if line else {"error": proc.stderr[-1500:]}
        r = results[variant]
        print(f"[{variant}] {len(r.get('kernels', []))} kernels, 1 layer 64x512 {r.get('ms_64x512')} ms, "
              f"norm reductions alone: {r.get('norm_reductions_alone', r.get('error'))}", flush=True)
    (out / "probe.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
