"""Bundles for air-gapped installs.

mopt export writes a directory (or a .tar of it):
  bundle.json            index: variants, references, image ids, smoke parameters, files
  images/<image>_<tag>.tar   the final image, as a docker archive (or OCI archive with --format oci)
  sbom/<image>_<tag>.cdx.json  CycloneDX SBOM from the image's own package lists (dpkg, pip)
  report.json, mopt.lock.json  when present
  models/<hub>/ORG--NAME/<commit>/  the hub models the images were built from (the state dir's model
                         cache layout), so the site can rebuild with the lock and no hub
  SHA256SUMS             sha256 of every other file
mopt install BUNDLE verifies the checksums, loads the images, checks they are the exported ones,
checks the host, runs each image's smoke test locally, and puts the models into the site's model cache.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from . import __version__, hubs
from .attest.sbom import sbom
from .dockerclient import DockerCli, find_docker, run_docker, skopeo_daemon_host
from .errors import BuildError, ConfigError, EnvironmentProblem, SmokeTestError
from .hashing import dump_json, sha256_file
from .models import HUB_KINDS
from .plan import Variant
from .recipe import ModelSource
from .state import StateDir, VariantRecord
from .yamlio import parse_json_bounded

Log = Callable[[str], None]
SUMS = "SHA256SUMS"
ENGINE_DIR = "/opt/mopt/engine"


def _in_image(docker: DockerCli, image: str, script: str) -> str:
    return run_docker(["run", "--rm", "--network", "none", "--entrypoint", "sh", image, "-c", script],
                      docker=docker, timeout=300).stdout


def export(variants: list[tuple[Variant, VariantRecord, dict]], out: Path, *, state: StateDir,
           fmt: str = "docker", log: Log = print) -> Path:
    """variants: (variant, build record, smoke spec dict) of images that passed their smoke test."""
    docker = find_docker()
    as_tar = out.suffix == ".tar"
    with tempfile.TemporaryDirectory(prefix="mopt-bundle-", dir=out.parent if out.parent.exists() else None) as tmp:
        root = Path(tmp) / "bundle"
        (root / "images").mkdir(parents=True)
        (root / "sbom").mkdir()
        index = {"format": 1, "mopt_version": __version__, "created": int(time.time()), "image_format": fmt,
                 "variants": []}
        for variant, record, smoke in variants:
            stem = f"{variant.image}_{variant.tag}"
            archive = root / "images" / f"{stem}.tar"
            log(f"export {variant.id}: {record.image_id[:19]} -> images/{archive.name}")
            if fmt == "oci":
                run_docker(["tag", record.image_id, record.references[0]], docker=docker)
                result = subprocess.run(
                    ["skopeo", "copy", "--quiet", *skopeo_daemon_host("src"), f"docker-daemon:{record.references[0]}",
                     f"oci-archive:{archive}:{record.references[0]}"], capture_output=True, text=True)
                if result.returncode != 0:
                    raise BuildError(f"skopeo copy to an OCI archive failed: {result.stderr.strip()[-300:]}")
            else:
                run_docker(["save", "-o", str(archive), *record.references], docker=docker, timeout=1800)
            (root / "sbom" / f"{stem}.cdx.json").write_text(
                dump_json(sbom(docker, record.image_id, record.references[0])))
            index["variants"].append({"id": variant.id, "references": list(record.references),
                                      "image_id": record.image_id, "archive": f"images/{archive.name}",
                                      "sbom": f"sbom/{stem}.cdx.json", "device": variant.device,
                                      "sm": variant.resolved.sm,
                                      "min_driver": variant.resolved.min_driver,
                                      "smoke": smoke})
        index["models"] = _export_models([record for _, record, _ in variants], state, root, log)
        for name, source in (("report.json", state.reports / "latest.json"),
                             ("mopt.lock.json", Path("mopt.lock.json"))):
            if source.is_file():
                shutil.copy(source, root / name)
        (root / "bundle.json").write_text(dump_json(index))
        files = sorted(p for p in root.rglob("*") if p.is_file())
        (root / SUMS).write_text("".join(f"{sha256_file(p)}  {p.relative_to(root).as_posix()}\n" for p in files))
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        if as_tar:
            with tarfile.open(out, "w") as tar:
                tar.add(root, arcname="bundle")
        else:
            shutil.move(str(root), out)
    return out


def _export_models(records: list[VariantRecord], state: StateDir, root: Path, log: Log) -> list[dict]:
    """Copy each hub model the images hold (at the commit they were built from) into models/."""
    entries = {}
    for record in records:
        source = ModelSource.parse(record.model.source)
        if source.kind not in HUB_KINDS or record.model.substituted or record.model.source in entries:
            continue
        repo, commit = hubs.parse_ref(source.ref)
        path = hubs.copy_out(state.models, source.kind, repo, commit, root / "models")
        log(f"export model {record.model.source} -> {path.relative_to(root)}")
        entries[record.model.source] = {"source": record.model.source, "path": path.relative_to(root).as_posix()}
    return list(entries.values())


def verify(root: Path) -> dict:
    """Check SHA256SUMS: every listed file matches and no unlisted file is present."""
    sums = root / SUMS
    if not sums.is_file():
        raise ConfigError(f"{root}: not a mopt bundle (no {SUMS})")
    listed = {}
    for n, line in enumerate(sums.read_text().splitlines(), 1):
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name or ".." in Path(name).parts:
            raise ConfigError(f"{SUMS}:{n}: malformed line")
        listed[name] = digest
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} - {SUMS}
    if present - set(listed):
        raise ConfigError(f"bundle has files not in {SUMS}: {', '.join(sorted(present - set(listed)))}")
    for name, digest in listed.items():
        path = root / name
        if not path.is_file():
            raise ConfigError(f"bundle is missing {name}")
        if sha256_file(path) != digest:
            raise ConfigError(f"checksum mismatch for {name}: the bundle is corrupt or was changed")
    return parse_json_bounded((root / "bundle.json").read_text(encoding="utf-8"), "bundle.json")


def _extract(bundle: Path, into: Path) -> Path:
    if bundle.is_dir():
        return bundle
    if not tarfile.is_tarfile(bundle):
        raise ConfigError(f"{bundle}: neither a bundle directory nor a tar archive")
    with tarfile.open(bundle) as tar:
        tar.extractall(into, filter="data")
    root = into / "bundle"
    if not root.is_dir():
        raise ConfigError(f"{bundle}: no bundle/ directory inside")
    return root


def install(bundle: Path, *, smoke: bool = True, state_dir: Path | None = None, log: Log = print) -> list[dict]:
    from .doctor import inspect_host
    from .smoke import SmokeSpec, smoke_test

    if not bundle.exists():
        raise ConfigError(f"{bundle}: no such bundle")
    with tempfile.TemporaryDirectory(prefix="mopt-install-") as tmp:
        root = _extract(bundle, Path(tmp))
        index = verify(root)
        log(f"checksums verified: {len(index['variants'])} images")
        docker = find_docker()
        facts = inspect_host()
        failed = [c for c in facts.checks if c.status == "fail"]
        if failed:
            raise EnvironmentProblem("host check failed: " + "; ".join(f"{c.name}: {c.detail}" for c in failed))
        results = []
        for entry in index["variants"]:
            archive = root / entry["archive"]
            if index.get("image_format") == "oci":
                ref = entry["references"][0]
                cmd = ["skopeo", "copy", "--quiet", *skopeo_daemon_host("dest"), f"oci-archive:{archive}",
                       f"docker-daemon:{ref}"]
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    raise BuildError(f"loading {archive.name} failed: {result.stderr.strip()[-300:]}")
                for other in entry["references"][1:]:
                    run_docker(["tag", ref, other], docker=docker)
            else:
                run_docker(["load", "-i", str(archive)], docker=docker, timeout=1800)
            loaded = json.loads(run_docker(["image", "inspect", entry["references"][0]], docker=docker).stdout)[0]
            if loaded["Id"] != entry["image_id"]:
                raise BuildError(f"{entry['id']}: loaded image {loaded['Id'][:19]} is not the exported "
                                 f"{entry['image_id'][:19]}")
            log(f"loaded {entry['id']} as {', '.join(entry['references'])}")
            outcome = {"id": entry["id"], "loaded": True, "smoke": "not run"}
            gpu_sms = {g.sm for g in facts.gpus}
            if entry["device"] == "cuda" and entry["sm"] not in gpu_sms:
                outcome["smoke"] = f"skipped: built for sm_{entry['sm']}, this host has " + \
                                   (", ".join(f"sm_{s}" for s in sorted(gpu_sms)) or "no NVIDIA GPU")
            elif smoke:
                s = entry["smoke"]
                engine_json = json.loads(_in_image(docker, entry["image_id"], f"cat {ENGINE_DIR}/engine.json"))
                reference = json.loads(_in_image(docker, entry["image_id"], f"cat {ENGINE_DIR}/reference.json"))
                spec = SmokeSpec(image=entry["image_id"], port=s["port"], inputs=tuple(s["inputs"]),
                                 dimension=s["dimension"], min_cosine=s["min_cosine"], normalize=s["normalize"],
                                 reference=reference, engine_json=engine_json,
                                 start_timeout_s=s.get("start_timeout_s", 120), gpu=entry["device"] == "cuda")
                result = smoke_test(spec, log=log)
                if not result.passed:
                    raise SmokeTestError(f"{entry['id']}: smoke test failed after install: "
                                         + "; ".join(result.failures))
                outcome["smoke"] = "passed"
                log(f"{entry['id']}: smoke test passed on this host (cosine {result.min_cosine:.5f})")
            results.append(outcome)
        if state_dir is not None and (root / "models").is_dir():
            hubs.copy_in(root / "models", StateDir(state_dir).models, log)
        return results
