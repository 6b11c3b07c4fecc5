"""Render Jinja2 templates into one directory per variant: Dockerfiles for each stage, the compile
script, the compile inputs and a build manifest. Byte-identical on re-run: no timestamps, sorted
JSON, every input named in the stage keys.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import jinja2
import yaml

from . import __version__
from .backends import backend, backends
from .errors import ConfigError
from .hashing import dump_json, sha256_text, tree_digest
from .matrix import Matrix
from .plan import Variant
from .runtime.errors import RuntimeToolError  # the contract (builder/runtime/params.py and what it raises):
from .runtime.params import PARAMS_FILE, EngineParams  # torch-free, the host's only imports of the runtime

# Inside the compile container (see templates/compile.sh.j2). The model sits where the final image
# keeps it, so engine.json names a path that exists there (the opt-in recompile reads it).
MOUNTS = {"model": "/opt/mopt/model", "inputs": "/mopt/inputs", "out": "/mopt/out"}
RUNTIME_PACKAGE = Path(__file__).parent / "runtime"


def runtime_digest(root: Path | None = None) -> str:
    """The runtime stage's context key: every file the stage copies (build._link_tree copies all but
    dotfiles and __pycache__, as tree_digest skips), openapi.json and other data included."""
    return tree_digest(root or RUNTIME_PACKAGE)


@cache
def defaults() -> dict:
    return yaml.safe_load(resources.files("builder").joinpath("data", "defaults.yaml").read_text("utf-8"))


def _environment(templates: Path) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=False, autoescape=False)
    env.filters["shell_quote"] = shlex.quote
    return env


@dataclass(frozen=True)
class RenderedVariant:
    variant: Variant
    files: dict  # file name -> text
    manifest: dict


def _context(matrix: Matrix, variant: Variant) -> dict:
    entry = matrix.image(variant.image)
    recipe = entry.recipe
    resolved = variant.resolved
    cuda = resolved.cuda
    data = defaults()
    spec = backend(variant.backend)
    packages = list(data["runtime_packages"]) + list(spec.runtime_packages)
    cuda_nodot = cuda.replace(".", "") if cuda else ""
    indexes = {k: v.replace("{cuda_nodot}", cuda_nodot) for k, v in data["indexes"].items()}
    return {
        "id": variant.id, "image": variant.image, "flavour": variant.flavour, "backend": variant.backend,
        "compile_options": spec.compile_options, "verify": spec.verify,
        "engine_holds_weights": spec.engine_holds_weights,
        "device": variant.device, "repository": variant.repository, "tag": variant.tag,
        "long_tag": variant.long_tag, "resolved": resolved, "python": resolved.python,
        "base": resolved.base, "cuda_nodot": cuda_nodot, "cuda_major": cuda.split(".")[0] if cuda else "",
        "runtime_source": resolved.runtime_source,
        "indexes": indexes, "torch_args": _torch_args(variant, indexes, cuda_nodot),
        "cuda_from_pypi": resolved.cuda_from_pypi,
        "serving_prune": data["serving_prune"],
        "packages": packages, "vllm_cpu_remove": data["vllm_cpu_remove"], "user": data["user"],
        "paths": data["paths"], "mounts": MOUNTS, "engine": recipe.engine,
        "precision": recipe.precision_for(variant.device, variant.axes.precision), "pooling": recipe.pooling,
        "normalize": recipe.normalize, "instruction": recipe.instruction,
        "matryoshka_min_dim": recipe.matryoshka_min_dim, "min_cosine": recipe.min_cosine,
        "description": recipe.description,
        "license": recipe.license, "source_url": recipe.source_url, "model_source": recipe.model.text,
        "entrypoint": entrypoint(recipe.serve_command), "port": recipe.port, "max_inputs": recipe.max_inputs,
        # Docker's health is what `depends_on: service_healthy` waits for: mopt's server is ready once its
        # engine has loaded (/health answers while loading); a backend's own server has /health only.
        "ready_path": "/health" if spec.own_server else "/ready",
        "model_runtime": {"repository": model_runtime_repository(variant.repository)},
        "max_wait_ms": recipe.max_wait_ms,
        "source_date_epoch": _source_date_epoch(matrix),
        "packed": _packed(variant, recipe, spec),
        # A CUDA image on NVIDIA's base carries the cuda-compat package, loaded at start only on an
        # older driver (forward compatibility, data-center GPUs).
        "forward_compat": (resolved.forward_compat if variant.device == "cuda"
                           and matrix.bases[resolved.base.name].has_cuda else None),
    }


def _torch_args(variant: Variant, indexes: dict, cuda_nodot: str) -> list[str]:
    """pip's arguments for the variant's torch: the +cpu build (a wheelhouse's, PyPI has none); on a base
    without CUDA, PyPI's own build, which brings CUDA's libraries as nvidia-* wheels (the plan checked that
    its CUDA is the variant's); else a CUDA build from PyTorch's CUDA index as the only index (no
    dependency confusion between two indexes)."""
    torch = variant.resolved.torch
    if not torch:
        return []
    if variant.device == "cpu":
        return [f"torch=={torch}+cpu"]
    if variant.resolved.cuda_from_pypi:
        # === (exactly this version string): ==2.13.0 also matches 2.13.0+cpu, which a wheelhouse may hold
        return [f"torch==={torch}"]
    return ["--index-url", indexes["pytorch_cuda"], f"torch=={torch}+cu{cuda_nodot}"]


def _packed(variant: Variant, recipe, spec) -> dict | None:
    """A packed engine's call limits (sequences, tokens), or None for a padded one: the recipe's
    engine.input, else the backend's choice for the device and the model's family."""
    engine = recipe.engine
    form = engine.input or spec.input_form(variant.device, recipe.family)
    if form == "padded":
        return None
    if not spec.input_forms:
        raise ConfigError(f"{variant.id}: engine.input packed needs a backend that compiles packed engines "
                          f"({', '.join(sorted(name for name, b in backends().items() if b.input_forms))}), "
                          f"not {variant.backend}")
    sequences = engine.max_sequences or engine.max_batch
    tokens = engine.max_batch_tokens or engine.max_batch * engine.max_seq_len
    if not engine.max_seq_len <= tokens <= sequences * engine.max_seq_len:
        raise ConfigError(f"{variant.id}: engine.max_batch_tokens {tokens} must be in max_seq_len.."
                          f"sequences x max_seq_len ({engine.max_seq_len}..{sequences * engine.max_seq_len})")
    return {"max_sequences": sequences, "max_batch_tokens": tokens}


def entrypoint(serve_command: tuple[str, ...]) -> list[str]:
    """The final image's ENTRYPOINT: the recipe's serve command without a --port. The port is the image's
    MOPT_PORT (serve.port), which the HEALTHCHECK reads too: a --port in the command would pin the server
    and leave `-e MOPT_PORT=...` moving the check alone."""
    values = {i + 1 for i, arg in enumerate(serve_command) if arg == "--port"}  # "--port N": N goes too
    return [arg for i, arg in enumerate(serve_command)
            if i not in values and arg != "--port" and not arg.startswith("--port=")]


def toolchain_template(templates: Path, backend_name: str) -> str | None:
    """A backend whose engine needs a compiler to build but not to serve has a toolchain template: the
    compile step runs in an image FROM the runtime plus the compiler, and the final image is FROM the
    runtime, so it ships none."""
    name = f"toolchain-{backend_name}.Dockerfile.j2"
    return name if (templates / name).is_file() else None


def _source_date_epoch(matrix: Matrix) -> int:
    """One fixed timestamp for every build step: the newest rootfs base's SOURCE_DATE_EPOCH."""
    return max((b.source_date_epoch for b in matrix.bases.values() if b.kind == "rootfs"), default=0)


def _render_template(env: jinja2.Environment, name: str, context: dict) -> str:
    try:
        return env.get_template(name).render(**context)
    except jinja2.TemplateNotFound as exc:
        raise ConfigError(f"template not found: {exc.name}", file=f"templates/{name}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"template syntax error: {exc.message}", file=f"templates/{exc.name or name}",
                          line=exc.lineno) from None
    except jinja2.UndefinedError as exc:
        raise ConfigError(f"template variable error: {exc.message}", file=f"templates/{name}") from None


def engine_params(variant: Variant, context: dict) -> EngineParams:
    """The engine parameters of a variant (the contract, builder/runtime/params.py), from its recipe as
    the render context has it; validated here, so a combination the runtime refuses stops the render
    (exit 2) before anything is built."""
    engine, packed, options = context["engine"], context["packed"], context["compile_options"]
    values = {
        "backend": variant.backend, "device": variant.device, "precision": context["precision"],
        "max_batch": packed["max_sequences"] if packed else engine.max_batch, "max_seq_len": engine.max_seq_len,
        "pooling": context["pooling"], "normalize": context["normalize"], "instruction": context["instruction"],
        "matryoshka_min_dim": context["matryoshka_min_dim"],
    }
    if "inductor" in options:
        values.update(compile_mode=engine.compile_mode, attention=engine.attention)
    if packed:
        values.update(input_form="packed", max_batch_tokens=packed["max_batch_tokens"])
    if "tensorrt" in options:  # the recipe's engine.tensorrt keys are the contract's trt_ fields (absent: its defaults)
        values.update({f"trt_{key}": value for key, value in engine.tensorrt.items()})
    try:
        return EngineParams.parse(values)
    except RuntimeToolError as exc:
        raise ConfigError(f"{variant.id}: the runtime refuses these engine parameters: {exc.message}") from None


MODEL_RUNTIME_PARAMS = "runtime-params.json"
# What a model runtime image (no model inside) leaves to the mounted model: its name and place, and what
# its own files or its family decide (pooling, normalisation, a query instruction, Matryoshka dimensions,
# causal attention).
MODEL_SPECIFIC_PARAMS = ("model_dir", "model_name", "pooling", "normalize", "instruction", "matryoshka_min_dim",
                         "attention")  # causal attention is for decoders only: --attention causal says so


def model_runtime_repository(repository: str) -> str:
    """The model runtime image of a variant's flavour: its repository plus -runtime, same tags."""
    return f"{repository}-runtime"


def model_runtime_params(params: EngineParams) -> dict:
    """The flavour's engine parameters a model runtime image starts from (MOPT_ENGINE_PARAMS)."""
    return {k: v for k, v in params.to_dict().items() if k not in MODEL_SPECIFIC_PARAMS}


def render_variant(matrix: Matrix, variant: Variant, templates: Path, runtime_digest: str,
                   siblings: tuple[Variant, ...] = ()) -> RenderedVariant:
    """siblings: every planned variant of the same image and flavour (the guard names their tags)."""
    env = _environment(templates)
    toolchain = toolchain_template(templates, variant.backend)
    # A backend that compiles in a toolchain stage serves from a runtime without what only the compile needs.
    context = _context(matrix, variant) | {"serving_only": bool(toolchain)}
    entry = matrix.image(variant.image)
    recipe = entry.recipe
    files = {
        "Dockerfile.base": _render_template(env, "base.Dockerfile.j2", context),
        "Dockerfile.runtime": _render_template(env, backend(variant.backend).runtime_template, context),
        "compile.sh": _render_template(env, "compile.sh.j2", context),
        "Dockerfile.final": _render_template(env, "final.Dockerfile.j2", context),
        "Dockerfile.model-runtime": _render_template(env, "model-runtime.Dockerfile.j2", context),
    }
    if toolchain:
        files["Dockerfile.toolchain"] = _render_template(env, toolchain, context)
    # The guard names the tag that fits a host's GPU: same image, flavour and CUDA, other sm.
    same_flavour = [v for v in (*siblings, variant) if v.image == variant.image and v.flavour == variant.flavour
                    and v.resolved.cuda == variant.resolved.cuda]
    image_info = {"repository": variant.repository, "tag": variant.tag, "long_tag": variant.long_tag,
                  "tag_template": next(f.tag for f in entry.flavours if f.name == variant.flavour),
                  "tags_by_sm": {v.resolved.sm: v.tag for v in same_flavour if v.resolved.sm}}
    files["image-info.json"] = dump_json(image_info)
    files["smoke-inputs.json"] = dump_json(list(recipe.smoke_inputs))
    files[PARAMS_FILE] = dump_json(engine_params(variant, context).to_dict())
    files[MODEL_RUNTIME_PARAMS] = dump_json(model_runtime_params(engine_params(variant, context)))
    base_key = sha256_text("base", files["Dockerfile.base"])
    runtime_key = sha256_text("runtime", base_key, files["Dockerfile.runtime"], runtime_digest)
    toolchain_key = sha256_text("toolchain", runtime_key, files["Dockerfile.toolchain"]) if toolchain else None
    # Only what reaches the compile step: compile.sh, the engine parameters, tags, reference texts.
    compile_key = sha256_text("compile", toolchain_key or runtime_key, files["compile.sh"], files[PARAMS_FILE],
                              files["image-info.json"], files["smoke-inputs.json"])
    final_key = sha256_text("final", compile_key, files["Dockerfile.final"])
    manifest = {
        "schema": 1,
        "mopt_version": __version__,
        "id": variant.id,
        "image": variant.image,
        "flavour": variant.flavour,
        "repository": variant.repository,
        "tag": variant.tag,
        "long_tag": variant.long_tag,
        "backend": variant.backend,
        "device": variant.device,
        "axes": variant.axes.to_json(),
        "resolved": variant.resolved.to_json(),
        "recipe": {"path": str(recipe.path.relative_to(matrix.path.parent.resolve()))
                   if recipe.path.is_relative_to(matrix.path.parent.resolve()) else str(recipe.path),
                   "digest": recipe.digest},
        "model": {"source": recipe.model.text, "dimension": recipe.dimension,
                  "substitute": recipe.substitute.text if recipe.substitute else None,
                  "substitute_dimension": recipe.substitute_dimension},
        "engine": {"max_batch": recipe.engine.max_batch, "max_seq_len": recipe.engine.max_seq_len,
                   "precision": recipe.precision_for(variant.device, variant.axes.precision),
                   "pooling": recipe.pooling, "normalize": recipe.normalize,
                   "compile_mode": recipe.engine.compile_mode, "attention": recipe.engine.attention},
        "smoke": {"inputs": list(recipe.smoke_inputs), "min_cosine": recipe.min_cosine,
                  "start_timeout_s": recipe.start_timeout_s, "port": recipe.port},
        "context": {"mopt_runtime": runtime_digest},
        # Render-time keys; the build folds in the digests of parents it actually used.
        "stages": [
            {"name": "base", "file": "Dockerfile.base", "from": variant.resolved.base.ref,
             "base_kind": variant.resolved.base.kind, "key": base_key},
            {"name": "runtime", "file": "Dockerfile.runtime", "parent": "base", "context": ["mopt_runtime"],
             "key": runtime_key},
            *([{"name": "toolchain", "file": "Dockerfile.toolchain", "parent": "runtime", "key": toolchain_key}]
              if toolchain else []),
            {"name": "compile", "file": "compile.sh", "parent": "toolchain" if toolchain else "runtime",
             "gpu": variant.device == "cuda", "key": compile_key},
            {"name": "final", "file": "Dockerfile.final", "parent": "runtime", "key": final_key},
        ],
    }
    files["manifest.json"] = dump_json(manifest)
    return RenderedVariant(variant=variant, files=files, manifest=manifest)


def render(matrix: Matrix, variants: tuple[Variant, ...], out: Path, templates: Path | None = None,
           all_variants: tuple[Variant, ...] = ()) -> list[Path]:
    """Write one directory per variant under out/<image>/<tag>/; returns the directories.

    all_variants: the whole plan, not just the selection, so each engine knows every tag of its flavour.
    """
    templates = templates or matrix.path.parent / "templates"
    if not templates.is_dir():
        raise ConfigError("templates directory not found", file=str(templates))
    digest = runtime_digest()
    rendered = [render_variant(matrix, v, templates, digest, all_variants or variants) for v in variants]
    directories = []
    for item in rendered:  # everything rendered before anything is written: no half-rendered tree
        directory = out / item.variant.image / item.variant.tag
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in item.files.items():
            path = directory / name
            if not path.exists() or path.read_text("utf-8") != text:
                path.write_text(text, encoding="utf-8")
        directories.append(directory)
    return directories
