"""BuildKit layer cache shared through a registry, so a fresh runner reuses the layers another built.

`--cache-registry HOST[:PORT][/NAMESPACE]` keeps one cache reference per stage and variant,
`<registry>/mopt-cache:<stage>-<image>-<tag>`, for the stages whose layers are worth sharing (base,
runtime, toolchain: apt and pip installs; the final stage only copies the engine and the model).

- With the buildx plugin: a registry cache (`--cache-from/--cache-to type=registry,mode=max`), which
  BuildKit reads and writes itself.
- With Engine 20.10's built-in BuildKit (no buildx): an inline cache. The stage is built with
  `BUILDKIT_INLINE_CACHE=1`, so its image config carries the cache metadata, and `--cache-from` the
  reference; after the build mopt copies the stage image there by id (skopeo, as publish does).

The cache is an optimisation: a reference not there yet is a miss (BuildKit says "not found" and
builds), and a failed export is a warning, never a failed build. Anyone who can push to the cache
repository can feed layers into later builds, so give it the same write access as the release
repositories. Credentials come from the docker config (DOCKER_CONFIG), as for publishing.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .dockerclient import DockerCli
from .errors import PublishError
from .registry.reference import Registry

CACHED_STAGES = ("base", "runtime", "toolchain")
CACHE_REPOSITORY = "mopt-cache"


@dataclass(frozen=True)
class RegistryCache:
    registry: Registry
    config_dir: Path  # the docker config directory whose config.json holds the registry's credentials

    @classmethod
    def parse(cls, text: str, config_dir: Path) -> RegistryCache:
        return cls(Registry.parse(text), config_dir)

    def ref(self, stage: str, image: str, tag: str) -> str:
        """The cache reference of one stage of one variant (a valid tag: at most 128 characters)."""
        name = f"{self.registry.host}/{self.registry.namespace}/{CACHE_REPOSITORY}" if self.registry.namespace \
            else f"{self.registry.host}/{CACHE_REPOSITORY}"
        cache_tag = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{stage}-{image}-{tag}")[:128]
        return f"{name}:{cache_tag}"

    def build_args(self, docker: DockerCli, ref: str) -> list[str]:
        """The `docker build` arguments that read (and, with buildx, write) the cache at REF."""
        if docker.buildkit == "buildx":
            return ["--cache-from", f"type=registry,ref={ref}", "--cache-to", f"type=registry,ref={ref},mode=max"]
        return ["--cache-from", ref, "--build-arg", "BUILDKIT_INLINE_CACHE=1"]

    def export(self, docker: DockerCli, image_id: str, ref: str, log: Callable[[str], None]) -> None:
        """Built-in BuildKit: copy the stage image (its config holds the inline cache) to REF. buildx wrote
        the cache during the build already."""
        from .registry.push import copy_image

        if docker.buildkit == "buildx":
            return
        try:
            copy_image(image_id, ref, self.config_dir, insecure=self.registry.is_loopback, log=lambda _: None)
            log(f"  layer cache -> {ref}")
        except PublishError as exc:
            log(f"  warning: the layer cache was not exported ({exc.message}); the build is unaffected")
