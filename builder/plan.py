"""Expand the matrix into variants: cross axes, apply exclude/include, pick newest compatible
values, check every combination against the compatibility knowledge base, and name the tags.

Every combination ends up either a Variant or a Rejected with its reasons.
"""
from __future__ import annotations

import fnmatch
import itertools
import re
import string
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from functools import cache

from packaging.version import Version

from . import compat
from .axes import AXES, COMBO_AXES, LONG_TAG_PREFIXES
from .backends import backend
from .errors import ConfigError
from .matrix import Flavour, ImageEntry, Matrix
from .runtime.params import backend_precisions  # the contract (torch-free): what each backend compiles

_DOCKER_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")



@dataclass(frozen=True)
class Axes:
    """The values a variant was made from (crossed, fixed or picked), one field per axis of axes.AXES;
    None where the flavour does not use the axis."""
    cuda: str | None = None
    sm: str | None = None
    driver: str | None = None
    tensorrt: str | None = None
    tensorrt_llm: str | None = None
    vllm: str | None = None
    torch: str | None = None
    python: str | None = None
    base: str | None = None
    precision: str | None = None  # the engine's, where the flavour crosses or sets it (else the recipe's)

    @classmethod
    def of(cls, values: Mapping) -> Axes:
        return cls(**{axis: values.get(axis) for axis in AXES})

    def to_json(self) -> dict:
        """The axes this variant uses, in AXES order."""
        return {axis: getattr(self, axis) for axis in AXES if getattr(self, axis) is not None}


@dataclass(frozen=True)
class BaseImage:
    """What a variant's base stage starts from."""
    name: str  # the matrix's bases entry
    kind: str  # "image": a reference pulled or present; "rootfs": a Debian rootfs built here (mmdebstrap)
    ref: str   # the image reference, or the local name the rootfs is imported as


@dataclass(frozen=True)
class Resolved:
    """Everything a variant's templates, labels, lock and guard read, derived once by the plan: the axes'
    values with what the compatibility knowledge base implies from them (compat.check), the base, the
    backend's version and the NVIDIA_REQUIRE_CUDA constraint."""
    python: str
    base: BaseImage
    backend_version: str  # the version of the flavour's backend (its backend's version axis)
    runtime_source: str   # pypi | nvidia-index: where the runtime's packages come from
    cuda: str | None = None
    cuda_major: int | None = None
    sm: str | None = None
    cc: str | None = None            # compute capability of sm ("9.0")
    driver: str | None = None
    gpu_brand: str | None = None
    tensorrt: str | None = None      # a version, or a range where a TensorRT-LLM pin implies it
    tensorrt_llm: str | None = None
    vllm: str | None = None
    torch: str | None = None
    min_driver: str | None = None    # the driver floor of this CUDA (and GPU arch)
    min_driver_mvc: str | None = None  # the floor under minor-version compatibility, where it applies
    require_cuda: str | None = None  # NVIDIA_REQUIRE_CUDA
    cuda_from_pypi: bool = False     # a CUDA variant on a base without CUDA: CUDA from PyPI wheels alone
    driver_path: str | None = None   # native | forward | none: how the given driver runs this CUDA
    forward_compat: Mapping | None = None  # compat.forward_compat(): the cuda-compat package, path, branches
    cuda_implied: bool = False       # CUDA came from the TensorRT-LLM pin, not the axes
    tensorrt_implied: bool = False   # TensorRT came from the TensorRT-LLM pin
    torch_from: str | None = None    # tensorrt_llm | vllm: whose pin chose torch
    torch_spec_tensorrt_llm: str | None = None
    torch_default_cuda: str | None = None  # the CUDA of torch's default PyPI build
    torch_default_cuda_full: str | None = None  # its exact CUDA release (the cuda-toolkit wheels torch pins)
    vllm_wheel_cuda: str | None = None     # the CUDA of vLLM's PyPI wheels
    sm_renamed_to: str | None = None

    @classmethod
    def of(cls, facts: Mapping, **derived) -> Resolved:
        """The record from compat.check's resolved facts plus what the plan derives; a fact this record does
        not declare is a programming error here, not a key some reader may miss."""
        unknown = sorted(set(facts) - _RESOLVED_FIELDS)
        if unknown:
            raise TypeError(f"compat.check resolved {', '.join(unknown)}, which plan.Resolved does not declare")
        return cls(**{**facts, **derived})

    def to_json(self) -> dict:
        return asdict(self)


