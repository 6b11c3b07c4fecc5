"""Image signatures in the sigstore/cosign format (builder/attest/cosign.py) over the in-memory registry of
test_attest_contract.py. That a standard verifier accepts them is held by tests/integration/test_attest.py
(Debian 13's skopeo under a policy.json sigstoreSigned requirement)."""
import base64
import json

import pytest

from builder import __version__
from builder.attest import cosign, dsse
from builder.attest.signing import verify
from builder.errors import PublishError, VerificationFailed
from builder.registry.api import Manifest
from tests.unit import test_attest_contract as contract
from tests.unit.test_attest_contract import (
    NAME,
    REPO,
    InMemoryRegistry,
    attach,
    provenance_statement,
    push_image,
    sbom_statement,
)

kind, key, stranger = contract.kind, contract.key, contract.stranger  # the same key fixtures, both key types


def signature_layers(reg: InMemoryRegistry, digest: str) -> list[dict]:
    found = reg.manifest(REPO, cosign.signature_tag(digest))
    assert found is not None and found.media_type == cosign.OCI_MANIFEST
    return found.body["layers"]


def test_the_signature_manifest_is_cosigns_layout_byte_for_byte(key):
    """What cosign and containers/image read: an OCI image manifest (schema 2) at sha256-<hex>.sig whose
    config is cosign's empty image config and whose layers are the payloads; every JSON document compact
    with sorted keys, so the same inputs give the same bytes (and digests)."""
    reg = InMemoryRegistry()
    image = push_image(reg)
    cosign.sign(reg, REPO, image.digest, [f"{NAME}:v1"], key)
    manifest = reg.manifest(REPO, cosign.signature_tag(image.digest))
    layer = manifest.body["layers"][0]
    config = reg.get_blob(REPO, manifest.body["config"]["digest"])
    assert config == (b'{"architecture":"","config":{},"created":"0001-01-01T00:00:00Z","os":"",'
                      b'"rootfs":{"diff_ids":["' + layer["digest"].encode() + b'"],"type":"layers"}}')
    assert manifest.body == {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": manifest.body["config"]
                   ["digest"], "size": len(config)},
        "layers": [{"mediaType": "application/vnd.dev.cosign.simplesigning.v1+json", "digest": layer["digest"],
                    "size": len(reg.get_blob(REPO, layer["digest"])), "annotations": {
                        "dev.cosignproject.cosign/signature": layer["annotations"][cosign.SIGNATURE_ANNOTATION],
                        "dev.mopt.keyid": dsse.key_id(key.public_key())}}]}
    assert reg.get_blob(REPO, layer["digest"]) == (
        b'{"critical":{"identity":{"docker-reference":"' + f"{NAME}:v1".encode() + b'"},"image":'
        b'{"docker-manifest-digest":"' + image.digest.encode() + b'"},"type":"cosign container image signature"},'
        b'"optional":{"creator":"mopt ' + __version__.encode() + b'"}}')


def test_other_attachments_at_the_signature_tag_are_kept_and_skipped(key):
    """A layer another tool put there (no annotations, another media type) stays when mopt signs, and does
    not stop the search for a valid signature after it; a manifest without layers holds no signature."""
    reg = InMemoryRegistry()
    image = push_image(reg)
    foreign = b"an attestation of another tool"
    body = {"schemaVersion": 2, "mediaType": cosign.OCI_MANIFEST,
            "config": {"mediaType": cosign.OCI_CONFIG, "digest": reg.upload_blob(REPO, b"{}"), "size": 2},
            "layers": [{"mediaType": "application/vnd.dsse.envelope.v1+json", "digest": reg.upload_blob(REPO, foreign),
                        "size": len(foreign)}]}
    reg.put_manifest(REPO, cosign.signature_tag(image.digest), reg.put_manifest_by_digest(REPO, body))
    cosign.sign(reg, REPO, image.digest, [f"{NAME}:v1"], key)
    layers = signature_layers(reg, image.digest)
    assert layers[0] == body["layers"][0] and len(layers) == 2
    assert cosign.signed_references(reg, REPO, image.digest, key.public_key()) == [f"{NAME}:v1"]
    empty = {k: v for k, v in body.items() if k != "layers"}  # malformed (no layers key): stored as is
    raw = json.dumps(empty).encode()
    reg.manifests[(REPO, "sha256:empty")] = Manifest("sha256:empty", cosign.OCI_MANIFEST, empty, raw)
    reg.tags[(REPO, cosign.signature_tag(image.digest))] = "sha256:empty"
    assert cosign.signed_references(reg, REPO, image.digest, key.public_key()) == []


