"""Reclaim the disk that builds leave behind: mopt's own images no state directory refers to, and
BuildKit's cache beyond a size.

Every build makes stage images (mopt-stage/<stage>:<key>) and final images, all carrying the
io.mopt.stage.key label. A stage key changes whenever its inputs change, so old stage images pile
up (several GB each for CUDA and vLLM runtimes) until the daemon's disk is full. An image is kept
when a variant record in one of the kept state directories names it (the final image or one of
its stages); images without the label (the rootfs bases, anything not ours) are never touched.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .build import KEY_LABEL
from .dockerclient import DockerCli, docker_free_gib, run_docker
from .errors import EnvironmentProblem
from .state import StateDir

Log = Callable[[str], None]


@dataclass(frozen=True)
class OurImage:
    image_id: str  # full sha256:...
    tags: tuple[str, ...]  # empty for a dangling image


@dataclass(frozen=True)
class PruneResult:
    removed: tuple[OurImage, ...]
    kept: tuple[OurImage, ...]
    failed: tuple[tuple[OurImage, str], ...]  # (image, docker's reason), e.g. a container still uses it
    free_before_gib: float
    free_after_gib: float


def referenced_image_ids(state_dirs: Iterable[Path]) -> set[str]:
    """Image ids named by the variant records of STATE_DIRS (an unreadable record is an error: it might
    name images a user still needs, so prune refuses rather than guess)."""
    ids: set[str] = set()
    for state in state_dirs:
        for _, record in StateDir(state).records():
            ids |= record.image_ids()
    return ids


def our_images(docker: DockerCli, labels: Iterable[str] = ()) -> list[OurImage]:
    """Every local image carrying the stage-key label (and every one of LABELS, KEY or KEY=VALUE), tagged
    or dangling, grouped by id."""
    filters = [arg for label in (KEY_LABEL, *labels) for arg in ("--filter", f"label={label}")]
    listing = run_docker(["images", "--all", "--no-trunc", *filters, "--format", "{{.ID}} {{.Repository}}:{{.Tag}}"],
                         docker=docker, timeout=120, error_cls=EnvironmentProblem)
    tags: dict[str, list[str]] = {}
    for line in listing.stdout.splitlines():
        image_id, _, ref = line.strip().partition(" ")
        if not image_id:
            continue
        bucket = tags.setdefault(image_id, [])
        if ref and "<none>" not in ref:
            bucket.append(ref)
    return [OurImage(image_id, tuple(sorted(refs))) for image_id, refs in sorted(tags.items())]


def prune(docker: DockerCli, keep_states: Iterable[Path], *, labels: Iterable[str] = (),
          build_cache_gib: float | None = None, dry_run: bool = False, log: Log = print) -> PruneResult:
    keep_ids = referenced_image_ids(keep_states)
    before = docker_free_gib()
    removed, kept, failed = [], [], []
    for image in our_images(docker, labels):
        if image.image_id in keep_ids:
            kept.append(image)
            continue
        names = " ".join(image.tags) or image.image_id[:19]
        if dry_run:
            log(f"would remove {names}")
            removed.append(image)
            continue
        # Removing by tag untags every name and then deletes the image; a dangling one goes by id.
        result = run_docker(["rmi", *(image.tags or (image.image_id,))], docker=docker, check=False, timeout=300)
        if result.returncode == 0:
            log(f"removed {names}")
            removed.append(image)
        else:
            reason = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["docker rmi failed"]
            failed.append((image, reason[0]))
    if build_cache_gib is not None:
        if dry_run:
            log(f"would trim BuildKit's cache to {build_cache_gib:g} GiB")
        else:
            keep_bytes = int(build_cache_gib * 2**30)
            run_docker(["builder", "prune", "--force", "--keep-storage", str(keep_bytes)], docker=docker,
                       timeout=900, error_cls=EnvironmentProblem)
            log(f"trimmed BuildKit's cache to {build_cache_gib:g} GiB")
    return PruneResult(tuple(removed), tuple(kept), tuple(failed), before, docker_free_gib())
