"""Small version helpers: dotted versions, the KB's range notation, sm / compute capability, CUDA.

Range notation (used in builder/data/compat.yaml):

    "12.1"        prefix match: 12.1, 12.1.0, 12.1.1 ... (not 12.10)
    "12.0-12.8"   inclusive; lower bound compared as a version, upper bound by prefix
                  (12.0 <= v and v[:2] <= 12.8, so 12.8.1 is in, 12.9 is not)
    ">=10.13.2"   PEP 440 comparison; also >, <, <=, ==, != (the local part "+cpu" is ignored)
    "10.13.2+"    same as ">=10.13.2"
    "~10.11.0"    >=10.11.0,<10.12 (same major.minor)
    "*"           anything
    "a,b"         AND of terms;  a list of ranges (see `in_any`) is OR.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from packaging.version import InvalidVersion, Version

from .errors import ConfigError, quoted

__all__ = [
    "VersionRange",
    "cc_to_sm",
    "compare_versions",
    "in_any",
    "major_minor",
    "normalize_cuda",
    "normalize_driver",
    "normalize_sm",
    "parse_range",
    "parse_version",
    "release",
    "sm_major_minor",
    "sm_to_cc",
]

_DOTTED = re.compile(r"^\d+(\.\d+)*$", re.ASCII)


def parse_version(value: object) -> Version:
    """Parse "12.1", "10.13.2", "580.65.06", "2.13.0+cpu", "2.8.0a0" into a packaging Version."""
    if isinstance(value, Version):
        return value
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"not a version: {value!r}")
    return _parse_version_text(str(value))


@lru_cache(maxsize=4096)
def _parse_version_text(value: str) -> Version:
    text = value.strip()
    if not text:
        raise ConfigError("empty version")
    if text[0] in "vV":
        text = text[1:]
    if not text.isascii():
        raise ConfigError(f"not a version: {value!r}")
    try:
        return Version(text)
    except InvalidVersion:
        raise ConfigError(f"not a version: {value!r}") from None


def release(value: object) -> tuple[int, ...]:
    """The numeric release tuple: "580.65.06" -> (580, 65, 6); "2.13.0+cpu" -> (2, 13, 0)."""
    return parse_version(value).release


def compare_versions(a: object, b: object) -> int:
    """-1, 0 or 1 (public versions; a local part like +cu128 is ignored)."""
    va, vb = Version(parse_version(a).public), Version(parse_version(b).public)
    return (va > vb) - (va < vb)


def major_minor(value: object) -> str:
    """ "12.8.1" -> "12.8"; "12" -> "12.0"."""
    rel = release(value)
    return f"{rel[0]}.{rel[1] if len(rel) > 1 else 0}"


def _pad(rel: tuple[int, ...], n: int) -> tuple[int, ...]:
    return rel[:n] + (0,) * (n - len(rel)) if len(rel) < n else rel[:n]


_OPS = (">=", "<=", "==", "!=", ">", "<")


@dataclass(frozen=True)
class _Term:
    op: str          # one of _OPS, "prefix", "span", "tilde", "any"
    a: str = ""
    b: str = ""

    def contains(self, v: Version) -> bool:
        pub = Version(v.public)
        if self.op == "any":
            return True
        if self.op == "prefix":
            want = release(self.a)
            return _pad(v.release, len(want)) == want
        if self.op == "span":
            hi = release(self.b)
            return pub >= parse_version(self.a) and _pad(v.release, len(hi)) <= hi
        if self.op == "tilde":
            lo = parse_version(self.a)
            rel = lo.release
            upper = Version(f"{rel[0]}.{(rel[1] if len(rel) > 1 else 0) + 1}")
            return lo <= pub < upper
        other = parse_version(self.a)
        return {
            ">=": pub >= other, "<=": pub <= other, "==": pub == other,
            "!=": pub != other, ">": pub > other, "<": pub < other,
        }[self.op]


@dataclass(frozen=True)
class VersionRange:
    """An AND of terms, parsed from the KB's range notation (see the module docstring)."""

    text: str
    terms: tuple[_Term, ...]

    def contains(self, version: object) -> bool:
        v = parse_version(version)
        return all(t.contains(v) for t in self.terms)

    def __contains__(self, version: object) -> bool:
        return self.contains(version)

    def __str__(self) -> str:
        return self.text


def _parse_term(raw: str, whole: str) -> _Term:
    t = raw.strip()
    if not t:
        raise ConfigError(f"empty term in version range {whole!r}")
    if t == "*":
        return _Term("any")
    for op in _OPS:
        if t.startswith(op):
            arg = t[len(op):].strip()
            parse_version(arg)
            return _Term(op, arg)
    if t.startswith("~"):
        arg = t[1:].strip()
        if not _DOTTED.match(arg):
            raise ConfigError(f"bad tilde range {t!r} in {whole!r}")
        return _Term("tilde", arg)
    if t.endswith("+"):
        arg = t[:-1].strip()
        if not _DOTTED.match(arg):
            raise ConfigError(f"bad open range {t!r} in {whole!r}")
        return _Term(">=", arg)
    if "-" in t:
        lo, _, hi = t.partition("-")
        lo, hi = lo.strip(), hi.strip()
        if not (_DOTTED.match(lo) and _DOTTED.match(hi)):
            raise ConfigError(f"bad span {t!r} in version range {whole!r} (write e.g. 12.0-12.8)")
        if parse_version(lo) > parse_version(hi):
            raise ConfigError(f"empty span {t!r} in version range {whole!r}: {lo} > {hi}")
        return _Term("span", lo, hi)
    if not _DOTTED.match(t):
        raise ConfigError(f"bad version range {whole!r}: {t!r} is neither a version nor a comparison")
    return _Term("prefix", t)


