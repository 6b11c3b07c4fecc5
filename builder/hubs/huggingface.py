"""hf:// sources through huggingface_hub: the Hugging Face Hub, or the HF_ENDPOINT mirror.

The token is HF_TOKEN, else the file HF_TOKEN_PATH names, else the one `hf auth login` writes. A
connection cut mid-file is retried by huggingface_hub in the same call (past its first 10 MiB chunk,
with a Range request).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import BuildError, ConfigError, EnvironmentProblem
from .settings import ALLOW_PATTERNS, IGNORE_PATTERNS, HubSettings, offline_from_env

# huggingface_hub reads this at import. Without it, its first request goes to HF_ENDPOINT or huggingface.co
# whatever endpoint= says, which an air-gapped or mirror-only site must not see.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
DEFAULT_ENDPOINT = "https://huggingface.co"


@dataclass(frozen=True)
class HuggingFace:
    settings: HubSettings
    scheme: str = "hf"
    name: str = "the Hugging Face Hub"

    @classmethod
    def from_env(cls) -> HuggingFace:
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
        endpoint = (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        return cls(HubSettings(endpoint=endpoint, token=token, offline=offline_from_env("HF_HUB_OFFLINE")))

    def resolve(self, repo: str, revision: str) -> str:
        return self._call(repo, revision, lambda api: api.model_info(repo, revision=revision)).sha

    def download(self, repo: str, commit: str, staging: Path) -> None:
        from huggingface_hub import snapshot_download

        self._call(repo, commit, lambda api: snapshot_download(
            repo, revision=commit, endpoint=self.settings.endpoint, token=self.settings.token or False,
            local_dir=staging, allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS)))

    def listed_sha256(self, repo: str, commit: str) -> dict[str, str]:
        # The Hub lists a sha256 for LFS files (the weights); small git files have a git blob id only.
        info = self._call(repo, commit, lambda api: api.model_info(repo, revision=commit, files_metadata=True))
        return {s.rfilename: s.lfs.sha256 for s in info.siblings or () if getattr(s, "lfs", None) is not None}

    def _call(self, repo: str, revision: str, call):
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

        where, endpoint, token = f"hf://{repo}@{revision}", self.settings.endpoint, self.settings.token
        try:
            return call(HfApi(endpoint=endpoint, token=token or False))
        except GatedRepoError:
            how = "the token was refused" if token else "no token: set HF_TOKEN or HF_TOKEN_PATH"
            raise ConfigError(f"{where} is gated ({how}); accept its terms on the Hub with the token's "
                              "account") from None
        except RepositoryNotFoundError:
            raise ConfigError(f"{where}: no such model on {endpoint} (or it is private and "
                              f"{'the token cannot see it' if token else 'no token was given'})") from None
        except RevisionNotFoundError:
            raise ConfigError(f"{where}: no such branch, tag or commit on {endpoint}") from None
        except (_transport_error(), OfflineModeIsEnabled, LocalEntryNotFoundError) as exc:
            raise EnvironmentProblem(f"{where}: cannot reach {endpoint} or the connection broke "
                                     f"({type(exc).__name__}); the files already downloaded are kept for the "
                                     "next run") from None
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
