"""The attestation contract (builder/attest/), each part held by a test that fails when it breaks:

1. DSSE: the signature is over DSSE's pre-authentication encoding (PAE), and our envelopes interoperate
   with an independent implementation of the spec, securesystemslib's DSSE, both ways, for ECDSA P-256
   and Ed25519 keys; a changed payload, payloadType or signature is refused by both implementations.
2. A signed statement counts only for the image digest it names as its subject.
3. Verification requires a signed provenance and a signed SBOM (with components) for the digest.

verify() and the referrer code (referrers.py) talk to a registry: InMemoryRegistry below stands in for
builder.registry.api.RegistryApi, with the methods attest/ calls and a registry's checks on what a
manifest references. tests/integration/test_attest.py runs the same code against a real registry.

securesystemslib pairs a signature with a key by keyid (not the DSSE spec's rule: the keyid is an
unauthenticated hint), so its verification key is built with our keyid (dsse.key_id).
"""
from __future__ import annotations

import base64
import copy
import hashlib
import json

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa, x25519
from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import VerificationError
from securesystemslib.signer import CryptoSigner, SSlibKey

from builder.attest import cosign, dsse, referrers
from builder.attest.provenance import CYCLONEDX, SLSA_PROVENANCE, statement
from builder.attest.sbom import document
from builder.attest.signing import REQUIRED, Verified, verify
from builder.errors import ConfigError, PublishError, VerificationFailed
from builder.registry.api import Manifest

IN_TOTO = "application/vnd.in-toto+json"
DSSE_ENVELOPE = "application/vnd.dsse.envelope.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
REPO = "mopt/minilm-embed"
NAME = "registry.test:5000/mopt/minilm-embed"
KINDS = ["ecdsa-p256", "ed25519"]


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def new_key(kind: str):
    return ec.generate_private_key(ec.SECP256R1()) if kind == "ecdsa-p256" else ed25519.Ed25519PrivateKey.generate()


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def key(kind):
    return new_key(kind)


@pytest.fixture
def stranger(kind):
    return new_key(kind)


# --------------------------------------------------------------------------- securesystemslib, the reference
def sslib_sign(payload: bytes, payload_type: str, *private_keys) -> dict:
    """An envelope made by securesystemslib's DSSE (one signature per key, in order)."""
    envelope = Envelope(payload, payload_type, {})
    for private_key in private_keys:
        envelope.sign(CryptoSigner(private_key))
    return envelope.to_dict()


def sslib_verifies(envelope: dict, public_key, keyid: str | None = None) -> bool:
    """Whether securesystemslib's DSSE accepts ENVELOPE as signed by PUBLIC_KEY (under KEYID, default
    the keyid our envelopes carry)."""
    sslib_key = SSlibKey.from_crypto(public_key, keyid=keyid or dsse.key_id(public_key))
    try:
        Envelope.from_dict(copy.deepcopy(envelope)).verify([sslib_key], 1)
    except VerificationError:
        return False
    return True


