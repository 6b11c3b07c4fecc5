"""Compatibility checks for a version combination, driven by the knowledge base builder/data/compat.yaml.

All facts live in the YAML (each row with its source); this module only knows how to read the
tables. `check(Combo(...))` returns a Verdict: reasons (hard incompatibilities, each naming the
versions and the source), warnings (UNCONFIRMED facts, caveats) and resolved values (torch pinned
by vLLM / TensorRT-LLM, minimum drivers, compute capability ...). Bad input (a junk sm, a malformed
version) raises ConfigError; an incompatible combination is a Verdict, which
`Verdict.raise_for_incompatible()` turns into IncompatibleError.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema

from .axes import PACKAGE_AXES
from .errors import ConfigError, IncompatibleError, clipped, quoted
from .versions import (
    compare_versions,
    in_any,
    major_minor,
    normalize_cuda,
    normalize_driver,
    normalize_sm,
    parse_range,
    parse_version,
    release,
    sm_major_minor,
    sm_to_cc,
)
from .yamlio import safe_load_bounded

__all__ = [
    "GPU_BRANDS",
    "Combo",
    "DriverPath",
    "KnowledgeBase",
    "Verdict",
    "check",
    "cubin_runs_on",
    "driver_path",
    "forward_compat",
    "gpu_brand_of",
    "gpu_compute_capability",
    "knowledge_base",
    "load_knowledge_base",
    "min_driver",
    "min_driver_mvc",
    "require_cuda_env",
    "supported_sms",
]

DATA_FILE = Path(__file__).parent / "data" / "compat.yaml"
SCHEMA_FILE = Path(__file__).parent / "schemas" / "compat.schema.json"


@dataclass(frozen=True)
class Combo:
    cuda: str | None = None          # "12.1"; None for cpu
    sm: str | None = None            # normalised "86"
    driver: str | None = None        # a branch "535" or a full version "550.54.14" (branch = >= branch.0)
    tensorrt: str | None = None
    tensorrt_llm: str | None = None
    vllm: str | None = None
    torch: str | None = None
    python: str | None = None
    gpu_brand: str | None = None     # datacenter | workstation | consumer | embedded; None: unknown
    # The image has no CUDA of its own (a plain Debian base): CUDA's libraries come from torch's and
    # vLLM's PyPI wheels, and PyPI carries one CUDA build of each release.
    cuda_from_pypi: bool = False


GPU_BRANDS = ("datacenter", "workstation", "consumer", "embedded")


@dataclass(frozen=True)
class Verdict:
    compatible: bool
    reasons: tuple[str, ...]         # why incompatible, each a full sentence naming versions and the source
    warnings: tuple[str, ...]        # unconfirmed facts, PTX caveats
    resolved: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()      # which path applies where it is not the obvious one (forward compatibility)

    def raise_for_incompatible(self) -> None:
        """Raise IncompatibleError (exit 3) listing every reason when the combination cannot work."""
        if not self.compatible:
            raise IncompatibleError("incompatible combination:\n  - " + "\n  - ".join(self.reasons))


# ------------------------------------------------------------------------------------ loading

def _keypath(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


@dataclass(frozen=True)
class KnowledgeBase:
    """The validated compat.yaml (treat `data` as read-only)."""

    data: Mapping[str, Any]
    path: str

    # -- generic row lookups --
    def rows(self, *keys: str) -> list[dict]:
        node: Any = self.data
        for k in keys:
            node = node[k]
        return node

    def match_rows(self, table: tuple[str, ...], key: str, version: str) -> list[dict]:
        return [r for r in self.rows(*table) if in_any(version, r[key])]

    def source_text(self, row: Mapping[str, Any]) -> str:
        return f"(source: {row['source']})"

    # -- cuda --
    def toolkit(self, cuda: str) -> dict | None:
        mm = major_minor(cuda)
        return next((r for r in self.rows("cuda", "toolkits") if r["version"] == mm), None)

    def nonexistent(self, cuda: str) -> dict | None:
        mm = major_minor(cuda)
        return next((r for r in self.rows("cuda", "nonexistent") if major_minor(r["version"]) == mm), None)

    def unconfirmed_cuda(self, cuda: str) -> dict | None:
        return next((r for r in self.rows("cuda", "unconfirmed") if in_any(cuda, r["versions"])), None)

    def mvc(self, major: int) -> dict | None:
        rows = self.rows("cuda", "minor_version_compatibility")
        return next((r for r in rows if r["major"] == major), None)

    # -- sm --
    def arch(self, sm: str) -> dict | None:
        return next((r for r in self.rows("sm", "archs") if r["sm"] == sm), None)

    def precision(self, precision: str) -> dict | None:
        return next((r for r in self.data.get("precisions", ()) if r["precision"] == precision), None)


# table -> the keys of its rows written in the range notation
_RANGE_FIELDS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("cuda", "unconfirmed"): ("versions",),
    ("tensorrt", "cuda_builds"): ("tensorrt", "cuda", "cuda_unconfirmed"),
    ("tensorrt", "sm_rules"): ("tensorrt",),
    ("tensorrt_llm", "pins"): ("tensorrt_llm", "tensorrt", "torch"),
    ("tensorrt_llm", "sm_rules"): ("tensorrt_llm",),
    ("vllm", "torch_pins"): ("vllm",),
    ("vllm", "default_wheel_cuda"): ("vllm",),
    ("torch", "builds"): ("torch",),
    ("torch", "arch_lists"): ("torch",),
}


def _validate_drops(drops: list[dict], file: str) -> None:
    for i, row in enumerate(drops):
        if "when_cuda" in row:
            try:
                parse_range(row["when_cuda"])
            except ConfigError as exc:
                raise ConfigError(exc.message, file=file, key=_keypath(["drops", i, "when_cuda"])) from None
        if "restored_in" in row and release(row["restored_in"]) <= release(row["dropped_in"]):
            raise ConfigError(f"restored_in {row['restored_in']} is not after dropped_in {row['dropped_in']}",
                              file=file, key=_keypath(["drops", i, "restored_in"]))


def _validate_semantics(data: Mapping[str, Any], file: str) -> None:
    """Checks JSON Schema cannot express: every range parses, every source resolves."""
    sources = set(data["sources"])

    def walk(node: Any, path: list[Any]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "source" and isinstance(v, str):
                    for ref in v.split(";"):
                        head = ref.strip().split(" ")[0]
                        if not (head in sources or head.startswith(("http://", "https://"))):
                            raise ConfigError(f"source {head!r} is neither a key of `sources` nor a URL",
                                              file=file, key=_keypath([*path, k]))
                else:
                    walk(v, [*path, k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, [*path, i])

    walk({k: v for k, v in data.items() if k != "sources"}, [])
    _validate_drops(data["drops"], file)
    for table, keys in _RANGE_FIELDS.items():
        for i, row in enumerate(data[table[0]][table[1]]):
            for k in keys:
                if k not in row:
                    continue
                values = [row[k]] if isinstance(row[k], str) else row[k]
                for j, r in enumerate(values):
                    try:
                        parse_range(r)
                    except ConfigError as exc:
                        where = [*table, i, k] if isinstance(row[k], str) else [*table, i, k, j]
                        raise ConfigError(exc.message, file=file, key=_keypath(where)) from None


def load_knowledge_base(path: str | Path | None = None) -> KnowledgeBase:
    """Read and validate a compat.yaml (uncached); ConfigError naming the key path when it is broken."""
    path = Path(path) if path else DATA_FILE
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the compatibility knowledge base: {exc}", file=file) from None
    data = safe_load_bounded(text, file)
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(e.absolute_path), list(map(str, e.path))))
    if errors:
        err = jsonschema.exceptions.best_match(errors)
        raise ConfigError(f"does not match the compat schema: {clipped(err.message)}", file=file,
                          key=_keypath(err.absolute_path))
    _validate_semantics(data, file)
    return KnowledgeBase(data=data, path=file)


@lru_cache(maxsize=1)
def knowledge_base() -> KnowledgeBase:
    """The packaged knowledge base, validated once and cached."""
    return load_knowledge_base()


# ------------------------------------------------------------------------------------ helpers

def _sm_num(sm: str) -> tuple[int, int]:
    return sm_major_minor(sm)


def _driver_text(driver: str) -> str:
    return f"driver branch {driver}" if "." not in driver else f"driver {driver}"


def _cuda_ge(a: str, b: str) -> bool:
    return compare_versions(major_minor(a), major_minor(b)) >= 0


def _toolkit_min_driver(kb: KnowledgeBase, cuda: str) -> str | None:
    row = kb.toolkit(cuda)
    if row is None:
        return None
    rel = release(cuda)
    update = rel[2] if len(rel) > 2 else 0
    best = row["min_driver"]
    for num, drv in sorted(row.get("updates", {}).items(), key=lambda kv: int(kv[0])):
        if int(num) <= update:
            best = drv
    return best


def _cuda_problem(kb: KnowledgeBase, cuda: str) -> str | None:
    """Why a cuda version has no minimum driver in the KB (None when it has one)."""
    gone = kb.nonexistent(cuda)
    if gone:
        return f"CUDA {cuda} does not exist: {gone.get('note', 'never released')} {kb.source_text(gone)}."
    if kb.toolkit(cuda) is None:
        unconf = kb.unconfirmed_cuda(cuda)
        if unconf:
            return (f"CUDA {cuda}: {unconf.get('note', 'UNCONFIRMED')} {kb.source_text(unconf)}.")
        return (f"CUDA {cuda} is unknown to the compatibility knowledge base ({kb.path}); "
                f"add a cuda.toolkits row with its minimum driver and source.")
    return None


def min_driver(cuda: str, kb: KnowledgeBase | None = None) -> str:
    """Minimum Linux x86_64 driver of a CUDA toolkit ("12.1" -> "530.30.02"; "12.2.2" -> U2's)."""
    kb = kb or knowledge_base()
    cuda = normalize_cuda(cuda)
    found = _toolkit_min_driver(kb, cuda)
    if found is None:
        raise IncompatibleError(_cuda_problem(kb, cuda) or f"CUDA {cuda}: no minimum driver")
    return found


def min_driver_mvc(cuda: str, kb: KnowledgeBase | None = None) -> str | None:
    """The minor-version-compatibility floor of the CUDA major (12.x -> "525.60.13"), None if unknown."""
    kb = kb or knowledge_base()
    row = kb.mvc(release(normalize_cuda(cuda))[0])
    return row["min_driver"] if row else None


def require_cuda_env(cuda: str, kb: KnowledgeBase | None = None) -> str:
    """NVIDIA_REQUIRE_CUDA as NVIDIA's nvidia/cuda images write it for this CUDA version.

    Brand/driver-branch clauses come from cuda.container_requirement.rows where sourced; other
    versions get the plain "cuda>=X.Y" (which NVIDIA's own arm64/sbsa images use as well).
    """
    kb = kb or knowledge_base()
    cuda = normalize_cuda(cuda)
    gone = kb.nonexistent(cuda)
    if gone:
        raise IncompatibleError(_cuda_problem(kb, cuda) or "")
    mm = major_minor(cuda)
    req = kb.data["cuda"]["container_requirement"]
    row = next((r for r in req["rows"] if r["cuda"] == mm), None)
    parts = [f"cuda>={mm}"]
    for clause in (row or {}).get("clauses", []):
        brands = clause["brands"]
        brands = req["brand_sets"][brands] if isinstance(brands, str) else brands
        for branch in clause["branches"]:
            parts += [f"brand={b},driver>={branch},driver<{branch + 1}" for b in brands]
    return " ".join(parts)


def supported_sms(cuda: str, kb: KnowledgeBase | None = None) -> tuple[str, ...]:
    """The sm targets a CUDA toolkit can compile for, per the KB (sorted by compute capability)."""
    kb = kb or knowledge_base()
    cuda = normalize_cuda(cuda)
    out = [r["sm"] for r in kb.rows("sm", "archs") if _sm_cuda_problem(kb, r, r["sm"], cuda) is None]
    return tuple(sorted(out, key=lambda s: (_sm_num(s), s)))


def _gpu_row(name: str, kb: KnowledgeBase) -> dict | None:
    """The sm.gpus row of a GPU name as users or nvidia-smi write it: "A10", "NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-80GB", "Tesla T4", "NVIDIA GeForce RTX 4090" (the longest table name that the
    name is, or starts with before a space or dash)."""
    words = name.upper().split()
    while words and words[0] in ("NVIDIA", "TESLA", "GEFORCE"):
        words = words[1:]
    want = " ".join(words)
    rows = {n.upper(): row for row in kb.rows("sm", "gpus") for n in row["names"]}
    hits = [n for n in rows if want == n or want.startswith((n + " ", n + "-"))]
    # every hit is a prefix of `want`, so the greatest is the longest
    return rows[max(hits)] if hits else None


def gpu_compute_capability(name: str, kb: KnowledgeBase | None = None) -> str:
    """GPU marketing name -> compute capability ("A10" -> "8.6"); ConfigError when unknown."""
    kb = kb or knowledge_base()
    row = _gpu_row(name, kb)
    if row is None:
        raise ConfigError(f"GPU {quoted(name)} is not in the compatibility knowledge base's GPU table (sm.gpus)")
    return row["cc"]


def gpu_brand_of(name: str, nvml_brand: str | None = None, kb: KnowledgeBase | None = None) -> str | None:
    """The product line of a GPU: its sm.gpus row by name, else its NVML brand (as doctor.NVML_BRANDS
    names it: "tesla", "geforcertx" ...), else a brand word in its name ("Tesla", "GeForce", "Quadro");
    None when none of them tells."""
    kb = kb or knowledge_base()
    row = _gpu_row(name, kb)
    if row is not None:
        return row["kind"]
    brands = kb.data["cuda"]["forward_compatibility"]["brands"]
    for brand in (nvml_brand, *name.lower().split()):
        kind = next((k for k, names in brands.items() if brand in names), None)
        if kind:
            return kind
    return None


def forward_compat(cuda: str, kb: KnowledgeBase | None = None, sm: str | None = None) -> dict:
    """What an image of this CUDA version carries for forward compatibility: the cuda-compat package,
    where its libraries go, and the driver branches NVIDIA supports it on (empty when not sourced); for a
    GPU arch `sm`, only the branches that know that GPU."""
    kb = kb or knowledge_base()
    fc = kb.data["cuda"]["forward_compatibility"]
    major, minor = release(normalize_cuda(cuda))[:2]
    branches = _forward_branches(kb, f"{major}.{minor}")
    arch = _arch_min_driver(kb, sm) if sm else None
    if arch:
        branches = tuple(b for b in branches if b >= release(arch[1])[0])
    return {"package": fc["package"].format(major=major, minor=minor),
            "path": fc["path"].format(major=major, minor=minor), "branches": list(branches)}


def _forward_branches(kb: KnowledgeBase, mm: str) -> tuple[int, ...]:
    """The data-center (brand=tesla) driver branches of the CUDA version's container_requirement row."""
    req = kb.data["cuda"]["container_requirement"]
    row = next((r for r in req["rows"] if r["cuda"] == mm), None)
    out: set[int] = set()
    for clause in (row or {}).get("clauses", []):
        brands = req["brand_sets"][clause["brands"]] if isinstance(clause["brands"], str) else clause["brands"]
        if "tesla" in brands:
            out.update(clause["branches"])
    return tuple(sorted(out))


def _arch_min_driver(kb: KnowledgeBase, sm: str) -> tuple[str, str, str] | None:
    """(the first CUDA for sm, its minimum driver, their sources): no older driver knows the GPU. None where
    the KB does not tell (an arch of its oldest toolkit's baseline, or one added before its first toolkit)."""
    row = kb.arch(normalize_sm(sm).removesuffix("a"))
    added = row.get("added") if row else None
    floor = _toolkit_min_driver(kb, added) if added else None
    if not floor:
        return None
    return added, floor, f"(source: {row['source']}; {kb.toolkit(added)['source']})"


@dataclass(frozen=True)
class DriverPath:
    """How a driver runs an image of a CUDA version: natively (driver >= the toolkit's minimum),
    through forward compatibility (cuda-compat, data-center GPUs, supported branches), or not."""

    path: str                        # native | forward | none
    min_driver: str
    detail: str                      # the explanation: why it runs this way, or why not
    source: str = ""


def driver_path(cuda: str, driver: str, gpu_brand: str | None = None, kb: KnowledgeBase | None = None,
                sm: str | None = None) -> DriverPath:
    """Whether `driver` (a branch "535" or a version) runs CUDA `cuda` images on a GPU of `gpu_brand` and
    arch `sm` (when given: forward compatibility cannot serve a GPU that the driver's branch predates)."""
    kb = kb or knowledge_base()
    cuda, driver = normalize_cuda(cuda), normalize_driver(driver)
    floor = _toolkit_min_driver(kb, cuda)
    if floor is None:
        raise IncompatibleError(_cuda_problem(kb, cuda) or f"CUDA {cuda}: no minimum driver")
    is_branch = "." not in driver
    branch = release(driver)[0]
    if not (branch < release(floor)[0] if is_branch else compare_versions(driver, floor) < 0):
        return DriverPath("native", floor, f"{_driver_text(driver)} meets CUDA {cuda}'s minimum driver {floor}")
    fc = kb.data["cuda"]["forward_compatibility"]
    info = forward_compat(cuda, kb)
    src = kb.source_text(fc)
    mm = major_minor(cuda)
    supported = branch in info["branches"]
    kinds = fc["kinds"]
    if gpu_brand is not None and kinds[gpu_brand] == "yes":
        arch = _arch_min_driver(kb, sm) if sm else None
        if supported and arch and branch < release(arch[1])[0]:
            return DriverPath("none", floor, (
                f"{_driver_text(driver)} predates sm_{sm}: CUDA {arch[0]}, the first to support it, needs driver "
                f">= {arch[1]} {arch[2]}, and forward compatibility replaces only the user-mode driver, not the "
                f"kernel driver that must know the GPU {src}"), src)
        if supported:
            return DriverPath("forward", floor, (
                f"{_driver_text(driver)} is below CUDA {cuda}'s minimum driver {floor}, but "
                f"a data-center GPU runs CUDA {mm} on it through forward compatibility: the image carries "
                f"{info['package']} and loads it from {info['path']} at start, and its NVIDIA_REQUIRE_CUDA admits "
                f"brand=tesla on branch {branch}"),
                src)
        if info["branches"]:
            why = (f"forward compatibility for CUDA {mm} supports driver branches "
                   f"{', '.join(map(str, info['branches']))}, not {branch}")
        else:
            why = (f"the knowledge base has no sourced forward-compatibility branches for CUDA {mm}, and the "
                   f"image's NVIDIA_REQUIRE_CUDA (cuda>={mm}) admits no older branch")
        return DriverPath("none", floor, f"{why} {src}", src)
    if gpu_brand == "consumer":
        return DriverPath("none", floor, "forward compatibility (cuda-compat) does not apply: it works only on "
                                         "data-center GPUs; "
                                         "a consumer GPU fails with cudaErrorCompatNotSupportedOnDevice (804) "
                                         + src, src)
    if not supported:
        return DriverPath("none", floor, "")  # nothing forward compatibility could change
    if gpu_brand is not None and kinds[gpu_brand] == "unmodeled":
        return DriverPath("none", floor, "on Jetson, forward compatibility follows JetPack's own support table "
                                         "(cuda-compat for L4T), which this knowledge base does not hold, and "
                                         f"mopt's images are built for x86_64 hosts; it is not assumed {src}", src)
    if gpu_brand == "workstation":
        hint = "forward compatibility works only on select NGC Server Ready RTX SKUs, so it is not assumed"
    else:
        hint = "the GPU's product line is unknown, so forward compatibility is not assumed"
    hint += (f"; on a data-center GPU it would run through forward compatibility ({info['package']}): "
             f"give --gpu-brand datacenter if it is one")
    return DriverPath("none", floor, f"{hint} {src}", src)


def precision_problem(precision: str, sm: str, kb: KnowledgeBase | None = None) -> str | None:
    """Why an engine in PRECISION cannot run on sm_SM (the knowledge base's precisions table), or None."""
    kb = kb or knowledge_base()
    row = kb.precision(precision)
    if row is None or _sm_num(normalize_sm(sm)) >= _sm_num(row["min_sm"]):
        return None
    return f"{precision} engines need sm_{row['min_sm']} or newer, not sm_{sm} {kb.source_text(row)}"


def cubin_runs_on(built_sm: str, device_sm: str, kb: KnowledgeBase | None = None) -> bool:
    """Whether a cubin built for built_sm runs on a device of device_sm (the KB's binary-compat rule)."""
    kb = kb or knowledge_base()
    rule = kb.data["sm"]["binary_compatibility"]
    b, d = normalize_sm(built_sm), normalize_sm(device_sm)
    if b.endswith("a") and not rule["arch_specific_portable"]:
        return _sm_num(b) == _sm_num(d)
    if rule["cubin"] == "same_major_ge_minor":
        (bm, bn), (dm, dn) = _sm_num(b), _sm_num(d)
        return bm == dm and dn >= bn
    raise ConfigError(f"unknown cubin rule {rule['cubin']!r}", file=kb.path,
                      key="sm.binary_compatibility.cubin")


def _sm_cuda_problem(kb: KnowledgeBase, row: Mapping[str, Any], sm: str, cuda: str) -> str | None:
    """Why CUDA `cuda` cannot compile for `sm` (None when it can)."""
    src = kb.source_text(row)
    added = row.get("added")
    if added is None and sm not in kb.data["sm"]["baseline"]["sms"]:
        base = kb.data["sm"]["baseline"]
        return (f"sm_{sm} has no `added` row and is not in the CUDA {base['cuda']} baseline list "
                f"(source: {base['source']}).")
    if added and not _cuda_ge(cuda, added):
        return (f"sm_{sm} (compute capability {sm_to_cc(sm)}) was added in CUDA {added}; CUDA {cuda} cannot "
                f"compile for it (nvcc fatal : Unsupported gpu architecture 'compute_{sm}') {src}.")
    removed = row.get("removed")
    if removed and _cuda_ge(cuda, removed):
        renamed = ""
        if row.get("renamed_to"):
            renamed = f"; it was renamed sm_{row['renamed_to']} in CUDA {removed}"
        return (f"sm_{sm} (compute capability {sm_to_cc(sm)}) was dropped in CUDA {removed}{renamed}; "
                f"CUDA {cuda} cannot compile for it (nvcc fatal : Unsupported gpu architecture "
                f"'compute_{sm}') {src}.")
    return None


# ------------------------------------------------------------------------------------ check

class _Ctx:
    def __init__(self, kb: KnowledgeBase, cuda_from_pypi: bool):
        self.kb = kb
        self.cuda_from_pypi = cuda_from_pypi
        self.reasons: list[str] = []
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.resolved: dict[str, Any] = {}

    def reject(self, msg: str) -> None:
        if msg not in self.reasons:
            self.reasons.append(msg)

    def warn(self, msg: str) -> None:
        if msg not in self.warnings:
            self.warnings.append(msg)

    def note(self, msg: str) -> None:
        if msg not in self.notes:
            self.notes.append(msg)

    def fact(self, row: Mapping[str, Any], msg: str, *, soft: str = "") -> None:
        """A rejection when the row is confirmed (and no `soft` excuse is given), else a warning."""
        if soft:
            self.warn(msg + " " + soft)
        elif row.get("confirmed", True):
            self.reject(msg)
        else:
            self.warn("UNCONFIRMED: " + msg + " Not enforced; verify before relying on it.")


def _unique(ctx: _Ctx, table: tuple[str, ...], key: str, version: str, what: str, *,
            explicit: bool) -> dict | None:
    rows = ctx.kb.match_rows(table, key, version)
    if len(rows) > 1:
        raise ConfigError(f"{what} {version} matches {len(rows)} rows; the rows must not overlap",
                          file=ctx.kb.path, key=".".join(table))
    if not rows:
        msg = (f"{what} {version} is unknown to the compatibility knowledge base ({ctx.kb.path}, "
               f"{'.'.join(table)}); add a row with its source if it is real.")
        if explicit:
            ctx.reject(msg)
        else:
            ctx.warn(msg + " It was implied by another pin, so it is not checked further.")
        return None
    if rows[0].get("confirmed") is False and rows[0].get("note"):
        ctx.warn(f"UNCONFIRMED: {what} {version}: {rows[0]['note']} {ctx.kb.source_text(rows[0])}.")
    return rows[0]


def _pin_version(pin: str) -> str | None:
    """A concrete version for a pin: "10.3" -> "10.3", "~10.11.0" -> "10.11.0", ">=2.7.1,<..." -> None."""
    rng = parse_range(pin)
    if len(rng.terms) == 1 and rng.terms[0].op in ("prefix", "tilde", "=="):
        return rng.terms[0].a
    return None


def _same_release(a: str, b: str) -> bool:
    ra, rb = release(a), release(b)
    n = max(len(ra), len(rb))
    return ra + (0,) * (n - len(ra)) == rb + (0,) * (n - len(rb))


def _check_trtllm(ctx: _Ctx, combo: Combo, cuda: str | None) -> None:
    ver = combo.tensorrt_llm
    for axis, value in (("cuda", cuda), ("sm", combo.sm), ("python", combo.python)):
        _dropped(ctx, "tensorrt_llm", ver, axis, value, cuda=cuda)
    row = _unique(ctx, ("tensorrt_llm", "pins"), "tensorrt_llm", ver, "TensorRT-LLM", explicit=True)
    if row is None:
        return
    src = ctx.kb.source_text(row)
    if row.get("tensorrt"):
        if combo.tensorrt:
            if not in_any(combo.tensorrt, row["tensorrt"]):
                ctx.fact(row, f"TensorRT-LLM {ver} is pinned to TensorRT {row['tensorrt']}, "
                              f"but TensorRT {combo.tensorrt} was given {src}.")
        else:
            pinned = _pin_version(row["tensorrt"])
            ctx.resolved["tensorrt"] = pinned or row["tensorrt"]
            ctx.resolved["tensorrt_implied"] = True
            if not pinned:
                ctx.warn(f"TensorRT-LLM {ver} pins TensorRT {row['tensorrt']}, a range, not one release; "
                         f"TensorRT is not checked further {src}.")
    if row.get("cuda"):
        if cuda:
            if major_minor(cuda) != major_minor(row["cuda"]):
                ctx.fact(row, f"TensorRT-LLM {ver} is built for CUDA {row['cuda']}, "
                              f"but CUDA {cuda} was given {src}.")
        else:
            ctx.resolved["cuda"] = major_minor(row["cuda"])
            ctx.resolved["cuda_implied"] = True
    if row.get("torch"):
        ctx.resolved["torch_spec_tensorrt_llm"] = row["torch"]
        if combo.torch:
            if not parse_range(row["torch"]).contains(combo.torch):
                ctx.fact(row, f"TensorRT-LLM {ver} requires torch {row['torch']}, "
                              f"but torch {combo.torch} was given {src}.")
        else:
            pinned = _pin_version(row["torch"])
            if pinned:
                ctx.resolved["torch"] = pinned
                ctx.resolved["torch_from"] = "tensorrt_llm"


def _check_vllm(ctx: _Ctx, combo: Combo, cuda: str | None) -> None:
    ver = combo.vllm
    for axis, value in (("cuda", cuda), ("sm", combo.sm), ("python", combo.python)):
        _dropped(ctx, "vllm", ver, axis, value, cuda=cuda)
    row = _unique(ctx, ("vllm", "torch_pins"), "vllm", ver, "vLLM", explicit=True)
    if row is not None:
        pin, src = row["torch"], ctx.kb.source_text(row)
        if combo.torch and not _same_release(combo.torch, pin):
            ctx.fact(row, f"vLLM {ver} pins torch=={pin} (PyPI requires_dist), but torch {combo.torch} "
                          f"was given; pip would refuse the install {src}.")
        trtllm_spec = ctx.resolved.get("torch_spec_tensorrt_llm")
        if trtllm_spec and not parse_range(trtllm_spec).contains(pin):
            ctx.reject(f"vLLM {ver} pins torch=={pin} but TensorRT-LLM {combo.tensorrt_llm} requires torch "
                       f"{trtllm_spec}; they cannot share one environment {src}.")
        if not combo.torch:
            ctx.resolved["torch"] = pin
            ctx.resolved["torch_from"] = "vllm"
    wheel = [r for r in ctx.kb.rows("vllm", "default_wheel_cuda") if in_any(ver, r["vllm"])]
    if wheel:
        w = wheel[0]
        ctx.resolved["vllm_wheel_cuda"] = w["cuda"]
        built = [w["cuda"], *w.get("variants", [])]
        if ctx.cuda_from_pypi and cuda and major_minor(cuda) != w["cuda"]:
            ctx.reject(f"on a base without CUDA, vLLM and CUDA's libraries come from PyPI, whose vLLM {ver} wheels "
                       f"are built for CUDA {w['cuda']}, not {major_minor(cuda)} {ctx.kb.source_text(w)}.")
        elif cuda and major_minor(cuda) not in built:
            ctx.warn(f"vLLM {ver}'s PyPI wheels are built for CUDA {', '.join(built)}, not CUDA {cuda}; "
                     f"the image needs a vLLM/torch build matching CUDA {cuda} {ctx.kb.source_text(w)}.")


def _newest_floor_before(kb: KnowledgeBase, cuda: str) -> dict | None:
    """The toolkit row of the newest CUDA the KB knows before `cuda`: a later CUDA never needs an older
    driver, so its floor bounds an unconfirmed version's from below."""
    older = [r for r in kb.rows("cuda", "toolkits") if compare_versions(r["version"], major_minor(cuda)) < 0]
    return max(older, key=lambda r: release(r["version"])) if older else None


def _warn_unknown_update(ctx: _Ctx, cuda: str, tk: Mapping[str, Any] | None, floor: str | None) -> None:
    if tk is None:
        return
    known = max((int(n) for n in tk.get("updates", {})), default=0)
    if len(release(cuda)) > 2 and release(cuda)[2] > known:
        ctx.warn(f"CUDA {cuda}: the knowledge base knows CUDA {major_minor(cuda)} up to update {known} "
                 f"({major_minor(cuda)}.{known}); its minimum driver {floor} is assumed {ctx.kb.source_text(tk)}.")


def _driver_limit(floor: str | None, tk: dict | None, before: dict | None,
                  mvc: dict | None) -> tuple[str | None, dict | None]:
    """The driver a CUDA version needs and the row that says so: its toolkit's floor; for a version past
    the table, the newest floor of the newest CUDA before it; else its major's MVC floor."""
    if floor:
        return floor, tk
    if before:
        return max([before["min_driver"], *before.get("updates", {}).values()], key=release), before
    return (mvc["min_driver"], mvc) if mvc else (None, None)


def _check_cuda_driver(ctx: _Ctx, cuda: str, driver: str | None, gpu_brand: str | None,
                       sm: str | None = None) -> None:
    kb = ctx.kb
    problem = _cuda_problem(kb, cuda)
    ctx.resolved["cuda_major"] = release(cuda)[0]
    mvc = kb.mvc(release(cuda)[0])
    ctx.resolved["min_driver_mvc"] = mvc["min_driver"] if mvc else None
    floor = _toolkit_min_driver(kb, cuda)
    ctx.resolved["min_driver"] = floor
    if problem:
        if not (kb.unconfirmed_cuda(cuda) and not kb.nonexistent(cuda)):
            ctx.reject(problem)  # never released, or unknown: no driver to hold it to
            return
        ctx.warn("UNCONFIRMED: " + problem + " A driver is checked against the newest known CUDA's minimum.")
    if floor is not None:
        ctx.resolved["forward_compat"] = forward_compat(cuda, kb, sm)
    tk = kb.toolkit(cuda)
    _warn_unknown_update(ctx, cuda, tk, floor)
    if not driver:
        return
    before = _newest_floor_before(kb, cuda) if floor is None else None  # past the table (unconfirmed)
    limit, limit_row = _driver_limit(floor, tk, before, mvc)
    if limit is None:
        return
    req = kb.data["cuda"]["container_requirement"]
    error = " ".join(req["error_template"].format(cuda=major_minor(cuda)).split())
    src = kb.source_text(limit_row)
    is_branch = "." not in driver
    branch, limit_branch = release(driver)[0], release(limit)[0]
    below = branch < limit_branch if is_branch else compare_versions(driver, limit) < 0
    if below:
        way = driver_path(cuda, driver, gpu_brand, kb, sm=sm) if floor else None
        if way is not None and way.path == "forward":
            ctx.resolved["driver_path"] = "forward"
            ctx.note(f"{way.detail} {way.source}.")
            return
        ctx.resolved["driver_path"] = "none"
        mvc_note = ""
        if mvc and compare_versions(driver if not is_branch else f"{driver}.999", mvc["min_driver"]) >= 0:
            disable = req.get("disable_env", "NVIDIA_DISABLE_REQUIRE=true")
            mvc_note = (f" Minor version compatibility ({release(cuda)[0]}.x on >= {mvc['min_driver']}) "
                        f"would only help with {disable} and no PTX JIT (cudaErrorUnsupportedPtxVersion).")
        fwd_note = f" {way.detail[:1].upper()}{way.detail[1:]}." if way is not None and way.detail else ""
        if before is not None:
            ctx.reject(f"{_driver_text(driver)} is below {limit}, the minimum driver of CUDA {before['version']}, the "
                       f"newest release the knowledge base knows before CUDA {cuda}; a later CUDA never needs an "
                       f"older driver {src}.")
            return
        if tk and not is_branch and compare_versions(driver, tk["min_driver"]) >= 0:  # an update's floor
            ctx.reject(f"{_driver_text(driver)} is below CUDA {cuda}'s minimum driver {limit}: the container's "
                       f"cuda>={major_minor(cuda)} check passes, but this CUDA update needs the newer driver "
                       f"{src}.{fwd_note}")
            return
        ctx.reject(f"{_driver_text(driver)} is below CUDA {cuda}'s minimum driver {limit}; the container "
                   f"would stop at start with \"{error}\" {src}.{mvc_note}{fwd_note}")
        return
    ctx.resolved["driver_path"] = "native"
    if is_branch and branch == limit_branch and release(limit)[1:] != (0,):
        whose = f"CUDA {cuda}'s minimum driver" if before is None else f"CUDA {before['version']}'s minimum driver"
        ctx.warn(f"driver branch {driver} includes releases older than {whose} {limit}; "
                 f"the host needs >= {limit} {src}.")


def _check_sm_cuda(ctx: _Ctx, sm: str, cuda: str | None) -> str | None:
    """Validates sm against the arch table (and cuda); returns the sm whose row applies."""
    kb = ctx.kb
    row = kb.arch(sm)
    if row is None and sm.endswith("a"):
        base = kb.arch(sm[:-1])
        if base is not None:
            ctx.warn(f"sm_{sm}: no row for this arch-specific target; using sm_{sm[:-1]}'s CUDA range. "
                     f"'a' targets run only on compute capability {sm_to_cc(sm)}.")
            row = base
    if row is None:
        ctx.reject(f"sm_{sm} is unknown to the compatibility knowledge base ({kb.path}, sm.archs); "
                   f"add a row with the CUDA version that added it and its source.")
        return None
    if row.get("renamed_to"):
        ctx.resolved["sm_renamed_to"] = row["renamed_to"]
    if cuda and kb.nonexistent(cuda) is None and (kb.toolkit(cuda) or kb.unconfirmed_cuda(cuda)):
        problem = _sm_cuda_problem(kb, row, row["sm"], cuda)
        if problem:
            ctx.fact(row, problem.replace(f"sm_{row['sm']} ", f"sm_{sm} ", 1))
    return row["sm"]


def _sm_rules(ctx: _Ctx, table: tuple[str, ...], key: str, version: str, what: str, sm: str) -> None:
    smn = _sm_num(sm)
    base = sm.rstrip("a")
    for row in ctx.kb.match_rows(table, key, version):
        src = ctx.kb.source_text(row)
        note = f" ({row['note']})" if row.get("note") else ""
        if row.get("min_sm") and smn < _sm_num(row["min_sm"]):
            ctx.fact(row, f"{what} {version} needs sm >= {row['min_sm']} (compute capability "
                          f"{sm_to_cc(row['min_sm'])}); sm_{sm} is not supported{note} {src}.")
        if base in row.get("exclude_sms", []):
            ctx.fact(row, f"{what} {version} does not support sm_{sm}{note} {src}.")
        if base in row.get("deprecated_sms", []):
            ctx.warn(f"{what} {version}: sm_{sm} is deprecated{note} {src}.")


def _check_tensorrt(ctx: _Ctx, trt: str, explicit: bool, cuda: str | None, sm: str | None,
                    python: str | None) -> None:
    _dropped(ctx, "tensorrt", trt, "python", python)
    dropped = _dropped(ctx, "tensorrt", trt, "cuda", cuda)
    row = _unique(ctx, ("tensorrt", "cuda_builds"), "tensorrt", trt, "TensorRT", explicit=explicit)
    if row is not None and cuda and row.get("confirmed", True) and not dropped:
        src = ctx.kb.source_text(row)
        if in_any(cuda, row["cuda"]):
            pass
        elif in_any(cuda, row.get("cuda_unconfirmed", [])):
            ctx.warn(f"UNCONFIRMED: TensorRT {trt} build for CUDA {cuda} is not confirmed {src}.")
        else:
            builds = ", ".join(row["cuda"]) or "none sourced"
            ctx.fact(row, f"TensorRT {trt} has no build for CUDA {cuda} (builds: CUDA {builds}) {src}.")
    if sm:
        before = len(ctx.reasons)
        if row is not None:
            _sm_rules(ctx, ("tensorrt", "sm_rules"), "tensorrt", trt, "TensorRT", sm)
        if len(ctx.reasons) == before:  # its own rows have not refused this sm already
            _dropped(ctx, "tensorrt", trt, "sm", sm, cuda=cuda)


_PYTHON = re.compile(r"[23]\.(0|[1-9]\d?)(\.(0|[1-9]\d{0,2}))?", re.ASCII)


def _torch_local_cuda(torch: str) -> str | None:
    local = parse_version(torch).local
    if local and local.startswith("cu") and local[2:].isdigit():
        return normalize_cuda(local)
    return None


def _check_torch(ctx: _Ctx, torch: str, explicit: bool, cuda: str | None, sm: str | None,
                 python: str | None) -> None:
    kb = ctx.kb
    soft = ""
    if not explicit and ctx.resolved.get("torch_from") == "tensorrt_llm":
        soft = (f"torch {torch} is implied by the TensorRT-LLM {ctx.resolved.get('tensorrt_llm')} pin, whose "
                f"releases ship their own torch build, so this is not enforced.")
    _dropped(ctx, "torch", torch, "python", python, soft=soft)
    local = parse_version(torch).local
    if local == "cpu":
        if cuda:
            ctx.reject(f"torch {torch} is a CPU-only build; it cannot use CUDA {cuda}.")
        return
    local_cuda = _torch_local_cuda(torch)
    if local_cuda and cuda and major_minor(local_cuda) != major_minor(cuda):
        ctx.reject(f"torch {torch} is built for CUDA {local_cuda}, but CUDA {cuda} was given.")
    matches = kb.match_rows(("torch", "builds"), "torch", torch)
    confirmed = matches[0] if len(matches) == 1 and _variants_confirmed(matches[0]) else None
    restores = frozenset({confirmed["default_cuda"], *confirmed["cuda_variants"]}) if confirmed else frozenset()
    if _dropped(ctx, "torch", torch, "cuda", cuda, soft=soft, restores=restores) and not soft:
        return
    row = _unique(ctx, ("torch", "builds"), "torch", torch, "torch", explicit=explicit)
    if row is None:
        return
    ctx.resolved["torch_default_cuda"] = row["default_cuda"]
    ctx.resolved["torch_default_cuda_full"] = row.get("default_cuda_full")
    if not cuda:
        return
    src = kb.source_text(row)
    mm = major_minor(cuda)
    if ctx.cuda_from_pypi and mm != row["default_cuda"]:
        ctx.fact(row, f"on a base without CUDA, torch and CUDA's libraries come from PyPI, whose torch {torch} is "
                      f"built for CUDA {row['default_cuda']}, not {mm} (its other CUDA builds are on "
                      f"download.pytorch.org; a base with CUDA, such as nvidia-cuda, installs from there) {src}.",
                 soft=soft)
    built = sorted({row["default_cuda"], *row["cuda_variants"]}, key=release)
    if mm not in built:
        if _variants_confirmed(row):
            ctx.fact(row, f"torch {torch} has no CUDA {mm} build (PyPI default CUDA {row['default_cuda']}; "
                          f"download.pytorch.org variants: {', '.join(built)}) {src}.", soft=soft)
        else:
            ctx.warn(f"UNCONFIRMED: torch {torch} CUDA {mm} build: {row.get('note', 'variants unconfirmed')} "
                     f"(known: {', '.join(built)}) {src}.")
    if sm:
        before = len(ctx.reasons) + len(ctx.warnings)
        _check_torch_arch(ctx, torch, mm, sm, soft)
        if len(ctx.reasons) + len(ctx.warnings) == before:  # the arch lists have not spoken of this sm
            _dropped(ctx, "torch", torch, "sm", sm, cuda=cuda, soft=soft)


def _variants_confirmed(row: Mapping[str, Any]) -> bool:
    return bool(row.get("variants_confirmed", True) and row.get("confirmed", True))


_PACKAGE_NAMES = {"torch": "torch", "vllm": "vLLM", "tensorrt": "TensorRT", "tensorrt_llm": "TensorRT-LLM"}


def _from_on(version: str, start: str) -> bool:
    """version >= start by release ("2.9" covers 2.9.0 and 2.9.1; 2.8.1 is before it)."""
    return compare_versions(".".join(map(str, release(version))), start) >= 0


def _covers(axis: str, row: Mapping[str, Any], value: str) -> tuple[str, str] | None:
    """(the dropped line, what that means for the version) when `value` is on the line `row` drops, as a
    reason names them: ("CUDA 12", "has no CUDA 12.8 build"), ("sm_90", "does not support sm_90a"),
    ("Python 3.9", "does not support Python 3.9.7"); None when the row drops another line."""
    if axis == "cuda":
        line = release(row["cuda"])
        if release(value)[:len(line)] == line:
            return f"CUDA {row['cuda']}", f"has no CUDA {major_minor(value)} build"
    elif axis == "sm":
        base = value.removesuffix("a")  # an arch-specific target is on its base's line
        if base in row["sm"]:
            return f"sm_{base}", f"does not support sm_{value}"
    elif major_minor(value) in row["python"]:
        return f"Python {major_minor(value)}", f"does not support Python {value}"
    else:
        # an older Python than a dropped one went before it (or with it): 3.7 is gone where 3.8 is
        newest = max(row["python"], key=release)
        if release(major_minor(value)) < release(newest):
            return f"Python {newest}", f"does not support Python {value}, older still"
    return None


def _dropped(ctx: _Ctx, package: str, version: str, axis: str, value: str | None, *, cuda: str | None = None,
             soft: str = "", restores: frozenset[str] = frozenset()) -> bool:
    """Report each `axis` line (cuda, sm or python) that `package` dropped at or before `version` (the KB's
    drops, inherited by every later version) and `value` is on; True when one was. `cuda`: the CUDA of
    the build, for drops limited to some builds (when_cuda); `restores`: CUDA lines a confirmed row of
    this version lists again."""
    if not value or (axis == "cuda" and major_minor(value) in restores):
        return False
    what = _PACKAGE_NAMES[package]
    hits = []
    for row in ctx.kb.rows("drops"):
        if row["package"] != package or axis not in row or not _from_on(version, row["dropped_in"]):
            continue
        if row.get("restored_in") and _from_on(version, row["restored_in"]):
            continue
        if row.get("when_cuda") and not (cuda and in_any(cuda, row["when_cuda"])):
            continue
        covered = _covers(axis, row, value)
        if covered is not None:
            hits.append((row, covered))
    if not hits:
        return False
    # one reason: the first drop that took this line (several rows cover a Python older than all of them)
    row, covered = min(hits, key=lambda hit: release(hit[0]["dropped_in"]))
    builds = f" from its builds for CUDA {row['when_cuda']}" if row.get("when_cuda") else ""
    note = f" ({row['note']})" if row.get("note") else ""
    ctx.fact(row, f"{what} dropped {covered[0]}{builds} in {row['dropped_in']} and a dropped line does not come "
                  f"back: {what} {version} {covered[1]}{note} {ctx.kb.source_text(row)}.", soft=soft)
    return True


def _check_torch_arch(ctx: _Ctx, torch: str, mm: str, sm: str, soft: str) -> None:
    """Whether torch's cuXY wheels carry kernels (or PTX) for sm, by the arch lists of its builds."""
    kb = ctx.kb
    smn = _sm_num(sm)
    for al in kb.rows("torch", "arch_lists"):
        if mm not in al["cuda"] or not in_any(torch, al["torch"]):
            continue
        asrc = kb.source_text(al)
        note = f" ({al['note']})" if al.get("note") else ""
        if smn < _sm_num(al["min_sm"]):
            ctx.fact(al, f"torch {torch} cu{mm.replace('.', '')} wheels start at sm_{al['min_sm']}; "
                         f"they contain no kernels for sm_{sm}{note} {asrc}.", soft=soft)
        elif al.get("max_sm") and smn > _sm_num(al["max_sm"]):
            if cubin_runs_on(al["max_sm"], sm, kb):
                continue
            if al.get("ptx"):
                ctx.warn(f"torch {torch} cu{mm.replace('.', '')} covers sm_{sm} only through PTX JIT of "
                         f"sm_{al['max_sm']} PTX; {kb.data['cuda']['ptx_jit_caveat']['text']} {asrc}.")
            else:
                ctx.fact(al, f"torch {torch} cu{mm.replace('.', '')} wheels end at sm_{al['max_sm']} "
                             f"without PTX; sm_{sm} is not covered{note} {asrc}.", soft=soft)


def _check_driver_without_cuda(ctx: _Ctx, combo: Combo, driver: str, sm: str | None) -> None:
    """No CUDA given: a package from PyPI brings its default CUDA build (vLLM's wheels, torch's default), and
    the driver is held to that; with neither, there is nothing to hold it to."""
    if ctx.resolved.get("vllm_wheel_cuda"):
        cuda, whose = ctx.resolved["vllm_wheel_cuda"], f"vLLM {combo.vllm}'s PyPI wheels"
    elif ctx.resolved.get("torch_default_cuda"):
        cuda, whose = ctx.resolved["torch_default_cuda"], f"torch {ctx.resolved['torch']}'s PyPI default build"
    else:
        ctx.warn(f"{_driver_text(driver)} given without a CUDA version; nothing to check it against.")
        return
    ctx.note(f"no CUDA version given: the driver is checked against CUDA {cuda}, the CUDA of {whose}.")
    _check_cuda_driver(ctx, cuda, driver, combo.gpu_brand, sm)


def _validated_packages(combo: Combo) -> str | None:
    """ConfigError for a malformed Python or package version; the CUDA a torch +cuXYZ local part names."""
    if combo.python is not None and not _PYTHON.fullmatch(str(combo.python).strip()):
        raise ConfigError(f"not a Python version: {quoted(combo.python)}; write e.g. 3.12 or 3.12.4")
    for name in PACKAGE_AXES:
        value = getattr(combo, name)
        if value is not None:
            parse_version(value)
    if combo.torch is None:
        return None
    local = parse_version(combo.torch).local
    try:
        local_cuda = _torch_local_cuda(combo.torch)
    except ConfigError:
        local_cuda = None  # +cu1, +cu99999: said below
    if local and local != "cpu" and not local_cuda:
        raise ConfigError(f"torch {quoted(combo.torch)}: its local version +{local} is not a build tag "
                          "mopt knows (+cpu or +cuXYZ, e.g. 2.9.0+cu128)")
    return local_cuda


def check(combo: Combo, kb: KnowledgeBase | None = None) -> Verdict:
    """Check one combination against the knowledge base. ConfigError for malformed input."""
    kb = kb or knowledge_base()
    ctx = _Ctx(kb, combo.cuda_from_pypi)
    cuda = normalize_cuda(combo.cuda) if combo.cuda is not None else None
    sm = normalize_sm(combo.sm) if combo.sm is not None else None
    driver = normalize_driver(combo.driver) if combo.driver is not None else None
    cuda = cuda or _validated_packages(combo)  # torch 2.9.0+cu128 names its CUDA
    if combo.gpu_brand is not None and combo.gpu_brand not in GPU_BRANDS:
        raise ConfigError(f"GPU brand {combo.gpu_brand!r}: expected one of {', '.join(GPU_BRANDS)}")
    combo = replace(combo, cuda=cuda, sm=sm, driver=driver)
    ctx.resolved.update({"cuda": cuda, "sm": sm, "driver": driver, "tensorrt": combo.tensorrt,
                         "tensorrt_llm": combo.tensorrt_llm, "vllm": combo.vllm, "torch": combo.torch,
                         "python": combo.python, "gpu_brand": combo.gpu_brand, "cc": sm_to_cc(sm) if sm else None,
                         "cuda_major": None, "min_driver": None, "min_driver_mvc": None})

    if combo.tensorrt_llm:
        _check_trtllm(ctx, combo, cuda)
    eff_cuda = cuda or ctx.resolved.get("cuda")
    if combo.vllm:
        _check_vllm(ctx, combo, eff_cuda)
    if eff_cuda:
        _check_cuda_driver(ctx, eff_cuda, driver, combo.gpu_brand, sm)
    arch_sm = _check_sm_cuda(ctx, sm, eff_cuda) if sm else None
    trt = combo.tensorrt or ctx.resolved.get("tensorrt")
    if trt and (combo.tensorrt or _pin_version(trt)):      # an implied range names no release to look up
        _check_tensorrt(ctx, trt, bool(combo.tensorrt), eff_cuda, sm if arch_sm else None, combo.python)
    if combo.tensorrt_llm and sm and arch_sm:
        _sm_rules(ctx, ("tensorrt_llm", "sm_rules"), "tensorrt_llm", combo.tensorrt_llm, "TensorRT-LLM", sm)
    torch = combo.torch or ctx.resolved.get("torch")
    if torch:
        _check_torch(ctx, torch, bool(combo.torch), eff_cuda, sm if arch_sm else None, combo.python)
    if driver and not eff_cuda:
        _check_driver_without_cuda(ctx, combo, driver, sm)

    return Verdict(compatible=not ctx.reasons, reasons=tuple(ctx.reasons), warnings=tuple(ctx.warnings),
                   resolved=dict(ctx.resolved), notes=tuple(ctx.notes))
