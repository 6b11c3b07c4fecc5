"""A local stand-in for the Hugging Face Hub, for tests.

The project's machines cannot reach huggingface.co, so tests that exercise model
downloads point ``huggingface_hub`` (2.4.0) at this in-process HTTP server instead
(pass ``endpoint=hub.endpoint`` explicitly).  It implements only the subset of the
Hub's HTTP API that ``HfApi.model_info``/``repo_info``, ``HfApi.list_repo_tree``
and ``snapshot_download``/``hf_hub_download`` use:

* ``GET /api/models/{repo_id}[/revision/{revision}]`` (``?blobs=true`` adds size,
  blobId and lfs to each sibling)
* ``GET /api/models/{repo_id}/tree/{revision}[/{path}]`` (``?recursive=true``)
* ``HEAD``/``GET /{repo_id}/resolve/{revision}/{filename}`` with ``X-Repo-Commit``,
  ``ETag`` (git blob sha1) or ``X-Linked-Etag``/``X-Linked-Size`` (LFS sha256),
  and ``Range`` support (206 + ``Content-Range``).

Errors use the Hub's ``X-Error-Code`` header (RepoNotFound, GatedRepo,
RevisionNotFound, EntryNotFound), which huggingface_hub maps to its exception
types.  No Xet headers are ever sent, so clients fall back to plain HTTP.  The server plumbing
(loopback server, request log, ``cut_after``, ``Range``) is tests/stubserver.py's.
"""

from __future__ import annotations

import hashlib
import json
import re
from urllib.parse import parse_qs, unquote, urlsplit

from tests.stubserver import LoopbackStub, StubHandler

LFS_THRESHOLD = 1024 * 1024
_DATE = "2024-01-01T00:00:00.000Z"
_API = re.compile(r"/api/models/(?P<repo>.+?)(?:/revision/(?P<rev>[^/]+))?")
_TREE = re.compile(r"/api/models/(?P<repo>.+?)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?")
_RESOLVE = re.compile(r"/(?P<repo>.+?)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Blob:
    def __init__(self, path: str, data: bytes):
        self.path, self.data = path, data
        self.lfs = path.endswith((".safetensors", ".bin")) or len(data) > LFS_THRESHOLD
        self.sha256 = hashlib.sha256(data).hexdigest()
        if self.lfs:  # git stores a pointer file; its blob id is what the tree reports
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(data)}\n"
            self.oid = _git_oid(pointer.encode())
        else:
            self.oid = _git_oid(data)
        self.etag = self.sha256 if self.lfs else self.oid


class _Repo:
    def __init__(self):
        self.commits: dict[str, dict[str, _Blob]] = {}  # sha -> path -> blob
        self.refs: dict[str, str] = {}  # branch/tag -> sha
        self.gated, self.token = False, None  # access rule, set by the latest add_repo call

    def allows(self, auth: str | None) -> bool:
        if self.token is not None:
            return auth == f"Bearer {self.token}"
        return not self.gated or (auth or "").startswith("Bearer ")

    def resolve(self, rev: str | None) -> str | None:
        rev = rev or "main"
        return rev if rev in self.commits else self.refs.get(rev)


class HubStub(LoopbackStub):
    """``with HubStub() as hub:`` serves repos added with ``hub.add_repo`` at ``hub.endpoint``.

    ``hub.requests`` lists every request as ``(method, path_with_query, range_header_or_None,
    had_authorization)``; tokens themselves are never recorded.  ``hub.cut_after(filename, ...)``
    takes the file's path in its repo.
    """

    def __init__(self):
        super().__init__(_Handler, name="hubstub")
        self._repos: dict[str, _Repo] = {}

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        revision: str = "main",
        gated: bool = False,
        token: str | None = None,
    ) -> str:
        """Commit exactly ``files`` to ``repo_id``, point ``revision`` at it, return the commit sha.

        ``gated``/``token`` set the repo's access rule (the latest call wins): with ``token`` only
        ``Authorization: Bearer <token>`` gets in; ``gated`` without ``token`` accepts any bearer token.
        """
        with self._lock:
            sha = self._new_commit_id(repo_id, files)
            repo = self._repos.setdefault(repo_id, _Repo())
            repo.commits[sha] = {p: _Blob(p, bytes(d)) for p, d in files.items()}
            repo.refs[revision] = sha
            repo.gated, repo.token = gated, token
            return sha

    def tamper(self, repo_id: str, sha: str, path: str, data: bytes) -> None:
        """Serve other bytes for ``path`` at commit ``sha`` while every listing keeps the old hashes
        (a mirror or proxy that changed a file)."""
        with self._lock:
            self._repos[repo_id].commits[sha][path].data = bytes(data)

    def resolve_count(self, filename: str) -> int:
        """Number of GET (not HEAD) requests that resolved ``filename`` (any repo, any revision)."""
        with self._lock:
            return self._bodies[filename]


