"""Build one variant: base stage -> runtime stage -> engine compiled in a container of the exact
runtime image (or of its toolchain stage: that runtime plus a compiler, for backends that need one
only to compile) -> final image FROM that runtime plus the engine.

Every step has a content key; a step whose key is already built is skipped, so a second build
with nothing changed does no build work. Stage images are tagged by key
(mopt-stage/<stage>:<key>), which is as exact as a digest for a local image: BuildKit 0.8 cannot
FROM an image id, and the final image's layers are checked to start with the runtime's.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import base as base_module
from . import hubs
from .backends import backend
from .buildcache import CACHED_STAGES, RegistryCache
from .dockerclient import DOCKER_ROOT, DockerCli, docker_free_gib, find_docker, run_docker
from .errors import BuildError, ConfigError, EnvironmentProblem
from .hashing import sha256_text
from .lock import lock_entry, read_lock, requirements_text
from .matrix import Matrix
from .models import HUB_KINDS, LocalModel, ModelChoice, choose, image_tags, materialise, model_labels
from .plan import Variant
from .render import (
    MODEL_RUNTIME_PARAMS,
    MOUNTS,
    RUNTIME_PACKAGE,
    RenderedVariant,
    defaults,
    model_runtime_repository,
    render_variant,
    runtime_digest,
)
from .state import ModelRecord, StageRecord, StateDir, VariantRecord

Log = Callable[[str], None]
STAGE_REPO = "mopt-stage"
KEY_LABEL = "io.mopt.stage.key"
ROLE_LABEL = "io.mopt.role"
PARTIAL_SUFFIX = "-partial"  # stage images are built under <tag>-partial, then tagged <tag> once verified


@dataclass(frozen=True)
class BuildOptions:
    state_dir: Path
    templates: Path
    ca_bundle: Path | None = None
    find_links: tuple[Path, ...] = ()
    pip_index_url: str | None = None
    pip_extra_index_urls: tuple[str, ...] = ()
    models: str = "auto"  # source | substitute | auto
    min_free_gib: float = 4.0
    gpus: bool = True  # request GPUs for cuda variants' compile step
    lock_file: Path | None = None  # build --locked: pip --require-hashes and apt name=version from this lock
    force: bool = False  # rebuild every stage without cache and recompile (verify-repro)
    cache: RegistryCache | None = None  # BuildKit layer cache shared through a registry (buildcache.py)

    @property
    def state(self) -> StateDir:
        return StateDir(self.state_dir)


@dataclass(frozen=True)
class RuntimeStages:
    rendered: RenderedVariant
    render_dir: Path
    keys: dict[str, str]  # stage name -> its render key
    base_ref: str  # what the base stage builds FROM (a digest reference on a locked build)
    base: StageRecord
    runtime: StageRecord
    lock_files: dict[str, str]
    lock_digest: str


@dataclass(frozen=True)
class BuildResult:
    variant_id: str
    image_id: str
    references: tuple[str, ...]
    size_bytes: int
    engine_dir: Path
    engine_sha256: str
    model: LocalModel
    stages: tuple[StageRecord, ...]
    seconds: float
    render_dir: Path
    dimension: int
    notes: tuple[str, ...] = field(default=())

    @property
    def built_anything(self) -> bool:
        return any(not s.skipped for s in self.stages)


@dataclass(frozen=True)
class ModelRuntimeResult:
    """A model runtime image: a variant's runtime (and compiler) without a model (serve --model-id)."""

    variant_id: str
    image_id: str
    references: tuple[str, ...]  # (short ref, long ref)
    stages: tuple[StageRecord, ...]
    size_bytes: int

    @property
    def runtime(self) -> StageRecord:
        return next(s for s in self.stages if s.name == "runtime")


def default_ca_bundle() -> Path | None:
    """The extra CA for builds: $MOPT_CA_BUNDLE, else the host bundle (a TLS proxy's CA lives there)."""
    explicit = os.environ.get("MOPT_CA_BUNDLE")
    if explicit:
        return Path(explicit)
    host = Path("/etc/ssl/certs/ca-certificates.crt")
    return host if host.is_file() else None


