"""DSSE envelopes (https://github.com/secure-systems-lab/dsse) signed with a PEM key the user supplies.

Keys: PKCS#8 / SubjectPublicKeyInfo PEM, ECDSA P-256 (SHA-256, as cosign's default keys) or Ed25519.
cosign's own encrypted key format is not read: convert with `cosign public-key` / openssl. The key id
is the SHA-256 of the public key's DER, so a verifier can say which key signed.
"""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from ..errors import ConfigError

IN_TOTO = "application/vnd.in-toto+json"
ENVELOPE_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is signed."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def load_private_key(path: Path):
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: not an unencrypted PEM private key ({type(exc).__name__})") from None
    if not isinstance(key, (ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey)) or \
            (isinstance(key, ec.EllipticCurvePrivateKey) and not isinstance(key.curve, ec.SECP256R1)):
        raise ConfigError(f"{path}: the signing key must be ECDSA P-256 or Ed25519")
    return key


def make_key_pair(private_path: Path, public_path: Path) -> None:
    """A new ECDSA P-256 key (cosign's default kind): PKCS#8 PEM, readable by its owner only, and its public
    half (SubjectPublicKeyInfo PEM) beside it. An existing pair is kept."""
    if private_path.is_file() and public_path.is_file():
        return
    key = ec.generate_private_key(ec.SECP256R1())
    private_path.parent.mkdir(parents=True, exist_ok=True)
    private_path.touch(mode=0o600)
    private_path.chmod(0o600)
    private_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    public_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo))


def load_public_key(path: Path):
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: not a PEM public key ({type(exc).__name__})") from None
    if not isinstance(key, (ec.EllipticCurvePublicKey, ed25519.Ed25519PublicKey)) or \
            (isinstance(key, ec.EllipticCurvePublicKey) and not isinstance(key.curve, ec.SECP256R1)):
        raise ConfigError(f"{path}: the key must be ECDSA P-256 or Ed25519")
    return key


def key_id(public_key) -> str:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def sign_bytes(message: bytes, private_key) -> bytes:
    """MESSAGE signed: Ed25519, or ECDSA P-256 with SHA-256 (DER), as DSSE and cosign both use them."""
    if isinstance(private_key, ed25519.Ed25519PrivateKey):
        return private_key.sign(message)
    return private_key.sign(message, ec.ECDSA(hashes.SHA256()))


def valid_signature(message: bytes, signature: bytes, public_key) -> bool:
    try:
        if isinstance(public_key, ed25519.Ed25519PublicKey):
            public_key.verify(signature, message)
        else:
            public_key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def sign(statement: dict, *private_keys) -> dict:
    """An in-toto envelope of STATEMENT with one signature per key (DSSE allows several: a key rotation)."""
    if not private_keys:
        raise ValueError("dsse.sign needs at least one key")
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    message = pae(IN_TOTO, payload)
    return {"payloadType": IN_TOTO, "payload": base64.b64encode(payload).decode(),
            "signatures": [{"keyid": key_id(key.public_key()),
                            "sig": base64.b64encode(sign_bytes(message, key)).decode()} for key in private_keys]}


def open_envelope(envelope: object, public_key) -> dict | None:
    """The statement, when ENVELOPE is an in-toto DSSE envelope with a valid signature by PUBLIC_KEY;
    None otherwise (another key, a changed payload, not an envelope)."""
    if not isinstance(envelope, dict) or envelope.get("payloadType") != IN_TOTO:
        return None
    try:
        payload = base64.b64decode(envelope["payload"], validate=True)
        signatures = [base64.b64decode(s["sig"], validate=True) for s in envelope["signatures"]]
    except (KeyError, TypeError, ValueError):
        return None
    message = pae(IN_TOTO, payload)
    for signature in signatures:
        if not valid_signature(message, signature, public_key):
            continue
        try:
            statement = json.loads(payload)
        except ValueError:
            return None
        return statement if isinstance(statement, dict) else None
    return None
