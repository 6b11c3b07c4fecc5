"""modelscope://ORG/NAME@REVISION sources through the modelscope SDK (modelscope_hub): Qwen models are
commonly pulled from ModelScope where the Hugging Face Hub is out of reach.

The endpoint is MODELSCOPE_ENDPOINT (MODELSCOPE_DOMAIN, the older name, as a fallback); the token is
MODELSCOPE_API_TOKEN. Both are passed on every call, so the SDK never probes modelscope.cn or
modelscope.ai on its own. A private model asked without its token is "not found", as ModelScope answers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import BuildError, ConfigError, EnvironmentProblem
from .settings import ALLOW_PATTERNS, IGNORE_PATTERNS, HubSettings, offline_from_env

DEFAULT_ENDPOINT = "https://www.modelscope.cn"
# Read by the SDK on each call. INTRA_CLOUD off: its acceleration probe can name any host to fetch from;
# FILE_LOCK off: its lock files would pile up outside the model cache, never cleaned up.
os.environ.setdefault("MODELSCOPE_DOWNLOAD_INTRA_CLOUD", "false")
os.environ.setdefault("MODELSCOPE_DOWNLOAD_FILE_LOCK", "false")


@dataclass(frozen=True)
class ModelScope:
    settings: HubSettings
    scheme: str = "modelscope"
    name: str = "ModelScope"

    @classmethod
    def from_env(cls) -> ModelScope:
        endpoint = os.environ.get("MODELSCOPE_ENDPOINT") or os.environ.get("MODELSCOPE_DOMAIN") or DEFAULT_ENDPOINT
        if "://" not in endpoint:
            endpoint = f"https://{endpoint}"
        token = os.environ.get("MODELSCOPE_API_TOKEN", "").strip() or None
        return cls(HubSettings(endpoint=endpoint.rstrip("/"), token=token, offline=offline_from_env()))

    def resolve(self, repo: str, revision: str) -> str:
        # modelscope 1.40 has no public call from a branch or tag to its commit; this is the one request
        # the SDK's own (private) client makes for it, sent with the SDK's auth headers.
        import requests

        url = f"{self.settings.endpoint}/api/v1/models/{repo}/commits"
        try:
            response = requests.get(url, params={"Ref": revision, "PageNumber": 1, "PageSize": 1},
                                    headers=self._auth(), timeout=30)
        except requests.RequestException as exc:
            raise EnvironmentProblem(f"modelscope://{repo}@{revision}: cannot reach {self.settings.endpoint} "
                                     f"({type(exc).__name__})") from None
        if response.status_code in (401, 403, 404):
            raise self._not_found(repo, revision)
        if response.status_code != 200:
            raise BuildError(f"modelscope://{repo}@{revision}: ModelScope answered HTTP {response.status_code}")
        try:
            commits = (response.json().get("Data") or {}).get("Commit") or []
            commit = commits[0]["Id"] if commits else None
        except (ValueError, AttributeError, KeyError, TypeError):
            raise BuildError(f"modelscope://{repo}@{revision}: ModelScope's answer is not a commit list") from None
        if not commit:
            raise ConfigError(f"modelscope://{repo}@{revision}: no such branch, tag or commit on "
                              f"{self.settings.endpoint}")
        return commit

    def download(self, repo: str, commit: str, staging: Path) -> None:
        self._call(repo, commit, lambda api: api.download_repo(
            repo, "model", revision=commit, local_dir=staging, cache_dir=staging / ".cache",
            allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS)))

    def listed_sha256(self, repo: str, commit: str) -> dict[str, str]:
        files = self._call(repo, commit, lambda api: api.list_repo_files(repo, "model", revision=commit))
        return {f.path: f.sha256 for f in files if getattr(f, "sha256", None) and getattr(f, "type", "") != "tree"}

    def _auth(self) -> dict[str, str]:
        token = self.settings.token
        return {"Authorization": f"Bearer {token}", "Cookie": f"m_session_id={token}"} if token else {}

    def _not_found(self, repo: str, revision: str) -> ConfigError:
        why = "the token cannot see it" if self.settings.token else "no token: set MODELSCOPE_API_TOKEN"
        return ConfigError(f"modelscope://{repo}@{revision}: no such model on {self.settings.endpoint} (or it "
                           f"is private and {why})")

    def _call(self, repo: str, revision: str, call):
        from modelscope_hub import HubApi
        from modelscope_hub.errors import (
            AuthenticationError,
            FileDownloadError,
            FileIntegrityError,
            NetworkError,
            NotExistError,
            PermissionDeniedError,
        )

        try:
            return call(HubApi(endpoint=self.settings.endpoint, token=self.settings.token or ""))
        except (NotExistError, AuthenticationError, PermissionDeniedError):
            raise self._not_found(repo, revision) from None
        except FileDownloadError as exc:
            failed = getattr(exc, "failed_files", None) or {}
            bad = sorted(path for path, err in failed.items() if isinstance(err, FileIntegrityError))
            if bad:
                raise BuildError(f"modelscope://{repo}@{revision}: {', '.join(bad[:5])} did not match the size or "
                                 "sha256 ModelScope lists; the download was corrupted or tampered with") from None
            raise EnvironmentProblem(f"modelscope://{repo}@{revision}: a download from {self.settings.endpoint} "
                                     f"broke ({', '.join(sorted(failed)[:5])}); partial files are kept and resume "
                                     "on the next run") from None
        except NetworkError as exc:
            raise EnvironmentProblem(f"modelscope://{repo}@{revision}: cannot reach {self.settings.endpoint} or "
                                     f"the connection broke ({type(exc).__name__}); partial files are kept and "
                                     "resume on the next run") from None
