"""Served against raw, side by side in one run, on one log-normal workload: what the HTTP server lets
through of the engine's speed.

    PYTHONUNBUFFERED=1 CXX=g++ python3 benchmarks/served_vs_raw.py --out $OUT            # H200: Qwen3-0.6B shape
    .venv/bin/python benchmarks/served_vs_raw.py --tiny --device cpu --out /tmp/svr      # this machine
    ... --engine-dir DIR                    # an engine compiled already
    ... --old-runtime DIR                   # also serve with another checkout's builder/runtime (the old server)

The engine: a packed torch-aot engine (bf16 on CUDA) of Qwen3-Embedding-0.6B's shape with random
weights (benchmarks/packed_bench.py's model: no hub here), or the tiny Qwen3 with --tiny.
The workload: TEXTS texts whose token counts are log-normal (median 58, sigma 1, 8..max_seq_len), the
same texts for every case. Raw: the engine in-process on those texts' token ids, in calls of max_batch
texts (tokenizing not timed): the engine's own speed. Served: `python -m builder.runtime serve` (the
engine in its worker process, as in the images) under closed-loop clients on loopback, each sending
INPUTS texts per request for DURATION seconds after a warm-up; the clients are asyncio HTTP/1.1
keep-alive loops spread over several processes, so the load generator is not what limits. Cases:
32 clients x 16 inputs, 32 x 1 and 256 x 1 (the issue's goals: >= 0.9, >= 0.4, >= 0.7 of raw).
Prints and writes served_vs_raw.json: tokens/s, the ratio to raw, requests/s, p50/p99 latency.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = ("the cat is on the tree and paris is the capital of france what is the weather today in the "
         "north of the country where rivers run to the sea").split()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/mopt-served-vs-raw")
    p.add_argument("--engine-dir", default=None)
    p.add_argument("--tiny", action="store_true", help="the tiny Qwen3 instead of the 0.6B shape")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--texts", type=int, default=4096)
    p.add_argument("--duration", type=float, default=10.0, help="seconds each served case is timed")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--cases", default="32x16,32x1,256x1", help="CLIENTSxINPUTS, comma-separated")
    p.add_argument("--procs", type=int, default=0, help="client processes (default: min(8, cores/2))")
    p.add_argument("--format", choices=("float", "base64"), default="float")
    p.add_argument("--serve-args", default="", help="more flags for serve, e.g. '--max-wait-ms 0'")
    p.add_argument("--variants", default="", help="NAME=SERVE_ARGS;NAME=SERVE_ARGS...: more servers of this "
                   "runtime with other flags, each timed on every case; a NAME starting 'old' serves --old-runtime "
                   "(interleave them: the order of servers in one run shows in the figures)")
    p.add_argument("--old-runtime", default=None, help="a checkout whose builder/runtime is also served")
    p.add_argument("--port", type=int, default=18090)
    p.add_argument("--compile-graphs", default=None, help="MOPT_CUDA_GRAPHS for the compile step (its "
                   "fresh-process load check)")
    p.add_argument("--py-spy", default="", help="CASE (e.g. 32x1): record the first server's processes with "
                   "py-spy (on-CPU samples, folded stacks) through that case, into OUT/pyspy_CASE.txt")
    p.add_argument("--latency", action="store_true", help="also time single engine calls with and without "
                   "CUDA graphs (in-process)")
    return p.parse_args(argv)


def make_engine(a, work: Path) -> Path:
    out = work / "engine"
    if (out / "engine.json").is_file():
        return out
    if a.tiny:
        from builder.runtime.tiny_qwen3 import make_tiny_qwen3

        model = make_tiny_qwen3(work / "model", 0)
        precision = "fp32" if a.device == "cpu" else "bf16"
    else:
        from benchmarks.packed_bench import make_model

        model = make_model(work / "model", "qwen3", a.layers)
        precision = "bf16"
    args = [sys.executable, "-m", "builder.runtime", "compile", "--model", str(model), "--out", str(out),
            "--backend", "torch-aot", "--device", a.device, "--precision", precision, "--max-seq-len", "512",
            "--max-batch", "64", "--max-batch-tokens", str(64 * 512), "--pooling", "last", "--normalize",
            "--input", "packed"]
    t = time.monotonic()
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **({"MOPT_CUDA_GRAPHS": a.compile_graphs} if a.compile_graphs else {})})
    if proc.returncode != 0:
        raise SystemExit(f"compile failed:\n{proc.stderr[-3000:]}")
    print(f"compiled in {time.monotonic() - t:.0f}s", flush=True)
    return out


def workload(engine_dir: Path, n: int) -> tuple[list[str], list[int]]:
    """n texts with log-normal token counts, and each one's token count (as the server counts them)."""
    from builder.runtime.engine import engine_encoder
    from builder.runtime.fingerprint import read
    from builder.runtime.params import EngineParams

    params = EngineParams.from_dict(read(engine_dir)["params"])
    enc = engine_encoder(engine_dir, params)
    rng = random.Random(0)
    texts = []
    for _ in range(n):
        target = min(params.max_seq_len - 2, max(8, round(rng.lognormvariate(math.log(58), 1.0))))
        texts.append(" ".join(rng.choice(WORDS) for _ in range(target)))
    lengths = [len(ids) for ids in enc.encode(texts)]
    return texts, lengths