def tampered(envelope: dict, what: str) -> dict:
    out = copy.deepcopy(envelope)
    if what == "payload":  # the same statement but for its predicate, encoded the same way
        stmt = json.loads(base64.b64decode(out["payload"]))
        out["payload"] = b64(json.dumps(dict(stmt, predicate={"changed": True}), sort_keys=True,
                                        separators=(",", ":")).encode())
        assert out["payload"] != envelope["payload"]
    elif what == "payloadType":
        out["payloadType"] = "application/json" if out["payloadType"] == IN_TOTO else IN_TOTO
    elif what == "signature":
        sig = bytearray(base64.b64decode(out["signatures"][0]["sig"]))
        sig[len(sig) // 2] ^= 0x01
        out["signatures"][0]["sig"] = b64(bytes(sig))
    return out


DIGEST = "sha256:" + "ab" * 32
OTHER_DIGEST = "sha256:" + "cd" * 32


def a_statement(digest: str = DIGEST) -> dict:
    return statement(NAME, digest, SLSA_PROVENANCE, {"buildDefinition": {"buildType": "https://mopt.dev/build/v1"}})


# --------------------------------------------------------------------------- 1. DSSE: PAE and interop
@pytest.mark.parametrize("payload_type, payload", [
    (IN_TOTO, b'{"_type":"https://in-toto.io/Statement/v1"}'),
    ("http://example.com/HelloWorld", b"hello world"),
    ("", b""),
    ("t\u00ffpe with spaces", b"1 2 DSSEv1 \x00\xff"),
])
def test_pae_is_the_specs_encoding(payload_type, payload):
    """Lengths in bytes (of the UTF-8 type), as decimal ASCII, with single spaces: securesystemslib's
    PAE byte for byte."""
    assert dsse.pae(payload_type, payload) == Envelope(payload, payload_type, {}).pae()
    kind = payload_type.encode()
    assert dsse.pae(payload_type, payload) == b"DSSEv1 " + str(len(kind)).encode() + b" " + kind + b" " + \
        str(len(payload)).encode() + b" " + payload


def test_pae_of_the_specs_example():
    assert dsse.pae("http://example.com/HelloWorld", b"hello world") == \
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"


def test_the_signature_is_over_the_pae_not_the_payload(key):
    stmt = a_statement()
    envelope = dsse.sign(stmt, key)
    payload = base64.b64decode(envelope["payload"], validate=True)
    signature = base64.b64decode(envelope["signatures"][0]["sig"], validate=True)
    assert envelope["payloadType"] == IN_TOTO and len(envelope["signatures"]) == 1
    # The payload is the statement as canonical JSON (sorted keys, no spaces): what is signed is stable.
    assert payload == json.dumps(stmt, sort_keys=True, separators=(",", ":")).encode()

    def check(message: bytes) -> None:
        if isinstance(key, ed25519.Ed25519PrivateKey):
            key.public_key().verify(signature, message)
        else:
            key.public_key().verify(signature, message, ec.ECDSA(hashes.SHA256()))

    check(Envelope(payload, IN_TOTO, {}).pae())  # the PAE as securesystemslib computes it
    for not_signed in (payload, envelope["payload"].encode(), Envelope(payload, "application/json", {}).pae()):
        with pytest.raises(InvalidSignature):
            check(not_signed)


def test_key_id_is_the_sha256_of_the_public_keys_der(key):
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert dsse.key_id(key.public_key()) == "sha256:" + hashlib.sha256(der).hexdigest()
    assert dsse.sign(a_statement(), key)["signatures"][0]["keyid"] == dsse.key_id(key.public_key())


def test_our_envelope_verifies_with_securesystemslib(key, stranger):
    envelope = dsse.sign(a_statement(), key)
    assert sslib_verifies(envelope, key.public_key())
    # Another key, even one that claims our keyid, does not verify it.
    assert not sslib_verifies(envelope, stranger.public_key(), keyid=dsse.key_id(key.public_key()))
    assert not sslib_verifies(envelope, stranger.public_key())


def test_an_envelope_signed_by_two_keys_opens_with_either(key, stranger):
    """A key rotation signs with the old and the new key: one envelope, a signature each, in order; each key
    alone verifies it (securesystemslib agrees), a third does not."""
    envelope = dsse.sign(a_statement(), key, stranger)
    assert [s["keyid"] for s in envelope["signatures"]] == [dsse.key_id(k.public_key()) for k in (key, stranger)]
    for signer in (key, stranger):
        assert dsse.open_envelope(envelope, signer.public_key()) == a_statement()
        assert sslib_verifies(envelope, signer.public_key())
    third = new_key("ed25519")
    assert dsse.open_envelope(envelope, third.public_key()) is None
    with pytest.raises(ValueError) as caught:
        dsse.sign(a_statement())
    assert str(caught.value) == "dsse.sign needs at least one key"


@pytest.mark.parametrize("payload", [
    b'{"_type": "https://in-toto.io/Statement/v1", "subject": [], "predicateType": "x", "predicate": {}}',
    b'{"b":1,"a":[1,2,{"c":"\\u00e9"}]}',
])
def test_a_securesystemslib_envelope_opens_with_open_envelope(key, stranger, payload):
    """Whatever JSON object the payload holds (spacing, key order): the statement is the payload parsed."""
    envelope = sslib_sign(payload, IN_TOTO, key)
    assert dsse.open_envelope(envelope, key.public_key()) == json.loads(payload)
    assert dsse.open_envelope(envelope, stranger.public_key()) is None


@pytest.mark.parametrize("signed_by", ["mopt", "securesystemslib"])
@pytest.mark.parametrize("what", ["payload", "payloadType", "signature"])
def test_a_tampered_envelope_is_refused_by_both(key, signed_by, what):
    stmt = a_statement()
    if signed_by == "mopt":
        envelope = dsse.sign(stmt, key)
    else:
        envelope = sslib_sign(json.dumps(stmt).encode(), IN_TOTO, key)
    # Untouched, both accept it.
    assert dsse.open_envelope(envelope, key.public_key()) == stmt
    assert sslib_verifies(envelope, key.public_key(), keyid=envelope["signatures"][0]["keyid"])
    changed = tampered(envelope, what)
    assert dsse.open_envelope(changed, key.public_key()) is None
    assert not sslib_verifies(changed, key.public_key(), keyid=envelope["signatures"][0]["keyid"])


def test_the_payload_type_is_signed(key):
    """An envelope signed for another payloadType, relabelled in-toto, does not open: the type is in the PAE
    (the check is the signature's, not only the type's)."""
    payload = json.dumps(a_statement()).encode()
    envelope = sslib_sign(payload, "application/json", key)
    relabelled = dict(envelope, payloadType=IN_TOTO)
    assert dsse.open_envelope(relabelled, key.public_key()) is None
    assert not sslib_verifies(relabelled, key.public_key(), keyid=envelope["signatures"][0]["keyid"])
    assert dsse.open_envelope(envelope, key.public_key()) is None  # not an in-toto envelope
    assert dsse.open_envelope(sslib_sign(payload, IN_TOTO, key), key.public_key()) == a_statement()


def test_any_one_signature_by_the_key_opens_it(key, stranger, kind):
    """DSSE allows several signatures: the envelope opens when one of them is the key's, wherever it is."""
    third = new_key(kind)
    payload = json.dumps(a_statement()).encode()
    for signers in ((stranger, key), (key, stranger), (stranger, third, key)):
        envelope = sslib_sign(payload, IN_TOTO, *signers)
        assert len(envelope["signatures"]) == len(signers)
        assert dsse.open_envelope(envelope, key.public_key()) == a_statement()
    assert dsse.open_envelope(sslib_sign(payload, IN_TOTO, stranger, third), key.public_key()) is None
    ours = dsse.sign(a_statement(), key)
    doubled = dict(ours, signatures=[tampered(ours, "signature")["signatures"][0], ours["signatures"][0]])
    assert dsse.open_envelope(doubled, key.public_key()) == a_statement()


def test_a_signed_payload_that_is_not_a_json_object_does_not_open(key):
    """Validly signed (securesystemslib agrees) but not a statement: no statement comes out."""
    for payload in (b"not json", b"[1, 2]", b'"text"', b"\xff\xfe"):
        envelope = sslib_sign(payload, IN_TOTO, key)
        assert sslib_verifies(envelope, key.public_key(), keyid=envelope["signatures"][0]["keyid"])
        assert dsse.open_envelope(envelope, key.public_key()) is None


def _junk_inside(text: str) -> str:
    """TEXT with a character outside the base64 alphabet: a lenient decoder skips it, a strict one refuses."""
    out = text[:-4] + "!" + text[-4:]
    assert base64.b64decode(out) == base64.b64decode(text)
    return out


def _malformed(envelope: dict) -> list:
    sig = envelope["signatures"][0]
    return [
        None, "an envelope", [envelope], {},
        {k: v for k, v in envelope.items() if k != "payload"},
        {k: v for k, v in envelope.items() if k != "signatures"},
        {k: v for k, v in envelope.items() if k != "payloadType"},
        dict(envelope, payload=None),
        dict(envelope, payload=_junk_inside(envelope["payload"])),
        dict(envelope, signatures=None),
        dict(envelope, signatures=[]),
        dict(envelope, signatures=[{"keyid": sig["keyid"]}]),
        dict(envelope, signatures=[dict(sig, sig=None)]),
        dict(envelope, signatures=[dict(sig, sig=_junk_inside(sig["sig"]))]),
        dict(envelope, signatures=[dict(sig, sig="")]),
    ]


def test_a_malformed_envelope_is_refused_not_an_error(key):
    envelope = dsse.sign(a_statement(), key)
    assert dsse.open_envelope(envelope, key.public_key()) == a_statement()
    for i, bad in enumerate(_malformed(envelope)):
        assert dsse.open_envelope(bad, key.public_key()) is None, i


def test_keys_load_from_pem_files(tmp_path, key, stranger):
    private, public = tmp_path / "signer.key", tmp_path / "signer.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    loaded_private, loaded_public = dsse.load_private_key(private), dsse.load_public_key(public)
    assert dsse.key_id(loaded_private.public_key()) == dsse.key_id(key.public_key())
    assert dsse.key_id(loaded_public) == dsse.key_id(key.public_key())
    envelope = dsse.sign(a_statement(), loaded_private)
    assert dsse.open_envelope(envelope, loaded_public) == a_statement()
    assert sslib_verifies(envelope, key.public_key())
    assert dsse.load_public_key(str(public)) is not None and dsse.load_private_key(str(private)) is not None


def _pem_private(key, password: bytes | None = None) -> bytes:
    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def _pem_public(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.mark.parametrize("name, make_pem, message", [
    ("missing.key", None, "not an unencrypted PEM private key (FileNotFoundError)"),
    ("junk.key", lambda: b"not a key", "not an unencrypted PEM private key (ValueError)"),
    ("encrypted.key", lambda: _pem_private(ec.generate_private_key(ec.SECP256R1()), b"secret"),
     "not an unencrypted PEM private key (TypeError)"),
    ("public.key", lambda: _pem_public(ec.generate_private_key(ec.SECP256R1())),
     "not an unencrypted PEM private key (ValueError)"),
    ("p384.key", lambda: _pem_private(ec.generate_private_key(ec.SECP384R1())),
     "the signing key must be ECDSA P-256 or Ed25519"),
    ("rsa.key", lambda: _pem_private(rsa.generate_private_key(public_exponent=65537, key_size=1024)),
     "the signing key must be ECDSA P-256 or Ed25519"),
    ("ed448.key", lambda: _pem_private(ed448.Ed448PrivateKey.generate()),
     "the signing key must be ECDSA P-256 or Ed25519"),
    ("x25519.key", lambda: _pem_private(x25519.X25519PrivateKey.generate()),
     "the signing key must be ECDSA P-256 or Ed25519"),
])
def test_an_unusable_private_key_is_a_config_error(tmp_path, name, make_pem, message):
    path = tmp_path / name
    if make_pem:
        path.write_bytes(make_pem())
    with pytest.raises(ConfigError) as info:
        dsse.load_private_key(path)
    assert str(info.value) == f"{path}: {message}"


@pytest.mark.parametrize("name, make_pem, message", [
    ("missing.pub", None, "not a PEM public key (FileNotFoundError)"),
    ("junk.pub", lambda: b"not a key", "not a PEM public key (ValueError)"),
    ("private.pub", lambda: _pem_private(ec.generate_private_key(ec.SECP256R1())), "not a PEM public key (ValueError)"),
    ("rsa.pub", lambda: _pem_public(rsa.generate_private_key(public_exponent=65537, key_size=1024)),
     "the key must be ECDSA P-256 or Ed25519"),
    ("ed448.pub", lambda: _pem_public(ed448.Ed448PrivateKey.generate()), "the key must be ECDSA P-256 or Ed25519"),
])
def test_an_unusable_public_key_is_a_config_error(tmp_path, name, make_pem, message):
    path = tmp_path / name
    if make_pem:
        path.write_bytes(make_pem())
    with pytest.raises(ConfigError) as info:
        dsse.load_public_key(path)
    assert str(info.value) == f"{path}: {message}"


# --------------------------------------------------------------------------- the registry stand-in
class InMemoryRegistry:
    """Stands in for builder.registry.api.RegistryApi (the methods attest/ calls) over dicts, with what a
    registry checks: a manifest's blobs and an index's manifests exist with the sizes its descriptors
    state, and content is addressed by its sha256. The integration tests cover the real registry."""

    def __init__(self) -> None:
        self.blobs: dict[tuple[str, str], bytes] = {}
        self.manifests: dict[tuple[str, str], Manifest] = {}
        self.tags: dict[tuple[str, str], str] = {}

    def upload_blob(self, repo: str, data: bytes) -> str:
        digest = sha256(data)
        self.blobs[(repo, digest)] = data
        return digest

    def get_blob(self, repo: str, digest: str, max_bytes: int = 1 << 24) -> bytes:
        if (repo, digest) not in self.blobs:
            raise PublishError(f"GET blob {repo}@{digest} answered HTTP 404")
        if len(self.blobs[(repo, digest)]) > max_bytes:  # as RegistryApi.get_blob refuses it
            raise PublishError(f"blob {repo}@{digest} is larger than {max_bytes} bytes")
        return self.blobs[(repo, digest)]

    def put_manifest_by_digest(self, repo: str, body: dict) -> Manifest:
        for desc in [body["config"], *body["layers"]] if "config" in body else []:
            assert len(self.blobs[(repo, desc["digest"])]) == desc["size"], desc
        for desc in body.get("manifests", []):
            assert len(self.manifests[(repo, desc["digest"])].raw) == desc["size"], desc
        raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        m = Manifest(sha256(raw), body["mediaType"], body, raw)
        self.manifests[(repo, m.digest)] = m
        return m

    def put_manifest(self, repo: str, tag: str, m: Manifest) -> str:
        assert self.manifests[(repo, m.digest)] == m
        self.tags[(repo, tag)] = m.digest
        return m.digest

    def manifest(self, repo: str, reference: str) -> Manifest | None:
        digest = reference if reference.startswith("sha256:") else self.tags.get((repo, reference))
        return self.manifests.get((repo, digest))


def push_image(reg: InMemoryRegistry, tag: str = "v1", content: bytes = b"layer") -> Manifest:
    config = b'{"architecture":"amd64","os":"linux"}'
    body = {"schemaVersion": 2, "mediaType": DOCKER_MANIFEST,
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                       "digest": reg.upload_blob(REPO, config), "size": len(config)},
            "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                        "digest": reg.upload_blob(REPO, content), "size": len(content)}]}
    image = reg.put_manifest_by_digest(REPO, body)
    reg.put_manifest(REPO, tag, image)
    return image


def sbom_statement(digest: str, components: int = 2) -> dict:
    debs = [(f"lib{i}", "1.0", "amd64") for i in range(components)]
    return statement(NAME, digest, CYCLONEDX, document(f"{NAME}@{digest}", digest, {"ID": "debian"}, debs, []))


def provenance_statement(digest: str) -> dict:
    return statement(NAME, digest, SLSA_PROVENANCE, {"buildDefinition": {"buildType": "https://mopt.dev/build/v1"}})


def attach(reg: InMemoryRegistry, image: Manifest, stmt: dict, key) -> str:
    return referrers.attach(reg, REPO, image, stmt["predicateType"], dsse.sign(stmt, key))


def attach_envelope(reg: InMemoryRegistry, image: Manifest, predicate_type: str, envelope) -> str:
    return referrers.attach(reg, REPO, image, predicate_type, envelope)


def sign_tags(reg: InMemoryRegistry, image: Manifest, key) -> str:
    """The image signature publish makes (cosign's format), for every tag that names IMAGE."""
    tags = sorted(tag for (repo, tag), digest in reg.tags.items() if repo == REPO and digest == image.digest)
    return cosign.sign(reg, REPO, image.digest, [f"{NAME}:{tag}" for tag in tags], key)


# --------------------------------------------------------------------------- referrers: the registry side
def test_attach_writes_an_oci_artifact_naming_the_image_as_subject(key):
    reg = InMemoryRegistry()
    image = push_image(reg)
    envelope = dsse.sign(sbom_statement(image.digest), key)
    artifact_digest = referrers.attach(reg, REPO, image, CYCLONEDX, envelope)
    artifact = reg.manifest(REPO, artifact_digest)
    layer = json.dumps(envelope, sort_keys=True).encode()
    assert artifact.body == {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": DSSE_ENVELOPE,
        "config": {"mediaType": OCI_EMPTY, "digest": sha256(b"{}"), "size": 2},
        "layers": [{"mediaType": DSSE_ENVELOPE, "digest": sha256(layer), "size": len(layer)}],
        "subject": {"mediaType": DOCKER_MANIFEST, "digest": image.digest, "size": len(image.raw)},
        "annotations": {"dev.mopt.predicate-type": CYCLONEDX}}
    assert reg.get_blob(REPO, sha256(b"{}")) == b"{}"
    assert json.loads(reg.get_blob(REPO, sha256(layer))) == envelope
    # The OCI referrers tag schema: an index tagged sha256-<hex> lists the artifact.
    assert referrers.referrers_tag(image.digest) == "sha256-" + image.digest.split(":")[1]
    index = reg.manifest(REPO, "sha256-" + image.digest.split(":")[1])
    assert index.body == {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        {"mediaType": OCI_MANIFEST, "digest": artifact_digest, "size": len(artifact.raw),
         "artifactType": DSSE_ENVELOPE, "annotations": {"dev.mopt.predicate-type": CYCLONEDX}}]}
    assert referrers.envelopes(reg, REPO, image.digest) == [(artifact_digest, envelope)]


def test_attach_adds_to_the_referrers_index_and_replaces_a_repeat(key):
    reg = InMemoryRegistry()
    image = push_image(reg)
    tag = "sha256-" + image.digest.split(":")[1]
    # A referrer another tool listed stays listed.
    foreign = reg.put_manifest_by_digest(REPO, {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                                                "artifactType": "application/spdx+json", "config": {
                                                    "mediaType": OCI_EMPTY, "digest": reg.upload_blob(REPO, b"{}"),
                                                    "size": 2}, "layers": []})
    foreign_entry = {"mediaType": OCI_MANIFEST, "digest": foreign.digest, "size": len(foreign.raw),
                     "artifactType": "application/spdx+json"}
    reg.put_manifest(REPO, tag, reg.put_manifest_by_digest(REPO, {"schemaVersion": 2, "mediaType": OCI_INDEX,
                                                                  "manifests": [foreign_entry]}))
    sbom_envelope = dsse.sign(sbom_statement(image.digest), key)
    first = referrers.attach(reg, REPO, image, CYCLONEDX, sbom_envelope)
    second = attach(reg, image, provenance_statement(image.digest), key)
    again = referrers.attach(reg, REPO, image, CYCLONEDX, sbom_envelope)
    assert again == first and len({first, second, foreign.digest}) == 3
    listed = reg.manifest(REPO, tag).body["manifests"]
    assert [e["digest"] for e in listed] == [foreign.digest, second, first]
    assert listed[0] == foreign_entry
    assert [e["annotations"]["dev.mopt.predicate-type"] for e in listed[1:]] == [SLSA_PROVENANCE, CYCLONEDX]
    assert [d for d, _ in referrers.envelopes(reg, REPO, image.digest)] == [second, first]


def test_attach_to_an_empty_referrers_index(key):
    """An index with no `manifests` (OCI allows an empty list to be left out) gets the artifact as its one
    entry."""
    reg = InMemoryRegistry()
    image = push_image(reg)
    reg.put_manifest(REPO, referrers.referrers_tag(image.digest),
                     reg.put_manifest_by_digest(REPO, {"schemaVersion": 2, "mediaType": OCI_INDEX}))
    made = attach(reg, image, sbom_statement(image.digest), key)
    listed = reg.manifest(REPO, referrers.referrers_tag(image.digest)).body["manifests"]
    assert [e["digest"] for e in listed] == [made]


def test_envelopes_of_an_image_without_referrers_is_empty():
    reg = InMemoryRegistry()
    image = push_image(reg)
    assert referrers.envelopes(reg, REPO, image.digest) == []
    reg.put_manifest(REPO, referrers.referrers_tag(image.digest),
                     reg.put_manifest_by_digest(REPO, {"schemaVersion": 2, "mediaType": OCI_INDEX}))
    assert referrers.envelopes(reg, REPO, image.digest) == []


def _artifact(reg: InMemoryRegistry, layers: list[tuple[str, bytes]], artifact_type: str = DSSE_ENVELOPE) -> Manifest:
    return reg.put_manifest_by_digest(REPO, {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": artifact_type,
        "config": {"mediaType": OCI_EMPTY, "digest": reg.upload_blob(REPO, b"{}"), "size": 2},
        "layers": [{"mediaType": media, "digest": reg.upload_blob(REPO, data), "size": len(data)}
                   for media, data in layers]})


def _list(reg: InMemoryRegistry, image: Manifest, entries: list[dict]) -> None:
    index = reg.put_manifest_by_digest(REPO, {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries})
    reg.put_manifest(REPO, referrers.referrers_tag(image.digest), index)


def _entry(m: Manifest, **extra) -> dict:
    return {"mediaType": OCI_MANIFEST, "digest": m.digest, "size": len(m.raw), **extra}


def test_envelopes_reads_the_first_envelope_layer_of_each_dsse_referrer(key):
    reg = InMemoryRegistry()
    image = push_image(reg)
    one, two = (dsse.sign(s, key) for s in (sbom_statement(image.digest), provenance_statement(image.digest)))
    mixed = _artifact(reg, [("application/octet-stream", b'{"not": "an envelope"}'),
                            (DSSE_ENVELOPE, json.dumps(one).encode()), (DSSE_ENVELOPE, json.dumps(two).encode())])
    unreadable = _artifact(reg, [(DSSE_ENVELOPE, b"{not json")])
    undecodable = _artifact(reg, [(DSSE_ENVELOPE, b"\xff\xfe")])
    other_type = _artifact(reg, [(DSSE_ENVELOPE, json.dumps(two).encode())], artifact_type="application/spdx+json")
    no_layer = _artifact(reg, [])
    _list(reg, image, [_entry(other_type, artifactType="application/spdx+json"), _entry(mixed),
                       _entry(mixed, artifactType=DSSE_ENVELOPE), _entry(unreadable, artifactType=DSSE_ENVELOPE),
                       _entry(no_layer, artifactType=DSSE_ENVELOPE), _entry(undecodable, artifactType=DSSE_ENVELOPE)])
    assert referrers.envelopes(reg, REPO, image.digest) == [(mixed.digest, one), (unreadable.digest, None),
                                                             (undecodable.digest, None)]


def test_a_dsse_referrer_without_layers_has_no_envelope(key):
    reg = InMemoryRegistry()
    image = push_image(reg)
    body = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": DSSE_ENVELOPE,
            "config": {"mediaType": OCI_EMPTY, "digest": reg.upload_blob(REPO, b"{}"), "size": 2}}
    raw = json.dumps(body).encode()
    reg.manifests[(REPO, sha256(raw))] = bare = Manifest(sha256(raw), OCI_MANIFEST, body, raw)
    envelope = dsse.sign(sbom_statement(image.digest), key)
    whole = _artifact(reg, [(DSSE_ENVELOPE, json.dumps(envelope).encode())])
    _list(reg, image, [_entry(bare, artifactType=DSSE_ENVELOPE), _entry(whole, artifactType=DSSE_ENVELOPE)])
    assert referrers.envelopes(reg, REPO, image.digest) == [(whole.digest, envelope)]


