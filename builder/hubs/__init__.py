"""Model hubs: hf://ORG/NAME@REVISION (Hugging Face, huggingface.py) and modelscope://ORG/NAME@REVISION
(ModelScope, modelscope.py), pinned to a commit.

A branch or tag is resolved to its commit, and the build uses that commit: it goes into the image's
labels and the build record, and `mopt lock` pins it with every file's sha256. Only the files an
engine reads are downloaded (ALLOW_PATTERNS). They land in the state dir's model cache, one directory
per commit (<cache>/<scheme>/ORG--NAME/<commit>), whole or absent, shared by every variant. A download
that fails keeps what it finished in <commit>.partial/, and the next run fetches only the rest.

Tokens are used on the host only: the model reaches `docker build` as files in the build context, so a
token never enters a build, a layer, a label or a log. Offline (HF_HUB_OFFLINE / MOPT_OFFLINE), only
commits already in the cache are used.
"""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import BuildError, ConfigError
from ..hashing import tree_sha256
from .settings import ALLOW_PATTERNS, IGNORE_PATTERNS, HubSettings, offline_from_env  # noqa: F401  (the clients' API)

Log = Callable[[str], None]

COMMIT = re.compile(r"^[0-9a-f]{40}$")
MANIFEST = ".mopt-files.json"  # relative path -> sha256, written once a commit is complete


class Hub(Protocol):
    """One model hub's client: what fetch() needs from it."""

    scheme: str  # hf | modelscope
    name: str  # for messages: "the Hugging Face Hub"
    settings: HubSettings

    def resolve(self, repo: str, revision: str) -> str:
        """A branch or tag -> its commit id."""

    def download(self, repo: str, commit: str, staging: Path) -> None:
        """The commit's files that match ALLOW_PATTERNS (and not IGNORE_PATTERNS) into staging."""

    def listed_sha256(self, repo: str, commit: str) -> dict[str, str]:
        """The sha256 the hub lists per file (only those it lists), to check the download against."""


@dataclass(frozen=True)
class Snapshot:
    scheme: str
    repo: str
    revision: str  # as the recipe asked for it
    commit: str
    path: Path
    files: dict[str, str]  # relative path -> sha256

    @property
    def source(self) -> str:
        return f"{self.scheme}://{self.repo}@{self.commit}"

    def lock_entry(self) -> dict:
        return {"repo": self.repo, "revision": self.revision, "sha": self.commit,
                "files": dict(sorted(self.files.items()))}


def hub_for(scheme: str) -> Hub:
    """The client for a source kind, configured from the environment (endpoint, token, offline)."""
    if scheme == "hf":
        from .huggingface import HuggingFace

        return HuggingFace.from_env()
    if scheme == "modelscope":
        from .modelscope import ModelScope

        return ModelScope.from_env()
    raise ValueError(f"no hub for {scheme}:")


def parse_ref(ref: str) -> tuple[str, str]:
    """'org/name@rev' -> ('org/name', 'rev')."""
    repo, _, revision = ref.partition("@")
    return repo, revision


def reachable(settings: HubSettings, timeout: float = 3.0) -> bool:
    if settings.offline:
        return False
    import requests

    try:
        requests.head(settings.endpoint, timeout=timeout)
        return True
    except requests.RequestException:
        return False


def _home(cache: Path, scheme: str, repo: str) -> Path:
    return cache / scheme / repo.replace("/", "--")


