"""What a bench target is, and how it is brought up and taken down.

A target is `[NAME=]URL` (a running server's base URL) or `[NAME=]IMAGE` (an image, local or pulled):
mopt starts an image in a container the way docs/hardening.md runs one (read-only root, tmpfs /tmp,
no capabilities, no-new-privileges), with the GPUs when its io.mopt.device label says cuda, its port
published on 127.0.0.1 only; waits for /ready (/health on servers without it); and removes it after
its runs, whatever happened. A URL must name a loopback host or one the user names with --allow-host:
a load generator pointed at someone else's server is an attack, not a benchmark.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from ..dockerclient import candidate_paths
from ..errors import BenchError, ConfigError, EnvironmentProblem, clipped, quoted

LABEL = "io.mopt.bench"
HARDENED = ("--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges")
DEFAULT_PORT = 8000
PULL_TIMEOUT_S = 1800
DOCKER_TIMEOUT_S = 120
IMAGE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,510}")  # fullmatch: no newline at the end
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
GPUS = ("auto", "all", "none")
READY_TIMEOUT_S = 2.0  # one /ready or /health probe, whole (a server that drips bytes gets no longer)


@dataclass(frozen=True)
class Target:
    name: str
    ref: str  # the URL (no trailing /) or the image reference
    kind: str  # url | image

    @classmethod
    def parse(cls, text: str, allow_hosts: tuple[str, ...] = ()) -> Target:
        name, sep, ref = text.partition("=")
        if not sep or "/" in name or ":" in name:  # no name (a URL's "://" has both)
            name, ref = "", text
        if name and not NAME.fullmatch(name):
            raise ConfigError(f"target name {quoted(name)}: use letters, digits, '.', '_', '+' or '-' (64 at most)")
        if "://" in ref:
            url = _checked_url(ref, allow_hosts)
            return cls(name or urlsplit(url).netloc, url, "url")
        if not IMAGE_REF.fullmatch(ref) or ".." in ref:
            raise ConfigError(f"target {quoted(text)}: neither an http(s):// URL nor an image reference")
        return cls(name or ref.split("/")[-1][:64], ref, "image")


def _checked_url(url: str, allow_hosts: tuple[str, ...]) -> str:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"target URL {quoted(url)}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"target URL {quoted(url)}: use http://HOST[:PORT][/PREFIX] or https://...")
    if parts.username or parts.password:
        raise ConfigError(f"target URL {quoted(url)}: no credentials in the URL (they would be written to the "
                          f"result); pass --api-key")
    if parts.query or parts.fragment:
        raise ConfigError(f"target URL {quoted(url)}: a base URL has no query or fragment")
    host = parts.hostname.lower()
    if not (_loopback(host) or host in {h.lower() for h in allow_hosts}):
        raise ConfigError(f"target URL {quoted(url)}: {host} is not a loopback address; mopt bench loads only "
                          f"loopback or hosts you name as your own with --allow-host {host}")
    del port  # parsed only to check it
    return url.rstrip("/")


def _loopback(host: str) -> bool:
    """An address on loopback, or a name every address of which is (what /etc/hosts says of localhost)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)  # scope ids parse


def _docker_path() -> str:
    for path in candidate_paths():
        if path.startswith("/"):
            return path
    raise EnvironmentProblem("no docker client found: an image target needs Docker (bash scripts/setup.sh)")


def docker(*args: str, timeout: float = DOCKER_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run([_docker_path(), *args], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BenchError(f"docker {args[0]} did not finish within {timeout:.0f}s") from None
    if check and proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        raise BenchError(f"docker {args[0]} {clipped(args[-1], 80)} failed: {clipped(last[0])}")
    return proc


@dataclass(frozen=True)
class Image:
    """What the bench reads from an image before starting it."""

    image_id: str
    port: int
    gpu: bool
    labels: dict

    @classmethod
    def inspect(cls, ref: str, pull: bool = True, log: Callable[[str], None] = lambda m: None) -> Image:
        proc = docker("image", "inspect", ref, check=False)
        if proc.returncode != 0 and pull:
            log(f"{ref}: not here; pulling it")
            docker("pull", ref, timeout=PULL_TIMEOUT_S)
            proc = docker("image", "inspect", ref)
        elif proc.returncode != 0:
            raise BenchError(f"no image {ref} here")
        data = json.loads(proc.stdout)[0]
        config = data.get("Config") or {}
        labels = config.get("Labels") or {}
        env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
        exposed = sorted(int(p.split("/")[0]) for p in (config.get("ExposedPorts") or {}) if p.split("/")[0].isdigit())
        port = int(env["MOPT_PORT"]) if env.get("MOPT_PORT", "").isdigit() else (exposed[0] if exposed else
                                                                                  DEFAULT_PORT)
        return cls(data["Id"], port, labels.get("io.mopt.device") == "cuda", labels)


class Started:
    """An image target's container (a context manager): .base_url once ready, removed on exit."""

    def __init__(self, target: Target, image: Image, gpus: str, start_timeout_s: float, run_id: str = ""):
        self.target, self.image = target, image
        self.gpu = gpus == "all" or (gpus == "auto" and image.gpu)
        self.start_timeout_s = start_timeout_s
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.cid = ""
        self.base_url = ""
        self.start_seconds = 0.0

    def __enter__(self) -> Started:
        gpu = ("--gpus", "all") if self.gpu else ()
        self.cid = docker("run", "-d", "--label", f"{LABEL}={self.run_id}", *HARDENED, *gpu,
                          "-p", f"127.0.0.1::{self.image.port}", self.image.image_id).stdout.strip()
        try:
            mapping = docker("port", self.cid, f"{self.image.port}/tcp").stdout.split()
            try:
                self.base_url = f"http://127.0.0.1:{int(mapping[0].rsplit(':', 1)[1])}"
            except (IndexError, ValueError):
                raise BenchError(f"docker port named no host port for {self.image.port}: {mapping[:2]}") from None
            self.start_seconds = self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> float:
        start = time.monotonic()
        while time.monotonic() - start < self.start_timeout_s:
            state = json.loads(docker("inspect", "--format", "{{json .State}}", self.cid).stdout)
            if not state.get("Running"):
                logs = docker("logs", "--tail", "5", self.cid, check=False)
                tail = " | ".join((logs.stdout + logs.stderr).strip().splitlines()[-3:])
                raise BenchError(f"the container exited (code {state.get('ExitCode')}) before it "
                                 f"was ready: {clipped(tail)}")
            if ready(self.base_url):
                return time.monotonic() - start
            time.sleep(0.5)
        raise BenchError(f"not ready within {self.start_timeout_s:.0f}s (--start-timeout)")

    def __exit__(self, *exc) -> None:
        if self.cid:
            docker("rm", "-f", self.cid, check=False)


def ready(base_url: str) -> bool:
    """mopt answers /ready 200 once its engine is loaded; servers without /ready (vLLM, TEI) /health. Each
    probe is bounded as a whole, and anything that is not an HTTP answer is a no."""
    return asyncio.run(_ready(base_url))


async def _ready(base_url: str) -> bool:
    timeout = aiohttp.ClientTimeout(total=READY_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:  # no trust_env: never through a proxy
            for path in ("/ready", "/health"):
                async with session.get(base_url + path, allow_redirects=False) as response:
                    if response.status != 404:
                        return response.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return False
    return False