def call_latency(engine_dir: Path, texts: list[str]) -> dict:
    """One engine call's time (median of 20, in-process) at a few call sizes, with the CUDA graphs and
    without: what a graph saves per call."""
    import statistics

    from builder.runtime import cudagraphs
    from builder.runtime.engine import Engine

    out = {}
    for graphs in ("1", "0"):
        os.environ[cudagraphs.ENV] = graphs
        t = time.perf_counter()
        eng = Engine.open(engine_dir)
        row = {"load_s": round(time.perf_counter() - t, 2), "graphed": bool(getattr(eng.run, "cuda_graphs", False))}
        seqs = eng.encoder.encode(texts[:64])
        for n in (1, 8, 16, 32, 64):
            times = []
            for _ in range(22):
                t = time.perf_counter()
                eng.embed_tensor(seqs[:n])
                times.append(time.perf_counter() - t)
            row[f"{n}_texts_ms"] = round(statistics.median(times[2:]) * 1000, 3)
        if graphs == "1":
            reference = eng.embed_tensor(seqs)
        else:
            got = eng.embed_tensor(seqs)
            import torch

            row["cosine_vs_graphed_min"] = round(float(torch.nn.functional.cosine_similarity(got, reference).min()), 6)
        eng.close()
        out["graphs" if graphs == "1" else "direct"] = row
        print(json.dumps({"latency": out}), flush=True)
    os.environ.pop(cudagraphs.ENV, None)
    return out


def raw_engine(engine_dir: Path, texts: list[str]) -> dict:
    """The engine in-process on the workload's token ids, max_batch texts per call (twice: the second timed)."""
    from builder.runtime.engine import Engine

    eng = Engine.open(engine_dir)
    seqs = eng.encoder.encode(texts)
    tokens = sum(len(s) for s in seqs)
    step = eng.params.max_batch
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for i in range(0, len(seqs), step):
            eng.embed_tensor(seqs[i:i + step])
        best = max(best, tokens / (time.perf_counter() - t))
    eng.close()
    return {"raw_tok_s": round(best), "tokens": tokens, "texts": len(texts), "max_batch": step}


# --- the load generator --------------------------------------------------------------------------------

def _body(texts: list[str], fmt: str) -> bytes:
    return json.dumps({"input": texts, "model": "m", "encoding_format": fmt}).encode()


