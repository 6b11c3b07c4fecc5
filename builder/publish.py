"""Publish smoke-tested images to a registry: every immutable long tag first, verified, then the short tags.

A release (a list of :class:`PublishItem`) is published in phases:

0. for every item, ask the registry (HTTP API v2) what the long tag points at now; if any long tag
   already points at another image, refuse with :class:`PublishError` before pushing anything (long
   tags are immutable). The same image is recognised by the local image's RepoDigest for that
   repository, or a manifest whose config digest is the local image id (the very same content);
1. for every item: tag the local image and ``docker push`` the long ref (or skip the push when the
   registry already has this image there: ``skipped``), then verify it: GET the long tag's manifest,
   check its digest (header and body hash) is the pushed one, and HEAD every blob (and child
   manifest) it references;
2. only once EVERY long tag of the release is verified, move each short (moving) tag, unless it
   already points at that digest, and verify it the same way;
3. remove the registry-prefixed local tags this run created (the image itself is kept).

A failure in phases 0-1 leaves every short tag where it was, so users pulling a short tag never see
half a release; a re-run skips the long tags already verified (idempotent).

Credentials come only from docker's config.json (``docker_config``, else $DOCKER_CONFIG, else
~/.docker), including ``credsStore``/``credHelpers``; the same directory is handed to the docker
CLI as DOCKER_CONFIG. Passwords, tokens and Authorization headers are never logged or put in argv.

HTTP checks retry (bounded, exponential backoff) on connection errors, 5xx and 429; ``docker push``
is retried at most :data:`PUSH_EXTRA_ATTEMPTS` extra times on transient errors, never on auth errors.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from builder.dockerclient import DockerCli, find_docker, run_docker
from builder.errors import ConfigError, PublishError

Log = Callable[[str], None]

# Retry policy (module level so tests and callers can tighten it).
HTTP_ATTEMPTS = 5
HTTP_WAIT_MULTIPLIER_S = 0.5
HTTP_WAIT_MAX_S = 8.0
HTTP_TIMEOUT_S = 30.0
PUSH_EXTRA_ATTEMPTS = 2
PUSH_RETRY_WAIT_S = 2.0  # doubled after each transient failure
PUSH_TIMEOUT_S = 3600.0

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
INDEX_TYPES = MANIFEST_TYPES[:2]
ACCEPT = ", ".join(MANIFEST_TYPES)

DOCKER_HUB_HOSTS = ("docker.io", "index.docker.io", "registry-1.docker.io")
DOCKER_HUB_AUTH_KEY = "https://index.docker.io/v1/"

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAMESPACE_RE = re.compile(rf"^{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")
_PUSH_DIGEST_RE = re.compile(
    r"^(?P<tag>\S+): digest: (?P<digest>sha256:[0-9a-f]{64}) size: (?P<size>\d+)\s*$", re.MULTILINE)

# `docker push` output that means the credentials are missing or refused: never retried.
_AUTH_MARKERS = ("no basic auth credentials", "unauthorized", "denied", "authentication required",
                 "forbidden", "insufficient_scope", "incorrect username or password")
# Output that means a transient failure worth another attempt.
_TRANSIENT_MARKERS = ("connection refused", "connection reset", "i/o timeout", "timeout", "eof",
                      "toomanyrequests", "too many requests", "500 internal server error",
                      "502 bad gateway", "503 service unavailable", "504 gateway", "tls handshake",
                      "broken pipe", "server misbehaving", "temporary failure", "unexpected status: 5")
_ERROR_MARKERS = _AUTH_MARKERS + ("error", "unknown blob", "manifest invalid", "name unknown",
                                  "blob upload unknown", "does not exist", "unexpected status")


# --------------------------------------------------------------------------- data
@dataclass(frozen=True)
class PublishItem:
    variant_id: str  # e.g. "minilm-embed:cpu"
    image_id: str  # local image id (sha256:...) that passed its smoke test
    repository: str  # e.g. "mopt/minilm-embed" (namespace/image as planned)
    long_tag: str  # immutable tag, pushed first
    short_tag: str  # moving tag, pushed only after the long tag is verified


@dataclass(frozen=True)
class PublishResult:
    variant_id: str
    references: tuple[str, ...]  # pushed refs, long first
    digest: str  # manifest digest verified in the registry
    skipped: bool  # True when the registry already had this exact image at the long tag


def _is_loopback_host(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
    return name in ("localhost", "[::1]") or name.startswith("127.")


@dataclass(frozen=True)
class Registry:
    host: str  # "127.0.0.1:5000"
    namespace: str | None  # "team" from "127.0.0.1:5000/team" (replaces the planned namespace)

    @classmethod
    def parse(cls, text: str) -> Registry:
        """Parse ``HOST[:PORT][/NAMESPACE]``; raise ConfigError (exit 2) on anything else."""
        raw = text if isinstance(text, str) else ""
        value = raw.strip()
        if not value:
            raise ConfigError("registry is empty; expected HOST[:PORT][/NAMESPACE], e.g. 127.0.0.1:5000/team",
                              key="registry")
        if "://" in value:
            raise ConfigError(f"registry {raw!r} must not have a scheme; expected HOST[:PORT][/NAMESPACE]",
                              key="registry")
        if any(c.isspace() for c in value) or "@" in value:
            raise ConfigError(f"registry {raw!r} contains whitespace or '@'; expected "
                              "HOST[:PORT][/NAMESPACE]", key="registry")
        host, _, namespace = value.rstrip("/").partition("/")
        if host.startswith("["):  # [IPv6]:port
            m = re.fullmatch(r"\[([0-9A-Fa-f:]+)\](?::(\d+))?", host)
            if not m:
                raise ConfigError(f"registry {raw!r}: bad bracketed IPv6 host {host!r}", key="registry")
            port = m.group(2)
            name = m.group(1)
        else:
            name, sep, port = host.partition(":")
            if sep and not port:
                raise ConfigError(f"registry {raw!r}: empty port after ':'", key="registry")
            if not _HOSTNAME_RE.match(name):
                raise ConfigError(f"registry {raw!r}: {name!r} is not a valid host name or address",
                                  key="registry")
        if port is not None and port != "":
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"registry {raw!r}: port {port!r} is not a number in 1..65535",
                                  key="registry")
        # Docker reads the first path component as a registry host only if it has a '.' or ':' or
        # is 'localhost'; anything else would silently mean Docker Hub.
        if not (port or "." in name or name == "localhost" or host.startswith("[")):
            raise ConfigError(
                f"registry {raw!r}: {name!r} does not look like a registry host (no '.', no port, not "
                "'localhost'); docker would read it as a Docker Hub namespace. Write docker.io/"
                f"{value} for Docker Hub, or HOST:PORT for a registry",
                key="registry")
        if namespace and not _NAMESPACE_RE.match(namespace):
            raise ConfigError(
                f"registry {raw!r}: namespace {namespace!r} is invalid (lowercase letters, digits and "
                "separators '.', '_', '-', components joined by '/')", key="registry")
        return cls(host=host.lower() if not host.startswith("[") else host, namespace=namespace or None)

    def repository_path(self, repository: str) -> str:
        """The repository's path inside this registry (namespace replaced when one is set)."""
        repository = repository.strip("/")
        if not repository or not _NAMESPACE_RE.match(repository):
            raise ConfigError(f"repository {repository!r} is not a valid image repository name",
                              key="repository")
        image = repository.rsplit("/", 1)[-1]
        if self.namespace:
            return f"{self.namespace}/{image}"
        return repository

    def reference(self, repository: str, tag: str) -> str:
        """``host/namespace-or-planned/image:tag``."""
        if not _TAG_RE.match(tag or ""):
            raise ConfigError(f"tag {tag!r} is not a valid docker tag", key="tag")
        return f"{self.host}/{self.repository_path(repository)}:{tag}"

    def __str__(self) -> str:
        return f"{self.host}/{self.namespace}" if self.namespace else self.host

    # ---- where the API lives and which config.json key holds its credentials
    @property
    def api_host(self) -> str:
        return "registry-1.docker.io" if self.host in DOCKER_HUB_HOSTS else self.host

    @property
    def is_loopback(self) -> bool:
        return _is_loopback_host(self.host)