def fetch(hub: Hub, ref: str, cache: Path, log: Log, pinned: dict | None = None) -> Snapshot:
    """The commit `ref` names, downloaded into the cache (or found there). pinned: the lock's entry for
    this source; the build then uses its commit and refuses any file whose sha256 differs."""
    repo, revision = parse_ref(ref)
    where = f"{hub.scheme}://{repo}"
    home = _home(cache, hub.scheme, repo)
    if pinned is not None:
        commit = pinned["sha"]
    elif COMMIT.match(revision):
        commit = revision
    else:
        commit = _resolve(hub, repo, revision, home)
    if not COMMIT.match(commit):  # it names a directory of the cache: nothing but 40 hex digits
        raise ConfigError(f"{where}@{revision}: {commit[:60]!r} is not a commit id (40 hex digits); "
                          f"{'fix mopt.lock.json' if pinned is not None else 'the hub or the cache is broken'}")
    target = home / commit
    if not (target / MANIFEST).is_file():
        if hub.settings.offline:
            raise ConfigError(f"{where}@{commit} is not in the model cache ({home}) and the hubs are off "
                              "(offline mode); fetch it once online, or copy the cache over")
        _download(hub, repo, commit, home, log)
    if pinned is None:
        files = json.loads((target / MANIFEST).read_text())
    else:  # hashed afresh: the cache may have been copied in, or changed since
        files = tree_sha256(target)
        _check_pinned(where, commit, files, pinned["files"])
    return Snapshot(scheme=hub.scheme, repo=repo, revision=revision, commit=commit, path=target, files=files)


def _ref_file(home: Path, revision: str) -> Path:
    """Where the commit a branch or tag last named is kept (for offline use)."""
    return home / "refs" / revision.replace("/", "--")


def _resolve(hub: Hub, repo: str, revision: str, home: Path) -> str:
    """A branch or tag -> its commit (asked of the hub; offline, the last answer kept in refs/)."""
    ref_file = _ref_file(home, revision)
    if hub.settings.offline:
        if ref_file.is_file():
            return ref_file.read_text().strip()
        raise ConfigError(f"{hub.scheme}://{repo}@{revision}: offline mode is on and this revision was never "
                          "resolved here; pin a commit or fetch it once online")
    commit = hub.resolve(repo, revision)
    ref_file.parent.mkdir(parents=True, exist_ok=True)
    ref_file.write_text(commit + "\n")
    return commit


def _download(hub: Hub, repo: str, commit: str, home: Path, log: Log) -> None:
    where = f"{hub.scheme}://{repo}@{commit}"
    staging = home / f"{commit}.partial"  # kept when cut short: the next run fetches only what is missing
    log(f"model: downloading {hub.scheme}://{repo}@{commit[:12]} from {hub.settings.endpoint}")
    hub.download(repo, commit, staging)
    listed = hub.listed_sha256(repo, commit)
    shutil.rmtree(staging / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping, not the model's
    files = tree_sha256(staging)  # the same files as the model's digest
    for name, got in files.items():
        if name in listed and listed[name] != got:
            shutil.rmtree(staging, ignore_errors=True)
            raise BuildError(f"{where}: {name} has sha256 {got[:12]}, {hub.name} says {listed[name][:12]}; the "
                             "download was corrupted or tampered with (removed)")
    if "config.json" not in files:
        raise ConfigError(f"{where} has no config.json: not a model an engine can be built from")
    (staging / MANIFEST).write_text(json.dumps(files, indent=2, sort_keys=True) + "\n")
    target = home / commit
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # complete, or absent: never half there


def _check_pinned(where: str, commit: str, files: dict[str, str], pinned: dict[str, str]) -> None:
    changed = sorted(name for name in set(files) | set(pinned) if files.get(name) != pinned.get(name))
    if changed:
        raise ConfigError(f"{where}@{commit} does not match mopt.lock.json: {', '.join(changed[:5])} "
                          f"{'differs' if len(changed) == 1 else 'differ'} from the locked sha256; "
                          "run mopt lock again if the change is intended")


def cached(scheme: str, ref: str, cache: Path) -> bool:
    """Whether the commit `ref` names is complete in the cache (offline, through the last resolution)."""
    repo, revision = parse_ref(ref)
    home = _home(cache, scheme, repo)
    ref_file = _ref_file(home, revision)
    commit = revision if COMMIT.match(revision) else (ref_file.read_text().strip() if ref_file.is_file() else "")
    return bool(commit) and (home / commit / MANIFEST).is_file()


def available(hub: Hub, ref: str, cache: Path, pinned: dict | None = None) -> bool:
    """Whether fetch() can deliver `ref` (at the pinned commit on a locked build): cached, or the hub answers."""
    if pinned is not None:
        ref = f"{parse_ref(ref)[0]}@{pinned['sha']}"
    return cached(hub.scheme, ref, cache) or reachable(hub.settings)


def card_license(model_dir: Path) -> str | None:
    """The `license:` of the model card's YAML front matter (README.md), if any."""
    card = model_dir / "README.md"
    if not card.is_file():
        return None
    text = card.read_text(errors="replace")
    if not text.startswith("---"):
        return None
    front, _, _ = text[3:].partition("\n---")
    from ..errors import ConfigError
    from ..yamlio import safe_load_bounded

    try:
        data = safe_load_bounded(front, str(card))
    except ConfigError:  # malformed or hostile front matter: no license read from it
        return None
    value = data.get("license") if isinstance(data, dict) else None
    return value if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9.+-]{1,64}", value) else None


