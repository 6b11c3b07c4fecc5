"""GPU benchmark of the in-image runtime, through the image's own entry points.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_bench.py --out $OUT [--layers 28] [--deadline-s 540]

Builds a Qwen3-Embedding-0.6B-architecture model (random weights, seed 0; the Hub is unreachable),
compiles it with `python -m builder.runtime compile --backend torch-inductor --device cuda`,
then measures: eager vs engine throughput (64 x 512) and latency (1 x 32), a mixed-length
workload, cold start of a fresh process (prebuilt engine) vs the compile step, accuracy (early, as
it is cheap), the HTTP server
under concurrent loopback clients, the guard refusing altered engine.json files, and accuracy of
engines built from the tiny Qwen3 (real tokenizer) vs its fp32 eager reference. Sections that
would pass --deadline-s are skipped and recorded as such. Prints a table, writes bench.json.
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
    p.add_argument("--compile-modes", default="default,max-autotune-no-cudagraphs",
                   help="engines to build and measure, in order (later ones only if the deadline allows)")
    p.add_argument("--jit", action="store_true", help="also time torch.compile JIT (minutes of warm-up)")
    a = p.parse_args(argv)
    if a.device == "cpu" and a.precision != "fp32":
        p.error("--device cpu needs --precision fp32")
    return a


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
eng = Engine.open(sys.argv[1])
t_open = time.monotonic() - t0
first = eng.embed_texts(["hello world"])
t_first = time.monotonic() - t0
import builder.runtime.backends.torch_inductor as tcc
res = {"load_path": tcc.LAST_LOAD_PATH, "import_torch_s": round(t_import, 2), "first_embedding_s": round(t_first, 2),
       "beyond_import_s": round(t_first - t_import, 2), "open_s": round(t_open - t_import, 2),
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
    import random
    rng = random.Random(0)
    seqs = [[rng.randrange(2, 500) for _ in range(rng.randint(8, s))] for _ in range(512)]
    eng.embed_ids(seqs[:64])
    t = time.monotonic(); eng.embed_ids(seqs); dt = time.monotonic() - t
    res["mixed_tok_s"] = round(sum(map(len, seqs)) / dt); res["mixed_texts"] = len(seqs)
print("CHILD " + json.dumps(res), flush=True)
'''


def child(engine_dir: Path, *extra: str, timeout=600) -> dict:
    p = subprocess.run([sys.executable, "-c", COLD_CHILD, str(engine_dir), *extra], cwd=REPO, capture_output=True,
                       text=True, timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("CHILD "):
            return json.loads(line[6:])
    return {"error": f"rc {p.returncode}: {p.stderr[-1500:]}"}


def _module(model_dir: Path, a):
    """The eager embedding module of the benchmarked model, the way the backends build it."""
    from builder.runtime.backends.torch_aot import DTYPES, build_module
    from builder.runtime.params import EngineParams

    params = EngineParams(device=a.device, precision=a.precision, pooling="last", max_batch=a.batch,
                          max_seq_len=a.seq, backend=BACKEND)
    return build_module(str(model_dir), params, DTYPES[a.precision], a.device)


def _timed(m, a, b: int, s: int, n: int) -> tuple[float, float]:
    """(seconds of the first call, mean seconds of the next n) on random ids of shape b x s."""
    import torch

    ids = torch.randint(0, 500, (b, s), device=a.device)
    mask = torch.ones_like(ids)
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

    m = _module(model_dir, a)
    out = {"eager_tok_s": round(a.batch * a.seq / _timed(m, a, a.batch, a.seq, 10)[1]),
           "eager_latency_1x32_ms": round(_timed(m, a, 1, 32, 50)[1] * 1000, 3)}
    m = None  # free the eager copy before the engine runs
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return out


def jit(model_dir: Path, a) -> dict:
    """torch.compile JIT on the same model and batch (static shape), in this process: warm-up and speed."""
    import torch

    mode = a.compile_modes.split(",")[-1]
    warm, dt = _timed(torch.compile(_module(model_dir, a), mode=mode), a, a.batch, a.seq, 10)
    return {"mode": mode, "warmup_s": round(warm, 1), "jit_tok_s": round(a.batch * a.seq / dt)}


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
    eng.embed_texts(texts[:max_batch])  # warm
    t = time.monotonic()
    for i in range(0, len(texts), max_batch):
        eng.embed_texts(texts[i:i + max_batch])
    return {"raw_tok_s": round(tokens / (time.monotonic() - t)), "texts": len(texts), "tokens": tokens}


def server_bench(engine_dir: Path, a, port: int = 18080) -> dict:
    n = a.clients * a.requests
    warm, requests = request_texts(a, a.clients, seed=2), request_texts(a, n)
    raw = raw_same_workload(engine_dir, requests, json.loads((engine_dir / "engine.json").read_text())
                            ["params"]["max_batch"])
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "builder.runtime", "serve", "--engine-dir", str(engine_dir),
                             "--host", "127.0.0.1", "--port", str(port)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
            body = json.dumps({"input": texts, "model": "x"}).encode()
            req = urllib.request.Request(url + "/v1/embeddings", data=body,
                                         headers={"Content-Type": "application/json"})
            t = time.monotonic()
            resp = json.loads(urllib.request.urlopen(req, timeout=120).read())
            return time.monotonic() - t, resp["usage"]["prompt_tokens"]

        with ThreadPoolExecutor(a.clients) as ex:
            list(ex.map(one, warm))
            t = time.monotonic()
            res = list(ex.map(one, requests))
            wall = time.monotonic() - t
        lat = sorted(r[0] for r in res)
        served = sum(r[1] for r in res)
        return {"ready_s": ready, "clients": a.clients, "requests": n, "tok_s": round(served / wall),
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
    engine = work / "engine"
    section("eager", lambda: eager(model_dir, a), 30)

    def compile_step(mode: str, dest: Path):
        p, secs = cli("compile", "--model", str(model_dir), "--out", str(dest), "--backend", BACKEND,
                      "--device", a.device, "--precision", a.precision, "--max-batch", str(a.batch),
                      "--max-seq-len", str(a.seq), "--pooling", "last", "--no-verify", "--compile-mode", mode,
                      *(["--target-sm", "90"] if a.device == "cuda" else []),
                      timeout=max(60, a.deadline_s - (time.monotonic() - t_start)))
        if p.returncode != 0:
            raise RuntimeError(p.stderr[-2000:])
        info = json.loads((dest / "engine.json").read_text())
        keep = ("target_sm", "gpu_name", "driver", "torch", "cuda", "engine_sha256")
        manifest = json.loads((dest / "engine" / "compile_cache.json").read_text())
        return {"wall_s": secs, **{k: info[k] for k in keep}, "form": manifest.get("form"),
                "artifact": manifest.get("artifact")}

    engines = {}
    for i, mode in enumerate(a.compile_modes.split(",")):
        dest = work / f"engine-{mode}"
        section(f"compile[{mode}]", lambda mode=mode, dest=dest: compile_step(mode, dest), 60 if i == 0 else 150)
        if "error" in res.get(f"compile[{mode}]", {"error": 1}):
            continue
        engines[mode] = dest
        section(f"engine[{mode}]", lambda dest=dest: child(dest, str(a.batch), str(a.seq)), 45)
    if not engines:
        save()
        return 1
    engine = next(iter(engines.values()))
    if a.jit:
        section("jit", lambda: jit(model_dir, a), 150)
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
            p, secs = cli("compile", "--model", str(tiny), "--out", str(work / f"acc-{prec}"), "--backend", BACKEND,
                          "--device", a.device, "--precision", prec, "--max-batch", "8", "--max-seq-len", "64",
                          "--pooling", "last", "--reference-texts", str(work / "texts.json"))
            if p.returncode != 0:
                rows.append({"precision": prec, "error": p.stderr[-800:]})
                continue
            ref = json.loads((work / f"acc-{prec}" / "reference.json").read_text())
            from builder.runtime.compiler import cosine
            from builder.runtime.engine import Engine
            got = Engine.open(work / f"acc-{prec}").embed_texts(texts)
            cos = [cosine(x, y) for x, y in zip(got, ref["embeddings"], strict=True)]
            rows.append({"precision": prec, "cos_min": round(min(cos), 6), "cos_mean": round(sum(cos) / len(cos), 6),
                         "compile_wall_s": secs})
        rows.append({"precision": "fp8", "error": "not offered: torch-inductor has no fp8 path"})
        return rows
    section("guard", lambda: guard_cases(engine, work), 30)
    section("accuracy_tiny_qwen3", accuracy, 90)
    section("server", lambda: server_bench(engine, a), 60)

    res["total_s"] = round(time.monotonic() - t_start, 1)
    save()
    print_table(res)
    return 0


def print_table(res: dict) -> None:
    e = res.get("eager", {})
    rows = [("eager tokens/s (batch x seq)", e.get("eager_tok_s")),
            ("eager latency 1x32 ms", e.get("eager_latency_1x32_ms"))]
    for mode in res["args"]["compile_modes"].split(","):
        c, f = res.get(f"compile[{mode}]", {}), res.get(f"engine[{mode}]", {})
        rows += [(f"[{mode}] compile step s (form)", (c.get("wall_s"), c.get("form"))),
                 (f"[{mode}] engine tokens/s (batch x seq)", f.get("engine_tok_s")),
                 (f"[{mode}] engine latency 1x32 ms", f.get("engine_latency_1x32_ms")),
                 (f"[{mode}] engine mixed 8..seq tokens/s", f.get("mixed_tok_s")),
                 (f"[{mode}] fresh process -> first embedding s", f.get("first_embedding_s")),
                 (f"[{mode}]   of which import torch s", f.get("import_torch_s")),
                 (f"[{mode}]   load path", f.get("load_path"))]
    j = res.get("jit", {})
    rows += [("torch.compile JIT tokens/s, warm-up s", (j.get("jit_tok_s"), j.get("warmup_s"))),
             ("server tokens/s (raw engine, same texts; ratio)", (res.get("server", {}).get("tok_s"),
                                                                  res.get("server", {}).get("raw_tok_s"),
                                                                  res.get("server", {}).get("served_over_raw"))),
             ("server p50 / p99 ms", (res.get("server", {}).get("p50_ms"), res.get("server", {}).get("p99_ms")))]
    for k, v in rows:
        print(f"{k:48s} {v}")
    for g in res.get("guard", []) if isinstance(res.get("guard"), list) else []:
        print(f"guard {g['case']:12s} exit {g['exit']}: {g['message']}")
    for r in res.get("accuracy_tiny_qwen3", []) if isinstance(res.get("accuracy_tiny_qwen3"), list) else []:
        print("accuracy", r)


if __name__ == "__main__":
    sys.exit(main())
