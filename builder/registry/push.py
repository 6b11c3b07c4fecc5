"""Pushing a local image with the docker CLI: `docker push` with the release's DOCKER_CONFIG, its
output classified (auth errors never retried, transient ones a bounded number of times), the pushed
digest read back; and the registry-prefixed local tags a release creates, removed afterwards.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..dockerclient import DockerCli, run_docker
from ..errors import PublishError

Log = Callable[[str], None]

PUSH_EXTRA_ATTEMPTS = 2
PUSH_RETRY_WAIT_S = 2.0  # doubled after each transient failure
PUSH_TIMEOUT_S = 3600.0

_PUSH_DIGEST_RE = re.compile(
    r"^(?P<tag>\S+): digest: (?P<digest>sha256:[0-9a-f]{64}) size: (?P<size>\d+)\s*$", re.MULTILINE)

# `docker push` output that means the credentials are missing or refused: never retried.
_AUTH_MARKERS = ("no basic auth credentials", "unauthorized", "denied", "authentication required",
                 "forbidden", "insufficient_scope", "incorrect username or password")
# Output that means a transient failure worth another attempt.
_TRANSIENT_MARKERS = ("connection refused", "connection reset", "i/o timeout", "timeout", "eof",
                      "toomanyrequests", "too many requests", "500 internal server error",
                      "502 bad gateway", "503 service unavailable", "504 gateway", "tls handshake",
                      "broken pipe", "server misbehaving", "temporary failure", "unexpected status: 5")
_ERROR_MARKERS = _AUTH_MARKERS + ("error", "unknown blob", "manifest invalid", "name unknown",
                                  "blob upload unknown", "does not exist", "unexpected status")


@dataclass(frozen=True)
class LocalImage:
    id: str
    repo_digests: tuple[str, ...]

    def digests_for(self, name: str) -> set[str]:
        return {d.split("@", 1)[1] for d in self.repo_digests if d.split("@", 1)[0] == name}


def inspect_image(docker: DockerCli, ref: str) -> LocalImage | None:
    res = run_docker(["image", "inspect", "--format", "{{json .}}", ref], docker=docker, check=False,
                     timeout=60)
    if res.returncode != 0:
        return None
    try:
        data = json.loads(res.stdout.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None
    return LocalImage(data.get("Id", ""), tuple(data.get("RepoDigests") or ()))


_NORMAL_PUSH_LINE = re.compile(
    r"^(the push refers to repository \[[^\]]*\]|[0-9a-f]{12}: (preparing|waiting|pushed|pushing.*|"
    r"layer already exists|mounted from \S+)|\S+: digest: sha256:[0-9a-f]{64} size: \d+)$")
_TRANSIENT_RE = re.compile("|".join([re.escape(m) for m in _TRANSIENT_MARKERS if m != "eof"] + [r"\beof\b"]))


def classify_push_output(output: str) -> str:
    """'auth', 'transient', 'error' or 'ok' for a ``docker push`` output (exit code aside).

    Docker's ordinary progress lines (and the repository name they echo) are ignored; any other
    line with an error marker counts.
    """
    lines = [ln.strip().lower() for ln in output.splitlines() if ln.strip()]
    rest = [ln for ln in lines if not _NORMAL_PUSH_LINE.match(ln)]
    if any(m in ln for ln in rest for m in _AUTH_MARKERS):
        return "auth"
    if any(_TRANSIENT_RE.search(ln) for ln in rest):
        return "transient"
    if any(m in ln for ln in rest for m in _ERROR_MARKERS):
        return "error"
    return "ok"


def _error_lines(output: str, n: int = 6) -> str:
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    noisy = re.compile(r"^\S+: (preparing|waiting|pushed|pushing|layer already exists|mounted from|retrying in)",
                       re.I)
    useful = [ln for ln in lines if not noisy.match(ln)]
    return " | ".join((useful or lines)[-n:]) or "(no output)"


_LAYER_PROGRESS = re.compile(r"^\s*[0-9a-f]{12}: ")


def _worth_logging(line: str) -> bool:
    """Per-layer progress lines are noise in a release log; keep the rest (digest line, errors)."""
    return bool(line.strip()) and not _LAYER_PROGRESS.match(line)


def docker_push(docker: DockerCli, ref: str, config_dir: Path, *, log: Log,
                redact: Iterable[str] = (), auth_retries: int = 0) -> str:
    """``docker push ref`` with DOCKER_CONFIG=config_dir; return the pushed manifest digest.

    Raises PublishError on any error output or a missing digest line; retries transient failures
    at most PUSH_EXTRA_ATTEMPTS extra times. Auth failures are retried only ``auth_retries`` times
    (publish passes 1: the registry API has just accepted the same credentials, so docker's
    "unauthorized" then comes from a failed /v2/ ping behind a flaky proxy, not from the password).
    """
    tag = ref.rsplit(":", 1)[1]
    secrets = [s for s in redact if s]
    attempts = 1 + PUSH_EXTRA_ATTEMPTS
    for attempt in range(1, attempts + 1):
        recent: list[str] = []

        def keep(line: str, recent: list[str] = recent) -> None:
            recent.append(line)
            del recent[:-8]
            if _worth_logging(line):
                log(f"    {line}")

        try:
            res = run_docker(["push", ref], docker=docker, check=False, env={"DOCKER_CONFIG": str(config_dir)},
                             timeout=PUSH_TIMEOUT_S, redact=secrets, error_cls=PublishError, log=keep)
        except PublishError as exc:  # timed out: say what docker was doing (e.g. "Retrying in 5 seconds")
            raise PublishError(f"{exc.message}; docker's last output: {_error_lines(chr(10).join(recent))}") \
                from None
        output = (res.stdout or "") + (res.stderr or "")
        kind = classify_push_output(output)
        digests = [m.group("digest") for m in _PUSH_DIGEST_RE.finditer(output) if m.group("tag") == tag]
        if res.returncode == 0 and kind == "ok" and len(set(digests)) == 1:
            return digests[0]
        detail = _error_lines(output)
        if kind == "auth" and auth_retries > 0 and attempt < attempts:
            auth_retries -= 1
            log(f"  docker push {ref} was refused (attempt {attempt}/{attempts}) although the registry API "
                f"accepted these credentials; retrying once: {detail}")
            time.sleep(PUSH_RETRY_WAIT_S)
            continue
        if kind == "auth":
            raise PublishError(f"docker push {ref} was refused by the registry (authentication/"
                               f"authorization): {detail}; check `docker login {ref.split('/', 1)[0]}` "
                               f"in {config_dir}")
        if kind == "transient" and attempt < attempts:
            wait = PUSH_RETRY_WAIT_S * 2 ** (attempt - 1)
            log(f"  docker push {ref} failed transiently (attempt {attempt}/{attempts}): {detail}; "
                f"retrying in {wait:.0f}s")
            time.sleep(wait)
            continue
        if res.returncode == 0 and kind == "ok":
            raise PublishError(f"docker push {ref} printed no single 'digest: sha256:... size:' line for tag "
                               f"{tag!r}: {detail}")
        raise PublishError(f"docker push {ref} failed (exit {res.returncode}, attempt {attempt}/{attempts}): "
                           f"{detail}")
    raise AssertionError("unreachable")  # pragma: no cover


class LocalTags:
    """Registry-prefixed local tags this run created, removed on exit (the image is kept)."""

    def __init__(self, docker: DockerCli, log: Log):
        self.docker, self.log, self.created = docker, log, []

    def tag(self, image_id: str, ref: str) -> None:
        existing = inspect_image(self.docker, ref)
        if existing is not None and existing.id == image_id:
            return  # someone else's tag, already right: leave it alone
        run_docker(["tag", image_id, ref], docker=self.docker, error_cls=PublishError, timeout=60)
        if existing is None:
            self.created.append(ref)

    def cleanup(self) -> None:
        for ref in reversed(self.created):
            res = run_docker(["rmi", "--no-prune", ref], docker=self.docker, check=False, timeout=60)
            if res.returncode != 0:
                why = _error_lines(res.stderr or res.stdout)
                self.log(f"  warning: could not remove local tag {ref}: {why}")
        self.created.clear()


@contextmanager
def local_tags(docker: DockerCli, log: Log) -> Iterator[LocalTags]:
    tags = LocalTags(docker, log)
    try:
        yield tags
    finally:
        tags.cleanup()
