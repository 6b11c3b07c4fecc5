"""Peak memory of the served image against the requests in flight, for the memory formula of
docs/server.md: the cpu image hardened in a real container, N clients each sending the largest request
the limits allow (max_inputs inputs of max_input_chars CJK characters, JSON-escaped: about 1.5 MiB,
refused after tokenizing since every input is over the token limit), for several N and several
--max-inflight-bytes.

    .venv/bin/python benchmarks/admission_memory.py --image IMAGE [--out FILE]

Prints one JSON object: idle MiB, and per (budget, N): the cgroup's peak MiB, the statuses, seconds.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.served import ServedContainer, request  # noqa: E402

MIB = 1 << 20


def largest_body(limits: dict) -> bytes:
    text = "\u4e2d\u6587" * (limits["max_input_chars"] // 2)
    return json.dumps({"input": [text] * limits["max_inputs"]}).encode()


def burst(port: int, body: bytes, n: int) -> list:
    out: list = [None] * n

    def one(i):
        try:
            out[i] = request(port, "POST", "/v1/embeddings", body, {"Content-Type": "application/json"},
                             timeout=300)[0]
        except OSError as exc:
            out[i] = type(exc).__name__

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(330)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", required=True)
    p.add_argument("--memory", default="1536m")
    p.add_argument("--budgets", default="16,64,256", help="--max-inflight-bytes values, MiB")
    p.add_argument("--clients", default="1,8,64,200")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    docker = shutil.which("docker", path="/usr/bin") or "docker"
    res: dict = {"image": a.image, "memory_limit": a.memory, "date": time.strftime("%Y-%m-%d"), "runs": {}}
    for budget in (int(b) for b in a.budgets.split(",")):
        container = ServedContainer(docker, a.image, memory=a.memory, pids_limit=64,
                                    server_args=("--max-inflight-bytes", str(budget * MIB)))
        try:
            container.start()
            limits = json.loads(request(container.port, "GET", "/info")[2])["limits"]
            body = largest_body(limits)
            res["body_mib"] = round(len(body) / MIB, 2)
            time.sleep(2)
            idle = container.memory_bytes()
            res["runs"].setdefault("idle_mib", round(idle / MIB, 1))
            for n in (int(c) for c in a.clients.split(",")):
                container.reset_peak()
                t = time.monotonic()
                statuses = burst(container.port, body, n)
                row = {"budget_mib": budget, "clients": n, "seconds": round(time.monotonic() - t, 1),
                       "peak_mib": round(container.peak_memory_bytes() / MIB, 1),
                       "statuses": {str(s): statuses.count(s) for s in set(statuses)},
                       "oom_killed": container.state()["OOMKilled"]}
                res["runs"][f"{budget}MiB-{n}"] = row
                print(json.dumps(row), flush=True)
        finally:
            container.stop()
    print(json.dumps(res, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