def _add_layer(reg: InMemoryRegistry, digest: str, data: bytes, signature: str, first: bool = True) -> None:
    """A simple-signing layer with DATA and SIGNATURE put before (or after) the ones at DIGEST's tag."""
    found = reg.manifest(REPO, cosign.signature_tag(digest))
    layer = {"mediaType": cosign.SIMPLE_SIGNING, "digest": reg.upload_blob(REPO, data), "size": len(data),
             "annotations": {cosign.SIGNATURE_ANNOTATION: signature}}
    layers = [layer, *found.body["layers"]] if first else [*found.body["layers"], layer]
    reg.put_manifest(REPO, cosign.signature_tag(digest), reg.put_manifest_by_digest(REPO, {**found.body,
                                                                                          "layers": layers}))


def _sig(key, data: bytes) -> str:
    return base64.b64encode(dsse.sign_bytes(data, key)).decode()


def test_each_unusable_layer_is_skipped_and_the_search_goes_on(key):
    """Before the valid signature: a layer signed by the key over something that is not a payload, one whose
    base64 carries junk characters (strict decoding refuses it), one over a payload for another digest, and
    one larger than a payload can be: none counts, and none stops the search."""
    reg = InMemoryRegistry()
    image = push_image(reg)
    cosign.sign(reg, REPO, image.digest, [f"{NAME}:v1"], key)
    valid = signature_layers(reg, image.digest)[0]
    junk = valid["annotations"][cosign.SIGNATURE_ANNOTATION]
    _add_layer(reg, image.digest, reg.get_blob(REPO, valid["digest"]), junk[:8] + "!" + junk[8:])
    _add_layer(reg, image.digest, b"not json", _sig(key, b"not json"))
    bare = reg.manifest(REPO, cosign.signature_tag(image.digest)).body  # a layer without annotations
    bare_layer = {k: v for k, v in bare["layers"][0].items() if k != "annotations"}
    reg.put_manifest(REPO, cosign.signature_tag(image.digest), reg.put_manifest_by_digest(
        REPO, {**bare, "layers": [bare_layer, *bare["layers"]]}))
    other = cosign.payload(f"{NAME}:v1", "sha256:" + "0" * 64)
    _add_layer(reg, image.digest, other, _sig(key, other))
    big = cosign.payload(f"{NAME}:v1", image.digest)[:-1] + b', "pad": "' + b"x" * (64 * 1024) + b'"}'
    big = big[:64 * 1024 + 1] if len(big) > 64 * 1024 + 1 else big
    _add_layer(reg, image.digest, big, _sig(key, big))
    assert cosign.signed_references(reg, REPO, image.digest, key.public_key()) == [f"{NAME}:v1"]


def test_a_payload_of_exactly_the_limit_is_read_and_one_byte_more_is_not(key):
    reg = InMemoryRegistry()
    image = push_image(reg)
    cosign.sign(reg, REPO, image.digest, [f"{NAME}:v0"], key)
    base = json.loads(cosign.payload(f"{NAME}:v1", image.digest))
    for size, counted in ((cosign.MAX_PAYLOAD_BYTES, True), (cosign.MAX_PAYLOAD_BYTES + 1, False)):
        base["optional"]["pad"] = ""
        short = len(json.dumps(base, separators=(",", ":")).encode())
        base["optional"]["pad"] = "x" * (size - short)
        data = json.dumps(base, separators=(",", ":")).encode()
        assert len(data) == size
        _add_layer(reg, image.digest, data, _sig(key, data), first=False)
        assert (f"{NAME}:v1" in cosign.signed_references(reg, REPO, image.digest, key.public_key())) is counted
        reg.put_manifest(REPO, cosign.signature_tag(image.digest), reg.put_manifest_by_digest(REPO, {
            **reg.manifest(REPO, cosign.signature_tag(image.digest)).body,
            "layers": signature_layers(reg, image.digest)[:1]}))