def test_a_listed_referrer_that_is_missing_is_a_publish_error(key):
    reg = InMemoryRegistry()
    image = push_image(reg)
    gone = "sha256:" + "ee" * 32
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX,
             "manifests": [{"mediaType": OCI_MANIFEST, "digest": gone, "size": 10, "artifactType": DSSE_ENVELOPE}]}
    raw = json.dumps(index).encode()
    reg.manifests[(REPO, sha256(raw))] = Manifest(sha256(raw), OCI_INDEX, index, raw)
    reg.tags[(REPO, referrers.referrers_tag(image.digest))] = sha256(raw)
    with pytest.raises(PublishError) as info:
        referrers.envelopes(reg, REPO, image.digest)
    assert str(info.value) == f"{REPO}: referrer {gone} of {image.digest} is listed but missing"


# --------------------------------------------------------------------------- 2 and 3. verify()
def test_verify_accepts_a_signed_sbom_and_provenance_for_the_digest(key):
    reg = InMemoryRegistry()
    image = push_image(reg)
    push_image(reg, "other", b"another image")
    sbom_artifact = attach(reg, image, sbom_statement(image.digest), key)
    provenance_artifact = attach(reg, image, provenance_statement(image.digest), key)
    sign_tags(reg, image, key)
    expected = Verified(image.digest, dsse.key_id(key.public_key()),
                        {CYCLONEDX: sbom_artifact, SLSA_PROVENANCE: provenance_artifact}, [], [f"{NAME}:v1"])
    assert verify(reg, REPO, NAME, "v1", key.public_key()) == expected
    assert verify(reg, REPO, NAME, image.digest, key.public_key()) == expected


