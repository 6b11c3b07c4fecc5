"""builder.attest's pure parts: DSSE signing and opening with both key kinds, what makes an envelope
fail, the SBOM's purls per distribution, and the errors for unusable keys."""
from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from builder.attest import dsse
from builder.attest.provenance import SLSA_PROVENANCE, statement
from builder.attest.sbom import deb_purl, document, os_release, pypi_purl
from builder.errors import ConfigError

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize("make", [lambda: ec.generate_private_key(ec.SECP256R1()), ed25519.Ed25519PrivateKey.generate])
def test_a_signed_statement_opens_with_its_key_only(make):
    key, other = make(), make()
    stmt = statement("127.0.0.1:5000/mopt/x", DIGEST, SLSA_PROVENANCE, {"k": 1})
    envelope = dsse.sign(stmt, key)
    assert envelope["payloadType"] == dsse.IN_TOTO
    assert envelope["signatures"][0]["keyid"] == dsse.key_id(key.public_key())
    assert dsse.open_envelope(envelope, key.public_key()) == stmt
    assert dsse.open_envelope(envelope, other.public_key()) is None
    changed = dict(envelope, payload=base64.b64encode(json.dumps(dict(stmt, predicate={"k": 2})).encode()).decode())
    assert dsse.open_envelope(changed, key.public_key()) is None
    assert dsse.open_envelope(dict(envelope, payloadType="text/plain"), key.public_key()) is None
    assert dsse.open_envelope({"payload": "%%%", "signatures": []}, key.public_key()) is None
    assert dsse.open_envelope("not an envelope", key.public_key()) is None


def test_pae_is_dsse_v1():
    assert dsse.pae("t", b"ab") == b"DSSEv1 1 t 2 ab"


def test_unusable_keys_are_one_config_error(tmp_path):
    (tmp_path / "junk.pem").write_text("not a key")
    with pytest.raises(ConfigError, match="not an unencrypted PEM private key"):
        dsse.load_private_key(tmp_path / "junk.pem")
    with pytest.raises(ConfigError, match="not a PEM public key"):
        dsse.load_public_key(tmp_path / "junk.pem")
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = rsa_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    (tmp_path / "rsa.pem").write_bytes(pem)
    with pytest.raises(ConfigError, match="ECDSA P-256 or Ed25519"):
        dsse.load_private_key(tmp_path / "rsa.pem")


def test_deb_purls_name_the_image_distribution():
    ubuntu = os_release('NAME="Ubuntu"\nID=ubuntu\nVERSION_ID="22.04"\n')
    debian = os_release('ID=debian\nVERSION_ID="12"\n')
    assert deb_purl("libc6", "2.35-0ubuntu3.8", "amd64", ubuntu) == \
        "pkg:deb/ubuntu/libc6@2.35-0ubuntu3.8?arch=amd64&distro=ubuntu-22.04"
    assert deb_purl("python3.11", "3.11.2-6+deb12u6", "amd64", debian) == \
        "pkg:deb/debian/python3.11@3.11.2-6%2Bdeb12u6?arch=amd64&distro=debian-12"
    assert pypi_purl("Torch_Audio", "2.13.0+cpu") == "pkg:pypi/torch-audio@2.13.0%2Bcpu"
    doc = document("r@d", DIGEST, ubuntu, [("libc6", "2.35", "amd64")], [{"name": "numpy", "version": "2.1"}])
    assert [c["purl"] for c in doc["components"]] == ["pkg:deb/ubuntu/libc6@2.35?arch=amd64&distro=ubuntu-22.04",
                                                       "pkg:pypi/numpy@2.1"]
    empty = document("r@d", DIGEST, {}, [], [], note="no shell")
    assert empty["components"] == [] and empty["metadata"]["properties"][0]["value"] == "no shell"
