"""Error classes that carry their exit code (the CLI maps them; no traceback for user errors)."""
from __future__ import annotations


def clipped(text: str, limit: int = 300) -> str:
    """`text` cut to `limit` characters: an error that quotes a file or a value stays one readable line."""
    return text if len(text) <= limit else text[:limit] + "..."


def quoted(value: object, limit: int = 60) -> str:
    """A value as an error message quotes it (its repr), clipped."""
    return clipped(repr(value), limit)


class MoptError(Exception):
    """Base class: a message for the user and the process exit code."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(MoptError):
    """Bad input: config files, arguments, select patterns. Exit 2."""

    exit_code = 2

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None,
                 line: int | None = None):
        where = ""
        if file:
            where = file + (f":{line}" if line else "")
        if key:
            where = f"{where}: {key}" if where else key
        super().__init__(f"{where}: {message}" if where else message)
        self.file, self.key, self.line = file, key, line


class IncompatibleError(MoptError):
    """A combination that cannot work (compat check). Exit 3."""

    exit_code = 3


class BuildError(MoptError):
    """An image build or engine compile failed. Exit 4."""

    exit_code = 4


class SmokeTestError(MoptError):
    """A smoke test failed. Exit 5."""

    exit_code = 5


class PublishError(MoptError):
    """Pushing to the registry failed or a digest did not verify. Exit 6.

    A failed release says how far it got: `failed` names the variant it stopped at, `published` lists
    the results (registry.phases.PublishResult) whose short tag moved, `long_verified` the long tags that
    are in the registry and verified, which a re-run skips."""

    exit_code = 6

    def __init__(self, message: str, *, failed: str | None = None, published: tuple = (),
                 long_verified: tuple[str, ...] = ()):
        super().__init__(message)
        self.failed = failed
        self.published = list(published)
        self.long_verified = list(long_verified)


class EnvironmentProblem(MoptError):
    """Something the host lacks (docker daemon, BuildKit client, disk). Exit 7."""

    exit_code = 7


class VerificationFailed(MoptError):
    """An image's signed attestations are missing, not signed by the given key, or about another
    digest. Exit 8."""

    exit_code = 8


class IndexUnavailable(MoptError):
    """The package index (mopt kb check) is offline, unreachable, or answered with something unusable.
    Exit 9."""

    exit_code = 9


class BenchError(MoptError):
    """A bench target could not be measured: it did not start, could not be reached, or answered
    something that is not an embeddings response (mopt bench). Exit 10."""

    exit_code = 10
