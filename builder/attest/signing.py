"""Sign what was published, and check it: the steps publish and `mopt verify` take."""
from __future__ import annotations

from dataclasses import dataclass

from ..dockerclient import DockerCli
from ..errors import PublishError, VerificationFailed
from ..registry.api import RegistryApi
from . import cosign, dsse, referrers
from .provenance import CYCLONEDX, SLSA_PROVENANCE, AttestInputs, provenance, statement
from .sbom import sbom

REQUIRED = {SLSA_PROVENANCE: "provenance", CYCLONEDX: "SBOM"}


def attest(api: RegistryApi, repo: str, name: str, digest: str, inputs: AttestInputs, keys: list, docker: DockerCli,
           log) -> list[str]:
    """Sign the SBOM and the provenance of the image at NAME@DIGEST (one DSSE envelope each, one signature per
    key) and attach both to DIGEST."""
    subject = api.manifest(repo, digest)
    if subject is None:
        raise PublishError(f"{name}@{digest} is not in the registry: nothing to attach attestations to")
    bom = sbom(docker, inputs.record.image_id, f"{name}@{digest}")
    made = []
    for predicate_type, predicate in ((CYCLONEDX, bom),
                                      (SLSA_PROVENANCE, provenance(inputs.variant, inputs.record, inputs.state,
                                                                   inputs.lock_file))):
        envelope = dsse.sign(statement(name, digest, predicate_type, predicate), *keys)
        made.append(referrers.attach(api, repo, subject, predicate_type, envelope))
    log(f"  signed and attached SBOM ({len(bom['components'])} components) and provenance to {name}@{digest}")
    return made


@dataclass(frozen=True)
class Verified:
    digest: str
    key_id: str
    found: dict[str, str]  # predicate type -> artifact digest, signed by the key and bound to the digest
    rejected: list[str]  # why other referrers did not count
    signed_for: list[str]  # the references the image signature (cosign's format) names for this digest


def verify(api: RegistryApi, repo: str, name: str, reference: str, public_key) -> Verified:
    """Raise VerificationFailed unless the image at REFERENCE (a tag or a digest) has a provenance and an SBOM
    signed by PUBLIC_KEY whose subject is exactly its digest, and an image signature by that key for NAME:TAG
    (for a digest: for any tag of NAME)."""
    manifest = api.manifest(repo, reference)
    if manifest is None:
        raise VerificationFailed(f"{name}:{reference} is not in the registry")
    found: dict[str, str] = {}
    rejected: list[str] = []
    for artifact, envelope in referrers.envelopes(api, repo, manifest.digest):
        stmt = dsse.open_envelope(envelope, public_key)
        if stmt is None:
            rejected.append(f"{artifact}: not signed by this key (or changed after signing)")
            continue
        subject = stmt.get("subject")
        subjects = [s["digest"].get("sha256") for s in (subject if isinstance(subject, list) else [])
                    if isinstance(s, dict) and isinstance(s.get("digest"), dict)]
        if manifest.digest.split(":", 1)[1] not in subjects:
            rejected.append(f"{artifact}: signed for {', '.join('sha256:' + str(s) for s in subjects)}, "
                            f"not {manifest.digest}")
            continue
        predicate_type = stmt.get("predicateType", "")
        predicate = stmt.get("predicate")
        components = predicate.get("components") if isinstance(predicate, dict) else None
        if predicate_type == CYCLONEDX and not isinstance(components, list):
            rejected.append(f"{artifact}: an SBOM statement without components")
            continue
        found.setdefault(predicate_type, artifact)
    missing = [what for kind, what in REQUIRED.items() if kind not in found]
    if missing:
        detail = "; ".join(rejected) if rejected else "no attestation attached"
        raise VerificationFailed(f"{name}@{manifest.digest}: no valid signed {' or '.join(missing)} ({detail})")
    signed_for = cosign.signed_references(api, repo, manifest.digest, public_key)
    wanted = f"{name}@{manifest.digest}" if reference.startswith("sha256:") else f"{name}:{reference}"
    if not any(ref == wanted or (ref.rpartition(":")[0] == name and "@" in wanted) for ref in signed_for):
        detail = f"it is signed for {', '.join(signed_for)}" if signed_for else "no image signature by this key"
        raise VerificationFailed(f"{wanted}: not signed for this reference ({detail})")
    return Verified(manifest.digest, dsse.key_id(public_key), found, rejected, signed_for)
