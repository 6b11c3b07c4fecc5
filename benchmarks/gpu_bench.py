"""GPU benchmark of the in-image runtime, through the image's own entry points.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_bench.py --out $OUT [--layers 28] [--deadline-s 540] \
        [--engines default/causal,default/mask] [--jit default,default/causal,max-autotune] [--profile]

Builds a Qwen3-Embedding-0.6B-architecture model (random weights, seed 0; the Hub is unreachable),
compiles it with `python -m builder.runtime compile --backend torch-aot|torch-inductor --device cuda`,
one engine per --engines entry (compile mode/attention[/variant]), then measures: eager vs engine
throughput (64 x 512) and latency (1 x 32), a mixed-length workload, cold start of a fresh process
(prebuilt engine, through the guard as serve starts) vs the compile step, the start step by step with a profile of
the artifact load, torch.compile JIT on the same model (static shape, in this process), the guard
refusing altered engine.json files, accuracy of engines built from the tiny Qwen3 (real tokenizer)
vs its fp32 eager reference, the HTTP server under concurrent loopback clients against the raw
engine on the same texts, and (--profile) the top CUDA kernels of eager and of each engine. Sections
that would pass --deadline-s are skipped and recorded as such. Prints a table, writes bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QWEN3_06B = dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768)
TINY = dict(QWEN3_06B, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
BACKEND = "torch-inductor"
# Engine variants: the backend (torch-inductor unless said) and the environment of the compile step.
# aot: the AOTInductor .pt2. CXX=g++: that machine's CXX names a separate GCC (/opt/gcc) whose link puts
# a libstdc++ of its own into the .so, which then crashes at load (benchmarks/aoti_probe.py); the
# images' g++ is the distribution's.
VARIANTS = {"cudnn": {"env": {"MOPT_SDPA_BACKENDS": "cudnn,flash,efficient,math"}},
            "aot": {"backend": "torch-aot", "env": {"CXX": "g++"}},
            # the shape the compile tunes kernels for (torch_common.tune_shape): 2 x 16 before 2026-11-30
            "aot16": {"backend": "torch-aot", "env": {"CXX": "g++", "MOPT_TUNE_SHAPE": "2x16"}},
            # Inductor may fuse a reduction with a 2D-tiled pointwise consumer (benchmarks/fusion_probe.py)
            "aotfuse": {"backend": "torch-aot", "env": {
                "CXX": "g++", "MOPT_INDUCTOR_OPTIONS": '{"triton.tiling_prevents_reduction_fusion": false}'}}}
# Fresh processes that measure a start run as serve's engine worker does (no TorchScript: worker.py).
CHILD_ENV = {"PYTORCH_JIT": "0"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/mopt-gpu-bench")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--tiny", action="store_true", help="tiny widths (CPU smoke test of this script)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=8, help="requests per client")
    p.add_argument("--deadline-s", type=float, default=540.0)
    p.add_argument("--accuracy-precisions", default="fp32,bf16,fp16")
    p.add_argument("--engines", default="default/causal/aot",
                   help="engines to build and measure, in order (later ones only if the deadline allows): "
                        "MODE/ATTENTION[/VARIANT[+VARIANT]], VARIANT one of " + ", ".join(VARIANTS) +
                        "; the first is the recipe's choice, used for the guard, accuracy, start and server")
    p.add_argument("--jit", default="", help="torch.compile JIT runs to time, MODE[/ATTENTION[/FLAG...]] each, FLAG "
                   "dynamic (symbolic sizes), flash (the engines' SDPA kernels), exported (compile the graph "
                   "torch.export gives, the engines' input), asserts (with exported: keep export's dtype "
                   "asserts, which the engines strip) or model (transformers' own rotary tables, which the "
                   "engines replace: rotary.py), e.g. default,default/causal,default/causal/dynamic/flash,"
                   "max-autotune (minutes of warm-up each); --profile adds kernels")
    p.add_argument("--server-engine", type=int, default=0, help="index in --engines of the engine to serve")
    p.add_argument("--servers", default="float,base64",
                   help="server runs, FORMAT[+PYTHONPATH][@SWITCH_MS][!] each: response format, a dir put on the "
                        "server's and the client's path (an unpacked orjson wheel), the server's GIL switch "
                        "interval, ! for the engine in the server process (serve --no-engine-process)")
    p.add_argument("--skip", default="", help="sections to leave out: start,guard,accuracy,server")
    p.add_argument("--profile", action="store_true", help="top CUDA kernels of eager and of each engine")
    p.add_argument("--call-costs", default="", help="engine call costs in tokens to time mixed traffic with, e.g. "
                   "0,512,2048,max (engine.plan_calls; max: calls of max_batch rows)")
    a = p.parse_args(argv)
    if a.device == "cpu" and a.precision != "fp32":
        p.error("--device cpu needs --precision fp32")
    return a


def engine_spec(key: str) -> tuple[str, str, str, dict | None]:
    """An --engines entry MODE/ATTENTION[/VARIANT[+VARIANT...]] as (mode, attention, backend, compile
    environment); joined variants merge their environments, e.g. aot+cudnn."""
    mode, attention, variants = (key.split("/") + ["", ""])[:3]
    backend, env = BACKEND, {}
    for variant in filter(None, variants.split("+")):
        if variant not in VARIANTS:
            raise SystemExit(f"--engines {key}: unknown variant {variant!r} (one of {', '.join(VARIANTS)})")
        backend = VARIANTS[variant].get("backend", backend)
        env.update(VARIANTS[variant].get("env", {}))
    return mode, attention, backend, env or None


def model_config(layers: int, tiny: bool = False) -> dict:
    return dict(TINY if tiny else QWEN3_06B, num_hidden_layers=layers)


def make_model(dest: Path, layers: int, tiny: bool, seed: int = 0) -> Path:
    """Random-weight Qwen3 of the given shape with the tiny Qwen3's offline tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    from builder.runtime.tiny_qwen3 import make_tiny_qwen3

    make_tiny_qwen3(dest, seed)  # tokenizer files (ids < every vocab here) + a config to overwrite
    tok_cfg = json.loads((dest / "config.json").read_text())
    cfg = Qwen3Config(**model_config(layers, tiny), bos_token_id=tok_cfg["eos_token_id"],
                      eos_token_id=tok_cfg["eos_token_id"], pad_token_id=tok_cfg["eos_token_id"])
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3Model(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(dest, safe_serialization=True)
    return dest


def prime_bytecode() -> None:
    """Child processes share a byte-code cache, filled once here: images ship compiled byte-code
    (pip compiles at install); a venv without it would add seconds of source compiling to every
    cold start measured."""
    os.environ.setdefault("PYTHONPYCACHEPREFIX", "/tmp/mopt-gpu-bench-pycache")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-c", "import torch, torch._inductor.standalone_compile, transformers, "
                    "builder.runtime.__main__, builder.runtime.backends.torch_inductor, builder.runtime.server"],
                   cwd=REPO, capture_output=True, timeout=300, env=env)


