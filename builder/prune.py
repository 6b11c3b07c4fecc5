"""Reclaim the disk that builds leave behind: mopt's own images no state directory refers to, and
BuildKit's cache beyond a size.

Every build makes stage images (mopt-stage/<stage>:<key>) and final images, all carrying the
io.mopt.stage.key label. A stage key changes whenever its inputs change, so old stage images pile
up (several GB each for CUDA and vLLM runtimes) until the daemon's disk is full. An image is kept
when a variant record names it (the final image or one of its stages) in the pruned state dir, a
--keep-state dir, or any other state dir mopt worked in on this host (statelock.known_state_dirs:
another checkout's images); when a container (running or stopped) was made from it; or when it was
made after a build elsewhere on this host took its state dir's lock (that build may not have
recorded it yet). Images without the label (the rootfs bases, anything not ours) are never touched.
Prune holds the pruned state dir's lock, so no build of that dir runs meanwhile.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from .build import KEY_LABEL
from .dockerclient import DockerCli, docker_free_gib, run_docker
from .errors import ConfigError, EnvironmentProblem
from .state import StateDir
from .statelock import holder, known_state_dirs, state_lock

Log = Callable[[str], None]


@dataclass(frozen=True)
class OurImage:
    image_id: str  # full sha256:...
    tags: tuple[str, ...]  # empty for a dangling image


@dataclass(frozen=True)
class PruneResult:
    removed: tuple[OurImage, ...]
    kept: tuple[OurImage, ...]
    held: tuple[tuple[OurImage, str], ...]  # kept though no record names it: (image, why)
    failed: tuple[tuple[OurImage, str], ...]  # (image, docker's reason), e.g. a container still uses it
    free_before_gib: float
    free_after_gib: float


def referenced_image_ids(state_dirs: Iterable[Path], found: Iterable[Path] = (), log: Log = print) -> set[str]:
    """Image ids named by the variant records of STATE_DIRS (an unreadable record is an error: it might
    name images a user still needs, so prune refuses rather than guess) and of the state dirs FOUND on
    this host (an unreadable record there is noted and skipped: a stale checkout must not stop prune)."""
    ids: set[str] = set()
    for state in state_dirs:
        for _, record in StateDir(state).records():
            ids |= record.image_ids()
    for state in found:
        try:
            for _, record in StateDir(state).records():
                ids |= record.image_ids()
        except ConfigError as exc:
            log(f"note: {exc.message} (state dir {state}: its other records still count)")
            ids |= _readable_ids(StateDir(state))
    return ids


def _readable_ids(state: StateDir) -> set[str]:
    ids: set[str] = set()
    for path in sorted((state.root / "variants").glob("*/*.json")):
        if path.name.endswith(".smoke.json"):
            continue
        try:
            record = state.read_record(path.parent.name, path.stem)
        except ConfigError:
            continue
        ids |= record.image_ids() if record else set()
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


def container_image_ids(docker: DockerCli) -> set[str]:
    """Ids of the images every container on the daemon (running or stopped) was made from."""
    ids = run_docker(["ps", "--all", "--quiet", "--no-trunc"], docker=docker, timeout=120,
                     error_cls=EnvironmentProblem).stdout.split()
    if not ids:
        return set()
    found = run_docker(["container", "inspect", "--format", "{{.Image}}", *ids], docker=docker, check=False,
                       timeout=120)  # a container removed meanwhile fails its line only
    return {line.strip() for line in found.stdout.splitlines() if line.strip().startswith("sha256:")}


def created_after(docker: DockerCli, images: list[OurImage], cutoff: float) -> set[str]:
    """Ids of IMAGES created at or after CUTOFF (epoch seconds)."""
    if not images:
        return set()
    listing = run_docker(["image", "inspect", "--format", "{{.Id}} {{.Created}}", *(i.image_id for i in images)],
                         docker=docker, check=False, timeout=120)
    recent = set()
    for line in listing.stdout.splitlines():
        image_id, _, created = line.strip().partition(" ")
        try:  # RFC 3339 with nanoseconds: keep microseconds for fromisoformat
            stamp, _, frac = created.replace("Z", "").partition(".")
            when = datetime.fromisoformat(f"{stamp}.{(frac + '000000')[:6]}+00:00").timestamp()
        except ValueError:
            recent.add(image_id)  # unreadable: keep it
            continue
        if when >= cutoff - 1:
            recent.add(image_id)
    return recent


def prune(docker: DockerCli, state_dir: Path, keep_states: Iterable[Path] = (), *, labels: Iterable[str] = (),
          build_cache_gib: float | None = None, dry_run: bool = False, log: Log = print) -> PruneResult:
    with state_lock(state_dir, "mopt prune", log=log):
        return _prune(docker, state_dir, keep_states, labels, build_cache_gib, dry_run, log)


def _prune(docker: DockerCli, state_dir: Path, keep_states: Iterable[Path], labels: Iterable[str],
           build_cache_gib: float | None, dry_run: bool, log: Log) -> PruneResult:
    own = Path(state_dir).resolve()
    others = [d for d in known_state_dirs() if d.resolve() != own]
    keep_ids = referenced_image_ids(dict.fromkeys([Path(state_dir), *keep_states]), others, log)
    busy = [(d, h) for d in others if (h := holder(d)) is not None]
    images = our_images(docker, labels)
    why: dict[str, str] = {}
    if busy:
        directory, first = min(busy, key=lambda item: item[1].started)
        for image_id in created_after(docker, [i for i in images if i.image_id not in keep_ids], first.started):
            why[image_id] = f"made since {directory} was locked by {first.describe()}"
    for image_id in container_image_ids(docker):
        why[image_id] = "a container uses it"
    before = docker_free_gib()
    removed, kept, held, failed = [], [], [], []
    for image in images:
        if image.image_id in keep_ids:
            kept.append(image)
            continue
        if image.image_id in why:
            held.append((image, why[image.image_id]))
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
    return PruneResult(tuple(removed), tuple(kept), tuple(held), tuple(failed), before, docker_free_gib())
