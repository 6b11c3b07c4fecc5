"""A local stand-in for ModelScope (modelscope.cn), for tests.

The project's machines cannot reach ModelScope, so tests that exercise ``modelscope://``
downloads point the ``modelscope`` SDK (1.40, i.e. ``modelscope_hub`` 0.5) at this in-process
HTTP server instead: pass ``endpoint=stub.endpoint`` on every call (an explicit endpoint also
stops the SDK probing modelscope.cn / modelscope.ai for the repo) and set
``MODELSCOPE_DOWNLOAD_INTRA_CLOUD=false``.  It implements only the legacy ``/api/v1`` subset the
SDK's snapshot download and revision look-ups use, answering in ModelScope's envelope
``{"Code", "Message", "RequestId", "Success", "Data"}``:

* ``GET /api/v1/models/{owner}/{name}/repo/files?Revision=&Recursive=&Root=``: the file list,
  ``Data.Files`` entries with ``Path``, ``Name``, ``Type`` (``blob``/``tree``), ``Size``,
  ``Sha256``, ``IsLFS`` and ``Revision`` (id of the commit that last changed the file).  As on
  the real hub, an unknown revision is *not* an error: HTTP 200 with ``"Files": null``.
* ``GET /api/v1/models/{owner}/{name}/repo?Revision=&FilePath=``: one file's bytes, with
  ``Range`` support (206 + ``Content-Range``, 416 when unsatisfiable); an unknown file or
  revision is a 404 with ModelScope's ``Code`` 10990101007 body.
* ``GET /api/v1/models/{owner}/{name}/commits?Ref=&PageNumber=&PageSize=``: the history of a
  branch, tag or commit, newest first, as ``Data.Commit`` entries (``Id`` is the 40-hex commit
  id) plus a top-level ``TotalCount``; an unknown ``Ref`` gives an empty list.
* ``GET /api/v1/models/{owner}/{name}/revisions``: ``Data.RevisionMap.Branches``/``Tags``
  (``Revision``, ``CreatedAt``); a revision named like ``v1``/``v1.0``/``1.2`` is a tag.
* ``GET /api/v1/models/{owner}/{name}``: minimal repo metadata.

An unknown model, and a private repo (``add_repo(..., token=...)``) asked without that token
as ``m_session_id`` cookie or ``Authorization: Bearer`` header, is answered like ModelScope
answers a model it will not show: HTTP 404 (``MsStub(private_status=...)`` changes the status
used for private repos).  Every other path is a 404 too.  The server plumbing (loopback server,
request log, ``cut_after``, ``Range``) is tests/stubserver.py's.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from http.cookies import SimpleCookie
from urllib.parse import parse_qs, urlsplit

from tests.stubserver import LoopbackStub, StubHandler

_ROUTE = re.compile(r"/api/v1/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>repo/files|repo|commits|revisions))?")
_TAG = re.compile(r"v?\d+(\.\d+)*([-.+]\w+)*")
_NO_MODEL = (10010205001, "模型不存在")  # hub code for an unknown model; the SDK reads "Model does not exist."
_NO_FILE = (10990101007, "获取模型文件失败，文件内容为空")  # measured answer for a missing file/revision


def _is_lfs(path: str, data: bytes) -> bool:
    return path.endswith((".safetensors", ".bin", ".onnx", ".pt")) or len(data) > 1024 * 1024


class _Repo:
    def __init__(self):
        self.commits: dict[str, dict[str, bytes]] = {}  # commit id -> path -> bytes
        self.parent: dict[str, str | None] = {}  # commit id -> the revision's previous commit
        self.when: dict[str, int] = {}  # commit id -> commit time (epoch seconds)
        self.refs: dict[str, str] = {}  # branch/tag -> commit id
        self.token: str | None = None

    def resolve(self, rev: str | None) -> str | None:
        rev = rev or "master"
        return rev if rev in self.commits else self.refs.get(rev)

    def history(self, sha: str | None) -> list[str]:
        out = []
        while sha:
            out.append(sha)
            sha = self.parent[sha]
        return out

    def last_change(self, sha: str, path: str) -> str:
        """Id of the oldest commit in an unbroken run, back from ``sha``, holding ``path`` as is."""
        data = self.commits[sha][path]
        while (p := self.parent[sha]) and self.commits[p].get(path) == data:
            sha = p
        return sha


class MsStub(LoopbackStub):
    """``with MsStub() as ms:`` serves repos added with ``ms.add_repo`` at ``ms.endpoint``.

    ``ms.requests`` lists every request as ``(method, path_with_query, range_header_or_None,
    had_auth)``, where ``had_auth`` says an ``Authorization`` header or ``m_session_id`` cookie
    came along; token values are never recorded.  ``ms.cut_after(filename, ...)`` takes the
    file's ``FilePath``.
    """

    def __init__(self, *, private_status: int = 404):
        super().__init__(_Handler, name="msstub")
        self.private_status = private_status
        self._repos: dict[str, _Repo] = {}

    def add_repo(
        self, model_id: str, files: dict[str, bytes], *, revision: str = "master", token: str | None = None
    ) -> str:
        """Commit exactly ``files`` to ``model_id`` (``owner/name``) on top of ``revision``, move
        ``revision`` to the new commit and return its 40-hex id; earlier commits stay servable by
        id.  ``token`` sets the repo's access rule (the latest call wins): None is public, else
        private and only that token gets in."""
        with self._lock:
            sha = self._new_commit_id(f"{model_id}\0{revision}", files)
            repo = self._repos.setdefault(model_id, _Repo())
            repo.commits[sha] = {p: bytes(d) for p, d in files.items()}
            repo.parent[sha] = repo.refs.get(revision)
            repo.when[sha] = int(time.time())
            repo.refs[revision] = sha
            repo.token = token
            return sha


class _Handler(StubHandler):
    def _json(self, status, code, message, data, extra=None):
        body = {"Code": code, "Message": message, "RequestId": str(uuid.uuid4()), "Success": status == 200}
        if data is not None or status == 200:
            body["Data"] = data
        body.update(extra or {})
        self._send(status, json.dumps(body, ensure_ascii=False).encode(), [("Content-Type", "application/json")])

    def _ok(self, data, extra=None):
        self._json(200, 200, "success", data, extra)

    def do_GET(self):
        stub: MsStub = self.server.stub
        url, cookie = urlsplit(self.path), SimpleCookie(self.headers.get("Cookie", ""))
        session = cookie["m_session_id"].value if "m_session_id" in cookie else None
        bearer = (self.headers.get("Authorization") or "").removeprefix("Bearer ") or None
        self.record(bool(session or bearer))
        m, q = _ROUTE.fullmatch(url.path), {k: v[0] for k, v in parse_qs(url.query).items()}
        repo = stub._repos.get(m["repo"]) if m else None
        if repo is None or (repo.token is not None and repo.token not in (session, bearer)):
            status = stub.private_status if repo is not None else 404
            return self._json(status, *_NO_MODEL, None)
        kind, owner, name = m["kind"], *m["repo"].split("/")
        if kind is None:
            return self._ok({"Path": owner, "Name": name, "Visibility": 1 if repo.token else 5})
        if kind == "revisions":
            revs = {"Branches": [], "Tags": []}
            for ref, sha in sorted(repo.refs.items()):
                kind_key = "Tags" if _TAG.fullmatch(ref) else "Branches"
                revs[kind_key].append({"Revision": ref, "CreatedAt": repo.when[sha]})
            return self._ok({"RevisionMap": revs})
        if kind == "commits":
            shas = repo.history(repo.resolve(q.get("Ref")))
            size, page = max(int(q.get("PageSize", 50)), 1), max(int(q.get("PageNumber", 1)), 1)
            commits = [_commit(s, repo.when[s]) for s in shas[(page - 1) * size : page * size]]
            return self._ok({"Commit": commits}, {"TotalCount": len(shas)})
        sha = repo.resolve(q.get("Revision"))
        if kind == "repo/files":
            files = (
                None
                if sha is None
                else _listing(repo, sha, q.get("Root", "").strip("/"), q.get("Recursive", "false").lower() == "true")
            )
            return self._ok({"Files": files})
        data = None if sha is None else repo.commits[sha].get(q.get("FilePath", ""))
        if data is None:
            return self._json(404, *_NO_FILE, None)
        headers = [("Content-Type", "application/octet-stream"), ("Accept-Ranges", "bytes")]
        self.send_file(q["FilePath"], data, headers)


def _commit(sha: str, when: int) -> dict:
    return {
        "Id": sha,
        "ShortId": sha[:8],
        "Title": "Upload",
        "Message": "Upload",
        "CommittedDate": when,
        "CreatedAt": when,
    }


_ENTRY = ("Name", "Path", "Type", "Size", "Sha256", "IsLFS", "Revision", "CommittedDate")


def _listing(repo: _Repo, sha: str, root: str, recursive: bool) -> list[dict]:
    base = root + "/" if root else ""
    files, entries, dirs = repo.commits[sha], [], set()
    for path in sorted(p for p in files if p.startswith(base)):
        parts = path[len(base) :].split("/")
        dirs.update(base + "/".join(parts[:i]) for i in range(1, len(parts) if recursive else min(2, len(parts))))
        if recursive or len(parts) == 1:
            data, last = files[path], repo.last_change(sha, path)
            digest = hashlib.sha256(data).hexdigest()
            row = (parts[-1], path, "blob", len(data), digest, _is_lfs(path, data), last, repo.when[last])
            entries.append(dict(zip(_ENTRY, row, strict=True)))
    trees = [
        dict(zip(_ENTRY, (d.rsplit("/", 1)[-1], d, "tree", 0, "", False, sha, repo.when[sha]), strict=True))
        for d in sorted(dirs)
    ]
    return trees + entries
