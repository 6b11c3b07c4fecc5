"""What an attestation says: in-toto v1 statements about one image manifest digest. The provenance
predicate is SLSA v1 (buildDefinition + runDetails): the matrix entry, the rendered Dockerfiles'
digests, the base and stage image ids, the lock, the model, the engine fingerprint, mopt's version and
the git revision it ran from."""
from __future__ import annotations

import hashlib
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..plan import Variant
from ..state import StateDir, VariantRecord

STATEMENT = "https://in-toto.io/Statement/v1"
SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
CYCLONEDX = "https://cyclonedx.org/bom"
BUILD_TYPE = "https://mopt.dev/build/v1"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class AttestInputs:
    """What a published image's provenance states about how it was made."""

    variant: Variant
    record: VariantRecord
    state: StateDir
    lock_file: Path | None


def statement(subject_name: str, digest: str, predicate_type: str, predicate: dict) -> dict:
    return {"_type": STATEMENT, "subject": [{"name": subject_name, "digest": {"sha256": digest.split(":", 1)[1]}}],
            "predicateType": predicate_type, "predicate": predicate}


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def git_revision() -> str:
    try:
        res = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return res.stdout.strip() if res.returncode == 0 else ""


def provenance(variant: Variant, record: VariantRecord, state: StateDir, lock_file: Path | None) -> dict:
    render = state.render_dir(variant.image, variant.tag)
    dependencies = [{"name": f"rendered/{p.name}", "digest": {"sha256": _sha256_file(p)}}
                    for p in sorted(render.glob("*")) if p.is_file()]
    dependencies += [{"name": f"stage/{s.name}", "digest": {"sha256": s.image_id.split(":", 1)[1]}}
                     for s in record.stages if s.image_id.startswith("sha256:")]
    if lock_file is not None and lock_file.is_file():
        dependencies.append({"name": lock_file.name, "digest": {"sha256": _sha256_file(lock_file)}})
    if record.model.digest:
        dependencies.append({"name": f"model/{record.model.source}",
                             "digest": {"sha256": record.model.digest.removeprefix("sha256:")}})
    revision = git_revision()
    if revision:
        dependencies.append({"uri": "git+mopt", "digest": {"gitCommit": revision}})
    engine_json = record.engine_dir / "engine.json"
    internal = {"engine_sha256": record.engine_sha256}
    if engine_json.is_file():
        internal["engine_json_sha256"] = _sha256_file(engine_json)
    external = {"variant": variant.id, "matrix_entry": variant.resolved.to_json(), "backend": variant.backend,
                "device": variant.device}
    return {"buildDefinition": {"buildType": BUILD_TYPE,
                                "externalParameters": external,
                                "internalParameters": internal,
                                "resolvedDependencies": dependencies},
            "runDetails": {"builder": {"id": f"https://mopt.dev/mopt@{__version__}", "version": {"mopt": __version__}},
                           "metadata": {"invocationId": str(uuid.uuid4()),
                                        "finishedOn": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}}
