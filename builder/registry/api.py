"""Just enough of the registry HTTP API (distribution v2) to verify what was pushed: manifests by tag
or digest (digest checked against the body), blob existence and size, and whether a manifest is a
given local image (its config digest). Auth follows the registry's challenge (Basic or Bearer tokens);
connection errors, 5xx and 429 are retried with bounded exponential back-off.
"""
from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
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

from ..errors import PublishError
from ..hashing import sha256_bytes
from .credentials import Credentials
from .reference import Registry, is_loopback_host

# Retry policy (module level so tests and callers can tighten it).
HTTP_ATTEMPTS = 5
HTTP_WAIT_MULTIPLIER_S = 0.5
HTTP_WAIT_MAX_S = 8.0
HTTP_TIMEOUT_S = 30.0

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
INDEX_TYPES = MANIFEST_TYPES[:2]
MAX_TAGS = 5000  # a repository's tags read by `mopt pick HOST/REPO` at most
MAX_TAG_PAGES = 100
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")  # the OCI distribution spec's tag grammar


def _json_body(resp: requests.Response, what: str) -> Any:
    """The JSON of a 200 answer; PublishError naming WHAT otherwise."""
    if resp.status_code != 200:
        raise PublishError(f"{what} answered HTTP {resp.status_code}")
    try:
        return resp.json()
    except ValueError as exc:
        raise PublishError(f"{what} did not return JSON") from exc


def _next_page(link: str) -> str:
    """The path of a tags/list Link header's next page (relative, or absolute on any host: the path only)."""
    found = re.match(r"\s*<([^>]+)>", link)
    if not found:
        return ""
    target = found.group(1)
    if "://" in target:
        target = "/" + target.split("://", 1)[1].partition("/")[2]
    return target if target.startswith("/v2/") else ""
ACCEPT = ", ".join(MANIFEST_TYPES)

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


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
    raw: bytes = b""  # the bytes as the registry served them (their sha256 is the digest)