# --------------------------------------------------------------------------- credentials
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


# --------------------------------------------------------------------------- registry HTTP API
class _Transient(Exception):
    """A response worth retrying (5xx, 429)."""

    def __init__(self, status: int, url: str):
        super().__init__(f"HTTP {status} from {url}")
        self.status = status


_RETRYABLE = (requests.ConnectionError, requests.Timeout, _Transient)


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}
    return scheme.lower(), params


@dataclass
class Manifest:
    digest: str
    media_type: str
    body: dict[str, Any]


class RegistryApi:
    """Just enough of the distribution API v2 to verify pushes: manifests and blob existence.

    Auth follows the registry's 401 challenge: Basic with the config.json credentials, or the
    Bearer token flow (``realm``/``service``/``scope``; identity tokens as refresh tokens).
    """

    def __init__(self, registry: Registry, credentials: Credentials | None, *, config_dir: Path | None = None,
                 scheme: str | None = None):
        self.registry = registry
        self.credentials = credentials
        self.config_dir = config_dir
        self._scheme = scheme
        self._session = requests.Session()
        if registry.is_loopback:
            self._session.trust_env = False  # never send loopback traffic through an env proxy
        self._auth_header: dict[str, str] = {}  # per scope
        self._basic = False

    def close(self) -> None:
        self._session.close()

    # ---- plumbing
    def _retrying(self) -> Retrying:
        return Retrying(stop=stop_after_attempt(HTTP_ATTEMPTS),
                        wait=wait_exponential(multiplier=HTTP_WAIT_MULTIPLIER_S, max=HTTP_WAIT_MAX_S),
                        retry=retry_if_exception_type(_RETRYABLE), reraise=True)

    def _base(self) -> str:
        if self._scheme is None:
            self._scheme = self._detect_scheme()
        return f"{self._scheme}://{self.registry.api_host}"

    def _detect_scheme(self) -> str:
        if not self.registry.is_loopback:
            return "https"
        # Like docker for insecure (loopback) registries: HTTPS first, then plain HTTP.
        try:
            self._session.get(f"https://{self.registry.api_host}/v2/", timeout=5, verify=False)
            return "https"
        except requests.RequestException:
            return "http"

    def _send(self, method: str, url: str, headers: dict[str, str]) -> requests.Response:
        def once() -> requests.Response:
            resp = self._session.request(method, url, headers=headers, timeout=HTTP_TIMEOUT_S,
                                         allow_redirects=True,
                                         verify=not (self.registry.is_loopback and url.startswith("https")))
            if resp.status_code >= 500 or resp.status_code == 429:
                raise _Transient(resp.status_code, url)
            return resp

        try:
            return self._retrying()(once)
        except _Transient as exc:
            raise PublishError(f"registry {self.registry.host} kept failing: {exc} "
                               f"(after {HTTP_ATTEMPTS} attempts)") from exc
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise PublishError(f"cannot reach registry {self.registry.host} ({method} {url}): "
                               f"{type(exc).__name__} after {HTTP_ATTEMPTS} attempts") from exc
        except RetryError as exc:  # pragma: no cover - reraise=True makes this unreachable
            raise PublishError(f"registry {self.registry.host}: {exc}") from exc

    def _no_creds_message(self) -> str:
        where = self.config_dir / "config.json" if self.config_dir else "docker's config.json"
        return (f"no credentials for registry {self.registry.host} in {where}; "
                f"run `docker login {self.registry.host}` (or set DOCKER_CONFIG)")

    def _rejected_message(self, status: int) -> str:
        c = self.credentials
        who = f"user {c.username!r}" if c and c.username else "the identity token"
        src = c.source if c else "?"
        return (f"registry {self.registry.host} rejected the credentials ({who} from {src}): HTTP {status}; "
                f"run `docker login {self.registry.host}` again")

    def _authorize(self, challenge: str, scope: str) -> dict[str, str]:
        scheme, params = _parse_challenge(challenge)
        c = self.credentials
        if scheme == "basic":
            if not c or not (c.username or c.password):
                raise PublishError(self._no_creds_message())
            token = base64.b64encode(f"{c.username}:{c.password}".encode()).decode()
            return {"Authorization": f"Basic {token}"}
        if scheme == "bearer":
            return {"Authorization": f"Bearer {self._token(params, scope)}"}
        raise PublishError(f"registry {self.registry.host} asks for unsupported auth scheme {scheme!r}")

    def _token(self, params: dict[str, str], scope: str) -> str:
        realm = params.get("realm")
        if not realm:
            raise PublishError(f"registry {self.registry.host} sent a Bearer challenge without a realm")
        realm_host = requests.utils.urlparse(realm).netloc
        if not realm.startswith("https://") and not _is_loopback_host(realm_host):
            raise PublishError(f"registry {self.registry.host}: refusing to send credentials to a "
                               f"non-HTTPS token realm {realm}")
        c = self.credentials
        query = {"scope": scope}
        if params.get("service"):
            query["service"] = params["service"]
        session = self._session if _is_loopback_host(realm_host) == self.registry.is_loopback \
            else requests.Session()
        verify = not (_is_loopback_host(realm_host) and realm.startswith("https"))

        def once() -> requests.Response:
            if c and c.identity_token:
                data = {"grant_type": "refresh_token", "refresh_token": c.identity_token,
                        "service": params.get("service", ""), "scope": scope, "client_id": "mopt"}
                resp = session.post(realm, data=data, timeout=HTTP_TIMEOUT_S, verify=verify)
            else:
                auth = (c.username, c.password) if c and (c.username or c.password) else None
                resp = session.get(realm, params=query, auth=auth, timeout=HTTP_TIMEOUT_S, verify=verify)
            if resp.status_code >= 500 or resp.status_code == 429:
                raise _Transient(resp.status_code, realm)
            return resp

        try:
            resp = self._retrying()(once)
        except (*_RETRYABLE,) as exc:
            raise PublishError(f"token service {realm} for {self.registry.host} failed: {exc}") from exc
        if resp.status_code in (401, 403):
            if not c:
                raise PublishError(self._no_creds_message())
            raise PublishError(self._rejected_message(resp.status_code) + f" (token service {realm})")
        if resp.status_code != 200:
            raise PublishError(f"token service {realm} answered HTTP {resp.status_code}")
        try:
            body = resp.json()
        except ValueError as exc:
            raise PublishError(f"token service {realm} did not return JSON") from exc
        token = body.get("token") or body.get("access_token")
        if not token:
            raise PublishError(f"token service {realm} returned no token")
        return token

    def request(self, method: str, path: str, *, scope: str, headers: dict[str, str] | None = None
                ) -> requests.Response:
        """An authenticated request (challenge-driven; one re-authentication on 401)."""
        url = f"{self._base()}{path}"
        hdrs = dict(headers or {})
        auth = self._auth_header.get(scope) or (self._auth_header.get("*") if self._basic else None) or {}
        resp = self._send(method, url, {**hdrs, **auth})
        if resp.status_code == 401:
            # No credentials sent yet, or a cached token expired: answer the challenge once, afresh.
            challenge = resp.headers.get("WWW-Authenticate", "")
            if not challenge:
                raise PublishError(f"registry {self.registry.host} answered 401 without a challenge")
            auth = self._authorize(challenge, scope)
            if challenge.lower().startswith("basic"):
                self._basic = True
                self._auth_header["*"] = auth
            else:
                self._auth_header[scope] = auth
            resp = self._send(method, url, {**hdrs, **auth})
            if resp.status_code == 401:
                raise PublishError(self._rejected_message(401))
        if resp.status_code == 403:
            raise PublishError(f"registry {self.registry.host} denied {method} {path} (HTTP 403) for "
                               f"the configured credentials")
        return resp

    # ---- operations
    def manifest(self, repo: str, reference: str) -> Manifest | None:
        """The manifest at ``reference`` (tag or digest), its digest checked; None when absent."""
        resp = self.request("GET", f"/v2/{repo}/manifests/{reference}", scope=f"repository:{repo}:pull",
                            headers={"Accept": ACCEPT})
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise PublishError(f"GET manifest {repo}:{reference} from {self.registry.host} answered "
                               f"HTTP {resp.status_code}: {resp.text[:200]}")
        body_digest = "sha256:" + hashlib.sha256(resp.content).hexdigest()
        header = resp.headers.get("Docker-Content-Digest", "")
        if header and header != body_digest:
            raise PublishError(f"manifest {repo}:{reference}: Docker-Content-Digest {header} does not match "
                               f"the body's sha256 {body_digest}")
        if reference.startswith("sha256:") and reference != body_digest:
            raise PublishError(f"manifest {repo}@{reference} came back with digest {body_digest}")
        try:
            body = json.loads(resp.content)
        except ValueError as exc:
            raise PublishError(f"manifest {repo}:{reference} is not JSON") from exc
        media = body.get("mediaType") or resp.headers.get("Content-Type", "").split(";")[0]
        return Manifest(body_digest, media, body)

    def blob_exists(self, repo: str, digest: str) -> tuple[bool, int | None]:
        resp = self.request("HEAD", f"/v2/{repo}/blobs/{digest}", scope=f"repository:{repo}:pull")
        if resp.status_code == 404:
            return False, None
        if resp.status_code != 200:
            raise PublishError(f"HEAD blob {repo}@{digest} answered HTTP {resp.status_code}")
        length = resp.headers.get("Content-Length")
        return True, int(length) if length and length.isdigit() else None

    def verify(self, repo: str, tag: str, expected: str) -> Manifest:
        """The tag points at ``expected`` and everything that manifest references is present."""
        m = self.manifest(repo, tag)
        if m is None:
            raise PublishError(f"{self.registry.host}/{repo}:{tag} is missing from the registry right after "
                               "the push")
        if m.digest != expected:
            raise PublishError(f"{self.registry.host}/{repo}:{tag} points at {m.digest}, expected {expected}")
        self.check_complete(repo, m)
        return m

    def check_complete(self, repo: str, m: Manifest, depth: int = 0) -> None:
        if m.media_type in INDEX_TYPES or "manifests" in m.body:
            if depth > 2:
                raise PublishError(f"manifest {m.digest} nests indexes too deeply")
            for child in m.body.get("manifests", []):
                sub = self.manifest(repo, child["digest"])
                if sub is None:
                    raise PublishError(f"{repo}: index {m.digest} references missing manifest "
                                       f"{child['digest']}")
                self.check_complete(repo, sub, depth + 1)
            return
        descriptors = [m.body.get("config") or {}, *m.body.get("layers", [])]
        if not descriptors[0]:
            raise PublishError(f"{repo}: manifest {m.digest} has no config (schema 1?)")
        for desc in descriptors:
            digest = desc.get("digest", "")
            if not _DIGEST_RE.match(digest):
                raise PublishError(f"{repo}: manifest {m.digest} references an unsupported digest {digest!r}")
            ok, size = self.blob_exists(repo, digest)
            if not ok:
                raise PublishError(f"{repo}: blob {digest} referenced by manifest {m.digest} is missing")
            if size is not None and desc.get("size") is not None and int(desc["size"]) != size:
                raise PublishError(f"{repo}: blob {digest} has {size} bytes, the manifest says "
                                   f"{desc['size']}")


