"""hf://ORG/NAME@REVISION model sources through huggingface_hub.

A branch or tag is resolved to its commit sha, and the build uses that commit: the sha goes into the
image's labels and the build record, and `mopt lock` pins it with every file's sha256. Only the files
an engine reads are downloaded (ALLOW_PATTERNS). They land in the state dir's model cache, one
directory per commit, and every variant shares it. A connection cut mid-file is retried by
huggingface_hub in the same call (with a Range request past the first 10 MiB). A run that fails
anyway keeps the files it completed in the staging directory, and the next run fetches only the rest.

The token comes from HF_TOKEN or a token file (HF_TOKEN_PATH, or the one `hf auth login` writes). It
is used on the host only: the model reaches
`docker build` as files in the build context, so the token never enters a build, a layer, a label or
a log. HF_ENDPOINT (a mirror) and HF_HUB_OFFLINE / MOPT_OFFLINE are honoured. Offline, only commits
already in the cache are used.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import BuildError, ConfigError, EnvironmentProblem

# huggingface_hub reads this at import. Without it, its first request goes to HF_ENDPOINT or huggingface.co
# whatever endpoint= says, which an air-gapped or mirror-only site must not see.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

Log = Callable[[str], None]

DEFAULT_ENDPOINT = "https://huggingface.co"
# What the engines read: config, tokenizer, weights as safetensors, sentence-transformers pooling, the
# model card (for its license). Not the ONNX/OpenVINO/PyTorch-pickle copies many repos also carry.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "1_Pooling/*", "README.md")
IGNORE_PATTERNS = ("onnx/*", "openvino/*", "*.onnx", "*.onnx_data", "*.bin", "*.h5", "*.msgpack", "*.ot")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
MANIFEST = ".mopt-files.json"  # relative path -> sha256, written once a commit is complete


@dataclass(frozen=True)
class HubSettings:
    endpoint: str
    token: str | None  # never printed; repr hides it
    offline: bool

    def __repr__(self) -> str:
        shown = "set" if self.token else None
        return f"HubSettings(endpoint={self.endpoint!r}, token={shown}, offline={self.offline})"

    @classmethod
    def from_env(cls) -> HubSettings:
        """The token as huggingface_hub finds it: HF_TOKEN, else the file HF_TOKEN_PATH names, else the
        one `hf auth login` writes ($HF_HOME/token, ~/.cache/huggingface/token)."""
        token = os.environ.get("HF_TOKEN", "").strip() or None
        if token is None:
            home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
            path = Path(os.environ.get("HF_TOKEN_PATH") or home / "token")
            if os.environ.get("HF_TOKEN_PATH") and not path.is_file():
                raise ConfigError(f"HF_TOKEN_PATH={path}: no such file")
            try:
                if path.is_file():
                    token = path.read_text().strip() or None
            except OSError as exc:
                raise ConfigError(f"the Hub token file {path}: {exc.strerror}") from None
        offline = any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
                      for name in ("HF_HUB_OFFLINE", "MOPT_OFFLINE"))
        return cls(endpoint=(os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"), token=token,
                   offline=offline)


@dataclass(frozen=True)
class HubSnapshot:
    repo: str
    revision: str  # as the recipe asked for it
    sha: str  # the commit it named
    path: Path
    files: dict[str, str]  # relative path -> sha256

    @property
    def source(self) -> str:
        return f"hf://{self.repo}@{self.sha}"

    def lock_entry(self) -> dict:
        return {"repo": self.repo, "revision": self.revision, "sha": self.sha,
                "files": dict(sorted(self.files.items()))}


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


def fetch(ref: str, cache: Path, settings: HubSettings, log: Log, pinned: dict | None = None) -> HubSnapshot:
    """The commit `ref` names, downloaded into cache/hf/ORG--NAME/SHA (or found there). pinned: the lock's
    entry for this source; the build then uses its sha and refuses any file whose sha256 differs."""
    repo, revision = parse_ref(ref)
    home = cache / "hf" / repo.replace("/", "--")
    if pinned is not None:
        sha = pinned["sha"]
    elif _COMMIT.match(revision):
        sha = revision
    else:
        sha = _resolve(repo, revision, home, settings)
    target = home / sha
    if not (target / MANIFEST).is_file():
        if settings.offline:
            raise ConfigError(f"hf://{repo}@{sha} is not in the model cache ({home}) and the Hub is off "
                              "(HF_HUB_OFFLINE/MOPT_OFFLINE); fetch it once online, or copy the cache over")
        _download(repo, sha, home, settings, log)
    files = json.loads((target / MANIFEST).read_text())
    if pinned is not None:  # hashed afresh: the cache may have been copied in, or changed since
        files = _hash_tree(target)
        _check_pinned(repo, sha, files, pinned["files"])
    return HubSnapshot(repo=repo, revision=revision, sha=sha, path=target, files=files)


def _resolve(repo: str, revision: str, home: Path, settings: HubSettings) -> str:
    """A branch or tag -> its commit sha (asked of the Hub; offline, the last answer kept in refs/)."""
    ref_file = home / "refs" / revision.replace("/", "--")
    if settings.offline:
        if ref_file.is_file():
            return ref_file.read_text().strip()
        raise ConfigError(f"hf://{repo}@{revision}: the Hub is off (HF_HUB_OFFLINE/MOPT_OFFLINE) and this "
                          f"revision was never resolved here; pin a commit sha or fetch it once online")
    info = _call(repo, revision, settings, lambda api: api.model_info(repo, revision=revision))
    ref_file.parent.mkdir(parents=True, exist_ok=True)
    ref_file.write_text(info.sha + "\n")
    return info.sha


def _download(repo: str, sha: str, home: Path, settings: HubSettings, log: Log) -> None:
    from huggingface_hub import snapshot_download

    staging = home / f"{sha}.partial"  # kept when cut short: the next run fetches only what is missing
    log(f"model: downloading hf://{repo}@{sha[:12]} from {settings.endpoint}")
    _call(repo, sha, settings, lambda api: snapshot_download(
        repo, revision=sha, endpoint=settings.endpoint, token=settings.token or False, local_dir=staging,
        allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS)))
    expected = _call(repo, sha, settings, lambda api: api.model_info(repo, revision=sha, files_metadata=True))
    shutil.rmtree(staging / ".cache", ignore_errors=True)
    files = _hash_tree(staging)
    for sibling in expected.siblings or ():
        lfs = getattr(sibling, "lfs", None)
        got = files.get(sibling.rfilename)
        if got is not None and lfs is not None and lfs.sha256 != got:
            shutil.rmtree(staging, ignore_errors=True)
            raise BuildError(f"hf://{repo}@{sha}: {sibling.rfilename} has sha256 {got[:12]}, the Hub says "
                             f"{lfs.sha256[:12]}; the download was corrupted or tampered with (removed)")
    if "config.json" not in files:
        raise ConfigError(f"hf://{repo}@{sha} has no config.json: not a model an engine can be built from")
    (staging / MANIFEST).write_text(json.dumps(files, indent=2, sort_keys=True) + "\n")
    target = home / sha
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # complete, or absent: never half there


def _check_pinned(repo: str, sha: str, files: dict[str, str], pinned: dict[str, str]) -> None:
    changed = sorted(name for name in set(files) | set(pinned) if files.get(name) != pinned.get(name))
    if changed:
        raise ConfigError(f"hf://{repo}@{sha} does not match mopt.lock.json: {', '.join(changed[:5])} "
                          f"{'differs' if len(changed) == 1 else 'differ'} from the locked sha256; "
                          "run mopt lock again if the change is intended")


def _call(repo: str, revision: str, settings: HubSettings, call):
    """Run a Hub call; its failures as one clear mopt error (exit 2 for what the user must fix)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"hf://{repo}@{revision}"
    api = HfApi(endpoint=settings.endpoint, token=settings.token or False)
    try:
        return call(api)
    except GatedRepoError:
        how = "the token was refused" if settings.token else "no token: set HF_TOKEN or HF_TOKEN_PATH"
        raise ConfigError(f"{where} is gated ({how}); accept its terms on the Hub with the token's account") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{where}: no such model on {settings.endpoint} (or it is private and "
                          f"{'the token cannot see it' if settings.token else 'no token was given'})") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{where}: no such branch, tag or commit on {settings.endpoint}") from None
    except (_transport_error(), OfflineModeIsEnabled, LocalEntryNotFoundError) as exc:
        raise EnvironmentProblem(f"{where}: cannot reach {settings.endpoint} or the connection broke "
                                 f"({type(exc).__name__}); the files already downloaded are kept for the next "
                                 "run") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise BuildError(f"{where}: the Hub answered HTTP {status}") from None


