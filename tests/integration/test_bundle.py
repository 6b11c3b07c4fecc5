"""Air-gap bundles: mopt export writes images, sums, SBOM and report; mopt install verifies, loads,
checks the host and smoke-tests. Uses the cpu demo image (built here if the session has not)."""
import json
import subprocess
import tarfile

import pytest

from builder.dockerclient import find_docker
from tests.integration.conftest import mopt_cli as mopt

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bundle(docker_cli, tmp_path_factory):
    built = mopt("release", "--select", "minilm-embed:cpu")
    assert built.returncode == 0, built.stderr[-2000:]
    out = tmp_path_factory.mktemp("bundle") / "bundle.tar"
    result = mopt("export", "--select", "minilm-embed:cpu", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def test_bundle_contents(bundle):
    with tarfile.open(bundle) as tar:
        names = set(tar.getnames())
        assert {"bundle/SHA256SUMS", "bundle/bundle.json", "bundle/images/minilm-embed_cpu.tar",
                "bundle/sbom/minilm-embed_cpu.cdx.json", "bundle/report.json"} <= names
        sbom = json.load(tar.extractfile("bundle/sbom/minilm-embed_cpu.cdx.json"))
        index = json.load(tar.extractfile("bundle/bundle.json"))
    assert sbom["bomFormat"] == "CycloneDX" and sbom["specVersion"] == "1.5"
    purls = {c["purl"] for c in sbom["components"]}
    assert "pkg:pypi/torch@2.13.0%2Bcpu" in purls
    assert any(p.startswith("pkg:deb/debian/python3.11@") for p in purls)
    assert index["variants"][0]["references"][0] == "mopt/minilm-embed:cpu"


def test_tampered_bundle_is_refused(bundle, tmp_path):
    with tarfile.open(bundle) as tar:
        tar.extractall(tmp_path, filter="data")
    sbom = tmp_path / "bundle/sbom/minilm-embed_cpu.cdx.json"
    sbom.write_text(sbom.read_text().replace("CycloneDX", "CycloneDx", 1))
    result = mopt("install", str(tmp_path / "bundle"))
    assert result.returncode == 2, result.stderr
    assert "checksum mismatch for sbom/minilm-embed_cpu.cdx.json" in result.stderr
    (tmp_path / "bundle/extra.txt").write_text("x")
    assert "not in SHA256SUMS" in mopt("install", str(tmp_path / "bundle")).stderr


def test_install_loads_and_smoke_tests(bundle):
    docker = find_docker()
    subprocess.run([docker.path, "rmi", "mopt/minilm-embed:cpu"], capture_output=True)  # untag; the layers stay
    result = mopt("install", str(bundle))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "checksums verified" in result.stdout
    assert "minilm-embed:cpu: loaded, smoke test passed" in result.stdout
    inspect = subprocess.run([docker.path, "image", "inspect", "mopt/minilm-embed:cpu"], capture_output=True)
    assert inspect.returncode == 0
