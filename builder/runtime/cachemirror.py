"""A writable stand-in for a compiled-kernel cache shipped read-only in the image.

Inductor (torch-inductor engines, vLLM's compile cache) looks its kernels up in a cache directory it
also writes to: lock files at every start, and sometimes data entries it rewrites. The shipped cache
is root-owned and the root may be read-only, and a copy in /tmp would not do either: /tmp is noexec in
a hardened container, so a kernel copied there cannot be loaded. The mirror is a directory tree in
the temp dir whose files are symbolic links to the shipped ones: writes land in the mirror, and
kernels are loaded through the links from the image's own (exec-allowed) file system.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path


def temp_dir_until_exit(prefix: str) -> Path:
    """A new temp dir, removed when the process exits: a server's caches must not outlive it (each load
    left 9 MB in /tmp before)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


def writable_mirror(root: Path, dest: Path | None = None, prefix: str = "mopt-cache-") -> Path:
    """Mirror ROOT at DEST (made; default: a new temp dir, removed at exit) and return it: directories
    made, files linked. Lock files are left out: filelock opens them with O_NOFOLLOW, so a link to one
    fails, and a fresh lock is all a start needs."""
    if dest is None:
        dest = temp_dir_until_exit(prefix)
    dest.mkdir(parents=True, exist_ok=True)
    root = Path(root).resolve()
    for directory, subdirs, files in os.walk(root):
        rel = Path(directory).relative_to(root)
        for name in subdirs:
            (dest / rel / name).mkdir(exist_ok=True)
        for name in files:
            if not (name.endswith(".lock") or "locks" in rel.parts):
                (dest / rel / name).symlink_to(Path(directory) / name)
    return dest
