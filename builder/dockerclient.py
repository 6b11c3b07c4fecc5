"""Find a BuildKit-capable docker CLI with a reachable daemon, and run it.

Machines differ: some have the buildx plugin, some only a client whose built-in BuildKit
works with DOCKER_BUILDKIT=1 (Debian's docker.io 20.10), and some have a newer CLI first on
PATH that has neither (a 28.x CLI without buildx fails every BuildKit build). We therefore try
candidates in order ($MOPT_DOCKER, /usr/bin/docker, `docker` on PATH), prefer one with a working
buildx, else one whose built-in BuildKit passes a trivial probe build (COPY + --secret), and
cache the answer per process.

Secret values are never logged: secrets reach builds as files (``--secret id=x,src=FILE``) or
stdin, and ``run_docker`` masks any string passed in ``redact`` from logged lines and output.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .errors import BuildError, EnvironmentProblem, MoptError

BuildkitKind = Literal["buildx", "builtin"]

DEFAULT_CANDIDATES = ("/usr/bin/docker", "docker")
DOCKER_ROOT = Path("/var/lib/docker")  # where the daemon keeps images and BuildKit's cache
PROBE_TIMEOUT_S = 120
QUICK_TIMEOUT_S = 30

_cache: dict[tuple[str, ...], DockerCli] = {}
_cache_lock = threading.Lock()


@dataclass(frozen=True)
class DockerCli:
    """A docker client binary that can run BuildKit builds against a reachable daemon."""

    path: str
    version: str  # client version
    buildkit: BuildkitKind
    server_version: str = ""

    def build_args(self) -> list[str]:
        """The subcommand for a BuildKit build, for ``run_docker([*cli.build_args(), ...])``.

        With buildx, ``--load`` puts the result into the daemon's image store like ``docker build``.
        """
        if self.buildkit == "buildx":
            return ["buildx", "build", "--load"]
        return ["build"]

    def build_cmd(self) -> list[str]:
        """The full argv prefix for a BuildKit build (client path + build_args())."""
        return [self.path, *self.build_args()]

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment to run this client with: the current one plus DOCKER_BUILDKIT=1."""
        env = dict(os.environ)
        env["DOCKER_BUILDKIT"] = "1"
        if extra:
            env.update(extra)
        return env


@dataclass(frozen=True)
class _Attempt:
    candidate: str
    problem: str


def skopeo_daemon_host(side: Literal["src", "dest"], env: Mapping[str, str] | None = None) -> list[str]:
    """skopeo's arguments that point its docker-daemon: transport at the daemon docker uses: skopeo reads
    /var/run/docker.sock unless told, while docker and the SDK follow DOCKER_HOST (rootless Docker, a
    second daemon)."""
    host = (os.environ if env is None else env).get("DOCKER_HOST", "")
    return [f"--{side}-daemon-host", host] if host else []


def docker_free_gib(fallback: Path = Path("/")) -> float:
    """GiB free under the daemon's root (under FALLBACK where that directory is not on this host)."""
    return shutil.disk_usage(DOCKER_ROOT if DOCKER_ROOT.exists() else fallback).free / 2**30


def candidate_paths(env: Mapping[str, str] | None = None) -> list[str]:
    """Candidate client binaries, in order, resolved to absolute paths and de-duplicated.

    Unresolvable entries are kept as given so the error message can name them.
    """
    env = os.environ if env is None else env
    raw: list[str] = []
    if env.get("MOPT_DOCKER"):
        raw.append(env["MOPT_DOCKER"])
    raw.extend(DEFAULT_CANDIDATES)
    out: list[str] = []
    seen: set[str] = set()
    for cand in raw:
        resolved = shutil.which(cand, path=env.get("PATH")) if os.sep not in cand else cand
        key = os.path.realpath(resolved) if resolved else cand
        if key in seen:
            continue
        seen.add(key)
        out.append(resolved or cand)
    return out


def _quick(argv: Sequence[str], timeout: float = QUICK_TIMEOUT_S,
           env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL)