def copy_out(cache: Path, scheme: str, repo: str, commit: str, dest: Path) -> Path:
    """The cached commit, and the refs that named it, copied to dest/<scheme>/ORG--NAME/ (an export
    bundle's models/), so an air-gapped site can rebuild without any hub."""
    home = _home(cache, scheme, repo)
    if not COMMIT.match(commit) or not (home / commit / MANIFEST).is_file():
        raise ConfigError(f"{scheme}://{repo}@{commit[:40]} is not in the model cache ({home}); build the "
                          "variant here again before exporting it")
    out = _home(dest, scheme, repo)
    shutil.copytree(home / commit, out / commit, dirs_exist_ok=True)
    for ref in sorted((home / "refs").glob("*")):
        if ref.is_file() and ref.read_text().strip() == commit:
            (out / "refs").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ref, out / "refs" / ref.name)
    return out / commit


def copy_in(src: Path, cache: Path, log: Log) -> list[str]:
    """A bundle's models/ tree into the cache. Each commit is checked against its manifest and placed
    whole; one already complete in the cache is kept. Refs are added where the cache has none of that
    name (a site's own later resolution wins). Returns the sources placed or found."""
    placed = []
    for scheme_dir in sorted(p for p in src.iterdir() if p.is_dir()):
        if scheme_dir.name not in ("hf", "modelscope"):
            raise ConfigError(f"bundle models/{scheme_dir.name}: not a hub this mopt knows (hf, modelscope)")
        for repo_dir in sorted(p for p in scheme_dir.iterdir() if p.is_dir()):
            home = cache / scheme_dir.name / repo_dir.name
            where = f"{scheme_dir.name}://{repo_dir.name.replace('--', '/', 1)}"
            for commit_dir in sorted(p for p in repo_dir.iterdir() if p.is_dir() and COMMIT.match(p.name)):
                manifest = commit_dir / MANIFEST
                if not manifest.is_file() or json.loads(manifest.read_text()) != tree_sha256(commit_dir):
                    raise ConfigError(f"bundle's {where}@{commit_dir.name} does not match its own file list")
                target = home / commit_dir.name
                if (target / MANIFEST).is_file():
                    log(f"model cache: {where}@{commit_dir.name[:12]} already here")
                else:
                    staging = home / f"{commit_dir.name}.import"
                    shutil.rmtree(staging, ignore_errors=True)
                    shutil.copytree(commit_dir, staging)
                    shutil.rmtree(target, ignore_errors=True)
                    staging.rename(target)  # whole, or absent
                    log(f"model cache: {where}@{commit_dir.name[:12]} -> {target}")
                placed.append(f"{where}@{commit_dir.name}")
            for ref in sorted((repo_dir / "refs").glob("*")):
                mine = home / "refs" / ref.name
                if ref.is_file() and COMMIT.match(ref.read_text().strip()) and not mine.exists():
                    mine.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(ref, mine)
    return placed
