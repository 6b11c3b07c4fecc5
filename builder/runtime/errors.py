"""Runtime errors carry their exit code so the CLI never shows a traceback for a user error.

These mirror builder/errors.py on purpose: the runtime ships alone inside images (as mopt_runtime)
and must not import the host-side package."""
from __future__ import annotations


class RuntimeToolError(Exception):
    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(RuntimeToolError):
    """Bad arguments or input files. Exit 2 (matches the build side's ConfigError)."""

    exit_code = 2


class GuardError(RuntimeToolError):
    """The engine does not fit this host or was altered. Exit 3 (incompatible combination)."""

    exit_code = 3


class CompileError(RuntimeToolError):
    """The engine compile failed. Exit 4 (matches the build side's BuildError)."""

    exit_code = 4