def cli(*args, timeout=900, env=None):
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "builder.runtime", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return p, round(time.monotonic() - t, 2)


COLD_CHILD = r'''
import json, sys, time
t0 = time.monotonic()
import torch
t_import = time.monotonic() - t0
from builder.runtime.engine import Engine
from builder.runtime.guard import resolve
engine_dir, info = resolve(sys.argv[1])  # the serve path: the guard, then the load
t_guard = time.monotonic() - t0
eng = Engine.from_info(engine_dir, info)
t_open = time.monotonic() - t0
first = eng.embed_texts(["hello world"])
t_first = time.monotonic() - t0
inductor = sys.modules.get("builder.runtime.backends.torch_inductor")  # imported by the load if it is used
res = {"load_path": getattr(inductor, "LAST_LOAD_PATH", info["backend"]), "import_torch_s": round(t_import, 2),
       "first_embedding_s": round(t_first, 2),
       "beyond_import_s": round(t_first - t_import, 2), "guard_s": round(t_guard - t_import, 2),
       "load_s": round(t_open - t_guard, 2),
       "dim": len(first[0])}
if len(sys.argv) > 2:
    b, s = int(sys.argv[2]), int(sys.argv[3])
    dev = eng.params.device
    def bench(b, s, n):
        ids = torch.randint(0, 500, (b, s)); mask = torch.ones_like(ids)
        eng.run(ids, mask)
        if dev == "cuda": torch.cuda.synchronize()
        t = time.monotonic()
        for _ in range(n): eng.run(ids, mask)
        if dev == "cuda": torch.cuda.synchronize()
        return (time.monotonic() - t) / n
    dt = bench(b, s, 10); res["engine_tok_s"] = round(b * s / dt)
    res["engine_latency_1x32_ms"] = round(bench(1, 32, 50) * 1000, 3)
    from benchmarks.gpu_bench import mixed_workload
    res.update(mixed_workload(eng, s))
print("CHILD " + json.dumps(res), flush=True)
'''


