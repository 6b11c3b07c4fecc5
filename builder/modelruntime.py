"""`mopt build-runtime`: a variant's model runtime image (its runtime and compiler, no model), smoke-tested
the way users run it and then, with --registry, published under REPOSITORY-runtime with the same
phases as the baked images (long tag first, digest verified, then the short tag).

The smoke test mounts the variant's own model read-only and an empty engine cache: the container's
first start compiles the engine (the accuracy gate inside), and the served embeddings are checked
against the fp32 reference that compile wrote, on the gate's texts."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .build import Builder, ModelRuntimeResult
from .errors import SmokeTestError
from .plan import Variant
from .registry.phases import PublishItem, PublishResult, publish
from .registry.reference import Registry
from .render import defaults, model_runtime_repository
from .smoke import SmokeResult, SmokeSpec, smoke_test
from .warm import CONTAINER_CACHE, CONTAINER_MODEL

# A first start compiles: on top of the recipe's start timeout (which is for loading a baked engine).
COMPILE_ALLOWANCE_S = 1800


@dataclass(frozen=True)
class RuntimeRelease:
    built: ModelRuntimeResult
    smoke: SmokeResult
    published: tuple[PublishResult, ...] = ()


def _reference(cache: Path) -> dict:
    found = sorted(cache.glob("engines/*/reference.json"))
    if len(found) != 1:
        raise FileNotFoundError(f"{len(found)} engine entries in the smoke test's cache, expected 1")
    return json.loads(found[0].read_text())


def smoke(builder: Builder, variant: Variant, built: ModelRuntimeResult, log=print) -> SmokeResult:
    recipe = builder.matrix.image(variant.image).recipe
    model = builder.model(variant, built.runtime)
    uid = int(defaults()["user"]["uid"])  # the images' serving user
    with tempfile.TemporaryDirectory(prefix="mopt-runtime-smoke-") as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir()
        if os.getuid() == 0:
            os.chown(cache, uid, uid)  # the serving user writes the cache, as on a named volume
        else:
            cache.chmod(0o777)  # not root: no chown; a throw-away dir under this private temp dir
        Path(tmp).chmod(0o755)
        # The texts are the first compile's gate texts (reference.json: every length class, several scripts):
        # the recipe's inputs have no reference there.
        spec = SmokeSpec(image=built.image_id, port=recipe.port, inputs=(),
                         dimension=model.dimension, min_cosine=recipe.min_cosine, normalize=recipe.normalize,
                         reference={}, engine_json={}, start_timeout_s=recipe.start_timeout_s + COMPILE_ALLOWANCE_S,
                         gpu=variant.device == "cuda",
                         volumes=((str(model.path), CONTAINER_MODEL, "ro"), (str(cache), CONTAINER_CACHE, "rw")),
                         command=("--model-id", CONTAINER_MODEL),
                         reference_after_start=lambda: _reference(cache), baked_engine=False)
        log(f"  smoke: {built.references[0]} with {model.source} mounted (first start compiles)")
        return smoke_test(spec, log)


def release_runtime(builder: Builder, variant: Variant, registry: str | None, dry_run: bool = False,
                    log=print) -> RuntimeRelease:
    built = builder.model_runtime(variant)
    result = smoke(builder, variant, built, log)
    if not result.passed:
        raise SmokeTestError(f"{variant.id} model runtime {built.references[0]}: smoke test failed: "
                             f"{'; '.join(result.failures)}")
    if not registry:
        return RuntimeRelease(built, result)
    item = PublishItem(variant_id=f"{variant.id} (model runtime)", image_id=built.image_id,
                       repository=model_runtime_repository(variant.repository), long_tag=variant.long_tag,
                       short_tag=variant.tag)
    published = publish([item], Registry.parse(registry), dry_run=dry_run, log=log, docker=builder.docker)
    return RuntimeRelease(built, result, tuple(published))
