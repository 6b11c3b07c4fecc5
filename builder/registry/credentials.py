"""Registry credentials, only from docker's own config.json (`docker login`), including credsStore and
credHelpers. The same directory is handed to the docker CLI as DOCKER_CONFIG. Secrets are never
logged, put in argv or repr'd.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PublishError
from .reference import DOCKER_HUB_HOSTS, Registry

DOCKER_HUB_AUTH_KEY = "https://index.docker.io/v1/"


@dataclass(frozen=True)
class Credentials:
    source: str  # where they came from (a path or a helper name), for messages
    username: str = ""
    password: str = field(default="", repr=False)
    identity_token: str = field(default="", repr=False)

    @property
    def secrets(self) -> list[str]:
        return [s for s in (self.password, self.identity_token) if s]


def docker_config_dir(docker_config: str | os.PathLike[str] | None = None) -> Path:
    """The docker config directory: the argument (a dir or a config.json), $DOCKER_CONFIG, ~/.docker."""
    if docker_config:
        p = Path(docker_config).expanduser()
        return p.parent if p.name.endswith(".json") and not p.is_dir() else p
    env = os.environ.get("DOCKER_CONFIG")
    return Path(env).expanduser() if env else Path.home() / ".docker"


def _auth_keys(registry: Registry) -> list[str]:
    if registry.host in DOCKER_HUB_HOSTS:
        return [DOCKER_HUB_AUTH_KEY, "index.docker.io", "docker.io", "registry-1.docker.io"]
    h = registry.host
    return [h, f"https://{h}", f"http://{h}", f"https://{h}/v1/", f"https://{h}/v2/"]


def load_credentials(registry: Registry, config_dir: Path) -> Credentials | None:
    """Credentials for ``registry`` from ``config_dir/config.json`` (plain entries or a helper)."""
    path = config_dir / "config.json"
    if not path.exists():
        return None
    try:
        cfg = json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError) as exc:
        raise PublishError(f"cannot read docker config {path}: {exc}") from exc
    keys = _auth_keys(registry)
    helpers = cfg.get("credHelpers") or {}
    for key in keys:
        if key in helpers:
            return _from_helper(helpers[key], key)
    if cfg.get("credsStore"):
        creds = _from_helper(cfg["credsStore"], keys[0], missing_ok=True)
        if creds:
            return creds
    auths = cfg.get("auths") or {}
    for key in keys:
        entry = auths.get(key)
        if not entry:
            continue
        user, password = entry.get("username", ""), entry.get("password", "")
        if entry.get("auth"):
            try:
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError) as exc:
                raise PublishError(f"{path}: the auth entry for {key} is not valid base64 user:password") \
                    from exc
        if user or password or entry.get("identitytoken"):
            return Credentials(str(path), user, password, entry.get("identitytoken", ""))
    return None


def _from_helper(helper: str, server: str, missing_ok: bool = False) -> Credentials | None:
    prog = f"docker-credential-{helper}"
    try:
        res = subprocess.run([prog, "get"], input=server, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        if missing_ok:
            return None
        raise PublishError(f"credential helper {prog} failed for {server}: {type(exc).__name__}") from exc
    if res.returncode != 0:
        if missing_ok:
            return None
        # The helper's stdout may hold a secret on odd helpers: report only its stderr's first line.
        first = (res.stderr or "").strip().splitlines()[:1]
        raise PublishError(f"credential helper {prog} has no credentials for {server}: "
                           f"{first[0] if first else 'exit ' + str(res.returncode)}")
    try:
        data = json.loads(res.stdout)
    except json.JSONDecodeError as exc:
        raise PublishError(f"credential helper {prog} returned invalid JSON") from exc
    user, secret = data.get("Username", ""), data.get("Secret", "")
    if user == "<token>":
        return Credentials(prog, "", "", secret)
    return Credentials(prog, user, secret)
