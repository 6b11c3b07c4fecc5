"""Sharing one Docker daemon safely between state directories and processes.

- The lock: one mopt process at a time works in a state dir (builds share its `-partial` tags, engine
  dirs and logs). A second one waits up to MOPT_LOCK_WAIT seconds, saying who holds the lock, then
  fails with EnvironmentProblem. An advisory flock: released by the kernel when the holder dies.
- The host's list of state dirs: every state dir mopt worked in on this host, so that `mopt prune`
  in one checkout keeps the images another checkout's records name, and leaves alone what a build in
  progress elsewhere may have made since its lock was taken.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import EnvironmentProblem

LOCK_FILE = "lock"
ENV_LOCK_WAIT = "MOPT_LOCK_WAIT"  # seconds a second process waits for a state dir's lock
DEFAULT_LOCK_WAIT_S = 1800.0
ENV_STATE_REGISTRY = "MOPT_STATE_REGISTRY"  # the host's list of state dirs (default under XDG_STATE_HOME)


@dataclass(frozen=True)
class LockHolder:
    pid: int
    command: str
    started: float  # epoch seconds the holder took the lock

    def describe(self) -> str:
        since = time.strftime("%H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} ({self.command}, since {since})"


def _lock_wait() -> float:
    raw = os.environ.get(ENV_LOCK_WAIT, "").strip()
    if not raw:
        return DEFAULT_LOCK_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise EnvironmentProblem(f"{ENV_LOCK_WAIT}={raw!r}: expected a number of seconds >= 0")
    return value


def _read_holder(path: Path) -> LockHolder | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8") or "{}")
        return LockHolder(int(data["pid"]), str(data["command"]), float(data["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def holder(root: Path) -> LockHolder | None:
    """Who holds ROOT's lock now (None when nobody does); probes without waiting."""
    path = Path(root) / LOCK_FILE
    if not path.is_file():
        return None
    with open(path, "a+", encoding="utf-8") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(path) or LockHolder(0, "unknown", path.stat().st_mtime)
        fcntl.flock(probe, fcntl.LOCK_UN)
    return None


@contextmanager
def state_lock(root: Path, command: str, log=print, wait_s: float | None = None) -> Iterator[None]:
    """Hold ROOT's lock for the block; wait for another holder up to wait_s (default MOPT_LOCK_WAIT)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    wait_s = _lock_wait() if wait_s is None else wait_s
    path = root / LOCK_FILE
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the block
    try:
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                other = _read_holder(path)
                who = other.describe() if other else "another mopt process"
                if time.monotonic() >= deadline:
                    raise EnvironmentProblem(
                        f"state dir {root} is in use by {who}; one mopt process at a time works in a state dir "
                        f"(waited {wait_s:g} s; {ENV_LOCK_WAIT} sets how long, or use another --state-dir)") from None
                if not said:
                    log(f"waiting for state dir {root}: in use by {who} (up to {wait_s:g} s)")
                    said = True
                time.sleep(0.5)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "command": command, "started": time.time()}))
        handle.flush()
        register(root)
        yield
    finally:
        handle.close()  # releases the flock


def _registry_path() -> Path:
    override = os.environ.get(ENV_STATE_REGISTRY, "").strip()
    if override:
        return Path(override)
    base = os.environ.get("XDG_STATE_HOME", "").strip() or str(Path.home() / ".local" / "state")
    return Path(base) / "mopt" / "state-dirs"


def register(root: Path) -> None:
    """Add ROOT to the host's list of state dirs (once)."""
    path = _registry_path()
    entry = str(Path(root).resolve())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+", encoding="utf-8") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            handle.seek(0)
            if entry not in handle.read().splitlines():
                handle.write(entry + "\n")
    except OSError as exc:  # a read-only home: prune then only knows the dirs it is given
        print(f"mopt: note: cannot record state dir {entry} in {path}: {exc}", file=sys.stderr)


def known_state_dirs() -> list[Path]:
    """The host's state dirs that still exist."""
    try:
        lines = _registry_path().read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return [Path(line) for line in dict.fromkeys(lines) if line.strip() and Path(line, "variants").is_dir()]