def _last_line(text: str) -> str:
    """The most telling line of a failed command's output: its first ERROR line, else the last."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in lines:
        if ln.upper().startswith("ERROR"):
            return ln
    return lines[-1] if lines else "(no output)"


def _client_and_daemon(path: str) -> tuple[str, str]:
    """Return (client version, server version); raise _Unusable with a reason."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise _Unusable("not found or not executable")
    try:
        cv = _quick([path, "version", "--format", "{{.Client.Version}}"])
        client = cv.stdout.strip().splitlines()[0] if cv.stdout.strip() else ""
        sv = _quick([path, "version", "--format", "{{.Server.Version}}"])
    except subprocess.TimeoutExpired as exc:
        raise _Unusable(f"`{path} version` timed out (daemon hung?)") from exc
    if sv.returncode != 0 or not sv.stdout.strip():
        raise _Unusable(f"cannot reach the Docker daemon: {_last_line(sv.stderr or sv.stdout)}")
    return client or "unknown", sv.stdout.strip()


class _Unusable(Exception):
    pass


def _probe_build(cli: DockerCli) -> None:
    """A trivial BuildKit build with COPY and --secret, exported to a local dir (no image left)."""
    with tempfile.TemporaryDirectory(prefix="mopt-probe-") as tmp:
        ctx = os.path.join(tmp, "ctx")
        out = os.path.join(tmp, "out")
        os.makedirs(ctx)
        with open(os.path.join(ctx, "probe.txt"), "w") as f:
            f.write("mopt buildkit probe\n")
        with open(os.path.join(ctx, "Dockerfile"), "w") as f:
            # No `# syntax=` line: the frontend image would be pulled, and cannot be.
            f.write("FROM scratch\nCOPY probe.txt /probe.txt\n")
        secret = os.path.join(tmp, "secret")
        with open(secret, "w") as f:
            f.write("probe")
        argv = [*cli.build_cmd(), "--progress=plain", "--secret", f"id=probe,src={secret}",
                "--output", f"type=local,dest={out}", ctx]
        if cli.buildkit == "buildx":
            argv.remove("--load")  # --load and --output are exclusive
        try:
            res = _quick(argv, timeout=PROBE_TIMEOUT_S, env=cli.env())
        except subprocess.TimeoutExpired as exc:
            raise _Unusable("probe build timed out") from exc
        if res.returncode != 0:
            raise _Unusable(f"BuildKit probe build failed: {_last_line(res.stderr or res.stdout)}")
        if not os.path.isfile(os.path.join(out, "probe.txt")):
            raise _Unusable("BuildKit probe build produced no output (legacy builder?)")


def _has_buildx(path: str) -> bool:
    try:
        return _quick([path, "buildx", "version"]).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _detect(candidates: Sequence[str]) -> DockerCli:
    attempts: list[_Attempt] = []
    reachable: list[tuple[str, str, str]] = []
    for cand in candidates:
        try:
            client, server = _client_and_daemon(cand)
        except _Unusable as exc:
            attempts.append(_Attempt(cand, str(exc)))
            continue
        reachable.append((cand, client, server))

    # Pass 1: a client with the buildx plugin whose build works.
    for cand, client, server in reachable:
        if not _has_buildx(cand):
            continue
        cli = DockerCli(cand, client, "buildx", server)
        try:
            _probe_build(cli)
            return cli
        except _Unusable as exc:
            attempts.append(_Attempt(cand, f"buildx: {exc}"))

    # Pass 2: built-in BuildKit (DOCKER_BUILDKIT=1).
    for cand, client, server in reachable:
        cli = DockerCli(cand, client, "builtin", server)
        try:
            _probe_build(cli)
            return cli
        except _Unusable as exc:
            attempts.append(_Attempt(cand, f"no buildx plugin; built-in BuildKit: {exc}"))

    tried = "\n".join(f"  - {a.candidate}: {a.problem}" for a in attempts) or "  (none)"
    raise EnvironmentProblem(
        "no docker client that can run BuildKit builds against a reachable daemon.\n"
        f"Tried:\n{tried}\n"
        "Fix: install Debian's engine and client (`apt-get install docker.io`, which has BuildKit "
        "built in at /usr/bin/docker) or the buildx plugin; start the daemon "
        "(`dockerd > /var/log/dockerd.log 2>&1 &`, or run scripts/setup.sh); "
        "or point $MOPT_DOCKER at a working client."
    )