class RegistryApi:
    """Just enough of the distribution API v2 to verify pushes and move tags: manifests (read, and put
    under another tag) and blob existence.

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

    @property
    def insecure(self) -> bool:
        """Plain HTTP or an unverified certificate: a loopback registry only (as docker allows)."""
        return self.registry.is_loopback

    def _send(self, method: str, url: str, headers: dict[str, str], data: bytes | None = None) -> requests.Response:
        def once() -> requests.Response:
            resp = self._session.request(method, url, headers=headers, timeout=HTTP_TIMEOUT_S, data=data,
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
        if not realm.startswith("https://") and not is_loopback_host(realm_host):
            raise PublishError(f"registry {self.registry.host}: refusing to send credentials to a "
                               f"non-HTTPS token realm {realm}")
        c = self.credentials
        query = {"scope": scope}
        if params.get("service"):
            query["service"] = params["service"]
        session = self._session if is_loopback_host(realm_host) == self.registry.is_loopback \
            else requests.Session()
        verify = not (is_loopback_host(realm_host) and realm.startswith("https"))

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
        body = _json_body(resp, f"token service {realm}")
        token = (body.get("token") or body.get("access_token")) if isinstance(body, dict) else None
        if not token:
            raise PublishError(f"token service {realm} returned no token")
        return token

    def request(self, method: str, path: str, *, scope: str, headers: dict[str, str] | None = None,
                data: bytes | None = None) -> requests.Response:
        """An authenticated request (challenge-driven; one re-authentication on 401)."""
        url = f"{self._base()}{path}"
        hdrs = dict(headers or {})
        auth = self._auth_header.get(scope) or (self._auth_header.get("*") if self._basic else None) or {}
        resp = self._send(method, url, {**hdrs, **auth}, data)
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
            resp = self._send(method, url, {**hdrs, **auth}, data)
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
        body_digest = "sha256:" + sha256_bytes(resp.content)
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
        return Manifest(body_digest, media, body, resp.content)

    def tags(self, repo: str, limit: int = MAX_TAGS) -> list[str]:
        """REPO's tags (the registry's tags/list, followed page by page through its Link header), at most
        LIMIT: a registry that answers more is refused, not read without end."""
        path, found, seen = f"/v2/{repo}/tags/list?n=1000", [], set()
        while path:
            if path in seen or len(seen) >= MAX_TAG_PAGES:
                raise PublishError(f"{self.registry.host}/{repo}: the tag list does not end (page {len(seen) + 1})")
            seen.add(path)
            resp = self.request("GET", path, scope=f"repository:{repo}:pull")
            if resp.status_code == 404:
                raise PublishError(f"{self.registry.host}/{repo}: no such repository")
            body = _json_body(resp, f"the tag list of {repo} on {self.registry.host}")
            page = body.get("tags") if isinstance(body, dict) else None
            found += [t for t in page or [] if isinstance(t, str) and TAG.fullmatch(t)]
            if len(found) > limit:
                raise PublishError(f"{self.registry.host}/{repo} has more than {limit} tags")
            path = _next_page(resp.headers.get("Link", ""))
        return found

    def labels(self, repo: str, reference: str, platform: str = "amd64") -> dict[str, str]:
        """The image config's labels of REPO:REFERENCE (an index: its linux/PLATFORM image); {} when absent
        or of an unexpected shape (the registry's content is not trusted to be well formed)."""
        m = self.manifest(repo, reference)
        if m is None:
            return {}
        if not isinstance(m.body, dict):
            return {}
        if m.media_type in INDEX_TYPES or "manifests" in m.body:
            entries = m.body.get("manifests")
            chosen = [e for e in entries if isinstance(e, dict) and isinstance(e.get("digest"), str)
                      and isinstance(e.get("platform"), dict) and e["platform"].get("os") == "linux"
                      and e["platform"].get("architecture") == platform] if isinstance(entries, list) else []
            m = self.manifest(repo, chosen[0]["digest"]) if chosen else None
            if m is None or not isinstance(m.body, dict):
                return {}
        config_ref = m.body.get("config")
        if not isinstance(config_ref, dict) or not isinstance(config_ref.get("digest"), str):
            return {}
        try:
            config = json.loads(self.get_blob(repo, config_ref["digest"], max_bytes=4 * 1024 * 1024))
        except ValueError as exc:
            raise PublishError(f"the image config of {repo}:{reference} is not JSON") from exc
        inner = config.get("config") if isinstance(config, dict) else None
        labels = inner.get("Labels") if isinstance(inner, dict) else None
        return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}

    def put_manifest(self, repo: str, tag: str, m: Manifest) -> str:
        """Point TAG at exactly manifest M (its bytes, so its digest): a tag moves without a push."""
        resp = self.request("PUT", f"/v2/{repo}/manifests/{tag}", scope=f"repository:{repo}:pull,push",
                            headers={"Content-Type": m.media_type}, data=m.raw)
        if resp.status_code not in (200, 201):
            raise PublishError(f"PUT manifest {repo}:{tag} to {self.registry.host} answered HTTP "
                               f"{resp.status_code}: {resp.text[:200]}")
        digest = resp.headers.get("Docker-Content-Digest", "")
        if digest and digest != m.digest:
            raise PublishError(f"{repo}:{tag} was stored as {digest}, not the manifest {m.digest} sent")
        return m.digest

    def get_blob(self, repo: str, digest: str, max_bytes: int = 16 * 1024 * 1024) -> bytes:
        """A (small) blob's bytes, checked against its digest."""
        resp = self.request("GET", f"/v2/{repo}/blobs/{digest}", scope=f"repository:{repo}:pull")
        if resp.status_code != 200:
            raise PublishError(f"GET blob {repo}@{digest} answered HTTP {resp.status_code}")
        if len(resp.content) > max_bytes:
            raise PublishError(f"blob {repo}@{digest} is larger than {max_bytes} bytes")
        if "sha256:" + sha256_bytes(resp.content) != digest:
            raise PublishError(f"blob {repo}@{digest} does not match its digest")
        return resp.content

    def upload_blob(self, repo: str, data: bytes) -> str:
        """Put DATA as a blob of REPO (skipped when present); its digest."""
        digest = "sha256:" + sha256_bytes(data)
        if self.blob_exists(repo, digest)[0]:
            return digest
        scope = f"repository:{repo}:pull,push"
        start = self.request("POST", f"/v2/{repo}/blobs/uploads/", scope=scope)
        location = start.headers.get("Location", "")
        if start.status_code != 202 or not location:
            raise PublishError(f"starting a blob upload to {repo} answered HTTP {start.status_code}")
        if location.startswith("http"):
            location = "/" + location.split("/", 3)[3]
        sep = "&" if "?" in location else "?"
        done = self.request("PUT", f"{location}{sep}digest={digest}", scope=scope,
                            headers={"Content-Type": "application/octet-stream"}, data=data)
        if done.status_code != 201:
            raise PublishError(f"uploading blob {digest} to {repo} answered HTTP {done.status_code}")
        return digest

    def put_manifest_by_digest(self, repo: str, body: dict) -> Manifest:
        """Store BODY (a manifest or index) under its own digest; the stored manifest."""
        raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        m = Manifest("sha256:" + sha256_bytes(raw), body["mediaType"], body, raw)
        resp = self.request("PUT", f"/v2/{repo}/manifests/{m.digest}", scope=f"repository:{repo}:pull,push",
                            headers={"Content-Type": m.media_type}, data=raw)
        if resp.status_code not in (200, 201):
            raise PublishError(f"PUT manifest {repo}@{m.digest} answered HTTP {resp.status_code}: {resp.text[:200]}")
        return m

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


def config_digests(api: RegistryApi, repo: str, m: Manifest) -> set[str]:
    """The image config digests a manifest (or each manifest of an index) names."""
    if m.media_type in INDEX_TYPES or "manifests" in m.body:
        out: set[str] = set()
        for child in m.body.get("manifests", []):
            sub = api.manifest(repo, child["digest"])
            if sub is not None:
                out |= config_digests(api, repo, sub)
        return out
    cfg = (m.body.get("config") or {}).get("digest")
    return {cfg} if cfg else set()