def test_verify_accepts_envelopes_signed_by_securesystemslib(key):
    reg = InMemoryRegistry()
    image = push_image(reg)
    made = [attach_envelope(reg, image, s["predicateType"], sslib_sign(json.dumps(s).encode(), IN_TOTO, key))
            for s in (sbom_statement(image.digest), provenance_statement(image.digest))]
    sign_tags(reg, image, key)
    result = verify(reg, REPO, NAME, "v1", key.public_key())
    assert result.found == {CYCLONEDX: made[0], SLSA_PROVENANCE: made[1]} and result.rejected == []


def test_verify_of_an_image_not_in_the_registry_fails(key):
    reg = InMemoryRegistry()
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", key.public_key())
    assert str(info.value) == f"{NAME}:v1 is not in the registry"


def test_a_statement_about_another_digest_is_refused(key):
    """The envelopes are valid (they verify the image they name), but attached to another image they do
    not count for it: the signature is bound to the digest in the statement's subject."""
    reg = InMemoryRegistry()
    image, other = push_image(reg), push_image(reg, "other", b"another image")
    for target in (image, other):
        for stmt in (sbom_statement(other.digest), provenance_statement(other.digest)):
            attach(reg, target, stmt, key)
        sign_tags(reg, target, key)
    assert set(verify(reg, REPO, NAME, "other", key.public_key()).found) == {CYCLONEDX, SLSA_PROVENANCE}
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", key.public_key())
    message = str(info.value)
    assert message.startswith(f"{NAME}@{image.digest}: no valid signed provenance or SBOM (")
    assert message.count(f"signed for {other.digest}, not {image.digest}") == 2


