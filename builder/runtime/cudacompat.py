"""CUDA forward compatibility at start: on a driver older than the image's CUDA toolkit needs, put the
image's cuda-compat libraries (libcuda.so.* of a newer driver, data-center GPUs only) first on the
loader path and re-execute, before anything loads libcuda. The dynamic loader reads LD_LIBRARY_PATH
once, when the process starts; hence the re-exec. On a driver new enough the compat libraries must
not be used (NVIDIA: unsupported, CUDA error 803). Stdlib only: this runs first thing, before torch.

The images set MOPT_CUDA_COMPAT_DIR (e.g. /usr/local/cuda-12.8/compat) and MOPT_CUDA_MIN_DRIVER (the
toolkit's minimum driver, e.g. 570.26); CPU images set neither. MOPT_CUDA_COMPAT_APPLIED=1 marks the
re-executed process, so it never re-executes again."""
from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .hostinfo import _NVRM, PROC_DRIVER_VERSION

COMPAT_DIR_ENV = "MOPT_CUDA_COMPAT_DIR"
MIN_DRIVER_ENV = "MOPT_CUDA_MIN_DRIVER"
APPLIED_ENV = "MOPT_CUDA_COMPAT_APPLIED"

_VERSION = re.compile(r"\d+(?:\.\d+)*")


@dataclass(frozen=True)
class Decision:
    action: str  # "none" or "use-compat"
    reason: str
    ld_library_path: str | None = None  # the new LD_LIBRARY_PATH, for "use-compat" only


def _version(text: str) -> tuple[int, ...] | None:
    text = text.strip()
    return tuple(int(part) for part in text.split(".")) if _VERSION.fullmatch(text) else None


def _older(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)) < b + (0,) * (width - len(b))


def _prepend(directory: str, current: str | None) -> str:
    entries = current.split(":") if current else []
    if entries and os.path.normpath(entries[0] or ".") == os.path.normpath(directory):
        return current  # already first: not duplicated
    return ":".join([directory, *entries])


def decide(environ: Mapping[str, str], driver: str | None) -> Decision:
    """What to do at start, from the environment and the host driver's version (None: no GPU driver)."""
    compat_dir, minimum = environ.get(COMPAT_DIR_ENV, "").strip(), environ.get(MIN_DRIVER_ENV, "").strip()
    if not compat_dir or not minimum:
        return Decision("none", f"{COMPAT_DIR_ENV} or {MIN_DRIVER_ENV} not set (no CUDA forward compatibility)")
    if not driver:
        return Decision("none", "no NVIDIA driver detected: compat libraries not used")
    have, need = _version(driver), _version(minimum)
    if have is None or need is None:
        bad = f"driver version {driver!r}" if have is None else f"{MIN_DRIVER_ENV}={minimum!r}"
        return Decision("none", f"{bad} is not a dotted version: compat libraries not used")
    if not _older(have, need):
        return Decision("none", f"driver {driver.strip()} is new enough for CUDA's minimum {minimum}: "
                                "compat libraries not used")
    try:
        has_libcuda = any(Path(compat_dir).glob("libcuda.so*"))
    except OSError:
        has_libcuda = False
    if not has_libcuda:
        return Decision("none", f"driver {driver.strip()} is older than CUDA's minimum {minimum}, but the image "
                                f"carries no compat libraries (no libcuda.so* in {compat_dir})")
    return Decision("use-compat",
                    f"driver {driver.strip()} is older than CUDA's minimum {minimum}: using forward-compatibility "
                    f"libraries from {compat_dir} (data-center GPUs only)",
                    _prepend(compat_dir, environ.get("LD_LIBRARY_PATH")))


def driver_version() -> str | None:
    """The kernel module's version from PROC_DRIVER_VERSION (this module's attribute); None without one."""
    try:
        match = _NVRM.search(Path(PROC_DRIVER_VERSION).read_text(errors="replace"))
    except OSError:
        return None
    return match.group(1) if match else None


def command_line() -> list[str]:
    """This process's command line, as started (interpreter options, -m module or script, arguments)."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    return [sys.executable, *argv[1:]]


def reexec_if_needed(argv: Sequence[str] | None = None) -> None:
    """Re-execute ARGV, a command line whose first item (the interpreter) becomes sys.executable
    (default: this process's own, sys.orig_argv), with the compat libraries first on LD_LIBRARY_PATH
    and MOPT_CUDA_COMPAT_APPLIED=1, when decide() says so and this process is not the re-executed one;
    else return. The driver comes from PROC_DRIVER_VERSION, read at call time (tests set it)."""
    if os.environ.get(APPLIED_ENV):
        return
    decision = decide(os.environ, driver_version())
    if decision.action != "use-compat":
        return
    print(f"mopt: {decision.reason}", file=sys.stderr, flush=True)
    env = {**os.environ, "LD_LIBRARY_PATH": decision.ld_library_path, APPLIED_ENV: "1"}
    if decision.ld_library_path == os.environ.get("LD_LIBRARY_PATH"):
        os.environ[APPLIED_ENV] = "1"  # already first when the loader started: nothing to re-execute
        return
    args = list(argv) if argv is not None else command_line()
    sys.stdout.flush()
    try:
        os.execve(sys.executable, [sys.executable, *args[1:]], env)
    except OSError as exc:  # keep going without; CUDA then fails as it would have
        print(f"mopt: could not re-execute with the compat libraries: {exc}", file=sys.stderr, flush=True)