def default_find_links() -> tuple[Path, ...]:
    """pip's find-links setting ($PIP_FIND_LINKS): local directories only, as a wheelhouse."""
    return tuple(Path(p) for p in os.environ.get("PIP_FIND_LINKS", "").split() if Path(p).is_dir())


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _link_tree(src: Path, dst: Path, leave_out: tuple[str, ...] = ()) -> None:
    """SRC's files under DST, but for byte-code caches, hidden files and directories (a hub client's .cache)
    and names matching a LEAVE_OUT pattern."""
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.is_file() and "__pycache__" not in rel.parts and not any(p.startswith(".") for p in rel.parts) \
                and not any(fnmatch.fnmatch(path.name, pattern) for pattern in leave_out):
            _link_or_copy(path, dst / rel)


def _readable_by_all(root: Path) -> None:
    for path in root.rglob("*"):
        path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))


class Builder:
    def __init__(self, matrix: Matrix, all_variants: tuple[Variant, ...], options: BuildOptions,
                 log: Log = print, docker: DockerCli | None = None):
        self.matrix, self.all_variants, self.options, self.log = matrix, all_variants, options, log
        self.docker = docker or find_docker()
        self.state = options.state.create()
        self.runtime_digest = runtime_digest()
        self.wheelhouse = self._wheelhouse_files()

    # -- docker helpers -------------------------------------------------------------------
    def _inspect(self, ref: str) -> dict | None:
        result = run_docker(["image", "inspect", ref], docker=self.docker, check=False)
        if result.returncode != 0:
            return None
        return json.loads(result.stdout)[0]

    def _logfile(self, variant: Variant, stage: str) -> Callable[[str], None]:
        path = self.state.log_file(variant.image, variant.tag, stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("w", encoding="utf-8")

        def write(line: str) -> None:
            handle.write(line + "\n")
            handle.flush()

        write.path = path  # type: ignore[attr-defined]
        return write

    def _check_disk(self) -> None:
        free_gib = docker_free_gib(fallback=self.state.root)
        if free_gib < self.options.min_free_gib:
            raise EnvironmentProblem(f"only {free_gib:.1f} GiB free for Docker ({DOCKER_ROOT}); builds need at least "
                                     f"{self.options.min_free_gib} GiB: remove old images (mopt prune, docker image "
                                     "prune) or free disk")

    def _wheelhouse_files(self) -> list[Path]:
        files = []
        for directory in self.options.find_links:
            files += sorted(p for p in directory.iterdir() if p.suffix in (".whl", ".gz", ".zip") and p.is_file())
        return files

    def _wheelhouse_digest(self) -> str:
        return sha256_text(*(f"{p.name}:{p.stat().st_size}" for p in self.wheelhouse))

    def _docker_build(self, variant: Variant, stage: str, dockerfile: Path, context: Path, tag: str, key: str,
                      build_args: dict[str, str], labels: dict[str, str]) -> str:
        log = self._logfile(variant, stage)
        argv = [*self.docker.build_cmd()[1:], "--progress=plain", "-f", str(dockerfile), "-t", tag,
                "--label", f"{KEY_LABEL}={key}"]
        cache_ref = None
        if self.options.force:
            argv.append("--no-cache")
        elif self.options.cache is not None and stage in CACHED_STAGES:
            cache_ref = self.options.cache.ref(stage, variant.image, variant.tag)
            argv += self.options.cache.build_args(self.docker, cache_ref)
        for name, value in {**labels}.items():
            argv += ["--label", f"{name}={value}"]
        for name, value in build_args.items():
            argv += ["--build-arg", f"{name}={value}"]
        with tempfile.TemporaryDirectory(prefix="mopt-secrets-") as secrets:
            # Secrets are files mounted only into RUN steps: never a layer, an arg, a label or history.
            if self.options.ca_bundle:
                if not self.options.ca_bundle.is_file():
                    raise EnvironmentProblem(f"CA bundle {self.options.ca_bundle} does not exist")
                argv += ["--secret", f"id=ca,src={self.options.ca_bundle}"]
            pip_conf = self._pip_conf()
            if pip_conf:
                conf = Path(secrets) / "pip.conf"
                conf.write_text(pip_conf)
                conf.chmod(0o600)
                argv += ["--secret", f"id=pipconf,src={conf}"]
            argv.append(str(context))
            self.log(f"  {stage}: docker build -> {tag} (log {log.path})")  # type: ignore[attr-defined]
            result = run_docker(argv, docker=self.docker, log=log, check=False, timeout=3600)
        if result.returncode != 0:
            tail = "\n".join(result.stdout.strip().splitlines()[-12:])
            raise BuildError(f"{variant.id}: {stage} stage failed (log {log.path}):\n{tail}")  # type: ignore[attr-defined]
        info = self._inspect(tag)
        if not info:
            raise BuildError(f"{variant.id}: {stage} stage built but {tag} is not in the daemon")
        if cache_ref is not None:
            self.options.cache.export(self.docker, info["Id"], cache_ref, log=self.log)  # type: ignore[union-attr]
        return info["Id"]

    def _pip_conf(self) -> str:
        lines = []
        if self.options.pip_index_url:
            lines.append(f"index-url = {self.options.pip_index_url}")
        if self.options.pip_extra_index_urls:
            lines.append("extra-index-url = " + " ".join(self.options.pip_extra_index_urls))
        return "[global]\n" + "\n".join(lines) + "\n" if lines else ""

    # -- stages ---------------------------------------------------------------------------
    def _base_image(self, variant: Variant, locked: dict | None) -> tuple[str, str]:
        """(reference, image id) of the base the base stage builds FROM; a locked build takes a registry
        base by the digest the lock recorded, so a tag moved since cannot change it."""
        spec = self.matrix.bases[variant.resolved.base.name]
        if spec.kind == "rootfs":
            image = base_module.ensure_base(
                base_module.BaseSpec(name=spec.image, epoch=spec.source_date_epoch, packages=spec.packages,
                                     suite=spec.suite, variant=spec.variant, mirror=spec.mirror),
                self.state.bases, self.docker, log=lambda line: self.log("  " + line))
            return spec.image, image.image_id
        digests = (locked or {}).get("base", {}).get("repo_digests") or []
        ref = digests[0] if digests else variant.resolved.base.ref
        info = self._inspect(ref)
        if info is None:
            result = run_docker(["pull", ref], docker=self.docker, check=False, timeout=900)
            info = self._inspect(ref) if result.returncode == 0 else None
        if info is None:
            raise BuildError(f"{variant.id}: base image {ref} is not available locally and could not be pulled "
                             "(no registry access here?): load it with docker load, or build on a host that can pull")
        return ref, info["Id"]

    def _stage(self, variant: Variant, name: str, key: str, build: Callable[[str], str]) -> StageRecord:
        tag = f"{STAGE_REPO}/{name}:{key[:32]}"
        start = time.monotonic()
        info = None if self.options.force else self._inspect(tag)
        if info and (info["Config"].get("Labels") or {}).get(KEY_LABEL) == key:
            self.log(f"  {name}: up to date ({tag})")
            return StageRecord(name=name, key=key, image=tag, image_id=info["Id"], skipped=True, seconds=0.0)
        # Atomic stage tags: build (and verify) under a temporary tag, then tag the real one in a single
        # `docker tag`. An interrupted build leaves at most the temporary tag, which the next run drops:
        # never a stage tag that a later run would take as up to date.
        partial = f"{tag}{PARTIAL_SUFFIX}"
        run_docker(["rmi", "--no-prune", partial], docker=self.docker, check=False)
        image_id = build(partial)
        run_docker(["tag", image_id, tag], docker=self.docker)
        run_docker(["rmi", "--no-prune", partial], docker=self.docker, check=False)
        return StageRecord(name=name, key=key, image=tag, image_id=image_id, skipped=False,
                           seconds=round(time.monotonic() - start, 1))

    def _run_in_runtime(self, variant: Variant, runtime: StageRecord, mounts: list[tuple[Path, str, str]],
                        command: list[str], stage: str, gpu: bool) -> None:
        log = self._logfile(variant, stage)
        argv = ["run", "--rm", "--label", f"{ROLE_LABEL}={stage}", "--network", "none"]
        if gpu:
            argv += ["--gpus", "all"]
        for host, target, mode in mounts:
            argv += ["-v", f"{host}:{target}:{mode}"]
        argv += [runtime.image_id, *command]  # by image id: exactly the runtime that was built
        result = run_docker(argv, docker=self.docker, log=log, check=False, timeout=7200)
        if result.returncode != 0:
            tail = "\n".join(result.stdout.strip().splitlines()[-12:])
            raise BuildError(f"{variant.id}: {stage} in the runtime image failed (exit {result.returncode}, "
                             f"log {log.path}):\n{tail}")  # type: ignore[attr-defined]

    def _compile(self, variant: Variant, rendered: RenderedVariant, render_dir: Path, runtime: StageRecord,
                 model: LocalModel) -> StageRecord:
        compile_stage = next(s for s in rendered.manifest["stages"] if s["name"] == "compile")
        target_sm = variant.resolved.sm or "cpu"
        key = sha256_text(compile_stage["key"], runtime.image_id, model.digest, target_sm)
        engine_dir = self.state.engine_dir(key)
        if (engine_dir / ".complete").exists() and not self.options.force:
            self.log(f"  compile: engine up to date ({engine_dir})")
            return StageRecord(name="compile", key=key, image=str(engine_dir), image_id="", skipped=True, seconds=0.0)
        start = time.monotonic()
        self.log(f"  compile: {variant.backend} engine for {target_sm} in a container of {runtime.name} "
                 f"{runtime.image_id[:19]}")
        with tempfile.TemporaryDirectory(prefix="mopt-compile-", dir=self.state.engines) as tmp:
            out = Path(tmp) / "out"
            out.mkdir()
            gpu = variant.device == "cuda" and self.options.gpus
            self._run_in_runtime(variant, runtime, [(model.path, MOUNTS["model"], "ro"),
                                                    (render_dir, MOUNTS["inputs"], "ro"), (out, MOUNTS["out"], "rw")],
                                 ["sh", f"{MOUNTS['inputs']}/compile.sh"], "compile", gpu)
            if not (out / "engine.json").is_file():
                raise BuildError(f"{variant.id}: the compile step wrote no engine.json")
            shutil.rmtree(engine_dir, ignore_errors=True)
            out.rename(engine_dir)
        (engine_dir / ".complete").touch()
        return StageRecord(name="compile", key=key, image=str(engine_dir), image_id="", skipped=False,
                           seconds=round(time.monotonic() - start, 1))

    def _generate_model(self, variant: Variant, runtime: StageRecord) -> Callable[[str, int, Path], None]:
        def generate(name: str, seed: int, out: Path) -> None:
            out.mkdir(parents=True)
            self._run_in_runtime(variant, runtime, [(out, "/mopt/out", "rw")],
                                 ["python", "-m", "mopt_runtime", f"make-{name}", "--out", "/mopt/out",
                                  "--seed", str(seed)], "generate-model", False)
        return generate

    # -- one variant ----------------------------------------------------------------------
    def render(self, variant: Variant) -> tuple[RenderedVariant, Path]:
        """The variant's rendered files, written to its render dir in the state dir."""
        rendered = render_variant(self.matrix, variant, self.options.templates, self.runtime_digest,
                                  self.all_variants)
        render_dir = self.state.render_dir(variant.image, variant.tag)
        render_dir.mkdir(parents=True, exist_ok=True)
        for name, text in rendered.files.items():
            (render_dir / name).write_text(text, encoding="utf-8")
        return rendered, render_dir

    def runtime(self, variant: Variant) -> RuntimeStages:
        """The base and runtime stages (all mopt lock needs: it reads what the runtime image holds)."""
        rendered, render_dir = self.render(variant)
        keys = {s["name"]: s["key"] for s in rendered.manifest["stages"]}
        locked = self._locked_entry(variant, render_dir)
        base_ref, base_id = self._base_image(variant, locked)
        lock_files = self._lock_files(variant, locked, base_id)
        lock_digest = sha256_text(*(f"{name}\n{text}" for name, text in sorted(lock_files.items())))
        base_context = self.state.contexts / f"base-{lock_digest[:16]}"
        self._write_context_lock(base_context, lock_files)
        (base_context / "wheelhouse").mkdir(parents=True, exist_ok=True)
        base_key = sha256_text(keys["base"], base_id, lock_digest)
        base = self._stage(variant, "base", base_key, lambda tag: self._docker_build(
            variant, "base", render_dir / "Dockerfile.base", base_context, tag, base_key,
            {"BASE_IMAGE": base_ref}, {"io.mopt.base.id": base_id}))

        runtime_key = sha256_text(keys["runtime"], base.image_id, self._wheelhouse_digest(), lock_digest)

        def build_runtime(tag: str) -> str:
            context = self.state.context("runtime", runtime_key)
            shutil.rmtree(context, ignore_errors=True)
            _link_tree(RUNTIME_PACKAGE, context / "mopt_runtime")
            self._write_context_lock(context, lock_files)
            self._write_context_wheelhouse(context)
            try:
                return self._docker_build(variant, "runtime", render_dir / "Dockerfile.runtime", context, tag,
                                          runtime_key, {"BASE_IMAGE": base.image}, {})
            finally:
                shutil.rmtree(context, ignore_errors=True)

        runtime = self._stage(variant, "runtime", runtime_key, build_runtime)
        return RuntimeStages(rendered, render_dir, keys, base_ref, base, runtime, lock_files, lock_digest)

    def build(self, variant: Variant) -> BuildResult:
        start = time.monotonic()
        self._check_disk()
        entry = self.matrix.image(variant.image)
        made = self.runtime(variant)
        rendered, render_dir, keys, runtime = made.rendered, made.render_dir, made.keys, made.runtime
        stages = [made.base, runtime]

        compiler = self.compiler(variant, made)
        if compiler is not runtime:
            stages.append(compiler)

        model = self.model(variant, compiler)  # a generated model is made with the compile's packages
        compiled = self._compile(variant, rendered, render_dir, compiler, model)
        stages.append(compiled)
        engine_dir = Path(compiled.image)
        engine_json = json.loads((engine_dir / "engine.json").read_text())
        engine_sha = engine_json.get("engine_sha256", "")

        # A substitute model is built under its own tags and labels, never the variant's (models.image_tags).
        short_tag, long_tag = image_tags(variant.tag, variant.long_tag, model.substituted)
        labels = {"io.mopt.runtime.id": runtime.image_id, **model_labels(model, entry.recipe.description),
                  "org.opencontainers.image.ref.name": short_tag}
        # An engine that holds the weights ships beside the model's other files only (tokenizer, config).
        weights_left_out = tuple(defaults()["model_weight_files"]) if backend(variant.backend).engine_holds_weights \
            else ()
        final_key = sha256_text(keys["final"], compiled.key, runtime.image_id, json.dumps(labels, sort_keys=True),
                                *weights_left_out)

        def build_final(tag: str) -> str:
            context = self.state.context("final", final_key)
            shutil.rmtree(context, ignore_errors=True)
            _link_tree(engine_dir, context / "engine")
            _link_tree(model.path, context / "model", weights_left_out)
            _readable_by_all(context)  # the image copies them owned by root: the serving user must read them
            try:
                image_id = self._docker_build(
                    variant, "final", render_dir / "Dockerfile.final", context, tag, final_key,
                    {"RUNTIME_IMAGE": runtime.image, "ENGINE_SHA256": engine_sha}, labels)
            finally:
                shutil.rmtree(context, ignore_errors=True)
            self._verify_parent(variant, runtime, tag)
            return image_id

        final = self._stage(variant, "final", final_key, build_final)
        stages.append(final)
        references = (f"{variant.repository}:{short_tag}", f"{variant.repository}:{long_tag}")
        # The final image is verified (parent check) before these tags; long tag first, as in publish.
        for ref in reversed(references):
            run_docker(["tag", final.image_id, ref], docker=self.docker)
        info = self._inspect(final.image_id) or {}
        result = BuildResult(
            variant_id=variant.id, image_id=final.image_id, references=references,
            size_bytes=int(info.get("Size") or 0), engine_dir=engine_dir, engine_sha256=engine_sha, model=model,
            stages=tuple(stages), seconds=round(time.monotonic() - start, 1), render_dir=render_dir,
            dimension=model.dimension, notes=(model.note,) if model.note else ())
        self._record(variant, result)
        return result

    def model(self, variant: Variant, runtime: StageRecord) -> LocalModel:
        """The variant's model on this host (the recipe's, or its substitute), fetched once into the state."""
        recipe = self.matrix.image(variant.image).recipe
        client, choice, pinned = self._choose_model(variant, recipe)
        return materialise(recipe, choice, self.state.models, lambda line: self.log("  " + line),
                           generate=self._generate_model(variant, runtime), hub=client, pinned=pinned)

    def model_runtime(self, variant: Variant) -> ModelRuntimeResult:
        """The variant's runtime with the compiler its engine's compile needs, and no model: it compiles a
        mounted model's engine on its first start (builder/runtime/modelcache.py). Tagged as the variant
        under the repository's -runtime twin; the compiler stage's image id is its runtime identity."""
        made = self.runtime(variant)
        stages = [made.base, made.runtime]
        compiler = self.compiler(variant, made)
        if compiler is not made.runtime:
            stages.append(compiler)
        files = made.rendered.files
        key = sha256_text("model-runtime", compiler.image_id, files["Dockerfile.model-runtime"],
                          files[MODEL_RUNTIME_PARAMS])

        def build(tag: str) -> str:
            context = self.state.context("model-runtime", key)
            shutil.rmtree(context, ignore_errors=True)
            context.mkdir(parents=True)
            (context / MODEL_RUNTIME_PARAMS).write_text(files[MODEL_RUNTIME_PARAMS])
            _readable_by_all(context)
            try:
                image_id = self._docker_build(
                    variant, "model-runtime", made.render_dir / "Dockerfile.model-runtime", context, tag, key,
                    {"COMPILER_IMAGE": compiler.image, "RUNTIME_ID": compiler.image_id}, {})
            finally:
                shutil.rmtree(context, ignore_errors=True)
            self._verify_parent(variant, made.runtime, tag)
            return image_id

        stage = self._stage(variant, "model-runtime", key, build)
        stages.append(stage)
        repository = model_runtime_repository(variant.repository)
        references = (f"{repository}:{variant.tag}", f"{repository}:{variant.long_tag}")
        for ref in reversed(references):
            run_docker(["tag", stage.image_id, ref], docker=self.docker)
        info = self._inspect(stage.image_id) or {}
        return ModelRuntimeResult(variant_id=variant.id, image_id=stage.image_id, references=references,
                                  stages=tuple(stages), size_bytes=int(info.get("Size") or 0))

    def compiler(self, variant: Variant, made: RuntimeStages) -> StageRecord:
        """Where the variant's engine compiles: its toolchain stage (the runtime plus a compiler and what the
        serving-only runtime leaves out), or the runtime itself for a backend without one."""
        if "toolchain" not in made.keys:
            return made.runtime
        return self._toolchain(variant, made.render_dir, made.runtime, made.keys["toolchain"], made.lock_files,
                               made.lock_digest)

    def _toolchain(self, variant: Variant, render_dir: Path, runtime: StageRecord, render_key: str,
                   lock_files: dict[str, str], lock_digest: str) -> StageRecord:
        """The runtime plus a compiler, for the compile step only. Its layers must start with the runtime's:
        the engine is built by the very torch binaries the final image loads it with."""
        key = sha256_text(render_key, runtime.image_id, lock_digest)

        def build(tag: str) -> str:
            context = self.state.context("toolchain", key)
            shutil.rmtree(context, ignore_errors=True)
            self._write_context_lock(context, lock_files)
            self._write_context_wheelhouse(context)  # it installs again what the serving runtime left out
            try:
                image_id = self._docker_build(variant, "toolchain", render_dir / "Dockerfile.toolchain", context, tag,
                                              key, {"RUNTIME_IMAGE": runtime.image}, {})
            finally:
                shutil.rmtree(context, ignore_errors=True)
            self._verify_parent(variant, runtime, tag)
            return image_id

        return self._stage(variant, "toolchain", key, build)

    def _choose_model(self, variant: Variant, recipe) -> tuple[hubs.Hub | None, ModelChoice, dict | None]:
        """(the hub client for the recipe's source, the model to build, the lock's pin for it). auto takes the
        real model when its hub answers or the cache has it, else the recipe's substitute. On a locked build
        a hub's model must be pinned in the lock (the commit and every file's sha256)."""
        source = recipe.model
        client = hubs.hub_for(source.kind) if source.kind in HUB_KINDS else None  # its token stays on the host
        pinned = None
        if client is not None and self.options.lock_file is not None:
            pinned = read_lock(self.options.lock_file).get("models", {}).get(source.text)
        choice = choose(recipe, self.options.models,
                        lambda: client is not None and hubs.available(client, source.ref, self.state.models, pinned))
        if choice.substituted:
            return client, choice, None
        if client is not None and self.options.lock_file is not None and pinned is None:
            raise ConfigError(f"{self.options.lock_file} is stale for {variant.id}: it pins no commit for "
                              f"{source.text}; run mopt lock --select '{variant.id}'")
        return client, choice, pinned

    def _locked_entry(self, variant: Variant, render_dir: Path) -> dict | None:
        """The lock's entry for this variant's runtime on a --locked build (a stale lock is an error)."""
        if self.options.lock_file is None:
            return None
        return lock_entry(read_lock(self.options.lock_file), self.options.lock_file, variant, render_dir)

    def _lock_files(self, variant: Variant, entry: dict | None, base_id: str) -> dict[str, str]:
        """lock/ in the base and runtime contexts: empty unless --locked (then the pinned sets)."""
        if entry is None:
            return {}
        path = self.options.lock_file
        base = entry.get("base", {})
        rootfs = base_module.load_base(self.state.bases, base.get("ref", "")) if base.get("kind") == "rootfs" \
            else None
        if base.get("kind") == "rootfs" and (rootfs is None or rootfs.rootfs_sha256 != base.get("rootfs_sha256")):
            raise ConfigError(f"{path} is stale for {variant.id}: base {base.get('ref')} is not the locked rootfs "
                              f"(sha256 {str(base.get('rootfs_sha256'))[:12]}); run mopt lock")
        if base.get("kind") == "image" and base.get("image_id") != base_id:
            raise ConfigError(f"{path} is stale for {variant.id}: base {base.get('ref')} is {base_id[:19]}, "
                              f"the lock has {str(base.get('image_id'))[:19]}; run mopt lock")
        self.log(f"  locked: {len(entry['python'])} Python packages (hashes), {len(entry['debian'])} Debian packages")
        return {"requirements.txt": requirements_text(entry), "debian.txt": "\n".join(entry["debian"]) + "\n"}

    def _write_context_wheelhouse(self, context: Path) -> None:
        (context / "wheelhouse").mkdir(parents=True, exist_ok=True)
        for wheel in self.wheelhouse:
            _link_or_copy(wheel, context / "wheelhouse" / wheel.name)

    @staticmethod
    def _write_context_lock(context: Path, files: dict[str, str]) -> None:
        lock_dir = context / "lock"
        lock_dir.mkdir(parents=True, exist_ok=True)
        for stale in lock_dir.iterdir():
            if stale.name not in files:
                stale.unlink()
        for name, text in files.items():
            (lock_dir / name).write_text(text)

    def _verify_parent(self, variant: Variant, runtime: StageRecord, tag: str) -> None:
        """The final (or toolchain) image must sit on exactly the runtime image the engine was compiled in."""
        runtime_layers = (self._inspect(runtime.image_id) or {}).get("RootFS", {}).get("Layers", [])
        final_layers = (self._inspect(tag) or {}).get("RootFS", {}).get("Layers", [])
        if not runtime_layers or final_layers[: len(runtime_layers)] != runtime_layers:
            run_docker(["rmi", tag], docker=self.docker, check=False)
            raise BuildError(f"{variant.id}: {tag} is not built on runtime {runtime.image_id[:19]}; "
                             "refusing to tag it")

    def _record(self, variant: Variant, result: BuildResult) -> None:
        model = result.model
        self.state.write_record(variant.image, variant.tag, VariantRecord(
            id=variant.id, image_id=result.image_id, references=result.references, engine_dir=result.engine_dir,
            engine_sha256=result.engine_sha256,
            model=ModelRecord(source=model.source, digest=model.digest, dimension=model.dimension,
                              substituted=model.substituted, declared=model.declared, why=model.why),
            stages=result.stages, size_bytes=result.size_bytes))