def find_docker(candidates: Iterable[str] | None = None, *, refresh: bool = False) -> DockerCli:
    """Return a BuildKit-capable docker client with a reachable daemon (cached per process).

    ``candidates`` overrides the search order ($MOPT_DOCKER, /usr/bin/docker, docker on PATH).
    Raises EnvironmentProblem naming every candidate tried and why it was unusable.
    """
    cands = tuple(candidates) if candidates is not None else tuple(candidate_paths())
    with _cache_lock:
        if not refresh and cands in _cache:
            return _cache[cands]
        cli = _detect(cands)
        _cache[cands] = cli
        return cli


def clear_cache() -> None:
    """Forget the cached detection (tests, or after starting a daemon)."""
    with _cache_lock:
        _cache.clear()


def mask_secrets(text: str, redact: Sequence[str]) -> str:
    for secret in redact:
        if secret:
            text = text.replace(secret, "***")
    return text


def run_docker(
    args: Sequence[str],
    *,
    docker: DockerCli | None = None,
    log: Callable[[str], None] | None = None,
    check: bool = True,
    input: str | bytes | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    redact: Sequence[str] = (),
    error_cls: type[MoptError] = BuildError,
    echo: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``docker <args>`` with DOCKER_BUILDKIT=1 and return the CompletedProcess.

    With ``log``, stdout and stderr are merged and each line is passed to ``log`` as it arrives
    (``stdout`` then holds the merged text, ``stderr`` is ""). Without it both are captured
    separately. ``echo`` also logs the command line. Any string in ``redact`` is replaced by
    ``***`` in logged lines, in the returned output and in error messages; pass secrets through
    ``input`` (stdin) or files, never as arguments. ``check`` raises ``error_cls`` (BuildError by
    default) with the last output lines when the command fails or times out.
    """
    cli = docker or find_docker()
    argv = [cli.path, *[str(a) for a in args]]
    run_env = cli.env(env)
    shown = mask_secrets(" ".join(argv), redact)
    if log and echo:
        log(f"$ {shown}")
    data = input.encode() if isinstance(input, str) else input

    if log is None:
        try:
            res = subprocess.run(argv, input=data, capture_output=True, env=run_env, cwd=cwd,
                                 timeout=timeout, stdin=None if data is not None else subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise error_cls(f"`{shown}` timed out after {timeout}s") from exc
        out = mask_secrets(res.stdout.decode(errors="replace"), redact)
        err = mask_secrets(res.stderr.decode(errors="replace"), redact)
        result = subprocess.CompletedProcess(argv, res.returncode, out, err)
    else:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=run_env, cwd=cwd)
        if data is not None:
            assert proc.stdin is not None
            try:
                proc.stdin.write(data)
            finally:
                proc.stdin.close()
        timer = None
        timed_out = threading.Event()
        if timeout:
            def _kill() -> None:
                timed_out.set()
                proc.kill()
            timer = threading.Timer(timeout, _kill)
            timer.start()
        chunks: list[str] = []
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = mask_secrets(raw.decode(errors="replace"), redact)
                chunks.append(line)
                log(line.rstrip("\n"))
            rc = proc.wait()
        finally:
            if timer:
                timer.cancel()
        if timed_out.is_set():
            raise error_cls(f"`{shown}` timed out after {timeout}s")
        result = subprocess.CompletedProcess(argv, rc, "".join(chunks), "")

    if check and result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise error_cls(f"`{shown}` failed with exit code {result.returncode}:\n{tail}")
    return result


__all__ = ["DockerCli", "find_docker", "run_docker", "clear_cache", "candidate_paths"]
