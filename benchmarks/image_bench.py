"""Served images side by side on one mixed-length workload, as a user would compare them:

    .venv/bin/python benchmarks/image_bench.py NAME=URL [NAME=URL ...] [--rounds 3] [--requests 96]
        [--clients 8] [--texts 8] [--min-words 4] [--max-words 120] [--api-key KEY] [--model NAME] [--out FILE]

Each URL is a running server's base (e.g. http://127.0.0.1:8000) that answers OpenAI's POST
/v1/embeddings: a mopt image of any flavour, vLLM's server, or anything else with that route. Every
round sends the same requests (REQUESTS requests of TEXTS texts, each of MIN..MAX words drawn with a
fixed seed) from CLIENTS concurrent clients to each target in turn, in a rotated order, so drift on a
noisy machine falls on all targets alike. Prints words/s, requests/s and latency percentiles per
target and round, the median words/s per target, and each target's ratio to the first one's.
Only the standard library: it runs on any host against any server.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

WORDS = ("the quick brown fox jumps over a lazy dog while engineers ship inference images built for "
         "graphics processors serving embeddings of documents queries and code to users around the world "
         "with tokenizers batching padding attention pooling normalisation and caching").split()


def workload(requests: int, texts: int, min_words: int, max_words: int, seed: int = 0) -> list[list[str]]:
    """REQUESTS lists of TEXTS texts, each of MIN..MAX words (uniform), the same for every target."""
    rng = random.Random(seed)
    return [[" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(texts)]
            for _ in range(requests)]


def _post(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict) -> int:
    conn.request("POST", path, body, headers)
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise RuntimeError(f"{path} answered {response.status}: {data[:200]!r}")
    return len(json.loads(data)["data"])


def run_target(url: str, batches: list[list[str]], clients: int, api_key: str | None, model: str | None = None,
               timeout: float = 600.0) -> dict:
    """Send every batch once from CLIENTS threads (each with its own keep-alive connection)."""
    parts = urlsplit(url)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    extra = {"model": model} if model else {}  # no model: every server here embeds with the one it serves
    bodies = [json.dumps({"input": texts, **extra}).encode() for texts in batches]
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    queue = list(range(len(bodies)))

    def client():
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
        try:
            while True:
                with lock:
                    if not queue or errors:
                        return
                    index = queue.pop()
                started = time.perf_counter()
                try:
                    _post(conn, "/v1/embeddings", bodies[index], headers)
                except (OSError, RuntimeError, ValueError, http.client.HTTPException) as exc:
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}")
                    return
                with lock:
                    latencies.append(time.perf_counter() - started)
        finally:
            conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        return {"error": errors[0]}
    words = sum(len(text.split()) for texts in batches for text in texts)
    latencies.sort()
    return {"wall_s": round(wall, 3), "words_per_s": round(words / wall, 1),
            "requests_per_s": round(len(batches) / wall, 2),
            "p50_ms": round(1000 * latencies[len(latencies) // 2], 1),
            "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("targets", nargs="*", metavar="NAME=URL")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--texts", type=int, default=8, help="texts per request")
    p.add_argument("--min-words", type=int, default=4)
    p.add_argument("--max-words", type=int, default=120)
    p.add_argument("--warmup", type=int, default=8, help="requests sent to each target before timing")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="the request's model field (default: none sent)")
    p.add_argument("--out", default=None, help="also write the result JSON here")
    p.add_argument("--dump-workload", default=None, metavar="FILE",
                   help="write the timed requests as JSON and exit (benchmarks/raw_engine.py reads it)")
    a = p.parse_args(argv)
    if a.dump_workload:
        Path(a.dump_workload).write_text(json.dumps(workload(a.requests, a.texts, a.min_words, a.max_words)))
        return 0
    if not a.targets:
        p.error("name at least one NAME=URL target")
    targets = {}
    for item in a.targets:
        name, sep, url = item.partition("=")
        if not sep or not url.startswith("http://"):
            p.error(f"targets are NAME=http://HOST:PORT, got {item!r}")
        targets[name] = url.rstrip("/")
    batches = workload(a.requests, a.texts, a.min_words, a.max_words)
    warm = workload(a.warmup, a.texts, a.min_words, a.max_words, seed=1)
    for name, url in targets.items():
        res = run_target(url, warm, a.clients, a.api_key, a.model)
        if "error" in res:
            print(f"{name}: {res['error']}", file=sys.stderr)
            return 1
    names = list(targets)
    rounds = []
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        row = {}
        for name in order:
            row[name] = run_target(targets[name], batches, a.clients, a.api_key, a.model)
            if "error" in row[name]:
                print(f"{name}: {row[name]['error']}", file=sys.stderr)
                return 1
            print(json.dumps({"round": r, "target": name, **row[name]}), flush=True)
        rounds.append(row)
    median = {n: statistics.median(row[n]["words_per_s"] for row in rounds) for n in names}
    result = {"workload": {"requests": a.requests, "texts_per_request": a.texts, "words": [a.min_words, a.max_words],
                           "clients": a.clients, "rounds": a.rounds},
              "targets": targets, "rounds": rounds, "median_words_per_s": median,
              "ratio_to_first": {n: round(median[n] / median[names[0]], 3) for n in names}}
    print(json.dumps({k: result[k] for k in ("median_words_per_s", "ratio_to_first")}, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