@pytest.mark.parametrize("wrong", sorted(REQUIRED))
def test_each_attestation_is_bound_to_the_digest(key, wrong):
    reg = InMemoryRegistry()
    image = push_image(reg)
    for make in (sbom_statement, provenance_statement):
        stmt = make(image.digest)
        if stmt["predicateType"] == wrong:
            stmt = make(OTHER_DIGEST)
        attach(reg, image, stmt, key)
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", key.public_key())
    assert f"no valid signed {REQUIRED[wrong]} (" in str(info.value)
    assert f"signed for {OTHER_DIGEST}, not {image.digest}" in str(info.value)


def _with_subject(stmt: dict, subject) -> dict:
    out = dict(stmt)
    if subject is _ABSENT:
        del out["subject"]
    else:
        out["subject"] = subject
    return out


_ABSENT = object()


@pytest.mark.parametrize("subject", [
    _ABSENT, [], "IMAGE_HEX", ["IMAGE_HEX"], [{"name": NAME}], [{"name": NAME, "digest": {}}],
    [{"name": NAME, "digest": {"sha512": "IMAGE_HEX"}}],
    [{"name": NAME, "digest": {"SHA256": "IMAGE_HEX"}}],
    [{"name": NAME, "digest": {"sha256": "sha256:IMAGE_HEX"}}],  # the hex alone, as in-toto has it
    [{"name": NAME, "digest": {"sha256": "IMAGE_HEX_TRUNCATED"}}],
    [{"name": NAME, "digest": {"sha256": "OTHER_HEX"}}],
], ids=lambda s: "absent" if s is _ABSENT else json.dumps(s)[:48])
def test_a_statement_without_the_image_digest_as_subject_is_refused(key, subject):
    reg = InMemoryRegistry()
    image = push_image(reg)
    hexdigest = image.digest.split(":")[1]
    if subject is not _ABSENT:
        subject = json.loads(json.dumps(subject).replace("IMAGE_HEX_TRUNCATED", hexdigest[:-1])
                             .replace("IMAGE_HEX", hexdigest).replace("OTHER_HEX", OTHER_DIGEST.split(":")[1]))
    attach(reg, image, provenance_statement(image.digest), key)
    artifact = attach(reg, image, _with_subject(sbom_statement(image.digest), subject), key)
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", key.public_key())
    assert str(info.value).startswith(f"{NAME}@{image.digest}: no valid signed SBOM ({artifact}: signed for ")
    assert str(info.value).endswith(f", not {image.digest})")