def _lengths(kind: str, seq: int, texts: int, rng) -> list[int]:
    """uniform: 8..seq; lognormal: median 58 tokens, sigma 1.0, clipped to 8..seq (embedding traffic)."""
    import math

    if kind == "uniform":
        return [rng.randint(8, seq) for _ in range(texts)]
    return [min(seq, max(8, round(rng.lognormvariate(math.log(58), 1.0)))) for _ in range(texts)]


def mixed_workload(eng, seq: int, texts: int = 512) -> dict:
    """Mixed-length traffic through Engine.embed_ids (length-sorted, cut into engine calls by
    engine.plan_calls, each padded to its length bucket, as serve batches): texts of 8..seq random ids
    (seed 0), after one batch of them; tokens/s of a first pass (shapes this process has not run yet)
    and of a second. MOPT_BENCH_CALL_COSTS (gpu_bench --call-costs) adds second passes of the uniform
    and a log-normal workload for each engine call cost, in tokens ("max": calls of max_batch rows)."""
    import os
    import random

    from builder.runtime import engine as engine_module

    rng = random.Random(0)
    seqs = [[rng.randrange(2, 500) for _ in range(n)] for n in _lengths("uniform", seq, texts, rng)]
    eng.embed_ids(seqs[:64])
    res = {}
    for key in ("mixed_first_pass_tok_s", "mixed_tok_s"):
        t = time.monotonic()
        eng.embed_ids(seqs)
        res[key] = round(sum(map(len, seqs)) / (time.monotonic() - t))
    res["mixed_texts"] = len(seqs)
    costs = [c for c in os.environ.get("MOPT_BENCH_CALL_COSTS", "").split(",") if c]
    if costs:
        lognormal = [[rng.randrange(2, 500) for _ in range(n)] for n in _lengths("lognormal", seq, texts, rng)]
        table = engine_module.CALL_COST_TOKENS
        saved = dict(table)
        try:
            for name, work in (("uniform", seqs), ("lognormal", lognormal)):
                eng.embed_ids(work)  # its shapes once, so every cost below runs warm
                for cost in costs:
                    table[eng.params.device] = engine_module.UNPADDED_CALL_COST if cost == "max" else int(cost)
                    t = time.monotonic()
                    eng.embed_ids(work)
                    tok_s = round(sum(map(len, work)) / (time.monotonic() - t))
                    res.setdefault(f"{name}_by_call_cost", {})[cost] = tok_s
        finally:
            table.update(saved)
        res["lognormal_median_tokens"] = sorted(map(len, lognormal))[len(lognormal) // 2]
    return res


def child(engine_dir: Path, *extra: str, timeout=600, env=None) -> dict:
    p = subprocess.run([sys.executable, "-c", COLD_CHILD, str(engine_dir), *extra], cwd=REPO, capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, **CHILD_ENV, **(env or {})})
    for line in p.stdout.splitlines():
        if line.startswith("CHILD "):
            return json.loads(line[6:])
    return {"error": f"rc {p.returncode}: {p.stderr[-1500:]}"}


def module_params(a, attention: str):
    from builder.runtime.params import EngineParams

    return EngineParams(device=a.device, precision=a.precision, pooling="last", max_batch=a.batch,
                        max_seq_len=a.seq, backend=BACKEND, attention=attention)


def _module(model_dir: Path, a, attention: str = "mask", model_rotary: bool = False):
    """The eager embedding module of the benchmarked model, the way the backends build it; "mask" with
    model_rotary is the model as transformers runs it (eager with an all-ones mask takes SDPA's flash
    kernel too); without it, the rotary tables are computed as the engines do (rotary.py)."""
    from builder.runtime.backends.torch_common import DTYPES, build_module

    return build_module(str(model_dir), module_params(a, attention), DTYPES[a.precision], a.device, model_rotary)


