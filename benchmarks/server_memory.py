"""Memory and fairness of the served image under hostile load, in a real container on loopback:

    .venv/bin/python benchmarks/server_memory.py --image IMAGE [--memory 1536m] [--out FILE]

IMAGE is a built final image (e.g. the cpu demo's `minilm-embed:cpu` image id from the report). The
container runs hardened (read-only root, noexec tmpfs, no capabilities) under a memory limit without
swap. Prints one JSON object: the container's memory idle, the peak (cgroup) for the largest allowed
request alone and four at once, for the largest body (one string filling --max-body-bytes) alone and
four at once, the connections held before a 503, and the latency of a small request alone and
behind three large ones. docs/reliability.md quotes a run.
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.served import ServedContainer, embed, request  # noqa: E402

MIB = 1 << 20


def peak_during(container: ServedContainer, count: int, fn) -> dict:
    """Run FN COUNT times at once; the container's peak memory and the statuses."""
    base = container.memory_bytes()
    container.reset_peak()
    results: list = [None] * count

    def run(i):
        try:
            results[i] = fn()
        except OSError as exc:
            results[i] = repr(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return {"count": count, "seconds": round(time.monotonic() - started, 2),
            "statuses": [r if isinstance(r, str) else r[0] for r in results],
            "before_mib": round(base / MIB, 1), "peak_mib": round(container.peak_memory_bytes() / MIB, 1),
            "peak_over_before_mib": round((container.peak_memory_bytes() - base) / MIB, 1)}


def connections_before_503(port: int, limit: int) -> int | None:
    held = []
    try:
        for n in range(limit):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            held.append(s)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n")
            if b" 503 " in s.recv(4096).split(b"\r\n", 1)[0]:
                return n
        return None
    finally:
        for s in held:
            s.close()


def small_behind_large(port: int, count: int, large_text: str) -> dict:
    def timed(payload, out):
        started = time.monotonic()
        status, _ = embed(port, payload, timeout=300)
        out.append((status, round(time.monotonic() - started, 3)))

    alone: list = []
    timed({"input": "hi"}, alone)
    large: list = []
    threads = [threading.Thread(target=timed, args=({"input": [large_text] * count, "truncate_prompt_tokens": -1},
                                                           large)) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    behind: list = []
    timed({"input": "hi"}, behind)
    for t in threads:
        t.join(300)
    return {"small_alone_s": alone[0][1], "small_behind_large_s": behind[0][1],
            "large_s": sorted(x[1] for x in large), "statuses": [x[0] for x in alone + behind + large]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", required=True)
    p.add_argument("--memory", default="1536m", help="container memory limit (no swap)")
    p.add_argument("--max-connections", type=int, default=64)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    docker = shutil.which("docker")
    if docker is None:
        print("error: no docker client on PATH (bash scripts/setup.sh installs and starts it)", file=sys.stderr)
        return 2
    container = ServedContainer(docker, a.image, ("--max-connections", str(a.max_connections)), memory=a.memory)
    try:
        started = time.monotonic()
        container.start()
        start_s = time.monotonic() - started
        time.sleep(2)
        info = json.loads(request(container.port, "GET", "/info")[2])
        limits = info["limits"]
        count, chars = limits["max_inputs"], limits["max_input_chars"]
        largest = {"input": [("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]] * count,
                   "truncate_prompt_tokens": -1}
        body = json.dumps({"input": "word " * ((limits["max_body_bytes"] - 64) // 5)}).encode()
        post_body = lambda: request(container.port, "POST", "/v1/embeddings", body,  # noqa: E731
                                    {"Content-Type": "application/json"}, timeout=120)
        result = {
            "image": a.image, "memory_limit": a.memory, "start_to_healthy_s": round(start_s, 1),
            "limits": limits, "idle_mib": round(container.memory_bytes() / MIB, 1),
            "largest_request_1": peak_during(container, 1, lambda: embed(container.port, largest, timeout=300)),
            "largest_request_4": peak_during(container, 4, lambda: embed(container.port, largest, timeout=300)),
            "largest_body_1": peak_during(container, 1, post_body),
            "largest_body_4": peak_during(container, 4, post_body),
            "connections_before_503": connections_before_503(container.port, a.max_connections + 16),
            "small_request": small_behind_large(container.port, count, largest["input"][0]),
        }
        time.sleep(1)
        state = container.state()
        result["oom_killed"], result["running_after"] = state["OOMKilled"], state["Running"]
    finally:
        container.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