def test_a_refusal_names_every_subject_the_statement_was_signed_for(key):
    reg = InMemoryRegistry()
    image = push_image(reg)
    third = "sha256:" + "ef" * 32
    subjects = [{"name": "a", "digest": {"sha256": OTHER_DIGEST.split(":")[1]}},
                {"name": "b", "digest": {"sha256": third.split(":")[1]}}]
    artifact = attach(reg, image, _with_subject(provenance_statement(image.digest), subjects), key)
    attach(reg, image, sbom_statement(image.digest), key)
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", key.public_key())
    assert str(info.value) == (f"{NAME}@{image.digest}: no valid signed provenance "
                               f"({artifact}: signed for {OTHER_DIGEST}, {third}, not {image.digest})")


def test_a_statement_naming_the_image_among_several_subjects_counts(key):
    """in-toto: a statement may be about several artifacts; it counts for each one it names."""
    reg = InMemoryRegistry()
    image = push_image(reg)
    subjects = ["junk", {"name": "other", "digest": {"sha256": OTHER_DIGEST.split(":")[1]}},
                {"name": NAME, "digest": {"sha512": "00" * 64, "sha256": image.digest.split(":")[1]}}]
    made = [attach(reg, image, _with_subject(s, subjects), key)
            for s in (sbom_statement(image.digest), provenance_statement(image.digest))]
    sign_tags(reg, image, key)
    assert verify(reg, REPO, NAME, "v1", key.public_key()).found == {CYCLONEDX: made[0], SLSA_PROVENANCE: made[1]}