_RESOLVED_FIELDS = frozenset(f.name for f in fields(Resolved))


@dataclass(frozen=True)
class Variant:
    id: str
    image: str
    flavour: str
    backend: str
    device: str
    repository: str  # namespace/image
    tag: str
    long_tag: str
    axes: Axes
    resolved: Resolved
    warnings: tuple[str, ...] = ()

    @property
    def tags(self) -> tuple[str, ...]:
        return (self.tag, self.long_tag)

    def to_json(self) -> dict:
        return {"id": self.id, "image": self.image, "flavour": self.flavour, "backend": self.backend,
                "device": self.device, "repository": self.repository, "tag": self.tag,
                "tags": list(self.tags), "axes": self.axes.to_json(), "resolved": self.resolved.to_json(),
                "warnings": list(self.warnings)}


@dataclass(frozen=True)
class Rejected:
    id: str
    image: str
    flavour: str
    axes: Axes
    reasons: tuple[str, ...]

    def to_json(self) -> dict:
        return {"id": self.id, "image": self.image, "flavour": self.flavour, "axes": self.axes.to_json(),
                "reasons": list(self.reasons)}


@dataclass(frozen=True)
class Plan:
    variants: tuple[Variant, ...]
    rejected: tuple[Rejected, ...]
    combinations: int = 0
    warnings: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
        return {"variants": [v.to_json() for v in self.variants],
                "rejected": [r.to_json() for r in self.rejected],
                "combinations": self.combinations,
                "warnings": list(self.warnings)}


@cache
def _check(combo: compat.Combo) -> compat.Verdict:
    return compat.check(combo)


def _combo(values: dict, cuda_from_pypi: bool) -> compat.Combo:
    return compat.Combo(**{k: values.get(k) for k in COMBO_AXES}, gpu_brand=values.get("gpu_brand"),
                        cuda_from_pypi=cuda_from_pypi)


def _cuda_from_pypi(matrix: Matrix, device: str, base: str) -> bool:
    """A CUDA variant on a base without CUDA (a plain Debian rootfs): torch's and vLLM's PyPI wheels bring
    CUDA's libraries, and nothing else does."""
    return device == "cuda" and not matrix.bases[base].has_cuda


def _expand(flavour: Flavour) -> list[dict]:
    names = [axis for axis, _ in flavour.crossed]
    combos = [dict(zip(names, values, strict=True)) | flavour.fixed
              for values in itertools.product(*(values for _, values in flavour.crossed))]
    combos = [c for c in combos
              if not any(all(c.get(k) == v for k, v in rule.items()) for rule in flavour.exclude)]
    for extra in flavour.include:
        combo = dict(flavour.fixed) | extra
        if combo not in combos:
            combos.append(combo)
    return combos


def _pick_newest(matrix: Matrix, flavour: Flavour, combo: dict) -> tuple[list[str], compat.Verdict]:
    """Fill each `newest` axis with the newest value compatible with the rest: (reasons if none fits,
    the verdict of the values as filled in).

    A value the knowledge base confirms beats a newer one it only warns about (UNCONFIRMED rows).
    """
    from_pypi = _cuda_from_pypi(matrix, flavour.device, combo["base"])
    verdict = _check(_combo(combo, from_pypi))
    if not verdict.compatible:
        return list(verdict.reasons), verdict  # nothing to pick can fix the crossed axes
    for axis in flavour.newest:
        candidates = sorted(matrix.axes[axis], key=Version, reverse=True)
        verdicts = [(value, _check(_combo(combo | {axis: value}, from_pypi))) for value in candidates]
        compatible = [(value, v) for value, v in verdicts if v.compatible]
        if not compatible:
            reasons = dict.fromkeys(r for _, v in verdicts for r in v.reasons)
            return [f"no {axis} in axes.{axis} ({', '.join(candidates)}) fits: " + " ".join(reasons)], verdict
        confirmed = [(value, v) for value, v in compatible if not v.warnings]
        combo[axis], verdict = confirmed[0] if confirmed else compatible[0]
    return [], verdict


