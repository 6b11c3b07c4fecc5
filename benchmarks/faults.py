"""Fault injection against the real registry (Debian's docker-registry on 127.0.0.1) and the real daemon.

Scenarios (each one a function returning a dict of figures; tests/integration/test_faults.py runs
them a few times, this script runs them more and writes benchmarks/results/faults.json):

- ``registry_killed``: the docker-registry process is SIGKILLed while the publish uploads a layer,
  then restarted on the same port and storage;
- ``proxy``: the publish (skopeo and the registry API) talks to a seeded fault proxy on 127.0.0.1 in front of the
  registry that answers 500 or 429 and drops connections at random;
- ``wrong_credentials``: a config.json with a wrong password;
- ``disk_full``: the registry's storage is an 8 MiB tmpfs and the image has a larger layer;
- ``build_killed``: a build process is SIGKILLed while BuildKit runs.
- ``dockerd_restarted``: dockerd is stopped and started again during a BuildKit RUN step (only with
  MOPT_ALLOW_DOCKERD_RESTART=1: it stops every container on the host).

After each one: every tag in the registry maps to a complete manifest (its digest is the body's
sha256 and every referenced blob answers), tags hold the old or the new digest (never a short tag
ahead of the release's long tags), no stray tag, a clear error, and a re-run completes.

All traffic goes to 127.0.0.1 only; every scenario is bounded in count and time.

    .venv/bin/python benchmarks/faults.py [--reps 5] [--only proxy,...]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path
from unittest import mock

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from builder.dockerclient import DockerCli, find_docker, run_docker  # noqa: E402
from builder.errors import PublishError  # noqa: E402
from builder.localregistry import LocalRegistry, find_registry_binary  # noqa: E402
from builder.registry import api as api_mod  # noqa: E402
from builder.registry import push as push_mod  # noqa: E402
from builder.registry.api import ACCEPT  # noqa: E402
from builder.registry.phases import PublishItem, publish  # noqa: E402
from builder.registry.reference import Registry  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "faults.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lines(list):
    def __call__(self, line: str) -> None:
        self.append(line)

    def text(self) -> str:
        return "\n".join(self)


# --------------------------------------------------------------------------- fault proxy
class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream``: per connection, with a seeded RNG, it answers
    HTTP 500, HTTP 429 (Retry-After: 1), drops the connection, or passes it through."""

    def __init__(self, upstream_port: int, *, seed: int, p500: float = 0.1, p429: float = 0.1,
                 pdrop: float = 0.1, budget: int | None = None):
        self.upstream = ("127.0.0.1", upstream_port)
        self.rng = random.Random(seed)
        self.rates = (pdrop, p500, p429)
        self.enabled = False
        self.budget = budget  # at most this many faults (None: no limit), so a run stays bounded in time
        self.counts = {"connections": 0, "drop": 0, "500": 0, "429": 0, "passed": 0}
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._closing = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _decide(self) -> str:
        with self._lock:
            self.counts["connections"] += 1
            injected = self.counts["drop"] + self.counts["500"] + self.counts["429"]
            if not self.enabled or (self.budget is not None and injected >= self.budget):
                self.counts["passed"] += 1
                return "pass"
            r = self.rng.random()
            pdrop, p500, p429 = self.rates
            kind = "drop" if r < pdrop else "500" if r < pdrop + p500 else "429" if r < pdrop + p500 + p429 \
                else "passed"
            self.counts[kind] += 1
            return kind

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        kind = self._decide()
        try:
            if kind == "drop":
                conn.settimeout(2)
                with suppress(OSError):
                    conn.recv(1024)  # take part of the request, then vanish
                conn.close()
                return
            if kind in ("500", "429"):
                conn.settimeout(2)
                data = b""
                with suppress(OSError):
                    while b"\r\n\r\n" not in data and len(data) < 65536:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                reason = "Internal Server Error" if kind == "500" else "Too Many Requests"
                body = b'{"errors":[{"code":"UNKNOWN","message":"injected fault"}]}' if kind == "500" else \
                    b'{"errors":[{"code":"TOOMANYREQUESTS","message":"injected fault"}]}'
                head = (f"HTTP/1.1 {kind} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                        "\r\nConnection: close\r\n" + ("Retry-After: 1\r\n" if kind == "429" else "") + "\r\n")
                with suppress(OSError):
                    conn.sendall(head.encode() + body)
                conn.close()
                return
            up = socket.create_connection(self.upstream, timeout=10)
            up.settimeout(None)
            threading.Thread(target=self._pump, args=(up, conn), daemon=True).start()
            self._pump(conn, up)
        except OSError:
            with suppress(OSError):
                conn.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with suppress(OSError):
                    s.close()

    def close(self) -> None:
        self._closing = True
        with suppress(OSError):
            self._sock.close()


# --------------------------------------------------------------------------- images
def _tar_bytes(files: dict[str, bytes], *, executable: set[str] = frozenset()) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        dirs = sorted({str(Path(n).parent) for n in files} - {"."})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1700000000
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1700000000
            info.mode = 0o755 if name in executable else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def import_image(docker: DockerCli, name: str, files: dict[str, bytes], executable: set[str] = frozenset()) -> str:
    with tempfile.NamedTemporaryFile(suffix=".tar") as f:
        f.write(_tar_bytes(files, executable=executable))
        f.flush()
        run_docker(["import", f.name, name], docker=docker, timeout=120)
    return run_docker(["image", "inspect", "--format", "{{.Id}}", name], docker=docker).stdout.strip()


def shell_rootfs() -> dict[str, bytes]:
    """A tiny rootfs with /bin/sh and sha256sum (and their libraries) from the host, for RUN steps."""
    files: dict[str, bytes] = {}
    for binary in ("/bin/sh", "/usr/bin/sha256sum", "/bin/sleep"):
        real = Path(binary).resolve()
        files[binary.lstrip("/")] = real.read_bytes()
        out = subprocess.run(["ldd", str(real)], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            lib = parts[2] if "=>" in parts and len(parts) > 2 else parts[0] if parts and parts[0].startswith("/") \
                else None
            if lib and lib.startswith("/"):
                files[lib.lstrip("/")] = Path(lib).resolve().read_bytes()
    files["tmp/.keep"] = b""
    return files


def layered_image(docker: DockerCli, base: str, name: str, layers: list[bytes], tmp: Path) -> str:
    """A few layers via a trivial BuildKit build (COPY steps) FROM an imported image."""
    ctx = tmp / f"ctx-{secrets.token_hex(4)}"
    ctx.mkdir(parents=True)
    lines = [f"FROM {base}"]
    for i, data in enumerate(layers):
        (ctx / f"layer{i}.bin").write_bytes(data)
        lines.append(f"COPY layer{i}.bin /data/layer{i}.bin")
    (ctx / "Dockerfile").write_text("\n".join(lines) + "\n")
    run_docker([*docker.build_cmd()[1:], "--progress=plain", "-t", name, str(ctx)], docker=docker, timeout=300)
    shutil.rmtree(ctx, ignore_errors=True)
    return run_docker(["image", "inspect", "--format", "{{.Id}}", name], docker=docker).stdout.strip()


# --------------------------------------------------------------------------- registry checks
class RegistryView:
    """The checker's own view of the registry (direct, basic auth, no proxy)."""

    def __init__(self, reg: LocalRegistry):
        self.base = reg.url
        self.s = requests.Session()
        self.s.trust_env = False
        self.s.auth = (reg.user, reg.password)

    def tags(self) -> dict[str, dict[str, str]]:
        """{repo: {tag: digest}} after checking each tag is complete."""
        out: dict[str, dict[str, str]] = {}
        for repo in self.s.get(f"{self.base}/v2/_catalog", timeout=10).json().get("repositories") or []:
            r = self.s.get(f"{self.base}/v2/{repo}/tags/list", timeout=10)
            for tag in (r.json().get("tags") or []) if r.status_code == 200 else []:
                out.setdefault(repo, {})[tag] = self.complete(repo, tag)
        return out

    def complete(self, repo: str, ref: str) -> str:
        r = self.s.get(f"{self.base}/v2/{repo}/manifests/{ref}", headers={"Accept": ACCEPT}, timeout=10)
        assert r.status_code == 200, f"{repo}:{ref}: manifest answers {r.status_code}"
        digest = "sha256:" + hashlib.sha256(r.content).hexdigest()
        assert r.headers.get("Docker-Content-Digest") == digest, f"{repo}:{ref}: digest header != body hash"
        body = r.json()
        for child in body.get("manifests", []):
            self.complete(repo, child["digest"])
        for desc in [body.get("config") or {}, *body.get("layers", [])]:
            if desc:
                h = self.s.head(f"{self.base}/v2/{repo}/blobs/{desc['digest']}", timeout=10)
                assert h.status_code == 200, f"{repo}:{ref}: blob {desc['digest']} answers {h.status_code}"
                assert int(h.headers.get("Content-Length", -1)) == desc["size"], f"{repo}:{ref}: blob size"
        return digest


def check_state(view: RegistryView, allowed: dict[str, dict[str, set[str]]]) -> dict[str, dict[str, str]]:
    """Every tag complete, every tag expected, every digest one of its allowed (old or new) digests."""
    tags = view.tags()
    for repo, by_tag in tags.items():
        for tag, digest in by_tag.items():
            assert repo in allowed and tag in allowed[repo], f"stray tag {repo}:{tag}"
            assert digest in allowed[repo][tag], f"{repo}:{tag} = {digest}, not one of {allowed[repo][tag]}"
    return tags


# --------------------------------------------------------------------------- fixtures for the scenarios
class Bench:
    """Shared pieces: docker CLI, a few tiny images, a scratch dir; removes what it made."""

    def __init__(self, tmp: Path):
        self.docker = find_docker()
        find_registry_binary()
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.suffix = secrets.token_hex(3)
        self.names: list[str] = []
        self._base: str | None = None
        self._shell: str | None = None
        self.pairs: dict[str, tuple[list[str], list[str]]] = {}

    def name(self, what: str) -> str:
        ref = f"mopt-faults/{what}:{self.suffix}"
        self.names.append(ref)
        return ref

    @property
    def base(self) -> str:
        if self._base is None:
            self._base = self.name("base")
            import_image(self.docker, self._base, {"etc/mopt-faults": b"base\n"})
        return self._base

    @property
    def shell(self) -> str:
        if self._shell is None:
            self._shell = self.name("shell")
            files = shell_rootfs()
            import_image(self.docker, self._shell, files, executable=set(files))
        return self._shell

    def image(self, what: str, layers: list[bytes]) -> str:
        return layered_image(self.docker, self.base, self.name(what), layers, self.tmp)

    def registry(self, root: Path, *, port: int = 0) -> LocalRegistry:
        return LocalRegistry(root, port=port, user="faults", password="pw-" + secrets.token_hex(8)).start()

    def login(self, reg: LocalRegistry, address: str | None = None, password: str | None = None) -> Path:
        cfg = self.tmp / f"cfg-{secrets.token_hex(4)}"
        cfg.mkdir()
        import base64
        auth = base64.b64encode(f"{reg.user}:{password or reg.password}".encode()).decode()
        (cfg / "config.json").write_text(json.dumps({"auths": {address or reg.address: {"auth": auth}}}))
        return cfg

    def cleanup(self) -> None:
        if self.names:
            run_docker(["rmi", "-f", *self.names], docker=self.docker, check=False, timeout=120)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _items(ids: list[str], long_suffix: str, short: str = "stable") -> list[PublishItem]:
    return [PublishItem(variant_id=f"faults-{i}:cpu", image_id=image_id, repository=f"mopt/faults-{i}",
                        long_tag=f"{short}-{long_suffix}", short_tag=short) for i, image_id in enumerate(ids)]


@contextmanager
def _quick_retries(extra: int = 4):
    saved = (push_mod.COPY_RETRIES, api_mod.HTTP_WAIT_MULTIPLIER_S)
    push_mod.COPY_RETRIES, api_mod.HTTP_WAIT_MULTIPLIER_S = extra, 0.05
    try:
        yield
    finally:
        push_mod.COPY_RETRIES, api_mod.HTTP_WAIT_MULTIPLIER_S = saved


def _publish(items, address, cfg, log) -> tuple[list, PublishError | None]:
    try:
        return publish(items, Registry.parse(address), docker_config=str(cfg), log=log), None
    except PublishError as exc:
        return [], exc


def _allowed(old: list, new: list, items_old: list[PublishItem], items_new: list[PublishItem]) -> dict:
    allowed: dict[str, dict[str, set[str]]] = {}
    for results, items in ((old, items_old), (new, items_new)):
        for res, item in zip(results, items, strict=True):
            repo = item.repository
            for tag in (item.long_tag, item.short_tag):
                allowed.setdefault(repo, {}).setdefault(tag, set()).add(res.digest)
    return allowed


def _old_then_new(bench: Bench, what: str, new_layers: list[bytes]) -> tuple[list[str], list[str]]:
    """Two small 'old' images and two 'new' ones (the first with ``new_layers``); built once per Bench
    and reused by every repetition (each repetition has its own fresh registry)."""
    if what not in bench.pairs:
        old = [bench.image(f"{what}-old{i}", [f"old {i} {bench.suffix}\n".encode()]) for i in range(2)]
        new = [bench.image(f"{what}-new{i}", [f"new {i} {bench.suffix}\n".encode(), *(new_layers if i == 0 else [])])
               for i in range(2)]
        bench.pairs[what] = (old, new)
    return bench.pairs[what]


# --------------------------------------------------------------------------- scenarios
def registry_killed(bench: Bench, rep: int) -> dict:
    """SIGKILL docker-registry while the publish uploads a layer; restart it on the same port and storage."""
    started = time.monotonic()
    root = bench.tmp / f"killed-{rep}"
    reg = bench.registry(root, port=free_port())
    try:
        cfg = bench.login(reg)
        big = random.Random(0).randbytes(8 << 20)  # incompressible: gzip keeps the upload busy
        old_ids, new_ids = _old_then_new(bench, "killed", [big])
        items_old, items_new = _items(old_ids, "b1"), _items(new_ids, "b2")
        old, err = _publish(items_old, reg.address, cfg, Lines())
        assert err is None, err
        uploads = reg.data_dir / "docker/registry/v2/repositories"
        killed, did_kill = threading.Event(), threading.Event()

        def killer() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not killed.is_set():
                if any(p.is_dir() and any(p.iterdir()) for p in uploads.glob("*/*/_uploads")):
                    proc = reg._proc
                    assert proc is not None
                    os.kill(proc.pid, signal.SIGKILL)  # our own child, by pid
                    proc.wait()
                    did_kill.set()
                    time.sleep(0.5)
                    restart(reg)
                    return
                time.sleep(0.005)

        thread = threading.Thread(target=killer, daemon=True)
        log = Lines()
        with _quick_retries():
            thread.start()
            first, err = _publish(items_new, reg.address, cfg, log)
        killed.set()
        thread.join(30)
        view = RegistryView(reg)
        mid = check_state(view, _allowed(old, first, items_old, items_new) if err is None else
                          _merge(_allowed(old, [], items_old, []), _long_only(items_new, view)))
        if err is not None:  # a failed release moved no short tag
            assert all(mid[i.repository]["stable"] == o.digest for i, o in zip(items_old, old, strict=True))
        with _quick_retries():
            again, err2 = _publish(items_new, reg.address, cfg, Lines())
        assert err2 is None, err2
        final = check_state(view, _allowed(old, again, items_old, items_new))
        assert all(final[i.repository]["stable"] == r.digest for i, r in zip(items_new, again, strict=True))
        return {"scenario": "registry_killed", "rep": rep, "fault_injected": did_kill.is_set(),
                "first_run_ok": err is None, "error": (err.message.splitlines()[0][:300] if err else ""),
                "rerun_ok": True, "seconds": round(time.monotonic() - started, 1)}
    finally:
        reg.stop()


def _long_only(items: list[PublishItem], view: RegistryView) -> dict:
    """Long tags of a failed release may exist (any complete digest); its short tags may not have moved."""
    out: dict[str, dict[str, set[str]]] = {}
    for item in items:
        r = view.s.get(f"{view.base}/v2/{item.repository}/manifests/{item.long_tag}", headers={"Accept": ACCEPT},
                       timeout=10)
        if r.status_code == 200:
            out.setdefault(item.repository, {})[item.long_tag] = {r.headers["Docker-Content-Digest"]}
    return out


def _merge(a: dict, b: dict) -> dict:
    out = {repo: {tag: set(d) for tag, d in tags.items()} for repo, tags in a.items()}
    for repo, tags in b.items():
        for tag, digests in tags.items():
            out.setdefault(repo, {}).setdefault(tag, set()).update(digests)
    return out


def restart(reg: LocalRegistry) -> None:
    """Start docker-registry again with the same config (port, storage, secret)."""
    if reg._log_file is not None:
        reg._log_file.close()
    reg._log_file = open(reg.log_path, "ab")  # noqa: SIM115 - closed by reg.stop()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
    reg._proc = subprocess.Popen([find_registry_binary(), "serve", str(reg.config_path)], stdout=reg._log_file,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    problem = reg._wait_ready(30)
    assert problem is None, problem


def proxy(bench: Bench, rep: int, budget: int | None = 4) -> dict:
    """The publish (skopeo and the registry API) reaches the registry through a seeded fault proxy (500, 429, drops)."""
    started = time.monotonic()
    reg = bench.registry(bench.tmp / f"proxy-{rep}")
    fp = FaultProxy(reg.port, seed=rep, p500=0.12, p429=0.12, pdrop=0.12, budget=budget)
    try:
        cfg = bench.login(reg, fp.address)
        old_ids, new_ids = _old_then_new(bench, "proxy", [b"extra layer" * 1000])
        items_old, items_new = _items(old_ids, "b1"), _items(new_ids, "b2")
        old, err = _publish(items_old, fp.address, cfg, Lines())
        assert err is None, err
        fp.enabled = True
        log = Lines()
        with _quick_retries():
            first, err = _publish(items_new, fp.address, cfg, log)
        fp.enabled = False
        faults = {k: v for k, v in fp.counts.items()}
        view = RegistryView(reg)
        if err is None:
            check_state(view, _allowed(old, first, items_old, items_new))
        else:
            mid = check_state(view, _merge(_allowed(old, [], items_old, []), _long_only(items_new, view)))
            if getattr(err, "published", []) == []:
                assert all(mid[i.repository]["stable"] == o.digest for i, o in zip(items_old, old, strict=True))
        again, err2 = _publish(items_new, fp.address, cfg, Lines())
        assert err2 is None, err2
        check_state(view, _allowed(old, again, items_old, items_new))
        assert reg.password not in log.text()
        return {"scenario": "proxy", "rep": rep, "fault_injected": faults["drop"] + faults["500"] + faults["429"] > 0,
                "faults": faults, "first_run_ok": err is None,
                "error": (err.message.splitlines()[0][:200] if err else ""),
                "publisher_retries_seen": log.text().count("failed transiently"), "rerun_ok": True,
                "seconds": round(time.monotonic() - started, 1)}
    finally:
        fp.close()
        reg.stop()


def wrong_credentials(bench: Bench, rep: int) -> dict:
    started = time.monotonic()
    reg = bench.registry(bench.tmp / f"creds-{rep}")
    try:
        wrong = f"wrong-{secrets.token_hex(6)}"
        bad = bench.login(reg, password=wrong)
        image = _old_then_new(bench, "creds", [])[0][0]
        items = _items([image], "b1")
        log = Lines()
        _, err = _publish(items, reg.address, bad, log)
        assert err is not None and err.exit_code == 6
        assert "rejected the credentials" in err.message and f"docker login {reg.address}" in err.message
        assert wrong not in err.message and wrong not in log.text()
        view = RegistryView(reg)
        assert check_state(view, {}) == {}
        done, err2 = _publish(items, reg.address, bench.login(reg), Lines())
        assert err2 is None, err2
        check_state(view, _allowed([], done, [], items))
        return {"scenario": "wrong_credentials", "rep": rep, "fault_injected": True, "first_run_ok": False,
                "error": err.message.splitlines()[0][:200], "rerun_ok": True,
                "seconds": round(time.monotonic() - started, 1)}
    finally:
        reg.stop()


def can_mount_tmpfs(tmp: Path) -> str | None:
    """None when a tmpfs can be mounted here, else why not."""
    probe = tmp / "tmpfs-probe"
    probe.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        return f"cannot mount a tmpfs here: {res.stderr.strip() or res.returncode}"
    subprocess.run(["umount", str(probe)], check=False)
    return None


def disk_full(bench: Bench, rep: int, push_timeout: float | None = None) -> dict:
    """The registry's storage is an 8 MiB tmpfs; the new release has a 12 MiB incompressible layer.

    docker itself retries a failed layer upload 4 times (5+10+15+20 s of back-off) before it gives up;
    ``push_timeout`` bounds each copy to the registry instead (the tests use it to stay quick)."""
    started = time.monotonic()
    root = bench.tmp / f"disk-{rep}"
    data = root / "data"
    data.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(data)], check=True)
    reg = None
    try:
        reg = bench.registry(root)
        cfg = bench.login(reg)
        old_ids, new_ids = _old_then_new(bench, "disk", [random.Random(0).randbytes(12 << 20)])
        items_old, items_new = _items(old_ids, "b1"), _items(new_ids, "b2")
        old, err = _publish(items_old, reg.address, cfg, Lines())
        assert err is None, err
        saved = push_mod.COPY_TIMEOUT_S
        push_mod.COPY_TIMEOUT_S = push_timeout or saved
        try:
            with _quick_retries(extra=0):
                _, err = _publish(items_new, reg.address, cfg, Lines())
        finally:
            push_mod.COPY_TIMEOUT_S = saved
        assert err is not None and err.exit_code == 6, "a push to a full disk must fail"
        assert "no space left on device" in reg.log_path.read_text(errors="replace")
        view = RegistryView(reg)
        mid = check_state(view, _merge(_allowed(old, [], items_old, []), _long_only(items_new, view)))
        assert all(mid[i.repository]["stable"] == o.digest for i, o in zip(items_old, old, strict=True))
        subprocess.run(["mount", "-o", "remount,size=256m", str(data)], check=True)  # the operator frees space
        again, err2 = _publish(items_new, reg.address, cfg, Lines())
        assert err2 is None, err2
        check_state(view, _allowed(old, again, items_old, items_new))
        return {"scenario": "disk_full", "rep": rep, "fault_injected": True, "first_run_ok": False,
                "error": err.message.splitlines()[0][:300], "rerun_ok": True,
                "seconds": round(time.monotonic() - started, 1)}
    finally:
        if reg is not None:
            reg.stop()
        subprocess.run(["umount", "-l", str(data)], check=False)


# ---- builds
_DRIVER = r"""
import json, sys
from pathlib import Path
from types import SimpleNamespace
from builder.build import Builder, BuildOptions
from builder.dockerclient import find_docker
state, name, key, dockerfile, context, ca = sys.argv[1:7]
opts = BuildOptions(state_dir=Path(state), templates=Path(state), ca_bundle=Path(ca) if ca else None)
b = Builder.__new__(Builder)
b.options, b.state, b.docker, b.log = opts, opts.state, find_docker(), lambda line: print(line, flush=True)
v = SimpleNamespace(id="faults:build", image="faults", tag=name)
r = b._stage(v, name, key, lambda tag: b._docker_build(v, name, Path(dockerfile), Path(context), tag, key, {}, {}))
print(json.dumps({"image_id": r.image_id, "tag": r.image, "skipped": r.skipped}), flush=True)
"""


def run_stage_build(state: Path, name: str, key: str, dockerfile: Path, context: Path, ca: Path | None = None,
                    *, popen: bool = False):
    """builder.build.Builder._stage + _docker_build (the BuildKit path of `mopt build`) in a child process."""
    argv = [sys.executable, "-c", _DRIVER, str(state), name, key, str(dockerfile), str(context), str(ca or "")]
    if popen:
        return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)