def test_the_payload_is_containers_images_simple_signing_json():
    """The fields containers/image's strict parser demands, exactly: critical {identity, image, type} and
    optional; any other key in critical is refused there."""
    data = json.loads(cosign.payload(f"{NAME}:v1", "sha256:" + "ab" * 32))
    assert data == {"critical": {"identity": {"docker-reference": f"{NAME}:v1"},
                                 "image": {"docker-manifest-digest": "sha256:" + "ab" * 32},
                                 "type": "cosign container image signature"},
                    "optional": {"creator": f"mopt {__version__}"}}
    assert cosign.signature_tag("sha256:" + "ab" * 32) == "sha256-" + "ab" * 32 + ".sig"


def test_sign_stores_one_layer_per_reference_that_verifies_with_the_key_only(key, stranger):
    reg = InMemoryRegistry()
    image = push_image(reg)
    refs = [f"{NAME}:v1-long", f"{NAME}:v1"]
    cosign.sign(reg, REPO, image.digest, refs, key)
    layers = signature_layers(reg, image.digest)
    assert [layer["mediaType"] for layer in layers] == [cosign.SIMPLE_SIGNING] * 2
    assert {layer["annotations"][cosign.KEY_ANNOTATION] for layer in layers} == {dsse.key_id(key.public_key())}
    assert cosign.signed_references(reg, REPO, image.digest, key.public_key()) == refs
    assert cosign.signed_references(reg, REPO, image.digest, stranger.public_key()) == []
    config = json.loads(reg.get_blob(REPO, reg.manifest(REPO, cosign.signature_tag(image.digest)).body["config"]
                                     ["digest"]))
    assert config["rootfs"]["diff_ids"] == [layer["digest"] for layer in layers]


def test_signing_again_replaces_the_keys_own_signatures_and_keeps_another_keys(key, stranger):
    """Key rotation: both keys' signatures stand side by side; a re-run of publish does not pile up copies."""
    reg = InMemoryRegistry()
    image = push_image(reg)
    cosign.sign(reg, REPO, image.digest, [f"{NAME}:v1"], key)
    cosign.sign(reg, REPO, image.digest, [f"{NAME}:v1"], stranger)
    cosign.sign(reg, REPO, image.digest, [f"{NAME}:v1"], key)
    assert len(signature_layers(reg, image.digest)) == 2
    for signer in (key, stranger):
        assert cosign.signed_references(reg, REPO, image.digest, signer.public_key()) == [f"{NAME}:v1"]


def test_a_changed_payload_or_a_signature_for_another_digest_does_not_count(key):
    reg = InMemoryRegistry()
    image, other = push_image(reg), push_image(reg, "other", b"another image")
    cosign.sign(reg, REPO, other.digest, [f"{NAME}:other"], key)
    # other's valid signature copied to image's signature tag: it names other's digest.
    reg.tags[(REPO, cosign.signature_tag(image.digest))] = reg.tags[(REPO, cosign.signature_tag(other.digest))]
    assert cosign.signed_references(reg, REPO, image.digest, key.public_key()) == []
    # A payload edited after signing (its blob replaced under the layer's digest): the signature fails.
    layer = signature_layers(reg, other.digest)[0]
    edited = cosign.payload(f"{NAME}:evil", other.digest)
    reg.blobs[(REPO, layer["digest"])] = edited
    assert cosign.signed_references(reg, REPO, other.digest, key.public_key()) == []
    # Unreadable annotations are skipped, not a traceback.
    layer["annotations"][cosign.SIGNATURE_ANNOTATION] = "not base64!"
    assert cosign.signed_references(reg, REPO, other.digest, key.public_key()) == []


