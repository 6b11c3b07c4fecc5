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
from builder.base import DEFAULT_MIRROR
from builder.dockerclient import DockerCli, run_docker
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


# Debian 12's skopeo (1.9.3) is built with sigstore disabled: a Debian-local patch answers every sigstore
# signature with "Debian-local change: sigstore disabled". Debian 13's skopeo (1.18) has it, so the verifier
# runs in a Debian 13 rootfs that mmdebstrap makes from the Debian mirror (about 50 s, once; then the image).
SKOPEO_IMAGE = "mopt-test/skopeo:trixie"


@pytest.fixture(scope="module")
def skopeo_image(docker, tmp_path_factory):  # noqa: F811
    if run_docker(["image", "inspect", SKOPEO_IMAGE], docker=docker, check=False).returncode != 0:
        rootfs = tmp_path_factory.mktemp("skopeo") / "rootfs.tar"
        subprocess.run(["mmdebstrap", "--variant=minbase", "--include=skopeo,ca-certificates", "--quiet", "trixie",
                        str(rootfs), DEFAULT_MIRROR], check=True, capture_output=True, timeout=900)
        run_docker(["import", str(rootfs), SKOPEO_IMAGE], docker=docker, timeout=300)
    version = run_docker(["run", "--rm", "--network", "none", SKOPEO_IMAGE, "skopeo", "--version"], docker=docker,
                         timeout=60).stdout
    assert version.startswith("skopeo version 1.18"), version
    return SKOPEO_IMAGE


def skopeo_copy(docker: DockerCli, image: str, tmp: Path, policy: dict, registry_address: str, config: Path,  # noqa: F811
                source: str) -> subprocess.CompletedProcess:
    """Debian's skopeo (containers/image) copying SOURCE out of the registry under POLICY, reading the
    registry's sigstore attachments: the verifier users run, which this project did not write."""
    (tmp / "policy.json").write_text(json.dumps(policy))
    registries_d = tmp / "registries.d"
    registries_d.mkdir(exist_ok=True)
    (registries_d / "local.yaml").write_text(f"docker:\n  {registry_address}:\n    use-sigstore-attachments: true\n")
    out = tmp / f"copy-{len(list(tmp.glob('copy-*')))}"
    return run_docker(["run", "--rm", "--network", "host", "-v", f"{tmp}:{tmp}", image,
                       "skopeo", "--policy", str(tmp / "policy.json"), "--registries.d", str(registries_d),
                       "copy", "--src-tls-verify=false", "--src-authfile", str(config / "config.json"),
                       "--remove-signatures", f"docker://{source}", f"dir:{out}"], docker=docker, check=False,
                      timeout=120)


@pytest.mark.parametrize("kind", ["ec", "ed25519"])
def test_skopeo_accepts_the_signed_image_under_sigstore_signed_and_refuses_the_rest(docker, registry, tmp_path,  # noqa: F811
                                                                                   skopeo_image, kind):
    """policy.json's sigstoreSigned with our public key: the image published with --sign-key copies by its
    long tag, its short tag and its digest; an unsigned image, the signed image under a tag it was not
    signed for, and the signed image checked against another key are refused."""
    config = tmp_path / "docker-config"
    docker_login(registry.address, registry.user, registry.password, config_dir=config)
    private, public = keypair(tmp_path, "signer", kind)
    _, stranger = keypair(tmp_path, "stranger", kind)
    reg = registry.address
    signed_id = _import_image(docker, tmp_path, f"mopt-test/sigstore-a:{kind}", f"signed {kind}\n".encode())
    unsigned_id = _import_image(docker, tmp_path, f"mopt-test/sigstore-b:{kind}", f"unsigned {kind}\n".encode())
    published = mopt("publish", "--select", "minilm-embed:cpu", "--registry", reg, "--sign-key", str(private),
                     config=config, state=runner_state(tmp_path, "minilm-embed:cpu", signed_id, True))
    assert published.returncode == 0, published.stdout + published.stderr
    assert "(sigstore/cosign signature, 1 key(s))" in published.stdout + published.stderr
    unsigned = mopt("publish", "--select", "minilm-embed:cpu-vllm", "--registry", reg, config=config,
                    state=runner_state(tmp_path, "minilm-embed:cpu-vllm", unsigned_id, True))
    assert unsigned.returncode == 0, unsigned.stdout + unsigned.stderr
    short, long = planned_tags("minilm-embed:cpu")
    b_short, _ = planned_tags("minilm-embed:cpu-vllm")
    repo = f"{reg}/mopt/minilm-embed"

    def policy(key: Path) -> dict:
        return {"default": [{"type": "reject"}],
                "transports": {"docker": {repo: [{"type": "sigstoreSigned", "keyPath": str(key)}]},
                               "dir": {"": [{"type": "insecureAcceptAnything"}]}}}

    registry_ = Registry.parse(reg)
    api = RegistryApi(registry_, load_credentials(registry_, config), config_dir=config)
    try:
        digest = api.manifest("mopt/minilm-embed", long).digest
        api.put_manifest("mopt/minilm-embed", "retagged", api.manifest("mopt/minilm-embed", long))
    finally:
        api.close()
    for source in (f"{repo}:{long}", f"{repo}:{short}", f"{repo}@{digest}"):
        ok = skopeo_copy(docker, skopeo_image, tmp_path, policy(public), reg, config, source)
        assert ok.returncode == 0, (source, ok.stderr[-2000:])
    refusals = {f"{repo}:{b_short}": "A signature was required, but no signature exists",
                f"{repo}:retagged": f'Signature for identity \\"{repo}:{short}\\" is not accepted',  # not this tag
                f"{repo}:{long}@stranger": "cryptographic signature verification failed"}
    for source, why in refusals.items():
        source, _, who = source.partition("@")
        refused = skopeo_copy(docker, skopeo_image, tmp_path, policy(stranger if who else public), reg, config,
                              source)
        assert refused.returncode != 0 and why in refused.stderr, (source, refused.stderr[-2000:])
    # mopt verify names what the image signature covers, and refuses the re-tag the same way.
    ok = mopt("verify", f"{repo}:{short}", "--key", str(public), "--format", "json", config=config)
    assert ok.returncode == 0 and sorted(json.loads(ok.stdout)["signed_for"]) == sorted(
        [f"{repo}:{long}", f"{repo}:{short}"]), ok.stdout + ok.stderr
    retag = mopt("verify", f"{repo}:retagged", "--key", str(public), config=config)
    assert retag.returncode == 8 and f"{repo}:retagged: not signed for this reference" in retag.stderr
