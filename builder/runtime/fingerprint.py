"""engine.json: what an engine was built from and for, and the sha256 of every engine file."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from . import SCHEMA_VERSION
from .errors import GuardError, UsageError

ENGINE_JSON = "engine.json"
ENGINE_SUBDIR = "engine"
REQUIRED = ("schema_version", "backend", "backend_version", "torch", "cuda", "tensorrt", "device",
            "target_sm", "gpu_name", "driver", "engine_files", "engine_sha256", "model_digest",
            "params", "image")


HASH_CHUNK = 8 << 20  # bytes a read: the GIL is taken back twice a chunk, which costs up to a switch interval
# each while another thread runs Python (the model cache hashes while torch imports)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])  # releases the GIL (large buffers)
    return h.hexdigest()


def tree_files(root: Path) -> list[str]:
    """Every file under root, as a path relative to it, links followed: a Hugging Face snapshot's files
    are links into its blobs, and a model's subdirectory (1_Pooling/, a tokenizer dir) may be a link
    too, whose files the loaders read as much as any. A link to a directory outside root is refused,
    not skipped (skipped, a change there would not change the digest; followed, `x -> /` would hash
    the whole file system), and so is a link to a directory that holds it (a loop)."""
    top = root.resolve()
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        here = Path(dirpath)
        for name in dirnames:
            link = here / name
            if link.is_symlink():
                target = link.resolve()
                if not target.is_relative_to(top):
                    raise UsageError(f"{link} links to {target}, outside {root}: copy or mount that directory "
                                     "into the model directory (a digest must cover every file it uses)")
                if here.resolve().is_relative_to(target):
                    raise UsageError(f"{link} links to {target}, a directory that holds it (a loop)")
        found += [(here / name).relative_to(root).as_posix() for name in filenames if (here / name).is_file()]
    return sorted(found)


def file_hashes(root: str | Path) -> dict[str, str]:
    root = Path(root)
    return {rel: sha256_file(root / rel) for rel in tree_files(root)}


def model_digest(model_dir: str | Path) -> str:
    """sha256 over sorted relative paths and contents, so renames and edits both change it."""
    root = Path(model_dir)
    h = hashlib.sha256()
    for rel in tree_files(root):
        if rel.startswith(".cache/"):  # huggingface_hub download bookkeeping, not model content
            continue
        h.update(rel.encode() + b"\0")
        h.update(sha256_file(root / rel).encode() + b"\n")
    return h.hexdigest()


def write(out_dir: str | Path, data: dict) -> Path:
    data = {**data, "schema_version": SCHEMA_VERSION}
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ValueError(f"engine.json is missing {missing}")
    path = Path(out_dir) / ENGINE_JSON
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a fingerprint
    return path


def read(engine_dir: str | Path) -> dict:
    return read_raw(engine_dir)[1]


def read_raw(engine_dir: str | Path) -> tuple[bytes, dict]:
    """engine.json's bytes (what an integrity check done ahead is tied to) and its checked content."""
    path = Path(engine_dir) / ENGINE_JSON
    try:
        raw = path.read_bytes()
        data = json.loads(raw)
    except FileNotFoundError:
        raise GuardError(f"{path} not found: not an engine directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GuardError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise GuardError(f"{path} is not a JSON object")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise GuardError(f"{path} lacks fields {missing}")
    if data["schema_version"] != SCHEMA_VERSION:
        raise GuardError(f"{path} has schema_version {data['schema_version']}, this runtime reads "
                         f"{SCHEMA_VERSION}")
    return raw, data
