"""matrix.yaml -> a validated, frozen Matrix (axes, bases, images and their flavours).

Only structure and names are checked here; whether a combination can work is compat's job and
happens in plan.
"""
from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path

from .axes import AXES
from .backends import backends
from .errors import ConfigError
from .recipe import Recipe, load_recipe
from .versions import normalize_sm
from .yamlio import YamlDocument, load_yaml, validate

# Variables a tag template may use; plan fills them per variant.
TAG_VARIABLES = frozenset({
    "image", "flavour", "backend", "device", "cuda", "cuda_nodot", "sm", "driver", "tensorrt",
    "tensorrt_llm", "vllm", "torch", "python", "python_nodot", "base", "precision", "build_id",
})

DEFAULT_RUNNERS = {"gpu": ("self-hosted", "linux", "x64", "gpu-sm{sm}"), "cpu": ("ubuntu-24.04",)}


@dataclass(frozen=True)
class BaseSpec:
    name: str
    kind: str  # rootfs (built by `mopt base`) | image (pulled from a registry at build time)
    python: str
    image: str = ""  # rootfs: the local name it is imported under
    ref: str = ""    # image: reference template, {cuda_tag} filled from cuda_tags
    suite: str = ""
    mirror: str = "http://deb.debian.org/debian"
    variant: str = "minbase"
    packages: tuple[str, ...] = ()
    source_date_epoch: int = 0
    cuda_tags: dict = field(default_factory=dict)
    has_cuda: bool = False


@dataclass(frozen=True)
class Flavour:
    name: str
    backend: str
    device: str
    crossed: tuple[tuple[str, tuple[str, ...]], ...]  # (axis, values) in AXES order
    newest: tuple[str, ...]
    fixed: dict
    include: tuple[dict, ...]
    exclude: tuple[dict, ...]
    tag: str
    long_tag: str
    runtime_source: str
    size_budget_gb: float | None = None  # the final image's budget; a release over it fails (imagesize.py)


@dataclass(frozen=True)
class ImageEntry:
    name: str
    recipe: Recipe
    flavours: tuple[Flavour, ...]


@dataclass(frozen=True)
class Matrix:
    path: Path
    namespace: str
    build_id: str
    runners: dict
    axes: dict  # axis -> tuple of normalised values
    bases: dict  # name -> BaseSpec
    images: tuple[ImageEntry, ...]

    def image(self, name: str) -> ImageEntry:
        for entry in self.images:
            if entry.name == name:
                return entry
        raise ConfigError(f"no image {name!r} in {self.path} (images: {', '.join(e.name for e in self.images)})")


def _normalise(doc: YamlDocument, path: tuple, axis: str, value) -> str:
    if axis == "sm":
        try:
            return normalize_sm(value)
        except ConfigError as exc:
            raise doc.error(path, exc.message) from None
    return str(value)


def _template_fields(doc: YamlDocument, path: tuple, template: str) -> None:
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise doc.error(path, f"bad tag template {template!r}: {exc}") from None
    unknown = sorted(names - TAG_VARIABLES)
    if unknown:
        raise doc.error(path, f"unknown template variable {{{unknown[0]}}} in {template!r} "
                              f"(known: {', '.join(sorted(TAG_VARIABLES))})")


def _load_bases(doc: YamlDocument) -> dict[str, BaseSpec]:
    bases = {}
    for name, spec in (doc.data.get("bases") or {}).items():
        spec = dict(spec)
        if spec["kind"] == "image" and "{cuda_tag}" in spec["ref"] and not spec.get("cuda_tags"):
            raise doc.error(("bases", name, "cuda_tags"), "ref uses {cuda_tag} but no cuda_tags are given")
        bases[name] = BaseSpec(
            name=name, kind=spec["kind"], python=spec["python"], image=spec.get("image", ""),
            ref=spec.get("ref", ""), suite=spec.get("suite", ""),
            mirror=spec.get("mirror", BaseSpec.mirror), variant=spec.get("variant", "minbase"),
            packages=tuple(spec.get("packages", ())), source_date_epoch=spec.get("source_date_epoch", 0),
            cuda_tags=dict(spec.get("cuda_tags", {})), has_cuda=spec.get("has_cuda", False),
        )
    return bases


def _known(doc: YamlDocument, axes: dict, bases: dict, path: tuple, axis: str, value: str) -> None:
    """A value named anywhere in a flavour must be one the matrix declares."""
    if axis == "base" and value not in bases:
        raise doc.error(path, f"unknown base {value!r} (bases: {', '.join(sorted(bases)) or 'none'})")
    if axis in axes and value not in axes[axis]:
        raise doc.error(path, f"unknown {axis} value {value!r}: not in axes.{axis} "
                              f"({', '.join(axes[axis])})")


def _crossed(doc: YamlDocument, axes: dict, bases: dict, where: tuple, raw: dict) -> tuple:
    """The flavour's crossed axes as ((axis, values), ...) in AXES order."""
    crossed = []
    for axis in AXES:
        choice = (raw.get("axes") or {}).get(axis)
        if choice is None:
            continue
        if choice == "all":
            if axis not in axes:
                raise doc.error(where + ("axes", axis), f"'all' but the matrix declares no axes.{axis}")
            values = axes[axis]
        else:
            values = tuple(_normalise(doc, where + ("axes", axis, i), axis, v) for i, v in enumerate(choice))
            for i, value in enumerate(values):
                _known(doc, axes, bases, where + ("axes", axis, i), axis, value)
        crossed.append((axis, values))
    return tuple(crossed)