def test_a_signature_tag_that_is_not_an_oci_manifest_is_a_clear_error(key):
    reg = InMemoryRegistry()
    image = push_image(reg)
    reg.tags[(REPO, cosign.signature_tag(image.digest))] = image.digest  # a docker image manifest there
    with pytest.raises(PublishError, match="not a cosign signature manifest"):
        cosign.sign(reg, REPO, image.digest, [f"{NAME}:v1"], key)


def test_a_payload_signed_by_hand_with_the_spec_verifies(key):
    """Against the spec, not our helper: the signature is over the payload bytes, base64 in the annotation."""
    reg = InMemoryRegistry()
    image = push_image(reg)
    cosign.sign(reg, REPO, image.digest, [f"{NAME}:v1"], key)
    layer = signature_layers(reg, image.digest)[0]
    data = reg.get_blob(REPO, layer["digest"])
    signature = base64.b64decode(layer["annotations"]["dev.cosignproject.cosign/signature"])
    assert data == cosign.payload(f"{NAME}:v1", image.digest)
    if hasattr(key, "curve"):
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        key.public_key().verify(signature, data, ec.ECDSA(hashes.SHA256()))
    else:
        key.public_key().verify(signature, data)


def _attested(reg: InMemoryRegistry, image, key) -> None:
    attach(reg, image, sbom_statement(image.digest), key)
    attach(reg, image, provenance_statement(image.digest), key)


def test_verify_needs_an_image_signature_for_the_reference_asked_for(key):
    reg = InMemoryRegistry()
    image = push_image(reg)
    _attested(reg, image, key)
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", key.public_key())
    assert str(info.value) == f"{NAME}:v1: not signed for this reference (no image signature by this key)"
    cosign.sign(reg, REPO, image.digest, [f"{NAME}:v1-long"], key)
    cosign.sign(reg, REPO, image.digest, [f"{NAME}:v1-long", f"{NAME}:v1-other"], key)
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", key.public_key())
    assert str(info.value) == (f"{NAME}:v1: not signed for this reference (it is signed for {NAME}:v1-long, "
                               f"{NAME}:v1-other)")
    # By digest, a signature for any tag of the repository counts; another repository's does not.
    assert verify(reg, REPO, NAME, image.digest, key.public_key()).signed_for == [f"{NAME}:v1-long",
                                                                                   f"{NAME}:v1-other"]
    cosign.sign(reg, REPO, image.digest, [f"{NAME}-copy:v1"], key)
    assert verify(reg, REPO, NAME, image.digest, key.public_key()).signed_for[-1] == f"{NAME}-copy:v1"
    other = push_image(reg, "w", b"w")
    _attested(reg, other, key)
    cosign.sign(reg, REPO, other.digest, [f"{NAME}-copy:w"], key)
    with pytest.raises(VerificationFailed, match="not signed for this reference"):
        verify(reg, REPO, NAME, other.digest, key.public_key())


def test_a_half_pair_is_made_whole_with_a_new_key(tmp_path):
    private, public = tmp_path / "demo.key", tmp_path / "demo.pub"
    public.write_text("left over")
    dsse.make_key_pair(private, public)
    assert dsse.key_id(dsse.load_private_key(private).public_key()) == dsse.key_id(dsse.load_public_key(public))


def test_the_demos_key_pair_is_readable_by_its_owner_only_and_kept(tmp_path):
    private, public = tmp_path / "a" / "b" / "demo.key", tmp_path / "a" / "b" / "demo.pub"
    dsse.make_key_pair(private, public)
    assert private.stat().st_mode & 0o777 == 0o600
    key, pub = dsse.load_private_key(private), dsse.load_public_key(public)
    assert dsse.key_id(key.public_key()) == dsse.key_id(pub)
    before = private.read_bytes()
    dsse.make_key_pair(private, public)  # an existing pair is kept: signatures made with it stay valid
    assert private.read_bytes() == before
