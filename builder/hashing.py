"""Content digests and canonical JSON: the one place the host side hashes things.

Stage keys, lock keys, context digests, records and reports all go through these, so two runs over
the same inputs give the same keys and byte-identical files.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 22


def sha256_text(*parts: str) -> str:
    """sha256 over the parts, each ended by a NUL (so ("ab", "c") and ("a", "bc") differ)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_stream(handle: BinaryIO) -> str:
    digest = hashlib.sha256()
    while chunk := handle.read(CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as handle:
        return sha256_stream(handle)


def _tree_files(root: Path, pattern: str) -> Iterable[Path]:
    return sorted(p for p in root.glob(pattern)
                  if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith("."))


def tree_sha256(root: Path, pattern: str = "**/*") -> dict[str, str]:
    """relative path -> sha256 of each file, in sorted order; dotfiles and __pycache__ skipped."""
    return {path.relative_to(root).as_posix(): sha256_file(path) for path in _tree_files(root, pattern)}


def tree_digest(root: Path, pattern: str = "**/*") -> str:
    """sha256 over relative paths and contents, in sorted order (a context digest); dotfiles and
    __pycache__ skipped, so the digest does not depend on listing order or byte-code."""
    digest = hashlib.sha256()
    for name, file_sha in tree_sha256(root, pattern).items():
        digest.update(name.encode() + b"\0")
        digest.update(bytes.fromhex(file_sha))
    return digest.hexdigest()


def dump_json(data) -> str:
    """Canonical JSON text: sorted keys, two-space indent, UTF-8, one trailing newline."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
