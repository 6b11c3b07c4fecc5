"""Packed against padded engines, side by side in one process, for one model family.

    PYTHONUNBUFFERED=1 CXX=g++ python3 benchmarks/packed_bench.py --family qwen3|bert|xlmr --out $OUT \
        [--layers N] [--device cuda|cpu] [--precision bf16] [--batch 64] [--seq 512] [--forms padded,packed]

A form is an input form (padded, packed) with options after colons: `packed:unfused` compiles with
MOPT_FUSED_QK=0 (transformers' q/k norm and rotation instead of the fused kernel, fused_qk.py),
`packed:unmerged` with MOPT_MERGED_PROJ=0 (q/k/v and gate/up as separate layers; merged, the default since
2026-12-06, each group is one layer, merged.py; `packed:merged` says so explicitly), `:static` with
MOPT_FP8_SCALES=static (fp8 inputs scaled by calibrated ranges, quantize.py), `:triton` / `:flash` with
MOPT_VARLEN_KERNEL (packed attention's kernel: mopt's Triton kernel or aten's flash, varlen_attention.py),
and a precision (`packed:fp8`) overrides --precision for that engine. The engines compile in parallel, one
process each (the compile is mostly CPU work; the machine's cores are many).

Builds a random-weight model of the family's shape (qwen3: Qwen3-Embedding-0.6B, a causal decoder with
last-token pooling; bert: BERT-base, 12 layers, hidden 768, a bidirectional encoder with mean pooling,
the shape of bge/e5/gte; xlmr: XLM-R-large, 24 layers, hidden 1024, positions from padding_idx + 1,
CLS pooling, the shape of bge-m3 and multilingual-e5-large), compiles one torch-aot engine per input form with
`python -m builder.runtime compile` (the image's compile step, accuracy check included), and times
on the same GPU in one process, in real (unpadded) tokens per second:
  fixed       BATCH x SEQ, every row full
  half        BATCH x SEQ with half the rows half as long (padded forms pay for the padding)
  small       16 x 128
  batch1      1 x 32 (latency, ms)
  lognormal   512 texts, log-normal lengths (median 58 tokens, sigma 1, 8..SEQ), through Engine.embed_ids
              as the server calls it (padded: length-sorted calls cut by engine.plan_calls)
for eager transformers (padded, SDPA), torch.compile of the same eager module (dynamic shapes, its
first calls of each shape not timed), and each engine. Prints a table and writes packed_bench.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.gpu_bench import QWEN3_06B  # noqa: E402

BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2)
# XLM-R-large (bge-m3, multilingual-e5-large): positions from padding_idx + 1 (families.yaml). Its pad id is
# 600, above every id the offline tokenizer produces (transformers' eager positions skip pad tokens, so a
# real token with that id would be numbered apart), and the position table is longer by as much
# (602 + 512 rows instead of 514): the same offset arithmetic, the same compute.
XLMR_LARGE = dict(vocab_size=250002, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                  intermediate_size=4096, max_position_embeddings=1114, type_vocab_size=1, pad_token_id=600)
FAMILIES = {"qwen3": {"pooling": "last", "attention": "causal"}, "bert": {"pooling": "mean", "attention": "mask"},
            "xlmr": {"pooling": "cls", "attention": "mask"}}
DEFAULT_LAYERS = {"qwen3": 28, "bert": 12, "xlmr": 24}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILIES), required=True)
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/mopt-packed-bench")
    p.add_argument("--layers", type=int, default=0, help="default: the family's (28 qwen3, 12 bert, 24 xlmr)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--forms", default="padded,packed")
    p.add_argument("--max-seqs", type=int, default=0, help="packed engines: the sequence cap of a call (default "
                   "--batch); their token budget is BATCH x SEQ either way")
    p.add_argument("--no-jit", action="store_true", help="leave out torch.compile")
    p.add_argument("--no-eager", action="store_true", help="leave out eager transformers (and torch.compile)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of each case (the best is kept)")
    p.add_argument("--min-cosine", type=float, default=None, help="the compile step's gate (default its own); "
                   "-1 keeps every engine for timing, its cosine still reported")
    p.add_argument("--profile", action="store_true", help="the top CUDA kernels of each engine at BATCH x SEQ")
    return p.parse_args(argv)


def make_model(dest: Path, family: str, layers: int) -> Path:
    """Random weights (seed 0) of the family's shape, with the tiny Qwen3's offline tokenizer (ids below
    every vocab here; the Hub is out of reach)."""
    import torch
    from transformers import BertConfig, BertModel, Qwen3Config, Qwen3Model, XLMRobertaConfig, XLMRobertaModel

    from builder.runtime.tiny_qwen3 import make_tiny_qwen3

    make_tiny_qwen3(dest, 0)
    eos = json.loads((dest / "config.json").read_text())["eos_token_id"]
    torch.manual_seed(0)
    if family == "qwen3":
        cfg = Qwen3Config(**dict(QWEN3_06B, num_hidden_layers=layers), bos_token_id=eos, eos_token_id=eos,
                          pad_token_id=eos)
        model = Qwen3Model(cfg)
    elif family == "xlmr":
        model = XLMRobertaModel(XLMRobertaConfig(**dict(XLMR_LARGE, num_hidden_layers=layers)), add_pooling_layer=False)
    else:
        model = BertModel(BertConfig(**dict(BERT_BASE, num_hidden_layers=layers), pad_token_id=eos))
    model.to(torch.bfloat16).eval().save_pretrained(dest, safe_serialization=True)
    return dest


PRECISIONS = ("bf16", "fp16", "fp32", "fp8", "int8")
SWITCHES = {"unfused": ("MOPT_FUSED_QK", "0"), "merged": ("MOPT_MERGED_PROJ", "1"),  # form option -> variable
            "unmerged": ("MOPT_MERGED_PROJ", "0"),
            "static": ("MOPT_FP8_SCALES", "static"),
            "flash": ("MOPT_VARLEN_KERNEL", "flash"), "triton": ("MOPT_VARLEN_KERNEL", "triton")}


def form_options(form: str, a) -> tuple[str, str, dict]:
    """`packed:unfused:fp8` -> (input form, precision, extra environment)."""
    base, *options = form.split(":")
    unknown = [o for o in options if o not in SWITCHES and o not in PRECISIONS]
    if base not in ("padded", "packed") or unknown:
        raise SystemExit(f"packed_bench: unknown form {form!r}")
    precision = next((o for o in options if o in PRECISIONS), a.precision)
    return base, precision, dict(SWITCHES[o] for o in options if o in SWITCHES)


def start_compile(model: Path, out: Path, a, form: str):
    """The compile step for one form, started (Popen) with its argv's start time."""
    fam = FAMILIES[a.family]
    base, precision, env = form_options(form, a)
    args = [sys.executable, "-m", "builder.runtime", "compile", "--model", str(model), "--out", str(out),
            "--backend", "torch-aot", "--device", a.device, "--precision", precision,
            "--max-seq-len", str(a.seq), "--pooling", fam["pooling"], "--normalize", "--input", base]
    if base == "packed":
        args += ["--max-batch", str(a.max_seqs or a.batch), "--max-batch-tokens", str(a.batch * a.seq)]
    else:
        args += ["--max-batch", str(a.batch)]
    if base == "padded" and fam["attention"] == "causal":
        args += ["--attention", "causal"]
    if a.min_cosine is not None:
        args += ["--min-cosine", str(a.min_cosine)]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **env)), time.monotonic()