def _inputs(a, b: int, s: int):
    import torch

    ids = torch.randint(0, 500, (b, s), device=a.device)
    return ids, torch.ones_like(ids)


def profile_calls(run, calls: int = 3) -> dict:
    """Top CUDA kernels by self time over `calls` calls of run() after 3 unmeasured ones: ms per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                run()
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    ms = 1000 * calls
    rows = [f"{e.self_device_time_total / total * 100:5.1f}% {e.self_device_time_total / ms:8.2f} ms "
            f"x{e.count // calls:<4d} {e.key[:110]}" for e in sorted(events, key=lambda e: -e.self_device_time_total)]
    return {"ms_per_call": round(total / ms, 2), "top": rows[:30]}


def _timed(m, a, b: int, s: int, n: int) -> tuple[float, float]:
    """(seconds of the first call, mean seconds of the next n) on random ids of shape b x s."""
    import torch

    ids, mask = _inputs(a, b, s)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    with torch.no_grad():
        t = time.monotonic()
        m(ids, mask)
        sync()
        first = time.monotonic() - t
        t = time.monotonic()
        for _ in range(n):
            m(ids, mask)
        sync()
    return first, (time.monotonic() - t) / n


def eager(model_dir: Path, a) -> dict:
    import torch

    m = _module(model_dir, a, model_rotary=True)
    out = {"eager_tok_s": round(a.batch * a.seq / _timed(m, a, a.batch, a.seq, 10)[1]),
           "eager_latency_1x32_ms": round(_timed(m, a, 1, 32, 50)[1] * 1000, 3)}
    m = None  # free the eager copy before the engine runs
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return out


def jit(model_dir: Path, a, spec: str) -> dict:
    """torch.compile JIT, same batch, in this process: warm-up and speed. MODE alone is the model as
    transformers runs it; MODE/causal the engine's causal-attention module. Flags after that:
    "dynamic" compiles with symbolic sizes (dynamic=True, as the engines are) instead of for the one
    shape; "flash" limits SDPA to the engines' kernel list (sdpa.py: no cuDNN) as their compile does;
    "model" keeps transformers' rotary tables (the engines compute them as a product: rotary.py)."""
    from contextlib import nullcontext

    import torch

    from builder.runtime.sdpa import sdpa_backends, sdpa_kernels

    mode, *rest = spec.split("/")
    attention, flags = (rest[0] or "mask", rest[1:]) if rest else ("mask", [])
    torch._dynamo.reset()
    # Inductor's caches off: their keys leave out the SDPA kernel context, so a flash run after a
    # cuDNN one in this process got the cached cuDNN graph (H200 run 12); and each warm-up is cold.
    with sdpa_kernels() if "flash" in flags else nullcontext(), torch._inductor.config.patch(force_disable_caches=True):
        model_rotary = not rest or "model" in flags
        module = _module(model_dir, a, attention, model_rotary)
        if "exported" in flags:  # the engines' graph: torch.export with dynamic batch and sequence dims
            from builder.runtime.backends.torch_common import example_inputs, export_graph

            params = module_params(a, attention)
            example = example_inputs(a.batch, a.seq, a.device, params.pad_left)
            with torch.no_grad():
                module = export_graph(module, example, params, strip_asserts="asserts" not in flags)[0].module()
        compiled = torch.compile(module, mode=mode, dynamic=True if "dynamic" in flags else None)
        warm, dt = _timed(compiled, a, a.batch, a.seq, 10)
        mixed = mixed_workload(_jit_engine(compiled, model_dir, a, attention), a.seq)
        kernels = profile_calls(lambda: compiled(*_inputs(a, a.batch, a.seq))) if a.profile else None
    graph = ("exported, dtype asserts kept" if "asserts" in flags else "exported") if "exported" in flags else "module"
    out = {"mode": mode, "attention": attention, "rotary": "model" if model_rotary else "product",
           "shapes": "dynamic" if "dynamic" in flags else "static",
           "sdpa": ",".join(sdpa_backends()) if "flash" in flags else "free", "graph": graph,
           "warmup_s": round(warm, 1), "jit_tok_s": round(a.batch * a.seq / dt), **mixed,
           **({"profile": kernels} if kernels else {})}
    torch._dynamo.reset()
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return out


