"""What the host side knows about each engine backend, declared once per backend as data
(builder/runtime/backends/<name>.yaml, validated by schemas/backend.schema.json): the matrix axis that
is its version, the template of its runtime image, the packages that image adds, whether it serves
itself, and which option groups its compile step takes. The same file's `runtime:` section is what the
in-image runtime reads (builder/runtime/backends/registry.py): one description per backend, shipped
with the runtime. The host reads the files; it never imports the backends' code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path

from .errors import ConfigError
from .yamlio import load_yaml, validate


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    name: str
    description: str
    version_axis: str
    runtime_template: str
    runtime_packages: tuple[str, ...]
    own_server: bool
    verify: bool
    compile_options: tuple[str, ...]
    engine_holds_weights: bool = False  # the final image ships the model dir without its weight files
    # A base without CUDA, CUDA's libraries from PyPI wheels alone: the oldest CUDA it can (None: none) and why.
    cuda_from_pypi_min: str | None = None
    cuda_from_pypi_why: str = "its description declares no cuda_from_pypi"
    # device -> family (encoder | decoder) -> (form, source); empty: padded engines only.
    input_forms: dict = field(default_factory=dict)

    def input_form(self, device: str, family: str) -> str:
        """The input form an engine of this backend gets by default on DEVICE for a model FAMILY."""
        entry = self.input_forms.get(device, {}).get(family)
        return entry["form"] if entry else "padded"


def backends_dir() -> Path:
    return Path(str(resources.files("builder").joinpath("runtime", "backends")))


def load_backend(path: Path) -> BackendSpec:
    doc = load_yaml(path)
    validate(doc, "backend")
    data = doc.data
    if data["name"] != path.stem:
        raise doc.error(("name",), f"name {data['name']!r} differs from the file name {path.stem!r}")
    return BackendSpec(name=data["name"], description=data["description"], version_axis=data["version_axis"],
                       runtime_template=data["runtime_template"], runtime_packages=tuple(data["runtime_packages"]),
                       own_server=data["own_server"], verify=data["verify"],
                       compile_options=tuple(data["compile_options"]), input_forms=data.get("input_forms", {}),
                       engine_holds_weights=data.get("engine_holds_weights", False),
                       **_cuda_from_pypi(data.get("cuda_from_pypi")))


def _cuda_from_pypi(entry: dict | None) -> dict:
    return {"cuda_from_pypi_min": entry["min_cuda"], "cuda_from_pypi_why": entry["why"]} if entry else {}


@cache
def backends() -> dict[str, BackendSpec]:
    """Every backend mopt knows, by name."""
    return {spec.name: spec for spec in map(load_backend, sorted(backends_dir().glob("*.yaml")))}


def backend(name: str) -> BackendSpec:
    known = backends()
    if name not in known:
        raise ConfigError(f"unknown backend {name!r} (backends: {', '.join(sorted(known))})")
    return known[name]
