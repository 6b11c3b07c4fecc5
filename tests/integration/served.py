"""A served image in a real container on loopback, for the adversarial suite and the memory benchmark
(benchmarks/server_memory.py): start it hardened under a memory limit, wait for /health, read the
cgroup's peak memory, and tell whether it was killed for memory. Every wait is bounded."""
from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests import serving

HARDENED = ("--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges")
CONTAINER_PORT = 8000
LABEL = "io.mopt.test=adversarial"


def _docker(docker: str, *args: str, timeout: float = 60) -> str:
    proc = subprocess.run([docker, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout.strip()


@dataclass
class ServedContainer:
    docker: str
    image: str
    server_args: tuple[str, ...] = ()
    memory: str = "2g"
    env: dict = field(default_factory=dict)
    docker_args: tuple[str, ...] = ()  # more `docker run` options, e.g. ("--user", "4242:4242")
    pids_limit: int = 512
    ready_path: str = "/ready"  # mopt's readiness (/health answers already while loading); vLLM alone: /health
    cid: str = ""
    port: int = 0

    def start(self, health_timeout_s: float = 180) -> ServedContainer:
        self.launch()
        self.wait_healthy(health_timeout_s)
        return self

    def launch(self) -> ServedContainer:
        """`docker run -d`, hardened, and the published port; no wait for readiness."""
        env = [x for k, v in self.env.items() for x in ("-e", f"{k}={v}")]
        # --memory-swap equal to --memory: no swap, so going over the limit is an OOM kill, not a slow-down.
        self.cid = _docker(self.docker, "run", "-d", "--label", LABEL, *HARDENED, "--memory", self.memory,
                           "--memory-swap", self.memory, "--pids-limit", str(self.pids_limit),
                           "-p", f"127.0.0.1::{CONTAINER_PORT}", *env, *self.docker_args, self.image,
                           *self.server_args)
        self.refresh_port()
        return self

    def refresh_port(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                mapping = _docker(self.docker, "port", self.cid, f"{CONTAINER_PORT}/tcp")
                self.port = int(mapping.splitlines()[0].rsplit(":", 1)[1])
                return
            except (RuntimeError, IndexError, ValueError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def inspect(self, template: str) -> str:
        return _docker(self.docker, "inspect", "--format", template, self.cid)

    def docker_stop(self, timeout_s: int = 10) -> None:
        """`docker stop` as a user runs it: SIGTERM, then SIGKILL after timeout_s."""
        _docker(self.docker, "stop", "-t", str(timeout_s), self.cid, timeout=timeout_s + 60)

    def docker_stop_under_load(self, threads: list, settle_s: float) -> float:
        """After SETTLE_S (the requests in: some computing, some queued), `docker stop` with Docker's
        default 10 s; then the request threads joined (bounded). The seconds docker stop took."""
        time.sleep(settle_s)
        started = time.monotonic()
        self.docker_stop(10)
        took = time.monotonic() - started
        for t in threads:
            t.join(30)
        return took

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state()
            if not state["Running"]:
                raise RuntimeError(f"container exited ({state}): {self.logs()[-3000:]}")
            try:
                if request(self.port, "GET", self.ready_path, timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.ready_path} not 200 within {timeout_s}s: {self.logs()[-3000:]}")

    def state(self) -> dict:
        return json.loads(_docker(self.docker, "inspect", "--format", "{{json .State}}", self.cid))

    def exec(self, *command: str) -> str:
        """COMMAND's output inside the running container."""
        return _docker(self.docker, "exec", self.cid, *command)

    def wait_exited(self, timeout_s: float) -> dict:
        """The container's state once it has exited (bounded wait; the state as it is at the deadline)."""
        deadline = time.monotonic() + timeout_s
        state = self.state()
        while state["Running"] and time.monotonic() < deadline:
            time.sleep(0.5)
            state = self.state()
        return state

    def logs(self) -> str:
        proc = subprocess.run([self.docker, "logs", self.cid], capture_output=True, text=True, timeout=30)
        return proc.stdout + proc.stderr

    def _cgroup_file(self, name: str) -> Path:
        # cgroup v1 with the cgroupfs driver (Debian's docker.io here); v2 names the peak memory.peak.
        full = _docker(self.docker, "inspect", "--format", "{{.Id}}", self.cid)
        v1 = Path("/sys/fs/cgroup/memory/docker") / full / name
        if v1.exists():
            return v1
        v2 = Path("/sys/fs/cgroup/system.slice") / f"docker-{full}.scope" / {
            "memory.max_usage_in_bytes": "memory.peak", "memory.usage_in_bytes": "memory.current"}[name]
        if v2.exists():
            return v2
        raise RuntimeError(f"no cgroup memory file {name} for {self.cid}")

    def memory_bytes(self) -> int:
        return int(self._cgroup_file("memory.usage_in_bytes").read_text())

    def peak_memory_bytes(self) -> int:
        return int(self._cgroup_file("memory.max_usage_in_bytes").read_text())

    def reset_peak(self) -> None:
        """Start a new peak from the current usage (cgroup v1 only: v2's memory.peak cannot be reset
        on older kernels; then the figure is the peak since start)."""
        path = self._cgroup_file("memory.max_usage_in_bytes")
        if path.name == "memory.max_usage_in_bytes":
            path.write_text("0")

    def stop(self) -> None:
        if self.cid:
            subprocess.run([self.docker, "rm", "-f", self.cid], capture_output=True, timeout=60)


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = 30) -> tuple[int, dict, bytes]:
    """One request on a new connection: (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def posts_in_threads(port: int, body: bytes, count: int, headers: dict | None = None,
                     timeout: float = 60) -> tuple[list, list]:
    """COUNT copies of an embeddings POST sent at once, each on its own connection and thread: the
    threads, and results where each leaves the status it got or the error it met (a list read after
    joining the threads)."""
    results: list = [None] * count

    def one(i: int) -> None:
        try:
            results[i] = request(port, "POST", "/v1/embeddings", body,
                                 {"Content-Type": "application/json", **(headers or {})}, timeout=timeout)[0]
        except OSError as exc:
            results[i] = repr(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return results, threads


def embed(port: int, payload: dict, timeout: float = 120, headers: dict | None = None) -> tuple[int, dict]:
    status, _, raw = request(port, "POST", "/v1/embeddings", json.dumps(payload).encode(),
                             {"Content-Type": "application/json", **(headers or {})}, timeout=timeout)
    return status, json.loads(raw)


def raw_exchange(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send DATA as is, read until the server closes or TIMEOUT passes; everything it answered."""
    return serving.raw_exchange(port, data, wait=timeout, timeout=timeout)