def _tag_values(matrix: Matrix, image: str, flavour: Flavour, values: dict) -> dict:
    out = {axis: values.get(axis) for axis in AXES}
    out.update(image=image, flavour=flavour.name, backend=flavour.backend, device=flavour.device,
               build_id=matrix.build_id)
    out["cuda_nodot"] = values["cuda"].replace(".", "") if values.get("cuda") else None
    out["python_nodot"] = values["python"].replace(".", "") if values.get("python") else None
    return out


def _format_tag(template: str, values: dict, where: str) -> str:
    missing = [name for _, name, _, _ in string.Formatter().parse(template)
               if name and values.get(name) is None]
    if missing:
        raise ConfigError(f"tag template {template!r} uses {{{missing[0]}}}, which this flavour does not have",
                          key=where)
    tag = template.format(**values)
    if not _DOCKER_TAG.match(tag):
        raise ConfigError(f"tag {tag!r} from template {template!r} is not a valid Docker tag "
                          "([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})", key=where)
    return tag


def _default_long_tag(short: str, values: dict) -> str:
    """The immutable tag: the short tag plus every version, plus the build id."""
    parts = [short] + [f"{prefix}{values[axis]}" for axis, prefix in LONG_TAG_PREFIXES.items() if values.get(axis)]
    return "-".join(parts) + f"-b{values['build_id']}"


def _precision_problems(flavour: Flavour, precision: str, values: dict) -> list[str]:
    """Why the variant's engine PRECISION (its precision axis, else its recipe's) cannot be built: the backend
    compiles no such engines on the device (its description's precisions), or the GPU arch lacks it (the
    knowledge base's precisions table)."""
    takes = backend_precisions(flavour.backend, flavour.device)
    if precision not in takes:
        return [f"backend {flavour.backend} compiles no {precision} engines on {flavour.device} "
                f"(it takes {', '.join(takes)})"]
    # (a cuda flavour always has sm: the matrix refuses one without)
    problem = compat.precision_problem(precision, values["sm"]) if flavour.device == "cuda" else None
    return [problem] if problem else []


def _resolve(matrix: Matrix, flavour: Flavour, values: dict, verdict: compat.Verdict,
             precision: str) -> tuple[Resolved | None, list[str]]:
    """Everything a template, label or guard needs, derived once here; None with the reasons where the
    combination cannot be built."""
    reasons = []
    base = matrix.bases[values["base"]]
    python = values.get("python") or base.python
    if python != base.python:
        reasons.append(f"base {base.name} ships Python {base.python}, not {python}")
    if base.kind == "image":
        ref = base.ref
        if "{cuda_tag}" in ref:
            cuda_tag = base.cuda_tags.get(values.get("cuda") or "")
            if cuda_tag is None:
                reasons.append(f"base {base.name} has no image for CUDA {values.get('cuda')} "
                               f"(cuda_tags: {', '.join(base.cuda_tags)})")
                cuda_tag = ""
            ref = ref.replace("{cuda_tag}", cuda_tag)
        base_image = BaseImage(name=base.name, kind="image", ref=ref)
    else:
        base_image = BaseImage(name=base.name, kind="rootfs", ref=base.image)
    if flavour.device == "cpu" and base.has_cuda:
        reasons.append(f"base {base.name} is a CUDA image; a cpu flavour needs a plain base")
    spec = backend(flavour.backend)
    from_pypi = _cuda_from_pypi(matrix, flavour.device, base.name)
    if from_pypi:
        cuda = verdict.resolved.get("cuda")
        if spec.cuda_from_pypi_min is None:
            reasons.append(f"backend {spec.name} cannot build on base {base.name}, which has no CUDA of its own: "
                           f"{spec.cuda_from_pypi_why}")
        elif cuda and Version(cuda) < Version(spec.cuda_from_pypi_min):
            reasons.append(f"backend {spec.name} builds on a base without CUDA from CUDA "
                           f"{spec.cuda_from_pypi_min} on, not {cuda}: {spec.cuda_from_pypi_why}")
    reasons += _precision_problems(flavour, precision, values)
    backend_axis = spec.version_axis  # its value is "the backend's version" in labels
    backend_version = verdict.resolved.get(backend_axis)  # compat.check keeps every given value, adds implied
    if not backend_version:
        reasons.append(f"backend {flavour.backend} needs a {backend_axis} version: cross, set or pick it")
    if reasons:
        return None, reasons
    require_cuda = (compat.require_cuda_env(values["cuda"]) if flavour.device == "cuda" and values.get("cuda")
                    else None)
    return Resolved.of(verdict.resolved, python=python, base=base_image, backend_version=backend_version,
                       require_cuda=require_cuda, cuda_from_pypi=from_pypi,
                       runtime_source=flavour.runtime_source), []


