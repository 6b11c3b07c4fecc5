"""Signed SBOM and provenance through a real authenticated registry: `mopt publish --sign-key` attaches
both to the image digest as OCI referrers; `mopt verify --key` accepts them, and refuses another key,
an envelope changed after signing, and a valid envelope attached to another digest (exit 8)."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from builder.attest import dsse, referrers
from builder.attest.provenance import CYCLONEDX, SLSA_PROVENANCE
from builder.localregistry import docker_login
from builder.registry.api import RegistryApi
from builder.registry.credentials import load_credentials
from builder.registry.reference import Registry
from tests.integration.conftest import REPO
from tests.integration.test_publish import _import_image, docker, registry  # noqa: F401
from tests.integration.test_release_fanout import planned_tags, runner_state

pytestmark = pytest.mark.integration


def keypair(tmp: Path, name: str, kind: str = "ec") -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1()) if kind == "ec" else ed25519.Ed25519PrivateKey.generate()
    private, public = tmp / f"{name}.key", tmp / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def mopt(*args: str, config: Path, state: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, DOCKER_CONFIG=str(config))
    if state:
        env["MOPT_STATE_DIR"] = str(state)
    env.pop("MOPT_MATRIX", None)
    return subprocess.run([sys.executable, "-m", "builder", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("kind", ["ec", "ed25519"])
def test_signed_attestations_round_trip_and_tampering_fails(docker, registry, tmp_path, kind):  # noqa: F811
    config = tmp_path / "docker-config"
    docker_login(registry.address, registry.user, registry.password, config_dir=config)
    private, public = keypair(tmp_path, "signer", kind)
    _, stranger = keypair(tmp_path, "stranger", kind)
    image_a = _import_image(docker, tmp_path, f"mopt-test/attest-a:{kind}", b"attested A\n")
    image_b = _import_image(docker, tmp_path, f"mopt-test/attest-b:{kind}", b"unsigned B\n")
    reg = registry.address

    signed = mopt("publish", "--select", "minilm-embed:cpu", "--registry", reg, "--sign-key", str(private),
                  config=config, state=runner_state(tmp_path, "minilm-embed:cpu", image_a, True))
    assert signed.returncode == 0, signed.stdout + signed.stderr
    assert "signed and attached SBOM (0 components) and provenance" in signed.stdout + signed.stderr
    assert private.read_text().splitlines()[1] not in signed.stdout + signed.stderr
    short, long = planned_tags("minilm-embed:cpu")

    for ref in (f"{reg}/mopt/minilm-embed:{short}", f"{reg}/mopt/minilm-embed:{long}"):
        ok = mopt("verify", ref, "--key", str(public), "--format", "json", config=config)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        result = json.loads(ok.stdout)
        assert set(result["attestations"]) == {CYCLONEDX, SLSA_PROVENANCE} and result["not_counted"] == []
    digest = result["digest"]

    # Another key: nothing counts.
    other = mopt("verify", f"{reg}/mopt/minilm-embed:{short}", "--key", str(stranger), config=config)
    assert other.returncode == 8 and "not signed by this key" in other.stderr

    # What the statements say, read back with the signer's key.
    registry_ = Registry.parse(reg)
    api = RegistryApi(registry_, load_credentials(registry_, config), config_dir=config)
    try:
        found = referrers.envelopes(api, "mopt/minilm-embed", digest)
        statements = [dsse.open_envelope(env, dsse.load_public_key(public)) for _, env in found]
        by_type = {s["predicateType"]: s for s in statements}
        assert by_type[SLSA_PROVENANCE]["subject"][0]["digest"]["sha256"] == digest.split(":")[1]
        build = by_type[SLSA_PROVENANCE]["predicate"]["buildDefinition"]
        assert build["externalParameters"]["variant"] == "minilm-embed:cpu"
        assert by_type[CYCLONEDX]["predicate"]["bomFormat"] == "CycloneDX"

        # A valid envelope of A attached to B (publish B unsigned first): bound to another digest.
        unsigned = mopt("publish", "--select", "minilm-embed:cpu-vllm", "--registry", reg, config=config,
                        state=runner_state(tmp_path, "minilm-embed:cpu-vllm", image_b, True))
        assert unsigned.returncode == 0, unsigned.stdout + unsigned.stderr
        b_short, _ = planned_tags("minilm-embed:cpu-vllm")
        b_subject = api.manifest("mopt/minilm-embed", b_short)
        for (_, envelope), statement in zip(found, statements, strict=True):
            referrers.attach(api, "mopt/minilm-embed", b_subject, statement["predicateType"], envelope)
        moved = mopt("verify", f"{reg}/mopt/minilm-embed:{b_short}", "--key", str(public), config=config)
        assert moved.returncode == 8, moved.stdout + moved.stderr
        assert f"signed for {digest}, not {b_subject.digest}" in moved.stderr

        # An envelope changed after signing (the SBOM's payload edited): the signature no longer holds.
        envelope = dict(found[0][1])
        payload = json.loads(base64.b64decode(envelope["payload"]))
        payload["predicate"] = {"bomFormat": "CycloneDX", "components": []}
        envelope["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
        c_subject = b_subject  # replace B's referrers with the edited envelope only
        api.put_manifest("mopt/minilm-embed", referrers.referrers_tag(c_subject.digest), api.put_manifest_by_digest(
            "mopt/minilm-embed", {"schemaVersion": 2, "mediaType": referrers.OCI_INDEX, "manifests": []}))
        referrers.attach(api, "mopt/minilm-embed", c_subject, CYCLONEDX, envelope)
        edited = mopt("verify", f"{reg}/mopt/minilm-embed:{b_short}", "--key", str(public), config=config)
        assert edited.returncode == 8 and "not signed by this key (or changed after signing)" in edited.stderr
    finally:
        api.close()
    none = mopt("verify", f"{reg}/mopt/minilm-embed:no-such-tag", "--key", str(public), config=config)
    assert none.returncode == 8 and "is not in the registry" in none.stderr
