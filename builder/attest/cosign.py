"""Image signatures in the sigstore/cosign format, which verifiers this project did not write accept: skopeo
and podman (containers/image) under a policy.json `sigstoreSigned` requirement with the registry's
`use-sigstore-attachments`, and `cosign verify --key`.

The format (cosign's SIGNATURE_SPEC, "simple signing"):
- the payload is JSON: `critical` names the image (`docker-manifest-digest`) and the reference it is signed
  for (`identity.docker-reference`, here the full `host/repo:tag`), `type` "cosign container image
  signature"; `optional` carries the creator;
- the signature is over the payload's bytes: ECDSA P-256 with SHA-256 (DER), or Ed25519, base64 in the layer
  annotation `dev.cosignproject.cosign/signature`;
- the payloads are the layers (media type application/vnd.dev.cosign.simplesigning.v1+json) of an OCI image
  manifest tagged `sha256-<hex of the image digest>.sig` in the image's repository.

A signature names one reference. mopt signs the long tag and the short tag of each published image, so a
pull by either tag passes containers/image's default identity rule (matchRepoDigestOrExact), and the same
image under any other tag or repository does not.
"""
from __future__ import annotations

import base64
import json

from .. import __version__
from ..errors import PublishError
from ..registry.api import RegistryApi
from .dsse import key_id, sign_bytes, valid_signature

SIMPLE_SIGNING = "application/vnd.dev.cosign.simplesigning.v1+json"
SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
KEY_ANNOTATION = "dev.mopt.keyid"  # which key made a layer: signing again replaces only that key's layer
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
SIGNATURE_TYPE = "cosign container image signature"
MAX_PAYLOAD_BYTES = 64 * 1024  # a payload is a few hundred bytes; containers/image reads at most 4 MiB


def signature_tag(digest: str) -> str:
    return digest.replace(":", "-") + ".sig"  # a digest has one colon


def payload(reference: str, digest: str) -> bytes:
    """What is signed: the simple-signing JSON for REFERENCE (host/repo:tag) at DIGEST."""
    body = {"critical": {"identity": {"docker-reference": reference}, "image": {"docker-manifest-digest": digest},
                         "type": SIGNATURE_TYPE},
            "optional": {"creator": f"mopt {__version__}"}}  # written in sorted order: the same bytes each time
    return json.dumps(body, separators=(",", ":")).encode()


def _layers(api: RegistryApi, repo: str, digest: str) -> list[dict]:
    found = api.manifest(repo, signature_tag(digest))
    if found is None:
        return []
    if found.media_type != OCI_MANIFEST:
        raise PublishError(f"{repo}:{signature_tag(digest)} is a {found.media_type}, not a cosign signature manifest")
    return [layer for layer in found.body.get("layers", []) if isinstance(layer, dict)]


def sign(api: RegistryApi, repo: str, digest: str, references: list[str], private_key) -> str:
    """Sign DIGEST for each of REFERENCES and store the signatures beside those already there (another key's
    stay: two keys sign during a rotation); the signature manifest's digest."""
    keyid = key_id(private_key.public_key())
    new = []
    for reference in references:
        data = payload(reference, digest)
        new.append({"mediaType": SIMPLE_SIGNING, "digest": api.upload_blob(repo, data), "size": len(data),
                    "annotations": {SIGNATURE_ANNOTATION: base64.b64encode(sign_bytes(data, private_key)).decode(),
                                    KEY_ANNOTATION: keyid}})
    replaced = {(layer["digest"], keyid) for layer in new}
    kept = [layer for layer in _layers(api, repo, digest)
            if (layer.get("digest"), layer.get("annotations", {}).get(KEY_ANNOTATION)) not in replaced]
    layers = kept + new
    # cosign's config: no platform, one diff id per payload (containers/image does not read it).
    config = json.dumps({"architecture": "", "config": {}, "created": "0001-01-01T00:00:00Z", "os": "",
                         "rootfs": {"type": "layers", "diff_ids": [layer["digest"] for layer in layers]}},
                        sort_keys=True, separators=(",", ":")).encode()
    manifest = api.put_manifest_by_digest(repo, {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": api.upload_blob(repo, config), "size": len(config)},
        "layers": layers})
    api.put_manifest(repo, signature_tag(digest), manifest)
    return manifest.digest


def signed_references(api: RegistryApi, repo: str, digest: str, public_key) -> list[str]:
    """The references DIGEST is validly signed for by PUBLIC_KEY: payloads that verify and name DIGEST."""
    out = []
    for layer in _layers(api, repo, digest):
        if layer.get("mediaType") != SIMPLE_SIGNING:
            continue
        try:
            signature = base64.b64decode(layer["annotations"][SIGNATURE_ANNOTATION], validate=True)
            data = api.get_blob(repo, layer["digest"], max_bytes=MAX_PAYLOAD_BYTES)
        except (KeyError, TypeError, ValueError, PublishError):  # unreadable, or too large to be a payload
            continue
        if not valid_signature(data, signature, public_key):
            continue
        try:
            critical = json.loads(data)["critical"]
            named, reference = critical["image"]["docker-manifest-digest"], critical["identity"]["docker-reference"]
        except (ValueError, KeyError, TypeError):
            continue
        if named == digest and critical.get("type") == SIGNATURE_TYPE and isinstance(reference, str):
            out.append(reference)
    return out
