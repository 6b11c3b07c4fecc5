"""mopt verify-repro: build a variant twice from scratch (no cache, engine recompiled) and compare
normalised file manifests of the two final images: path, type, mode, size, sha256 (link target). With
--against-built the first image is the variant as already built and only the second is built from scratch.

Paths that legitimately differ between two builds are listed in VOLATILE with the reason; they are
reported as ignored, never silently dropped.
"""
from __future__ import annotations

import fnmatch
import subprocess
import tarfile
from collections.abc import Callable
from dataclasses import replace

from .build import Builder, BuildOptions
from .dockerclient import DockerCli, find_docker, run_docker
from .errors import BuildError
from .hashing import dump_json, sha256_stream
from .matrix import Matrix
from .plan import Variant

Log = Callable[[str], None]

# glob -> why it may differ between two builds of the same inputs
VOLATILE = {
    "var/log/*": "apt and dpkg logs record the time of each install",
    "var/cache/ldconfig/aux-cache": "ldconfig's cache records file times",
    "var/cache/debconf/*-old": "debconf's backup of its previous state",
    "var/lib/dpkg/*-old": "dpkg's backup of its previous state",
}


def image_manifest(docker: DockerCli, image: str) -> dict[str, dict]:
    """Every entry of the image's filesystem, from `docker export` of a container of it."""
    created = run_docker(["create", "--entrypoint", "true", image], docker=docker)
    container = created.stdout.strip().splitlines()[-1]
    entries: dict[str, dict] = {}
    try:
        with subprocess.Popen([docker.path, "export", container], stdout=subprocess.PIPE) as proc:
            assert proc.stdout is not None
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                for member in tar:
                    entry = {"type": member.type.decode() if isinstance(member.type, bytes) else str(member.type),
                             "mode": oct(member.mode), "size": member.size, "uid": member.uid, "gid": member.gid}
                    if member.isfile():
                        entry["sha256"] = sha256_stream(tar.extractfile(member))
                    elif member.issym() or member.islnk():
                        entry["link"] = member.linkname
                    entries[member.name.rstrip("/")] = entry
            if proc.wait() != 0:
                raise BuildError(f"docker export of {image[:19]} failed")
    finally:
        run_docker(["rm", "-f", container], docker=docker, check=False)
    return entries


def compare(a: dict[str, dict], b: dict[str, dict]) -> tuple[list[dict], list[dict]]:
    """(differences, ignored): each {path, change, a, b}; ignored ones carry the VOLATILE reason."""
    differences, ignored = [], []
    for path in sorted(set(a) | set(b)):
        left, right = a.get(path), b.get(path)
        if left == right:
            continue
        change = "added" if left is None else "removed" if right is None else "changed"
        item = {"path": path, "change": change, "a": left, "b": right}
        reason = next((why for pattern, why in VOLATILE.items() if fnmatch.fnmatch(path, pattern)), None)
        (ignored if reason else differences).append(item | ({"ignored_because": reason} if reason else {}))
    return differences, ignored


def verify_repro(matrix: Matrix, all_variants: tuple[Variant, ...], variant: Variant, options: BuildOptions,
                 log: Log = print, against_built: bool = False) -> dict:
    """Build VARIANT twice from scratch and compare the two images' files; AGAINST_BUILT: the first image is
    the variant as built (built now where it is missing or out of date, its cached stages and engine reused
    where their inputs match), the second one from scratch, the way a rebuilder checks what was shipped:
    half the work of two builds from scratch."""
    docker = find_docker()
    forced = replace(options, force=True)
    firsts = (options, forced) if against_built else (forced, forced)
    images = []
    for attempt, how in zip(("a", "b"), firsts, strict=True):
        said = "from scratch (no cache, engine recompiled)" if how.force else "as built (cache and engine reused)"
        log(f"{variant.id}: build {attempt} of 2, {said}")
        result = Builder(matrix, all_variants, how, log=log, docker=docker).build(variant)
        ref = f"mopt-repro/{variant.image}:{variant.tag}-{attempt}"
        run_docker(["tag", result.image_id, ref], docker=docker)  # keep build a while b replaces the tags
        images.append((ref, result.image_id))
    try:
        log(f"{variant.id}: comparing file manifests of {images[0][1][:19]} and {images[1][1][:19]}")
        manifests = [image_manifest(docker, ref) for ref, _ in images]
    finally:
        for ref, _ in images:
            run_docker(["rmi", "--no-prune", ref], docker=docker, check=False)
    differences, ignored = compare(*manifests)
    report = {"variant": variant.id, "images": [image_id for _, image_id in images],
              "identical_image_ids": images[0][1] == images[1][1], "files": len(manifests[0]),
              "first_build": "as built" if against_built else "from scratch",
              "differences": differences, "ignored": ignored, "reproducible": not differences,
              "volatile_rules": VOLATILE}
    path = options.state.repro_report(variant.image, variant.tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_json(report))
    report["report_path"] = str(path)
    return report


def summary(report: dict, limit: int = 20) -> str:
    lines = [f"{report['variant']}: {report['files']} files compared; {len(report['differences'])} differ, "
             f"{len(report['ignored'])} ignored as volatile"]
    for item in report["differences"][:limit]:
        a, b = item["a"] or {}, item["b"] or {}
        detail = ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
        lines.append(f"  {item['change']:<8} /{item['path']}  {detail[:160]}")
    if len(report["differences"]) > limit:
        lines.append(f"  ... {len(report['differences']) - limit} more in {report['report_path']}")
    return "\n".join(lines)