async def _client(port: int, requests: list[tuple[bytes, int]], start: int, step: int, stop_at: float,
                  warm_until: float, out: list) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = start
    try:
        while time.monotonic() < stop_at:
            body, tokens = requests[i % len(requests)]
            i += step
            head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            t = time.monotonic()
            writer.write(head + body)
            status_line = await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            done = time.monotonic()
            if t >= warm_until:
                out.append((done - t, tokens, status_line[9:12] == b"200", done))
    finally:
        writer.close()


def _client_process(port, requests, clients, first, step_all, stop_at, warm_until, queue) -> None:
    out: list = []

    async def main():
        await asyncio.gather(*(_client(port, requests, first + k, step_all, stop_at, warm_until, out)
                               for k in range(clients)))

    try:
        asyncio.run(main())
    except Exception as exc:  # noqa: BLE001
        queue.put({"error": f"{type(exc).__name__}: {exc}"})
        return
    queue.put({"results": out})


def load(port: int, texts: list[str], lengths: list[int], clients: int, inputs: int, a) -> dict:
    requests = []
    for i in range(0, len(texts) - inputs + 1, inputs):
        requests.append((_body(texts[i:i + inputs], a.format), sum(lengths[i:i + inputs])))
    procs = a.procs or max(1, min(8, (os.cpu_count() or 2) // 2))
    procs = min(procs, clients)
    now = time.monotonic()
    warm_until, stop_at = now + a.warmup, now + a.warmup + a.duration
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    workers, first = [], 0
    for p in range(procs):
        n = clients // procs + (1 if p < clients % procs else 0)
        proc = ctx.Process(target=_client_process, args=(port, requests, n, first, clients, stop_at, warm_until,
                                                         queue))
        proc.start()
        workers.append(proc)
        first += n
    results, errors = [], []
    for _ in workers:
        got = queue.get(timeout=a.warmup + a.duration + 120)
        (errors.append(got["error"]) if "error" in got else results.extend(got["results"]))
    for proc in workers:
        proc.join(30)
    ok = [r for r in results if r[2]]
    if not ok:
        return {"error": errors or "no successful request"}
    span = max(r[3] for r in ok) - min(r[3] - r[0] for r in ok)
    lat = sorted(r[0] for r in ok)
    return {"clients": clients, "inputs": inputs, "requests": len(ok), "failed": len(results) - len(ok),
            "errors": errors[:3], "tok_s": round(sum(r[1] for r in ok) / span), "req_s": round(len(ok) / span, 1),
            "p50_ms": round(lat[len(lat) // 2] * 1000, 2), "p99_ms": round(lat[min(len(lat) - 1,
                                                                                 int(len(lat) * 0.99))] * 1000, 2)}


def thread_cpu(pid: int) -> dict:
    """CPU seconds of every thread of pid and its children: {"pid/tid name": seconds} (/proc, Linux)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            out[f"{p}/{task.name} {name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def busiest(before: dict, after: dict, wall: float, top: int = 6) -> list:
    """The threads that used most CPU between two thread_cpu() readings, as shares of wall time."""
    used = sorted(((after[k] - before.get(k, 0.0)) / wall, k) for k in after)
    return [[k, round(share, 3)] for share, k in reversed(used[-top:]) if share > 0.01]


def py_spy(pid: int, seconds: float, out: Path):
    """py-spy recording pid and its children for seconds (None when py-spy is not there)."""
    near = [Path(sys.executable).parent / "py-spy", *(Path(d) / "bin" / "py-spy" for d in sys.path)]
    exe = shutil.which("py-spy") or next((str(p) for p in near if p.exists()), None)
    if exe is None:
        print("py-spy not found: no profile", flush=True)
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--subprocesses", "--rate", "250", "--threads",
                             "--duration", str(int(seconds)), "--format", "raw", "--nonblocking", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def scrape(port: int) -> dict:
    """Batch count and size, and the engine's running seconds, from the server's /metrics (the old
    server has no engine seconds)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        for name in ("mopt_batch_size_sum", "mopt_batch_size_count", "mopt_engine_seconds_total"):
            if line.startswith(name + " "):
                out[name] = float(line.split()[1])
    return out


def serve(engine_dir: Path, port: int, extra: list[str], pythonpath: str | None):
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "builder.runtime", "serve", "--engine-dir", str(engine_dir),
                             "--host", "127.0.0.1", "--port", str(port), "--max-inputs", "256",
                             "--max-connections", "4096", *extra],
                            cwd=pythonpath or REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:  # /ready: /health answers 200 while the engine loads (an older runtime has no /ready: 404)
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2).read()
            return proc, round(time.monotonic() - t0, 1)
        except urllib.error.HTTPError as err:
            if err.code == 404:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                return proc, round(time.monotonic() - t0, 1)
            time.sleep(0.3)
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("serve did not become healthy in 600 s")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def main(argv=None) -> int:
    a = parse_args(argv)
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    engine_dir = Path(a.engine_dir) if a.engine_dir else make_engine(a, work)
    texts, lengths = workload(engine_dir, a.texts)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "workload": {
        "texts": len(texts), "tokens": sum(lengths), "median_tokens": sorted(lengths)[len(lengths) // 2],
        "format": a.format}}
    try:
        import torch

        res["machine"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)
                          if torch.cuda.is_available() else None, "cpus": os.cpu_count()}
    except ImportError:
        pass
    if a.latency:
        res["call_latency"] = call_latency(engine_dir, texts)
    res["raw"] = raw_engine(engine_dir, texts)
    print(json.dumps(res["raw"]), flush=True)
    cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",") if c]
    servers = [("mopt", a.serve_args.split(), None)]
    for item in filter(None, a.variants.split(";")):  # a name starting "old" serves --old-runtime
        name, _, args = item.partition("=")
        servers.append((name, args.split(), str(Path(a.old_runtime).resolve()) if name.startswith("old") else None))
    if a.old_runtime and not any(name.startswith("old") for name, _, _ in servers):
        servers.append(("old", a.serve_args.split(), str(Path(a.old_runtime).resolve())))
    res["served"] = {}
    for k, (name, extra, path) in enumerate(servers):
        proc, ready = serve(engine_dir, a.port + k, extra, path)
        rows = {"ready_s": ready, "serve_args": extra}
        try:
            for clients, inputs in cases:
                case = f"{clients}x{inputs}"
                spy = py_spy(proc.pid, a.warmup + a.duration, out / f"pyspy_{case}.txt") \
                    if k == 0 and case in a.py_spy.split(",") else None
                before, t0, cpu0 = scrape(a.port + k), time.monotonic(), thread_cpu(proc.pid)
                row = load(a.port + k, texts, lengths, clients, inputs, a)
                after, wall = scrape(a.port + k), time.monotonic() - t0
                row["busiest_threads"] = busiest(cpu0, thread_cpu(proc.pid), wall)
                if spy is not None:
                    spy.wait(60)
                    row["py_spy"] = spy.stderr.read()[-300:]
                calls = after.get("mopt_batch_size_count", 0) - before.get("mopt_batch_size_count", 0)
                if calls:
                    row["mean_batch"] = round((after["mopt_batch_size_sum"] - before["mopt_batch_size_sum"]) / calls, 1)
                    row["calls_s"] = round(calls / wall, 1)
                if "mopt_engine_seconds_total" in after:
                    row["engine_busy"] = round((after["mopt_engine_seconds_total"]
                                                - before.get("mopt_engine_seconds_total", 0)) / wall, 3)
                if "tok_s" in row:
                    row["served_over_raw"] = round(row["tok_s"] / res["raw"]["raw_tok_s"], 3)
                rows[f"{clients}x{inputs}"] = row
                print(name, json.dumps(row), flush=True)
        finally:
            stop(proc)
        res["served"][name] = rows
        (out / "served_vs_raw.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