def _fixed(doc: YamlDocument, axes: dict, bases: dict, where: tuple, raw: dict, crossed_names: set) -> dict:
    fixed = {axis: _normalise(doc, where + ("set", axis), axis, v) for axis, v in (raw.get("set") or {}).items()}
    for axis, value in fixed.items():
        _known(doc, axes, bases, where + ("set", axis), axis, value)
        if axis in crossed_names:
            raise doc.error(where + ("set", axis), f"{axis} is both crossed (axes) and fixed (set)")
    return fixed


def _newest(doc: YamlDocument, axes: dict, where: tuple, raw: dict, taken: set) -> tuple[str, ...]:
    newest = tuple(raw.get("newest", ()))
    for i, axis in enumerate(newest):
        if axis in taken:
            raise doc.error(where + ("newest", i), f"{axis} is crossed or fixed already; newest picks one value")
        if axis not in axes:
            raise doc.error(where + ("newest", i), f"newest: {axis} but the matrix declares no axes.{axis}")
        if axis == "precision":  # not a version: there is no newest, cross or set it
            raise doc.error(where + ("newest", i), "newest: precision has no newest value; cross it (axes) or set it")
    return newest


def _combos(doc: YamlDocument, axes: dict, bases: dict, where: tuple, raw: dict, key: str,
            allowed: set) -> tuple[dict, ...]:
    """include or exclude entries, normalised, naming only ALLOWED axes."""
    entries = []
    for i, entry in enumerate(raw.get(key, ())):
        norm = {}
        for axis, value in entry.items():
            norm[axis] = _normalise(doc, where + (key, i, axis), axis, value)
            _known(doc, axes, bases, where + (key, i, axis), axis, norm[axis])
            if axis not in allowed:
                raise doc.error(where + (key, i, axis), f"{axis} is not an axis of this flavour")
        entries.append(norm)
    return tuple(entries)


def _load_flavour(doc: YamlDocument, axes: dict, bases: dict, image: str, name: str, raw: dict) -> Flavour:
    where = ("images", image, "flavours", name)
    if raw["backend"] not in backends():
        raise doc.error(where + ("backend",), f"unknown backend {raw['backend']!r} (backends: "
                                              f"{', '.join(sorted(backends()))})")
    crossed = _crossed(doc, axes, bases, where, raw)
    crossed_names = {axis for axis, _ in crossed}
    fixed = _fixed(doc, axes, bases, where, raw, crossed_names)
    taken = crossed_names | set(fixed)
    newest = _newest(doc, axes, where, raw, taken)
    if raw["device"] == "cpu":
        for axis in ("cuda", "sm"):
            if axis in taken:
                raise doc.error(where + ("device",), f"a cpu flavour cannot have the {axis} axis")
    elif "sm" not in taken:
        raise doc.error(where + ("axes",), "a cuda flavour must cross or set sm: engines are tied to the GPU arch")
    include = _combos(doc, axes, bases, where, raw, "include", taken)
    exclude = _combos(doc, axes, bases, where, raw, "exclude", set(AXES))  # removing by any axis is harmless
    _template_fields(doc, where + ("tag",), raw["tag"])
    long_tag = raw.get("long_tag", "")
    if long_tag:
        _template_fields(doc, where + ("long_tag",), long_tag)
    if "base" not in taken:
        raise doc.error(where + ("set",), "every flavour needs a base: set it (set: {base: NAME}) or cross it")
    return Flavour(
        name=name, backend=raw["backend"], device=raw["device"], crossed=crossed, newest=newest,
        fixed=fixed, include=include, exclude=exclude, tag=raw["tag"],
        long_tag=long_tag, runtime_source=raw.get("runtime_source", "pypi"), size_budget_gb=raw.get("size_budget_gb"),
    )


def load_matrix(path: Path | str) -> Matrix:
    path = Path(path)
    doc = load_yaml(path)
    validate(doc, "matrix")
    data = doc.data
    bases = _load_bases(doc)
    axes = {}
    for axis in AXES:
        if axis in data["axes"]:
            values = tuple(_normalise(doc, ("axes", axis, i), axis, v) for i, v in enumerate(data["axes"][axis]))
            if len(set(values)) != len(values):
                raise doc.error(("axes", axis), f"duplicate values after normalising: {', '.join(values)}")
            axes[axis] = values
    for i, base in enumerate(axes.get("base", ())):
        if base not in bases:
            raise doc.error(("axes", "base", i), f"unknown base {base!r} (bases: {', '.join(sorted(bases))})")
    images = []
    for name, entry in data["images"].items():
        recipe_path = (path.parent / entry["recipe"]).resolve()
        if not recipe_path.is_file():
            raise doc.error(("images", name, "recipe"), f"recipe file not found: {entry['recipe']}")
        recipe = load_recipe(recipe_path, name, display=entry["recipe"])
        flavours = tuple(_load_flavour(doc, axes, bases, name, fname, raw)
                         for fname, raw in entry["flavours"].items())
        images.append(ImageEntry(name=name, recipe=recipe, flavours=flavours))
    runners = {kind: tuple(labels) for kind, labels in DEFAULT_RUNNERS.items()}
    runners.update({kind: tuple(labels) for kind, labels in (data.get("runners") or {}).items()})
    return Matrix(path=path, namespace=data["namespace"], build_id=data.get("build_id", "1"),
                  runners=runners, axes=axes, bases=bases, images=tuple(images))