def _jit_engine(compiled, model_dir: Path, a, attention: str):
    """A JIT-compiled module behind the engines' Engine (tokenizer, length buckets, batching), so
    mixed_workload runs it the way it runs an engine; new shapes may recompile, as they would for a user."""
    import torch

    from builder.runtime.engine import Engine
    from builder.runtime.tokenization import TextEncoder

    params = module_params(a, attention)

    def run(ids, mask):
        with torch.no_grad():
            return compiled(ids.to(a.device), mask.to(a.device)).float().cpu()

    encoder = TextEncoder(model_dir, params.pooling, params.instruction, params.pad_left)
    return Engine(params, encoder, run, {"embedding_dim": model_config(a.layers, a.tiny)["hidden_size"]})


PROFILE_CHILD = r'''
import json, sys, torch
from benchmarks.gpu_bench import profile_calls
target, b, s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ids = torch.randint(0, 500, (b, s)); mask = torch.ones_like(ids)
if target == "eager":  # argv: eager b s model_dir precision
    from builder.runtime.backends.torch_common import DTYPES, build_module
    from builder.runtime.params import EngineParams
    params = EngineParams(backend="torch-inductor", device="cuda", precision=sys.argv[5], pooling="last",
                          max_batch=b, max_seq_len=s)
    m = build_module(sys.argv[4], params, DTYPES[params.precision], "cuda", model_rotary=True)
    ids, mask = ids.cuda(), mask.cuda()
    run = lambda: m(ids, mask)
else:  # argv: engine_out_dir b s
    from builder.runtime.engine import Engine
    eng = Engine.open(target)
    run = lambda: eng.run(ids, mask)
print("PROFILE " + json.dumps(profile_calls(run)), flush=True)
'''


def kernel_profile(target: str, a, model_dir: Path | None = None) -> dict:
    """Top CUDA kernels (self time, mean of 3 calls of batch x seq) in a fresh process: eager or an engine."""
    argv = [sys.executable, "-c", PROFILE_CHILD, target, str(a.batch), str(a.seq)]
    if target == "eager":
        argv += [str(model_dir), a.precision]
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    for line in p.stdout.splitlines():
        if line.startswith("PROFILE "):
            return json.loads(line[8:])
    return {"error": f"rc {p.returncode}: {p.stderr[-1500:]}"}