@pytest.mark.parametrize("present, missing", [
    ([CYCLONEDX], "provenance"),
    ([SLSA_PROVENANCE], "SBOM"),
    ([], "provenance or SBOM"),
])
def test_verify_requires_the_provenance_and_the_sbom(key, present, missing):
    reg = InMemoryRegistry()
    image = push_image(reg)
    makers = {CYCLONEDX: sbom_statement, SLSA_PROVENANCE: provenance_statement}
    for predicate_type in present:
        attach(reg, image, makers[predicate_type](image.digest), key)
    # Another, valid attestation does not stand in for a required one.
    attach(reg, image, statement(NAME, image.digest, "https://spdx.dev/Document", {"spdxVersion": "SPDX-2.3"}), key)
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", key.public_key())
    assert str(info.value) == f"{NAME}@{image.digest}: no valid signed {missing} (no attestation attached)"


def test_required_attestations_are_the_sbom_and_the_provenance():
    assert REQUIRED == {SLSA_PROVENANCE: "provenance", CYCLONEDX: "SBOM"}
    assert (SLSA_PROVENANCE, CYCLONEDX) == ("https://slsa.dev/provenance/v1", "https://cyclonedx.org/bom")


def test_a_statement_without_a_predicate_type_counts_for_no_required_one(key):
    """It is listed (under the empty type, as `mopt verify --format json` shows it) but is neither the SBOM
    nor the provenance."""
    reg = InMemoryRegistry()
    image = push_image(reg)
    untyped = provenance_statement(image.digest)
    del untyped["predicateType"]
    made = attach_envelope(reg, image, SLSA_PROVENANCE, dsse.sign(untyped, key))
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", key.public_key())
    assert str(info.value) == f"{NAME}@{image.digest}: no valid signed provenance or SBOM (no attestation attached)"
    attach(reg, image, sbom_statement(image.digest), key)
    attach(reg, image, provenance_statement(image.digest), key)
    sign_tags(reg, image, key)
    assert verify(reg, REPO, NAME, "v1", key.public_key()).found[""] == made


def test_verify_with_no_referrers_at_all_fails(key):
    reg = InMemoryRegistry()
    push_image(reg)
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", key.public_key())
    assert "no valid signed provenance or SBOM (no attestation attached)" in str(info.value)


# A predicate that is not an object at all (a list, a string, a number) is a refusal too, never a crash.
@pytest.mark.parametrize("predicate", [_ABSENT, {}, {"components": None}, {"components": {"a": 1}}, {"x": []},
                                       ["not", "an", "object"], "text", 7],
                         ids=["absent", "empty", "none", "dict", "other-key", "list", "string", "number"])