def parse_range(text: str) -> VersionRange:
    """Parse the KB range notation; ConfigError on anything else."""
    if not isinstance(text, str):
        raise ConfigError(f"version range must be a string, got {text!r}")
    return _parse_range_text(text)


@lru_cache(maxsize=2048)
def _parse_range_text(text: str) -> VersionRange:
    if not text.strip():
        raise ConfigError("empty version range")
    return VersionRange(text, tuple(_parse_term(p, text) for p in text.split(",")))


def in_any(version: object, ranges: list[str] | tuple[str, ...] | str) -> bool:
    """True when version is in any of the ranges (a single string is one range)."""
    if isinstance(ranges, str):
        ranges = [ranges]
    return any(parse_range(r).contains(version) for r in ranges)


# ---------------------------------------------------------------------------- sm / cc / cuda

_SM_RE = re.compile(r"^(?:sm|compute)?_?(\d{2,3})(a?)$", re.ASCII)
_CC_RE = re.compile(r"^(\d{1,2})\.(\d)(a?)$", re.ASCII)


def normalize_sm(value: object) -> str:
    """86, "86", "8.6", "sm_86", "sm86", "SM_86" -> "86"; "90a" / "sm_90a" / "9.0a" -> "90a".

    Raises ConfigError for anything else ("8.x", "abc", 0, negative, "8", "8.10", booleans).
    """
    if isinstance(value, bool):
        raise ConfigError(f"not a GPU architecture (sm): {value!r}")
    if isinstance(value, int):
        text = str(value)
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, str):
        text = value.strip().lower()
    else:
        raise ConfigError(f"not a GPU architecture (sm): {value!r}")
    m = _CC_RE.match(text)
    if m:
        major, minor, suffix = int(m.group(1)), m.group(2), m.group(3)
    else:
        m = _SM_RE.match(text)
        if not m:
            raise ConfigError(
                f"not a GPU architecture (sm): {value!r}; write e.g. 86, '8.6', 'sm_86' or 'sm_90a'")
        digits, suffix = m.group(1), m.group(2)
        major, minor = int(digits[:-1]), digits[-1]
    if major < 1 or (m.re is _CC_RE and major > 19):
        raise ConfigError(f"not a GPU architecture (sm): {value!r}; compute capability major must be 1..19")
    return f"{major}{minor}{suffix}"


def sm_major_minor(sm: object) -> tuple[int, int]:
    """ "86" -> (8, 6); "90a" -> (9, 0); "121" -> (12, 1)."""
    s = normalize_sm(sm).rstrip("a")
    return int(s[:-1]), int(s[-1])


def sm_to_cc(sm: object) -> str:
    """ "86" -> "8.6"; "120" -> "12.0"; "90a" -> "9.0" (the compute capability of the device)."""
    major, minor = sm_major_minor(sm)
    return f"{major}.{minor}"


def cc_to_sm(cc: object) -> str:
    """ "8.6" -> "86" (alias of normalize_sm for compute-capability strings)."""
    return normalize_sm(cc)


_CU_RE = re.compile(r"^cu(\d{2,3})$", re.ASCII)


def normalize_cuda(value: object) -> str:
    """ "12.1" -> "12.1"; "12.1.1" -> "12.1.1"; "cu121" -> "12.1"; "cu130" -> "13.0". ConfigError on junk."""
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"not a CUDA version: {value!r}")
    text = str(value).strip().lower()
    m = _CU_RE.match(text)
    if m:
        digits = m.group(1)
        return f"{int(digits[:-1])}.{digits[-1]}"
    parts = text.split(".")
    if not _DOTTED.match(text) or not 2 <= len(parts) <= 3 or any(p != str(int(p)) for p in parts):
        raise ConfigError(f"not a CUDA version: {quoted(value)}; write e.g. 12.1, 12.1.1 or cu121")
    return text


_DRIVER_RE = re.compile(r"\d{3}(\.\d{1,3}){0,2}", re.ASCII)


def normalize_driver(value: object) -> str:
    """A driver branch "535" or a full version "550.54.14"; ConfigError otherwise."""
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"not an NVIDIA driver version: {value!r}")
    text = str(value).strip()
    if not _DRIVER_RE.fullmatch(text):
        raise ConfigError(f"not an NVIDIA driver version: {quoted(value)}; write a branch (535) or 550.54.14")
    return text