class _Handler(StubHandler):
    def do_HEAD(self):
        self._handle(head=True)

    def do_GET(self):
        self._handle(head=False)

    def _json(self, obj, head):
        self._send(200, json.dumps(obj).encode(), [("Content-Type", "application/json")], head)

    def _error(self, status, code, message, head, extra=()):
        headers = [("Content-Type", "application/json"), ("X-Error-Code", code), ("X-Error-Message", message)]
        self._send(status, json.dumps({"error": message}).encode(), [*headers, *extra], head)

    def _handle(self, head):
        hub: HubStub = self.server.stub
        url = urlsplit(self.path)
        auth = self.headers.get("Authorization")
        self.record(auth is not None)
        kind, m = next(((k, m) for k, rx in _ROUTES if (m := rx.fullmatch(url.path))), (None, None))
        if m is None:
            return self._error(404, "NotFound", "Unknown endpoint", head)
        repo_id = unquote(m["repo"])
        repo = hub._repos.get(repo_id)
        if repo is None:
            return self._error(401, "RepoNotFound", "Repository not found", head)
        if not repo.allows(auth):
            return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted.", head)
        sha = repo.resolve(unquote(m["rev"]) if m["rev"] else None)
        if sha is None:
            return self._error(404, "RevisionNotFound", "Invalid rev id", head)
        files, query = repo.commits[sha], parse_qs(url.query)
        if kind == "info":
            return self._json(_model_info(repo_id, repo, sha, files, query.get("blobs") == ["true"]), head)
        if kind == "tree":
            path = unquote(m["path"] or "").strip("/")
            return self._tree(files, path, query.get("recursive") == ["true"], head)
        blob = files.get(unquote(m["file"]))
        if blob is None:
            return self._error(404, "EntryNotFound", "Entry not found", head, [("X-Repo-Commit", sha)])
        self._file(blob, sha, head)

    def _tree(self, files, prefix, recursive, head):
        base = prefix + "/" if prefix else ""
        if prefix and not any(p.startswith(base) for p in files):
            return self._error(404, "EntryNotFound", f"{prefix} does not exist", head)
        entries, dirs = [], set()
        for path in sorted(p for p in files if p.startswith(base)):
            parts = path[len(base) :].split("/")
            for i in range(1, len(parts) if recursive else min(2, len(parts))):
                dirs.add(base + "/".join(parts[:i]))
            if recursive or len(parts) == 1:
                entries.append(_tree_entry(files[path]))
        folders = [{"type": "directory", "oid": _git_oid(d.encode()), "size": 0, "path": d} for d in sorted(dirs)]
        self._json(folders + entries, head)

    def _file(self, blob: _Blob, sha: str, head: bool):
        headers = [("X-Repo-Commit", sha), ("ETag", f'"{blob.etag}"'), ("Accept-Ranges", "bytes")]
        if blob.lfs:
            headers += [("X-Linked-Etag", f'"{blob.sha256}"'), ("X-Linked-Size", str(len(blob.data)))]
        self.send_file(blob.path, blob.data, headers, head=head, refusal_headers=[("X-Repo-Commit", sha)])


_ROUTES = (("tree", _TREE), ("info", _API), ("resolve", _RESOLVE))


def _tree_entry(blob: _Blob) -> dict:
    entry = {"type": "file", "oid": blob.oid, "size": len(blob.data), "path": blob.path}
    if blob.lfs:
        entry["lfs"] = {"oid": blob.sha256, "size": len(blob.data), "pointerSize": 134}
    return entry


def _model_info(repo_id: str, repo: _Repo, sha: str, files: dict[str, _Blob], blobs: bool) -> dict:
    siblings = []
    for path in sorted(files):
        blob, sib = files[path], {"rfilename": path}
        if blobs:
            sib.update(size=len(blob.data), blobId=blob.oid)
            if blob.lfs:
                sib["lfs"] = {"sha256": blob.sha256, "size": len(blob.data), "pointerSize": 134}
        siblings.append(sib)
    gated = "auto" if repo.gated else False
    private = repo.token is not None and not repo.gated
    return {"id": repo_id, "sha": sha, "private": private, "gated": gated, "lastModified": _DATE, "siblings": siblings}