def test_an_sbom_without_a_components_list_is_refused(key, predicate):
    reg = InMemoryRegistry()
    image = push_image(reg)
    attach(reg, image, provenance_statement(image.digest), key)
    stmt = sbom_statement(image.digest)
    if predicate is _ABSENT:
        del stmt["predicate"]
    else:
        stmt["predicate"] = predicate
    artifact = attach(reg, image, stmt, key)
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", key.public_key())
    assert str(info.value) == (f"{NAME}@{image.digest}: no valid signed SBOM "
                               f"({artifact}: an SBOM statement without components)")


def test_a_refused_sbom_does_not_stop_the_search(key):
    """An SBOM without components listed before a valid one: the valid one (and what follows) counts."""
    reg = InMemoryRegistry()
    image = push_image(reg)
    bad = sbom_statement(image.digest)
    bad["predicate"] = {}
    refused = attach(reg, image, bad, key)
    good = attach(reg, image, sbom_statement(image.digest), key)
    provenance_artifact = attach(reg, image, provenance_statement(image.digest), key)
    sign_tags(reg, image, key)
    result = verify(reg, REPO, NAME, "v1", key.public_key())
    assert result.found == {CYCLONEDX: good, SLSA_PROVENANCE: provenance_artifact}
    assert result.rejected == [f"{refused}: an SBOM statement without components"]


def test_an_sbom_with_no_components_counts(key):
    """An image without a shell gets an SBOM whose components list is empty (sbom.py): it still counts."""
    reg = InMemoryRegistry()
    image = push_image(reg)
    made = attach(reg, image, sbom_statement(image.digest, components=0), key)
    attach(reg, image, provenance_statement(image.digest), key)
    sign_tags(reg, image, key)
    assert verify(reg, REPO, NAME, "v1", key.public_key()).found[CYCLONEDX] == made


def test_attestations_signed_by_another_key_or_changed_do_not_count(key, stranger):
    reg = InMemoryRegistry()
    image = push_image(reg)
    by_stranger = attach(reg, image, sbom_statement(image.digest), stranger)
    changed = attach_envelope(reg, image, SLSA_PROVENANCE,
                              tampered(dsse.sign(provenance_statement(image.digest), key), "payload"))
    unreadable = _artifact(reg, [(DSSE_ENVELOPE, b"{not json")])
    index = reg.manifest(REPO, referrers.referrers_tag(image.digest)).body
    _list(reg, image, [*index["manifests"], _entry(unreadable, artifactType=DSSE_ENVELOPE)])
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", key.public_key())
    why = "not signed by this key (or changed after signing)"
    assert str(info.value) == (f"{NAME}@{image.digest}: no valid signed provenance or SBOM "
                               f"({by_stranger}: {why}; {changed}: {why}; {unreadable.digest}: {why})")
    # With the stranger's key, its SBOM counts (and the rest still does not).
    with pytest.raises(VerificationFailed) as info:
        verify(reg, REPO, NAME, "v1", stranger.public_key())
    assert str(info.value).startswith(f"{NAME}@{image.digest}: no valid signed provenance ({changed}: ")


def test_verified_lists_what_counted_and_what_did_not(key, stranger):
    """The first valid statement of each type counts; extra attestation types are listed; the rest are
    reported with why."""
    reg = InMemoryRegistry()
    image = push_image(reg)
    rejected_sbom = attach(reg, image, sbom_statement(OTHER_DIGEST), key)
    first_sbom = attach(reg, image, sbom_statement(image.digest), key)
    second_sbom = attach(reg, image, sbom_statement(image.digest, components=3), key)
    by_stranger = attach(reg, image, provenance_statement(image.digest), stranger)
    provenance_artifact = attach(reg, image, provenance_statement(image.digest), key)
    spdx = attach(reg, image, statement(NAME, image.digest, "https://spdx.dev/Document", {}), key)
    assert len({rejected_sbom, first_sbom, second_sbom, by_stranger, provenance_artifact, spdx}) == 6
    sign_tags(reg, image, key)
    result = verify(reg, REPO, NAME, "v1", key.public_key())
    assert result == Verified(image.digest, dsse.key_id(key.public_key()),
                              {CYCLONEDX: first_sbom, SLSA_PROVENANCE: provenance_artifact,
                               "https://spdx.dev/Document": spdx},
                              [f"{rejected_sbom}: signed for {OTHER_DIGEST}, not {image.digest}",
                               f"{by_stranger}: not signed by this key (or changed after signing)"], [f"{NAME}:v1"])


@pytest.mark.parametrize("subject", [
    [{"digest": "sha256:not-an-object"}],
    {"digest": {"sha256": "IMAGE_HEX"}},
    [["not", "an", "object"]],
])
def test_a_signed_statement_of_the_wrong_shape_is_refused_not_a_crash(key, subject):
    """verify() meets whatever a key holder signed: a subject that is not in-toto's shape is a refusal
    (VerificationFailed, exit 8), never an AttributeError."""
    reg = InMemoryRegistry()
    image = push_image(reg)
    subject = json.loads(json.dumps(subject).replace("IMAGE_HEX", image.digest.split(":")[1]))
    attach(reg, image, provenance_statement(image.digest), key)
    attach(reg, image, _with_subject(sbom_statement(image.digest), subject), key)
    with pytest.raises(VerificationFailed, match="no valid signed SBOM"):
        verify(reg, REPO, NAME, "v1", key.public_key())


def test_a_public_key_on_another_curve_is_refused(tmp_path):
    path = tmp_path / "p384.pub"
    path.write_bytes(_pem_public(ec.generate_private_key(ec.SECP384R1())))
    with pytest.raises(ConfigError, match="must be ECDSA P-256 or Ed25519"):
        dsse.load_public_key(path)
