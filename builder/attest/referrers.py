"""Attestations in the registry as OCI referrer artifacts, the OCI 1.1 way a registry without the
referrers API supports (the "tag schema" fallback; distribution 2.8, the local registry, has no API):

- each DSSE envelope is a blob; an artifact manifest (artifactType application/vnd.dsse.envelope.v1+json,
  the empty config, the envelope as its one layer) names the image manifest as its `subject`;
- the image's referrers are listed in an OCI index tagged `sha256-<hex of the image digest>`, which
  attaching updates (read, add, write) and verification reads.

cosign stores its attestations under `sha256-<hex>.att` tags in its own layout; mopt follows the OCI
fallback instead, which oras and registries that add the referrers API read as well.
"""
from __future__ import annotations

import json

from ..errors import PublishError
from ..registry.api import Manifest, RegistryApi
from .dsse import ENVELOPE_MEDIA_TYPE

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
EMPTY_CONFIG = "application/vnd.oci.empty.v1+json"
PREDICATE_ANNOTATION = "dev.mopt.predicate-type"


def referrers_tag(digest: str) -> str:
    return digest.replace(":", "-")


def attach(api: RegistryApi, repo: str, subject: Manifest, predicate_type: str, envelope: dict) -> str:
    """Push ENVELOPE as a referrer of SUBJECT; the artifact manifest's digest."""
    layer = json.dumps(envelope, sort_keys=True).encode()
    config_digest = api.upload_blob(repo, b"{}")
    layer_digest = api.upload_blob(repo, layer)
    annotations = {PREDICATE_ANNOTATION: predicate_type}
    artifact = api.put_manifest_by_digest(repo, {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ENVELOPE_MEDIA_TYPE,
        "config": {"mediaType": EMPTY_CONFIG, "digest": config_digest, "size": 2},
        "layers": [{"mediaType": ENVELOPE_MEDIA_TYPE, "digest": layer_digest, "size": len(layer)}],
        "subject": {"mediaType": subject.media_type, "digest": subject.digest, "size": len(subject.raw)},
        "annotations": annotations})
    tag = referrers_tag(subject.digest)
    index = api.manifest(repo, tag)
    entries = [e for e in (index.body.get("manifests", []) if index else []) if e.get("digest") != artifact.digest]
    entries.append({"mediaType": OCI_MANIFEST, "digest": artifact.digest, "size": len(artifact.raw),
                    "artifactType": ENVELOPE_MEDIA_TYPE, "annotations": annotations})
    listing = api.put_manifest_by_digest(repo, {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries})
    api.put_manifest(repo, tag, listing)
    return artifact.digest


def envelopes(api: RegistryApi, repo: str, digest: str) -> list[tuple[str, object]]:
    """(artifact digest, parsed envelope or None when unreadable) for every DSSE referrer of DIGEST."""
    index = api.manifest(repo, referrers_tag(digest))
    out: list[tuple[str, object]] = []
    for entry in index.body.get("manifests", []) if index else []:
        if entry.get("artifactType") != ENVELOPE_MEDIA_TYPE:
            continue
        artifact = api.manifest(repo, entry["digest"])
        if artifact is None:
            raise PublishError(f"{repo}: referrer {entry['digest']} of {digest} is listed but missing")
        layers = [d for d in artifact.body.get("layers", []) if d.get("mediaType") == ENVELOPE_MEDIA_TYPE]
        for desc in layers[:1]:
            try:
                out.append((artifact.digest, json.loads(api.get_blob(repo, desc["digest"]))))
            except ValueError:
                out.append((artifact.digest, None))
    return out