def finish_compile(started, out: Path, a, form: str) -> dict:
    proc, t = started
    try:
        stdout, stderr = proc.communicate(timeout=max(1, 900 - (time.monotonic() - t)))
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        log = Path(a.out) / f"compile-{a.family}-{form.replace(':', '-')}.log"
        log.write_text(stderr)
        lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("frame #")]
        return {"error": "\n".join(lines[-12:]), "log": log.name}
    summary = json.loads(stdout.strip().splitlines()[-1])
    engine = json.loads((out / "engine.json").read_text())
    return {"compile_s": round(time.monotonic() - t, 1), "engine_min_cosine": summary.get("engine_min_cosine"),
            "accuracy_by_length": engine.get("accuracy_by_length"), "accuracy": engine.get("accuracy"),
            "fused": engine.get("fused"), "merged": engine.get("merged"), "fp8": engine.get("fp8")}


def lognormal_lengths(seq: int, texts: int, rng) -> list[int]:
    return [min(seq, max(8, round(rng.lognormvariate(math.log(58), 1.0)))) for _ in range(texts)]


def padded_case(b: int, s: int, half: bool, device: str):
    import torch

    ids = torch.randint(2, 500, (b, s), device=device)
    mask = torch.ones_like(ids)
    lengths = [s] * b
    if half:
        for r in range(1, b, 2):
            mask[r, s // 2:] = 0
            lengths[r] = s // 2
    return ids, mask, lengths


def timed(call, sync, rounds: int, repeat: int) -> float:
    """Best mean seconds per call over rounds of `repeat` calls, after two untimed ones."""
    call()
    call()
    sync()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(repeat):
            call()
        sync()
        best = min(best, (time.perf_counter() - t) / repeat)
    return best


def measure(name: str, a, padded_call, engine=None) -> dict:
    """padded_call(ids, mask) for eager/JIT/padded engines; engine: an Engine (packed or padded) whose
    embed path the log-normal case and, for packed engines, the fixed shapes go through."""
    import torch

    from builder.runtime.backends import dense_packing
    from builder.runtime.packed import pack

    dev = a.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    packed = engine is not None and engine.params.packed
    res = {}
    cases = {"fixed": (a.batch, a.seq, False), "half": (a.batch, a.seq, True), "small": (16, 128, False),
             "batch1": (1, 32, False)}
    for case, (b, s, half) in cases.items():
        ids, mask, lengths = padded_case(b, s, half, dev)
        if packed:
            seqs = [row[:n].tolist() for row, n in zip(ids, lengths, strict=True)]
            inputs = tuple(t.to(dev) for t in pack(seqs, dense_packing(engine.params)))
            call = lambda inputs=inputs: engine.run(*inputs)  # noqa: E731
        else:
            call = lambda ids=ids, mask=mask: padded_call(ids, mask)  # noqa: E731
        with torch.no_grad():
            dt = timed(call, sync, a.rounds, 20 if b * s <= 4096 else 5)
        res[case] = round(dt * 1000, 3) if case == "batch1" else round(sum(lengths) / dt)
    if engine is not None:
        rng = random.Random(0)
        seqs = [[rng.randrange(2, 500) for _ in range(n)] for n in lognormal_lengths(a.seq, 512, rng)]
        engine.embed_tensor(seqs)  # every call shape once
        best = min(_once(engine.embed_tensor, seqs) for _ in range(a.rounds))
        res["lognormal"] = round(sum(map(len, seqs)) / best)
    print(f"{name:28s} " + "  ".join(f"{k} {v:,}" for k, v in res.items()), flush=True)
    return res


def save(out: Path, report: dict) -> None:
    (out / f"packed_bench_{report['family']}.json").write_text(json.dumps(report, indent=1) + "\n")


def _once(fn, arg) -> float:
    t = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t


def padded_engine(module_call, model_dir: Path, a, dim: int):
    """An eager or JIT module behind Engine (length-sorted calls, plan_calls), as the server runs one."""
    import torch

    from builder.runtime.engine import Engine
    from builder.runtime.params import EngineParams
    from builder.runtime.tokenization import TextEncoder

    fam = FAMILIES[a.family]
    params = EngineParams(backend="torch-aot", device=a.device, precision=a.precision, pooling=fam["pooling"],
                          max_batch=a.batch, max_seq_len=a.seq)

    def run(ids, mask):
        with torch.no_grad():
            return module_call(ids.to(a.device), mask.to(a.device)).float().cpu()

    encoder = TextEncoder(model_dir, params.pooling, params.instruction, params.pad_left)
    return Engine(params, encoder, run, {"embedding_dim": dim})


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from builder.runtime.backends.torch_common import DTYPES, build_module
    from builder.runtime.engine import Engine
    from builder.runtime.params import EngineParams

    layers = a.layers or DEFAULT_LAYERS[a.family]
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(work / f"{a.family}-{layers}", a.family, layers)
    fam = FAMILIES[a.family]
    report = {"family": a.family, "layers": layers, "device": a.device, "precision": a.precision,
              "batch": a.batch, "seq": a.seq, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
              "command": " ".join(["benchmarks/packed_bench.py", *(argv or sys.argv[1:])]), "compile": {},
              "results": {}}
    forms = [f for f in a.forms.split(",") if f]
    engines = {form: work / f"engine-{a.family}-{form.replace(':', '-')}" for form in forms}
    started = {form: start_compile(model, engines[form], a, form) for form in forms}
    for form in forms:
        report["compile"][form] = finish_compile(started[form], engines[form], a, form)
        print(f"compile {form}: {report['compile'][form]}", flush=True)
    if not a.no_eager:
        params = EngineParams(backend="torch-aot", device=a.device, precision=a.precision, pooling=fam["pooling"],
                              max_batch=a.batch, max_seq_len=a.seq)
        eager = build_module(str(model), params, DTYPES[a.precision], a.device, model_rotary=True)
        dim = eager.body.config.hidden_size
        report["results"]["eager"] = measure("eager", a, eager, padded_engine(eager, model, a, dim))
        if not a.no_jit:
            jit = torch.compile(eager, dynamic=True)
            report["results"]["torch.compile"] = measure("torch.compile (dynamic)", a, jit,
                                                         padded_engine(jit, model, a, dim))
        del eager
    for form in forms:
        if "error" in report["compile"][form]:
            continue
        engine = Engine.open(engines[form])
        report["results"][f"engine {form}"] = measure(f"engine {form}", a, engine.run, engine)
        if a.profile and a.device == "cuda":
            from benchmarks.gpu_bench import profile_calls
            from builder.runtime.backends import dense_packing
            from builder.runtime.packed import pack

            ids, mask, _ = padded_case(a.batch, a.seq, False, "cpu")
            if engine.params.input_form == "packed":
                inputs = pack([row.tolist() for row in ids], dense_packing(engine.params))
            else:  # a padded engine takes the ids and their mask
                inputs = (ids, mask)
            inputs = tuple(t.to(a.device) for t in inputs)
            call = partial(engine.run, *inputs)
            report["results"][f"engine {form}"]["profile"] = profile_calls(call)
        del engine
        save(out, report)  # after each engine: a run cut off by its time limit keeps what it measured
    save(out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