def _config_digests(api: RegistryApi, repo: str, m: Manifest) -> set[str]:
    """The image config digests a manifest (or each manifest of an index) names."""
    if m.media_type in INDEX_TYPES or "manifests" in m.body:
        out: set[str] = set()
        for child in m.body.get("manifests", []):
            sub = api.manifest(repo, child["digest"])
            if sub is not None:
                out |= _config_digests(api, repo, sub)
        return out
    cfg = (m.body.get("config") or {}).get("digest")
    return {cfg} if cfg else set()


# --------------------------------------------------------------------------- docker CLI
@dataclass(frozen=True)
class _LocalImage:
    id: str
    repo_digests: tuple[str, ...]

    def digests_for(self, name: str) -> set[str]:
        return {d.split("@", 1)[1] for d in self.repo_digests if d.split("@", 1)[0] == name}


def _inspect(docker: DockerCli, ref: str) -> _LocalImage | None:
    res = run_docker(["image", "inspect", "--format", "{{json .}}", ref], docker=docker, check=False,
                     timeout=60)
    if res.returncode != 0:
        return None
    try:
        data = json.loads(res.stdout.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None
    return _LocalImage(data.get("Id", ""), tuple(data.get("RepoDigests") or ()))


_NORMAL_PUSH_LINE = re.compile(
    r"^(the push refers to repository \[[^\]]*\]|[0-9a-f]{12}: (preparing|waiting|pushed|pushing.*|"
    r"layer already exists|mounted from \S+)|\S+: digest: sha256:[0-9a-f]{64} size: \d+)$")
_TRANSIENT_RE = re.compile("|".join([re.escape(m) for m in _TRANSIENT_MARKERS if m != "eof"] + [r"\beof\b"]))


def classify_push_output(output: str) -> str:
    """'auth', 'transient', 'error' or 'ok' for a ``docker push`` output (exit code aside).

    Docker's ordinary progress lines (and the repository name they echo) are ignored; any other
    line with an error marker counts.
    """
    lines = [ln.strip().lower() for ln in output.splitlines() if ln.strip()]
    rest = [ln for ln in lines if not _NORMAL_PUSH_LINE.match(ln)]
    if any(m in ln for ln in rest for m in _AUTH_MARKERS):
        return "auth"
    if any(_TRANSIENT_RE.search(ln) for ln in rest):
        return "transient"
    if any(m in ln for ln in rest for m in _ERROR_MARKERS):
        return "error"
    return "ok"


def _error_lines(output: str, n: int = 6) -> str:
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    noisy = re.compile(r"^\S+: (preparing|waiting|pushed|pushing|layer already exists|mounted from|retrying in)",
                       re.I)
    useful = [ln for ln in lines if not noisy.match(ln)]
    return " | ".join((useful or lines)[-n:]) or "(no output)"


_LAYER_PROGRESS = re.compile(r"^\s*[0-9a-f]{12}: ")


def _worth_logging(line: str) -> bool:
    """Per-layer progress lines are noise in a release log; keep the rest (digest line, errors)."""
    return bool(line.strip()) and not _LAYER_PROGRESS.match(line)


def docker_push(docker: DockerCli, ref: str, config_dir: Path, *, log: Log,
                redact: Iterable[str] = (), auth_retries: int = 0) -> str:
    """``docker push ref`` with DOCKER_CONFIG=config_dir; return the pushed manifest digest.

    Raises PublishError on any error output or a missing digest line; retries transient failures
    at most PUSH_EXTRA_ATTEMPTS extra times. Auth failures are retried only ``auth_retries`` times
    (publish passes 1: the registry API has just accepted the same credentials, so docker's
    "unauthorized" then comes from a failed /v2/ ping behind a flaky proxy, not from the password).
    """
    tag = ref.rsplit(":", 1)[1]
    secrets = [s for s in redact if s]
    attempts = 1 + PUSH_EXTRA_ATTEMPTS
    for attempt in range(1, attempts + 1):
        recent: list[str] = []

        def keep(line: str, recent: list[str] = recent) -> None:
            recent.append(line)
            del recent[:-8]
            if _worth_logging(line):
                log(f"    {line}")

        try:
            res = run_docker(["push", ref], docker=docker, check=False, env={"DOCKER_CONFIG": str(config_dir)},
                             timeout=PUSH_TIMEOUT_S, redact=secrets, error_cls=PublishError, log=keep)
        except PublishError as exc:  # timed out: say what docker was doing (e.g. "Retrying in 5 seconds")
            raise PublishError(f"{exc.message}; docker's last output: {_error_lines(chr(10).join(recent))}") \
                from None
        output = (res.stdout or "") + (res.stderr or "")
        kind = classify_push_output(output)
        digests = [m.group("digest") for m in _PUSH_DIGEST_RE.finditer(output) if m.group("tag") == tag]
        if res.returncode == 0 and kind == "ok" and len(set(digests)) == 1:
            return digests[0]
        detail = _error_lines(output)
        if kind == "auth" and auth_retries > 0 and attempt < attempts:
            auth_retries -= 1
            log(f"  docker push {ref} was refused (attempt {attempt}/{attempts}) although the registry API "
                f"accepted these credentials; retrying once: {detail}")
            time.sleep(PUSH_RETRY_WAIT_S)
            continue
        if kind == "auth":
            raise PublishError(f"docker push {ref} was refused by the registry (authentication/"
                               f"authorization): {detail}; check `docker login {ref.split('/', 1)[0]}` "
                               f"in {config_dir}")
        if kind == "transient" and attempt < attempts:
            wait = PUSH_RETRY_WAIT_S * 2 ** (attempt - 1)
            log(f"  docker push {ref} failed transiently (attempt {attempt}/{attempts}): {detail}; "
                f"retrying in {wait:.0f}s")
            time.sleep(wait)
            continue
        if res.returncode == 0 and kind == "ok":
            raise PublishError(f"docker push {ref} printed no single 'digest: sha256:... size:' line for tag "
                               f"{tag!r}: {detail}")
        raise PublishError(f"docker push {ref} failed (exit {res.returncode}, attempt {attempt}/{attempts}): "
                           f"{detail}")
    raise AssertionError("unreachable")  # pragma: no cover


class _LocalTags:
    """Registry-prefixed local tags this run created, removed on exit (the image is kept)."""

    def __init__(self, docker: DockerCli, log: Log):
        self.docker, self.log, self.created = docker, log, []

    def tag(self, image_id: str, ref: str) -> None:
        existing = _inspect(self.docker, ref)
        if existing is not None and existing.id == image_id:
            return  # someone else's tag, already right: leave it alone
        run_docker(["tag", image_id, ref], docker=self.docker, error_cls=PublishError, timeout=60)
        if existing is None:
            self.created.append(ref)

    def cleanup(self) -> None:
        for ref in reversed(self.created):
            res = run_docker(["rmi", "--no-prune", ref], docker=self.docker, check=False, timeout=60)
            if res.returncode != 0:
                why = _error_lines(res.stderr or res.stdout)
                self.log(f"  warning: could not remove local tag {ref}: {why}")
        self.created.clear()


@contextmanager
def _local_tags(docker: DockerCli, log: Log) -> Iterator[_LocalTags]:
    tags = _LocalTags(docker, log)
    try:
        yield tags
    finally:
        tags.cleanup()


# --------------------------------------------------------------------------- publish
def _same_image(api: RegistryApi, repo: str, remote: Manifest, local: _LocalImage, name: str) -> bool:
    """Whether the registry's manifest is the local image: a RepoDigest match, else the same config."""
    if remote.digest in local.digests_for(name):
        return True
    return local.id in _config_digests(api, repo, remote)


def publish(items: Iterable[PublishItem], registry: Registry, *, docker_config: str | None = None,
            dry_run: bool = False, log: Log = print, docker: DockerCli | None = None) -> list[PublishResult]:
    """Publish a release in two phases (see the module doc): every long (immutable) tag is checked,
    pushed and verified first; the short (moving) tags move only once ALL of them are verified.

    Raises PublishError (exit 6) at the first failure. Its ``failed`` attribute names the variant
    that failed; ``published`` lists the results whose short tag moved (empty when phase 1 failed:
    then no short tag of the release moved, and ``long_verified`` lists the long tags that are in
    the registry and verified, which a re-run skips). ``dry_run`` changes nothing, logs what would
    move (long tags first, then short tags), and raises PublishError at the end if the real run would
    be refused.
    """
    items = list(items)
    seen: dict[tuple[str, str], str] = {}
    for item in items:
        for tag in (item.long_tag, item.short_tag):
            key = (registry.repository_path(item.repository), tag)
            if key in seen and seen[key] != item.variant_id:
                raise PublishError(f"{item.variant_id} and {seen[key]} would both publish {key[0]}:{tag}")
            seen[key] = item.variant_id
    config_dir = docker_config_dir(docker_config)
    creds = load_credentials(registry, config_dir)
    api = RegistryApi(registry, creds, config_dir=config_dir)
    secrets = creds.secrets if creds else []
    cli = docker or find_docker()
    try:
        if dry_run:
            return _plan_release(items, registry, api, cli, log)
        return _publish_release(items, registry, api, cli, config_dir, secrets, log)
    finally:
        api.close()


def _fail(exc: PublishError, item: PublishItem, published: list[PublishResult], long_verified: list[str],
          phase: str) -> PublishError:
    note = ""
    if phase == "long":
        note = "\n(no short tag was moved"
        note += f"; verified long tags a re-run will skip: {', '.join(long_verified)})" if long_verified else ")"
    elif published:
        note = f"\n(short tags already moved: {', '.join(r.variant_id for r in published)})"
    exc.message = f"{item.variant_id}: {exc.message}{note}"
    exc.args = (exc.message,)
    exc.failed = item.variant_id  # type: ignore[attr-defined]
    exc.published = list(published)  # type: ignore[attr-defined]
    exc.long_verified = list(long_verified)  # type: ignore[attr-defined]
    return exc


def _refs(item: PublishItem, registry: Registry) -> tuple[str, str, str, str]:
    repo = registry.repository_path(item.repository)
    long_ref = registry.reference(item.repository, item.long_tag)
    short_ref = registry.reference(item.repository, item.short_tag)
    return repo, f"{registry.host}/{repo}", long_ref, short_ref


def _local(cli: DockerCli, item: PublishItem) -> _LocalImage:
    local = _inspect(cli, item.image_id)
    if local is None:
        raise PublishError(f"local image {item.image_id} not found (was it removed after its smoke test?)")
    if item.image_id.startswith("sha256:") and local.id != item.image_id:
        raise PublishError(f"{item.image_id} resolves to image {local.id}, not the smoke-tested one")
    return local


def _immutable_refusal(long_ref: str, remote: Manifest, local: _LocalImage) -> PublishError:
    return PublishError(
        f"{long_ref} already points at {remote.digest} in the registry, which is not local image {local.id}; "
        "long tags are immutable and will not be moved (bump the version, or delete the tag from the registry "
        "deliberately)")


def _plan_release(items: list[PublishItem], registry: Registry, api: RegistryApi, cli: DockerCli,
                  log: Log) -> list[PublishResult]:
    problems: list[str] = []
    planned: list[tuple[PublishItem, _LocalImage | None, str, bool, list[str], bool]] = []
    log("[dry-run] phase 1: immutable long tags (pushed and verified first)")
    for item in items:
        repo, name, long_ref, _ = _refs(item, registry)
        try:
            local = _local(cli, item)
            remote_long = api.manifest(repo, item.long_tag)
        except PublishError as exc:
            problems.append(f"{item.variant_id}: {exc}")
            log(f"  {item.variant_id}: cannot check: {exc}")
            planned.append((item, None, "", False, [], True))
            continue
        moving: list[str] = []
        if remote_long is None:
            log(f"[dry-run] {long_ref} -> {local.id} (registry: no such tag) : would push")
            planned.append((item, local, "", False, [long_ref], False))
        elif _same_image(api, repo, remote_long, local, name):
            log(f"[dry-run] {long_ref} -> {local.id} (registry: {remote_long.digest}, same image) : would skip")
            planned.append((item, local, remote_long.digest, True, moving, False))
        else:
            problems.append(f"{item.variant_id}: {long_ref} already points at {remote_long.digest}, a different "
                            f"image than {local.id}; long tags are immutable")
            log(f"[dry-run] {long_ref} -> {local.id} (registry: {remote_long.digest}, DIFFERENT image) : "
                "would REFUSE")
            planned.append((item, local, remote_long.digest, False, moving, True))
    log("[dry-run] phase 2: moving short tags (only after every long tag above is verified)")
    results: list[PublishResult] = []
    for item, local, digest, skipped, moving, bad in planned:
        repo, _, _, short_ref = _refs(item, registry)
        try:
            remote_short = api.manifest(repo, item.short_tag)
        except PublishError as exc:
            problems.append(f"{item.variant_id}: {exc}")
            log(f"  {item.variant_id}: cannot check: {exc}")
            results.append(PublishResult(item.variant_id, tuple(moving), digest, skipped))
            continue
        short_now = remote_short.digest if remote_short else "no such tag"
        target = local.id if local else item.image_id
        if bad or problems:
            log(f"[dry-run] {short_ref} -> {target} (registry: {short_now}) : would not move")
        elif skipped and remote_short is not None and remote_short.digest == digest:
            log(f"[dry-run] {short_ref} -> {target} (registry: {short_now}) : already there")
        else:
            log(f"[dry-run] {short_ref} -> {target} (registry: {short_now}) : would push")
            moving = [*moving, short_ref]
        results.append(PublishResult(item.variant_id, tuple(moving), digest, skipped))
    if problems:
        err = PublishError("dry run: the publish would fail:\n  " + "\n  ".join(problems))
        err.published = []  # type: ignore[attr-defined]
        raise err
    return results


def _publish_release(items: list[PublishItem], registry: Registry, api: RegistryApi, cli: DockerCli,
                     config_dir: Path, secrets: list[str], log: Log) -> list[PublishResult]:
    # Phase 0: every long tag is free or already this image; refuse before pushing anything.
    state: list[tuple[PublishItem, _LocalImage, Manifest | None]] = []
    for item in items:
        repo, name, long_ref, _ = _refs(item, registry)
        try:
            local = _local(cli, item)
            remote_long = api.manifest(repo, item.long_tag)
            if remote_long is not None and not _same_image(api, repo, remote_long, local, name):
                raise _immutable_refusal(long_ref, remote_long, local)
        except PublishError as exc:
            raise _fail(exc, item, [], [], "long") from None
        state.append((item, local, remote_long))
    verified: list[tuple[PublishItem, _LocalImage, str, bool, list[str]]] = []
    with _local_tags(cli, log) as tags:
        # Phase 1: push and verify every long (immutable) tag.
        for item, local, remote_long in state:
            repo, name, long_ref, short_ref = _refs(item, registry)
            log(f"publish {item.variant_id}: {local.id} -> {long_ref}")
            pushed: list[str] = []
            try:
                remote_long = api.manifest(repo, item.long_tag)  # again: another publisher may have raced us
                if remote_long is None:
                    tags.tag(local.id, long_ref)
                    digest = docker_push(cli, long_ref, config_dir, log=log, redact=secrets,
                                           auth_retries=1)
                    pushed.append(long_ref)
                    skipped = False
                elif _same_image(api, repo, remote_long, local, name):
                    digest, skipped = remote_long.digest, True
                    log(f"  {long_ref} already points at {digest} (this image): not pushed again")
                else:
                    raise _immutable_refusal(long_ref, remote_long, local)
                api.verify(repo, item.long_tag, digest)
            except PublishError as exc:
                done = [registry.reference(v[0].repository, v[0].long_tag) for v in verified]
                raise _fail(exc, item, [], done, "long") from None
            log(f"  verified {long_ref} = {digest} (manifest and all blobs present)")
            verified.append((item, local, digest, skipped, pushed))
        log(f"all {len(verified)} long tags verified; moving the short tags")
        # Phase 2: only now move the short (moving) tags.
        results: list[PublishResult] = []
        for item, local, digest, skipped, pushed in verified:
            repo, _, _, short_ref = _refs(item, registry)
            try:
                remote_short = api.manifest(repo, item.short_tag)
                if remote_short is not None and remote_short.digest == digest:
                    log(f"  {short_ref} already points at {digest}")
                else:
                    was = remote_short.digest if remote_short else "absent"
                    tags.tag(local.id, short_ref)
                    short_digest = docker_push(cli, short_ref, config_dir, log=log, redact=secrets,
                                               auth_retries=1)
                    pushed.append(short_ref)
                    if short_digest != digest:
                        raise PublishError(f"{short_ref} was pushed as {short_digest}, but the verified long tag "
                                           f"is {digest}")
                    log(f"  moved {short_ref}: {was} -> {digest}")
                api.verify(repo, item.short_tag, digest)
            except PublishError as exc:
                raise _fail(exc, item, results, [], "short") from None
            log(f"  verified {short_ref} = {digest}")
            results.append(PublishResult(item.variant_id, tuple(pushed), digest, skipped))
    return results


__all__ = ["PublishItem", "PublishResult", "Registry", "RegistryApi", "Credentials", "publish",
           "docker_push", "classify_push_output", "load_credentials", "docker_config_dir"]