def start_steps(engine_dir: Path) -> dict:
    """benchmarks/start_breakdown.py on the engine, with a cProfile of the backend load."""
    p = subprocess.run([sys.executable, "benchmarks/start_breakdown.py", str(engine_dir), "--profile-load"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **CHILD_ENV})
    if p.returncode != 0:
        return {"error": p.stderr[-1500:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def guard_cases(engine_dir: Path, work: Path) -> list[dict]:
    data = json.loads((engine_dir / "engine.json").read_text())
    cases = {"other sm": {"target_sm": "80", "gpu_name": "NVIDIA A100"}, "other torch": {"torch": "2.0.0"},
             "other sha256": {"engine_sha256": "0" * 64}}
    out = []
    for label, change in cases.items():
        d = work / f"guard-{label.replace(' ', '-')}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(engine_dir, d, symlinks=True)
        (d / "engine.json").write_text(json.dumps({**data, **change,
                                                   "image": {"repository": "mopt/qwen3-emb",
                                                             "tags_by_sm": {"90": "cu130-sm90"}}}))
        p, _ = cli("check", "--engine-dir", str(d), timeout=120)
        out.append({"case": label, "exit": p.returncode, "message": p.stderr.strip().splitlines()[-1:]})
        shutil.rmtree(d, ignore_errors=True)
    return out


def request_texts(a, n: int, seed: int = 1) -> list[list[str]]:
    """n requests of 8 texts of 4..120 words: the served workload, the same for raw and served runs."""
    import random

    words = "the cat is on the tree and paris is the capital of france what is the weather".split()
    rng = random.Random(seed)
    return [[" ".join(rng.choice(words) for _ in range(rng.randint(4, min(120, a.seq // 2)))) for _ in range(8)]
            for _ in range(n)]


def raw_same_workload(engine_dir: Path, requests: list[list[str]], max_batch: int) -> dict:
    """The engine in-process (tokenise + embed, no HTTP, no batcher) on the served texts, max_batch
    texts per call: what the server is measured against."""
    from builder.runtime.engine import Engine

    eng = Engine.open(engine_dir)
    texts = [t for r in requests for t in r]
    tokens = sum(len(ids) for ids in eng.encoder.encode(texts))
    for _ in range(2):  # the second pass is timed: shapes seen once, as the server's warm pass does
        t = time.monotonic()
        for i in range(0, len(texts), max_batch):
            eng.embed_texts(texts[i:i + max_batch])
    return {"raw_tok_s": round(tokens / (time.monotonic() - t)), "texts": len(texts), "tokens": tokens}


def server_bench(engine_dir: Path, a, fmt: str = "float", env: dict | None = None, client_path: str = "",
                 in_process: bool = False, port: int = 18080) -> dict:
    """The serve CLI under a.clients concurrent loopback clients, a.requests requests each (8 texts),
    responses in fmt (float JSON, or base64 as OpenAI's Python client asks), against the raw engine
    on the same texts. One full warm pass, then the timed pass. The client parses with orjson when
    client_path holds it (a Python client parsing 1M floats is a bottleneck of its own)."""
    loads = json.loads
    if client_path:
        sys.path.insert(0, client_path)
        try:
            import orjson
            loads = orjson.loads
        except ImportError:
            pass
    n = a.clients * a.requests
    requests = request_texts(a, n)
    raw = raw_same_workload(engine_dir, requests, json.loads((engine_dir / "engine.json").read_text())
                            ["params"]["max_batch"])
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "builder.runtime", "serve", "--engine-dir", str(engine_dir),
                             "--host", "127.0.0.1", "--port", str(port),
                             *(["--no-engine-process"] if in_process else [])], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                return {"error": f"server exited {proc.returncode}: {proc.stderr.read()[-1500:]}"}
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.2)
            if time.monotonic() - t0 > 300:
                return {"error": "server not healthy after 300 s"}
        ready = round(time.monotonic() - t0, 2)

        def one(texts):
            body = json.dumps({"input": texts, "model": "x", "encoding_format": fmt}).encode()
            req = urllib.request.Request(url + "/v1/embeddings", data=body,
                                         headers={"Content-Type": "application/json"})
            t = time.monotonic()
            resp = loads(urllib.request.urlopen(req, timeout=120).read())
            return time.monotonic() - t, resp["usage"]["prompt_tokens"]

        with ThreadPoolExecutor(a.clients) as ex:
            list(ex.map(one, requests))
            t = time.monotonic()
            res = list(ex.map(one, requests))
            wall = time.monotonic() - t
        lat = sorted(r[0] for r in res)
        served = sum(r[1] for r in res)
        return {"format": fmt, "env": env or {}, "engine_process": not in_process, "ready_s": ready,
                "clients": a.clients, "requests": n,
                "tok_s": round(served / wall),
                "p50_ms": round(lat[len(lat) // 2] * 1000, 1), "p99_ms": round(lat[int(len(lat) * 0.99) - 1] * 1000, 1),
                **raw, "served_over_raw": round(served / wall / raw["raw_tok_s"], 3),
                "same_tokens": served == raw["tokens"]}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.call_costs:
        os.environ["MOPT_BENCH_CALL_COSTS"] = a.call_costs  # read by mixed_workload in the engine children
    sys.path.insert(0, str(REPO))
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t_start = time.monotonic()
    res: dict = {"args": vars(a), "backend": BACKEND, "config": model_config(a.layers, a.tiny), "skipped": []}

    def save():
        (out / "bench.json").write_text(json.dumps(res, indent=2) + "\n")

    def section(name, fn, need_s):
        if time.monotonic() - t_start + need_s > a.deadline_s:
            res["skipped"].append(name)
            print(f"[{name}] skipped (deadline)", flush=True)
            return
        t = time.monotonic()
        try:
            res[name] = fn()
        except Exception as exc:  # keep the other sections' figures
            res[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(f"[{name}] {round(time.monotonic() - t, 1)} s: {json.dumps(res[name])[:600]}", flush=True)
        save()

    model_dir = make_model(work / "model", a.layers, a.tiny)
    if a.engines:
        prime_bytecode()  # for the engines' fresh processes
    section("eager", lambda: eager(model_dir, a), 30)

    def compile_step(key: str, dest: Path):
        mode, attention, backend, env = engine_spec(key)
        p, secs = cli("compile", "--model", str(model_dir), "--out", str(dest), "--backend", backend,
                      "--device", a.device, "--precision", a.precision, "--max-batch", str(a.batch),
                      "--max-seq-len", str(a.seq), "--pooling", "last", "--no-verify", "--compile-mode", mode,
                      "--attention", attention, *(["--target-sm", "90"] if a.device == "cuda" else []),
                      timeout=max(60, a.deadline_s - (time.monotonic() - t_start)), env=env)
        if p.returncode != 0:
            raise RuntimeError(p.stderr[-2000:])
        info = json.loads((dest / "engine.json").read_text())
        keep = ("backend", "target_sm", "gpu_name", "driver", "torch", "cuda", "engine_sha256", "tuned_for",
                "inductor_options")
        out = {"wall_s": secs, **{k: info[k] for k in keep if k in info},
               "engine_bytes": sum(f.stat().st_size for f in (dest / "engine").rglob("*") if f.is_file())}
        manifest = dest / "engine" / "compile_cache.json"  # torch-inductor's
        if manifest.is_file():
            data = json.loads(manifest.read_text())
            out.update(form=data.get("form"), artifact=data.get("artifact"))
        return out

    engines = {}
    for i, key in enumerate(filter(None, a.engines.split(","))):
        dest = work / f"engine-{key.replace('/', '-')}"
        section(f"compile[{key}]", lambda key=key, dest=dest: compile_step(key, dest), 60 if i == 0 else 150)
        if "error" in res.get(f"compile[{key}]", {"error": 1}):
            continue
        engines[key] = dest
        section(f"engine[{key}]", lambda dest=dest: child(dest, str(a.batch), str(a.seq)), 45)
    skip = set(a.skip.split(",")) - {""}
    for spec in filter(None, a.jit.split(",")):
        section(f"jit[{spec}]", lambda spec=spec: jit(model_dir, a, spec), 150 if "autotune" in spec else 60)
    if not engines:  # --engines "": eager and JIT only
        res["total_s"] = round(time.monotonic() - t_start, 1)
        save()
        print_table(res)
        return 0 if not a.engines else 1
    if a.profile and a.device == "cuda":
        section("profile[eager]", lambda: kernel_profile("eager", a, model_dir), 40)
        for key, dest in engines.items():
            section(f"profile[{key}]", lambda dest=dest: kernel_profile(str(dest), a), 40)
    first_key, engine = next(iter(engines.items()))
    _, attention, first_backend, first_env = engine_spec(first_key)
    if "start" not in skip:
        section("cold[again]", lambda: child(engine), 30)  # a second fresh process: the spread of the figure
        section("start_steps", lambda: start_steps(engine), 30)

    def accuracy():
        tiny = work / "tiny"
        from builder.runtime.tiny_qwen3 import make_tiny_qwen3
        make_tiny_qwen3(tiny, 0)
        texts = ["what is the capital of france ?", "paris is the capital of france .", "hello world",
                 "the cat is on the tree", "a gpu inference image must match the host"]
        (work / "texts.json").write_text(json.dumps(texts))
        rows = []
        for prec in a.accuracy_precisions.split(","):
            if a.device == "cpu" and prec != "fp32":
                continue
            p, secs = cli("compile", "--model", str(tiny), "--out", str(work / f"acc-{prec}"), "--backend",
                          first_backend, "--device", a.device, "--precision", prec, "--max-batch", "8",
                          "--max-seq-len", "64", "--pooling", "last", "--attention", attention,
                          "--reference-texts", str(work / "texts.json"), env=first_env)
            if p.returncode != 0:
                rows.append({"precision": prec, "error": p.stderr[-800:]})
                continue
            ref = json.loads((work / f"acc-{prec}" / "reference.json").read_text())
            from builder.runtime.compiler import cosine
            from builder.runtime.engine import Engine
            got = Engine.open(work / f"acc-{prec}").embed_texts(texts)  # one padded batch of mixed lengths
            cos = [cosine(x, y) for x, y in zip(got, ref["embeddings"], strict=True)]
            rows.append({"precision": prec, "backend": first_backend, "attention": attention,
                         "cos_min": round(min(cos), 6),
                         "cos_mean": round(sum(cos) / len(cos), 6), "compile_wall_s": secs})
        rows.append({"precision": "fp8", "error": f"not offered: {first_backend} has no fp8 path"})
        return rows
    if "guard" not in skip:
        section("guard", lambda: guard_cases(engine, work), 30)
    if "accuracy" not in skip:
        section("accuracy_tiny_qwen3", accuracy, 90)
    if "server" not in skip and len(engines) > a.server_engine:
        key, served = list(engines.items())[a.server_engine]
        for spec in a.servers.split(","):
            in_process = spec.endswith("!")
            rest, _, switch_ms = spec.rstrip("!").partition("@")
            fmt, _, path = rest.partition("+")
            env = {}
            if path:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))
            if switch_ms:
                env["MOPT_SWITCH_INTERVAL_MS"] = switch_ms
            section(f"server[{key} {spec}]",
                    lambda fmt=fmt, env=env, path=path, inp=in_process: server_bench(served, a, fmt, env, path, inp),
                    40)

    res["total_s"] = round(time.monotonic() - t_start, 1)
    save()
    print_table(res)
    return 0

def print_table(res: dict) -> None:
    e = res.get("eager", {})
    rows = [("eager tokens/s (batch x seq)", e.get("eager_tok_s")),
            ("eager latency 1x32 ms", e.get("eager_latency_1x32_ms"))]
    for mode in filter(None, res["args"]["engines"].split(",")):
        c, f = res.get(f"compile[{mode}]", {}), res.get(f"engine[{mode}]", {})
        rows += [(f"[{mode}] compile step s (form)", (c.get("wall_s"), c.get("form"))),
                 (f"[{mode}] engine tokens/s (batch x seq)", f.get("engine_tok_s")),
                 (f"[{mode}] engine latency 1x32 ms", f.get("engine_latency_1x32_ms")),
                 (f"[{mode}] engine mixed 8..seq tokens/s (first pass)", (f.get("mixed_tok_s"),
                                                                          f.get("mixed_first_pass_tok_s"))),
                 (f"[{mode}] fresh process -> first embedding s", f.get("first_embedding_s")),
                 (f"[{mode}]   of which import torch s", f.get("import_torch_s")),
                 (f"[{mode}]   load path", f.get("load_path"))]
    cold = res.get("cold[again]", {})
    rows.append(("first engine, again: first embedding s (import torch)", (cold.get("first_embedding_s"),
                                                                            cold.get("import_torch_s"))))
    rows.append(("first engine, start steps s", res.get("start_steps", {}).get("steps_s")))
    for spec in filter(None, res["args"]["jit"].split(",")):
        j = res.get(f"jit[{spec}]", {})
        rows.append((f"torch.compile JIT [{spec}] tokens/s, warm-up s", (j.get("jit_tok_s"), j.get("warmup_s"))))
        rows.append((f"torch.compile JIT [{spec}] mixed tokens/s (first pass)", (j.get("mixed_tok_s"),
                                                                                 j.get("mixed_first_pass_tok_s"))))
    rows += [(f"{k} tokens/s, raw, ratio, p50/p99 ms", (v.get("tok_s"), v.get("raw_tok_s"), v.get("served_over_raw"),
                                                        v.get("p50_ms"), v.get("p99_ms")))
             for k, v in res.items() if k.startswith("server[")]
    for k, v in rows:
        print(f"{k:48s} {v}")
    for g in res.get("guard", []) if isinstance(res.get("guard"), list) else []:
        print(f"guard {g['case']:12s} exit {g['exit']}: {g['message']}")
    for r in res.get("accuracy_tiny_qwen3", []) if isinstance(res.get("accuracy_tiny_qwen3"), list) else []:
        print("accuracy", r)
    for key in [k for k in res if k.startswith("profile[")]:
        print(key, res[key].get("ms_per_call"), "ms per call", *res[key].get("top", [])[:12], sep="\n  ")


if __name__ == "__main__":
    sys.exit(main())