def stage_tags(docker: DockerCli, name: str) -> dict[str, str]:
    """{tag: io.mopt.stage.key label} of mopt-stage/<name>."""
    out = run_docker(["images", "--format", "{{.Repository}}:{{.Tag}}", f"mopt-stage/{name}"], docker=docker).stdout
    tags = {}
    for ref in out.split():
        labels = run_docker(["image", "inspect", "--format", "{{json .Config.Labels}}", ref], docker=docker).stdout
        tags[ref] = (json.loads(labels) or {}).get("io.mopt.stage.key", "")
    return tags


def rerun_tags_the_stage(bench: Bench, state: Path, name: str, key: str, ctx: Path) -> None:
    """After a fault: the same build re-run completes, tags the stage with its key, leaves no -partial tag."""
    res = run_stage_build(state, name, key, ctx / "Dockerfile", ctx)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    after = stage_tags(bench.docker, name)
    assert after.get(f"mopt-stage/{name}:{key[:32]}") == key, after
    assert not [t for t in after if t.endswith("-partial")], f"stray partial tag: {after}"


def build_killed(bench: Bench, rep: int) -> dict:
    """SIGKILL the build process while BuildKit runs a RUN step; no half-tagged stage; a re-run completes.

    Odd reps kill only the Python process (its docker CLI child finishes on its own: the worst case
    for half tags); even reps kill the whole process group (the build is cancelled)."""
    started = time.monotonic()
    name = f"faults{bench.suffix}"
    key = hashlib.sha256(f"{bench.suffix}-{rep}".encode()).hexdigest()
    ctx = bench.tmp / f"build-{rep}"
    ctx.mkdir(parents=True)
    (ctx / "Dockerfile").write_text(f"FROM {bench.shell}\nRUN echo {key} > /key && sleep 2\n"
                                    "RUN sha256sum /key > /sum\n")
    state = bench.tmp / "state"
    bench.names.append(f"mopt-stage/{name}:{key[:32]}")
    proc = run_stage_build(state, name, key, ctx / "Dockerfile", ctx, popen=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # wait until BuildKit is inside the RUN step
        if "sleep 2" in line or "docker build ->" in line:
            break
    time.sleep(0.8)
    whole_group = rep % 2 == 0
    if whole_group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    time.sleep(4)  # an orphaned docker CLI finishes its build meanwhile
    real = f"mopt-stage/{name}:{key[:32]}"
    after_kill = stage_tags(bench.docker, name)
    assert real not in after_kill, f"the final stage tag exists after the kill: {after_kill}"
    assert all(v == "" or k.endswith("-partial") for k, v in after_kill.items() if key[:32] in k)
    rerun_tags_the_stage(bench, state, name, key, ctx)
    return {"scenario": "build_killed", "rep": rep, "fault_injected": True, "first_run_ok": False,
            "killed": "process group" if whole_group else "python process only (docker CLI orphaned)",
            "partial_tag_left_by_kill": any(t.endswith("-partial") for t in after_kill), "rerun_ok": True,
            "seconds": round(time.monotonic() - started, 1)}


DOCKERD_LOG = Path("/var/log/dockerd.log")


def restart_dockerd(docker: DockerCli, timeout: float = 90) -> float:
    """Stop dockerd the way a service manager does (SIGTERM, then SIGKILL after a grace period: a
    graceful stop would let the build finish) and start it the way scripts/setup.sh does; returns
    seconds until `docker info` answers again."""
    started = time.monotonic()
    pids = subprocess.run(["pidof", "dockerd"], capture_output=True, text=True).stdout.split()
    assert pids, "no dockerd process to restart"
    for pid in pids:
        os.kill(int(pid), signal.SIGTERM)
    grace = time.monotonic() + 3
    deadline = time.monotonic() + timeout
    while subprocess.run(["pidof", "dockerd"], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "dockerd did not stop"
        if time.monotonic() > grace:
            for pid in subprocess.run(["pidof", "dockerd"], capture_output=True, text=True).stdout.split():
                with suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.2)
    # Without TMPDIR: scripts/test.sh points it at the run's own dir and removes that dir at the end, and a
    # daemon that outlives the run and keeps it makes every later `docker exec` fail (runc writes there)
    env = {name: value for name, value in os.environ.items() if name != "TMPDIR"}
    with DOCKERD_LOG.open("ab") as log:
        subprocess.Popen(["/usr/sbin/dockerd"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True, env=env)
    while run_docker(["info"], docker=docker, check=False, timeout=10).returncode != 0:
        assert time.monotonic() < deadline, "dockerd did not come back"
        time.sleep(0.5)
    return time.monotonic() - started


def exec_works_in_a_container(bench: Bench) -> str:
    """'ok', or docker exec's error: runc writes each exec's files under the daemon's TMPDIR, so a daemon
    started with a temp dir that is gone since fails every exec (what the smoke tests' checks use)."""
    name = f"faults-exec{bench.suffix}"
    run_docker(["rm", "-f", name], docker=bench.docker, check=False, timeout=60)
    run_docker(["run", "-d", "--name", name, bench.shell, "/bin/sleep", "60"], docker=bench.docker, timeout=60)
    try:
        done = run_docker(["exec", name, "/bin/sh", "-c", "echo exec-ok"], docker=bench.docker, check=False,
                          timeout=60)
        return "ok" if done.returncode == 0 and "exec-ok" in done.stdout else (done.stderr or done.stdout).strip()
    finally:
        run_docker(["rm", "-f", name], docker=bench.docker, check=False, timeout=60)


def dockerd_restarted(bench: Bench, rep: int) -> dict:
    """dockerd restarted while BuildKit runs a RUN step: the build fails clearly, leaves no stage tag,
    and a re-run completes. Stops every container on the host: CI (or MOPT_ALLOW_DOCKERD_RESTART=1) only."""
    started = time.monotonic()
    name = f"faults{bench.suffix}"
    key = hashlib.sha256(f"dockerd-{bench.suffix}-{rep}".encode()).hexdigest()
    ctx = bench.tmp / f"dockerd-{rep}"
    ctx.mkdir(parents=True)
    (ctx / "Dockerfile").write_text(f"FROM {bench.shell}\nRUN echo {key} > /key && sleep 30\n")
    state = bench.tmp / "state"
    real = f"mopt-stage/{name}:{key[:32]}"
    bench.names.append(real)
    proc = run_stage_build(state, name, key, ctx / "Dockerfile", ctx, popen=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # BuildKit's own output goes to the stage log, not here
        lines.append(line)
        if "docker build ->" in line:
            break
    time.sleep(4.0)  # inside the 30 s RUN step by now (its base is a tiny local image)
    # Restarted from a process whose TMPDIR is a dir removed afterwards, as scripts/test.sh's run dir is
    caller_tmp = bench.tmp / f"dockerd-caller-tmp-{rep}"
    caller_tmp.mkdir()
    with mock.patch.dict(os.environ, {"TMPDIR": str(caller_tmp)}):
        restart_s = restart_dockerd(bench.docker)
    shutil.rmtree(caller_tmp)
    lines += proc.stdout.readlines()
    code = proc.wait(120)
    output = "".join(lines)
    assert code != 0, f"the build survived a dockerd restart?\n{output[-1500:]}"
    assert "stage failed" in output or "failed with exit code" in output or "Error" in output, output[-1500:]
    after_restart = stage_tags(bench.docker, name)
    assert real not in after_restart, f"a stage tag exists after the failed build: {after_restart}"
    rerun_tags_the_stage(bench, state, name, key, ctx)
    exec_works = exec_works_in_a_container(bench)
    return {"scenario": "dockerd_restarted", "rep": rep, "fault_injected": True, "first_run_ok": False,
            "build_exit": code, "dockerd_back_after_s": round(restart_s, 1), "rerun_ok": True,
            "exec_after_caller_tmp_removed": exec_works,
            "seconds": round(time.monotonic() - started, 1)}


SCENARIOS: dict[str, Callable[[Bench, int], dict]] = {
    "registry_killed": registry_killed, "proxy": proxy, "wrong_credentials": wrong_credentials,
    "disk_full": disk_full, "build_killed": build_killed, "dockerd_restarted": dockerd_restarted}


def summarise(rows: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for row in rows:
        s = out.setdefault(row["scenario"], {"runs": 0, "faults_injected": 0, "survived": 0, "first_run_ok": 0,
                                             "seconds": 0.0})
        s["runs"] += 1
        s["faults_injected"] += int(bool(row.get("fault_injected")))
        s["survived"] += int(bool(row.get("rerun_ok")))
        s["first_run_ok"] += int(bool(row.get("first_run_ok")))
        s["seconds"] = round(s["seconds"] + row["seconds"], 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    bench = Bench(Path(tempfile.mkdtemp(prefix="mopt-faults-")))
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    try:
        for name in args.only.split(","):
            if name == "disk_full":
                why = can_mount_tmpfs(bench.tmp)
                if why:
                    skipped[name] = why
                    continue
            if name == "dockerd_restarted" and os.environ.get("MOPT_ALLOW_DOCKERD_RESTART") != "1":
                skipped[name] = "restarting dockerd stops every container on the host; MOPT_ALLOW_DOCKERD_RESTART=1"
                continue
            for rep in range(args.reps):
                try:
                    row = SCENARIOS[name](bench, rep)
                except AssertionError as exc:
                    row = {"scenario": name, "rep": rep, "rerun_ok": False, "seconds": 0.0, "failure": str(exc)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        bench.cleanup()
    summary = summarise(rows)
    report = {"reps": args.reps, "summary": summary, "skipped": skipped, "runs": rows,
              "note": "dockerd is not restarted (shared daemon); the build process is killed instead"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"written to {args.out}")
    if any(not r.get("rerun_ok") for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