def _transport_error() -> type[Exception]:
    """The HTTP client's connection/timeout error class (huggingface_hub 2.x ships httpx as httpx2)."""
    try:
        from httpx2 import TransportError
    except ImportError:
        from httpx import TransportError
    return TransportError


def cached(ref: str, cache: Path) -> bool:
    """Whether the commit `ref` names is complete in the cache (offline, through the last resolution)."""
    repo, revision = parse_ref(ref)
    home = cache / "hf" / repo.replace("/", "--")
    ref_file = home / "refs" / revision.replace("/", "--")
    sha = revision if _COMMIT.match(revision) else (ref_file.read_text().strip() if ref_file.is_file() else "")
    return bool(sha) and (home / sha / MANIFEST).is_file()


def available(ref: str, cache: Path, settings: HubSettings, pinned: dict | None = None) -> bool:
    """Whether fetch() can deliver `ref` (at the pinned commit on a locked build): cached, or the Hub answers."""
    if pinned is not None:
        ref = f"{parse_ref(ref)[0]}@{pinned['sha']}"
    return cached(ref, cache) or reachable(settings)


def _hash_tree(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root, dot-names (the manifest, caches) left out."""
    return {p.relative_to(root).as_posix(): _sha256(p) for p in sorted(root.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def card_license(model_dir: Path) -> str | None:
    """The `license:` of the model card's YAML front matter (README.md), if any."""
    card = model_dir / "README.md"
    if not card.is_file():
        return None
    text = card.read_text(errors="replace")
    if not text.startswith("---"):
        return None
    front, _, _ = text[3:].partition("\n---")
    import yaml

    try:
        data = yaml.safe_load(front)
    except yaml.YAMLError:
        return None
    value = data.get("license") if isinstance(data, dict) else None
    return value if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9.+-]{1,64}", value) else None