def _plan_flavour(matrix: Matrix, entry: ImageEntry, flavour: Flavour,
                  gpu_brand: str | None) -> tuple[list, list, int]:
    variants, rejected = [], []
    combos = _expand(flavour)
    for combo in combos:
        values = dict(combo) | ({"gpu_brand": gpu_brand} if gpu_brand else {})
        reasons, verdict = _pick_newest(matrix, flavour, values)
        resolved = None
        if not reasons:
            resolved, reasons = _resolve(matrix, flavour, values, verdict,
                                         entry.recipe.precision_for(flavour.device, values.get("precision")))
        tag_values = _tag_values(matrix, entry.name, flavour, values | {"torch": resolved and resolved.torch})
        where = f"images.{entry.name}.flavours.{flavour.name}"
        axes = Axes.of(values)
        if reasons:
            try:
                would_be = _format_tag(flavour.tag, tag_values, where + ".tag")
            except ConfigError:
                would_be = "-".join(f"{k}{v}" for k, v in axes.to_json().items())
            rejected.append(Rejected(id=f"{entry.name}:{would_be}", image=entry.name, flavour=flavour.name,
                                     axes=axes, reasons=tuple(reasons)))
            continue
        tag = _format_tag(flavour.tag, tag_values, where + ".tag")
        if flavour.long_tag:
            long_tag = _format_tag(flavour.long_tag, tag_values, where + ".long_tag")
        else:
            long_tag = _default_long_tag(tag, tag_values)
            if not _DOCKER_TAG.match(long_tag):
                raise ConfigError(f"the default long tag {long_tag!r} is too long; set long_tag", key=where)
        variants.append(Variant(
            id=f"{entry.name}:{tag}", image=entry.name, flavour=flavour.name, backend=flavour.backend,
            device=flavour.device, repository=f"{matrix.namespace}/{entry.name}", tag=tag, long_tag=long_tag,
            axes=axes, resolved=resolved, warnings=tuple(verdict.warnings)))
    return variants, rejected, len(combos)


def make_plan(matrix: Matrix, select: tuple[str, ...] = (), gpu_brand: str | None = None) -> Plan:
    """Every variant of the matrix. gpu_brand: the GPU product line that driver checks assume
    (forward compatibility on data-center GPUs); None: unknown."""
    variants, rejected, total = [], [], 0
    for entry in matrix.images:
        for flavour in entry.flavours:
            v, r, n = _plan_flavour(matrix, entry, flavour, gpu_brand)
            variants += v
            rejected += r
            total += n
    seen: dict[str, Variant] = {}
    for variant in variants:
        for tag in variant.tags:
            key = f"{variant.image}:{tag}"
            other = seen.get(key)
            if other is not None:
                raise ConfigError(
                    f"two variants would publish the same tag {key} (flavours {other.flavour} and "
                    f"{variant.flavour}, axes {other.axes.to_json()} and {variant.axes.to_json()}); "
                    "make the tag templates differ",
                    key=f"images.{variant.image}.flavours.{variant.flavour}.tag")
            seen[key] = variant
    if select:
        for pattern in select:
            if not any(fnmatch.fnmatchcase(x.id, pattern) for x in (*variants, *rejected)):
                known = ", ".join(v.id for v in variants[:6]) + (", ..." if len(variants) > 6 else "")
                raise ConfigError(f"--select {pattern!r} matches no variant (variants look like: {known})")
        variants = [v for v in variants if any(fnmatch.fnmatchcase(v.id, p) for p in select)]
        rejected = [r for r in rejected if any(fnmatch.fnmatchcase(r.id, p) for p in select)]
    warnings = sorted({w for v in variants for w in v.warnings})
    return Plan(variants=tuple(variants), rejected=tuple(rejected), combinations=total,
                warnings=tuple(warnings))
