"""The cpu MiniLM demo image run the way docs/hardening.md says: read-only root, a plain (noexec)
tmpfs /tmp, no capabilities, no-new-privileges, an arbitrary non-root uid; arguments after the image
name and MOPT_PORT reaching the server and its HEALTHCHECK; no setuid files, compiler or pip; the
engine and model owned by root and not writable by the serving user. Every wait is bounded."""
from __future__ import annotations

import json
import time
import uuid

import pytest
import requests

from builder.dockerclient import run_docker

pytestmark = pytest.mark.integration
LABEL = "io.mopt.test=hardened-image"
HARDENED = ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
START_TIMEOUT_S = 120
TEXTS = ["A man is eating food.", "Containers ship inference engines."]


@pytest.fixture
def start(docker_cli, cpu_demo_image):
    """start(docker_args, image_args, port) -> (container id, base URL); containers removed afterwards."""
    started: list[str] = []

    def run(docker_args: list[str], image_args: list[str] = (), port: int = 8000) -> tuple[str, str]:
        name = f"mopt-hardened-{uuid.uuid4().hex[:10]}"
        run_docker(["run", "-d", "--name", name, "--label", LABEL, "-p", f"127.0.0.1::{port}", *docker_args,
                    cpu_demo_image, *image_args], docker=docker_cli, timeout=60)
        started.append(name)
        mapped = run_docker(["port", name, f"{port}/tcp"], docker=docker_cli, timeout=30).stdout.split()[0]
        return name, f"http://127.0.0.1:{mapped.rsplit(':', 1)[1]}"

    yield run
    for name in started:
        run_docker(["rm", "-f", name], docker=docker_cli, check=False, timeout=60)


def wait_healthy(docker_cli, name: str, base: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        state = json.loads(run_docker(["inspect", "-f", "{{json .State}}", name], docker=docker_cli).stdout)
        if state["Status"] == "exited":
            logs = run_docker(["logs", name], docker=docker_cli, check=False).stdout
            pytest.fail(f"the container exited ({state['ExitCode']}) before answering /health:\n{logs[-1500:]}")
        try:
            if requests.get(f"{base}/ready", timeout=2).status_code == 200:  # /health: already while loading
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    pytest.fail(f"/ready did not answer 200 within {START_TIMEOUT_S}s")


def embed(base: str, texts: list[str]) -> requests.Response:
    return requests.post(f"{base}/v1/embeddings", json={"input": texts, "model": "m"}, timeout=60)


def in_image(docker_cli, image: str, script: str, user: str | None = None) -> str:
    """SCRIPT's output in a throwaway container of IMAGE (entrypoint sh), as USER or the image's user."""
    argv = ["run", "--rm", "--network", "none", "--entrypoint", "sh", *(["--user", user] if user else []),
            image, "-c", script]
    return run_docker(argv, docker=docker_cli, timeout=120).stdout


def test_hardened_run_serves_embeddings(docker_cli, start):
    name, base = start([*HARDENED, "--user", "4242:4242"])
    wait_healthy(docker_cli, name, base)
    response = embed(base, TEXTS)
    assert response.status_code == 200, response.text[:300]
    assert [len(d["embedding"]) for d in response.json()["data"]] == [384, 384]
    # /tmp is the plain Docker tmpfs (noexec), and the server wrote no shared library anywhere there
    mounts = run_docker(["exec", name, "grep", " /tmp ", "/proc/mounts"], docker=docker_cli).stdout
    assert "noexec" in mounts.split()[3].split(","), mounts
    found = run_docker(["exec", name, "find", "/tmp", "-name", "*.so*"], docker=docker_cli).stdout
    assert found.strip() == ""
    status = run_docker(["exec", name, "grep", "-E", "^(Uid|CapEff|NoNewPrivs):", "/proc/1/status"],
                        docker=docker_cli).stdout
    fields = dict(line.split(":", 1) for line in status.splitlines())
    assert fields["Uid"].split()[0] == "4242" and int(fields["CapEff"].strip(), 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"


def test_arguments_after_the_image_name_reach_the_server(docker_cli, start):
    name, base = start([], ["--max-inputs", "1"])
    wait_healthy(docker_cli, name, base)
    assert embed(base, TEXTS[:1]).status_code == 200
    too_many = embed(base, TEXTS)
    assert too_many.status_code == 400, too_many.text[:300]


def test_mopt_port_moves_the_server_and_its_healthcheck(docker_cli, start):
    name, base = start(["-e", "MOPT_PORT=9000"], port=9000)
    wait_healthy(docker_cli, name, base)
    # The image's HEALTHCHECK (every 10 s) must reach the server on 9000 too: bounded wait for "healthy".
    deadline = time.monotonic() + 60
    health = None
    while time.monotonic() < deadline:
        health = json.loads(run_docker(["inspect", "-f", "{{json .State.Health}}", name], docker=docker_cli).stdout)
        if health and health["Status"] in ("healthy", "unhealthy"):
            break
        time.sleep(1)
    assert health and health["Status"] == "healthy", health


def test_entrypoint_cmd_labels_and_env(docker_cli, cpu_demo_image):
    config = json.loads(run_docker(["image", "inspect", cpu_demo_image], docker=docker_cli).stdout)[0]["Config"]
    assert config["Entrypoint"] == ["python", "-m", "mopt_runtime", "serve"]
    assert not config["Cmd"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["MOPT_PORT"] == "8000" and env["MOPT_ENGINE_DIR"] == "/opt/mopt/engine"
    assert env["MOPT_MAX_INPUTS"] == "2048"  # images/minilm-embed/image.yaml serve.max_inputs
    assert config["Labels"]["io.mopt.compiler"] == "none" and config["User"] == "10001:10001"


def test_no_setuid_files_no_compiler_no_pip(docker_cli, cpu_demo_image):
    # as root, so that find sees every directory (the image's user may not read /root)
    assert in_image(docker_cli, cpu_demo_image, "find / -xdev -perm /6000 -type f", user="0").strip() == ""
    found = in_image(docker_cli, cpu_demo_image,
                     "for c in g++ gcc cc c++ pip pip3; do command -v $c || true; done; "
                     "python -m pip --version > /dev/null 2>&1 && echo python-m-pip || true")
    assert found.strip() == ""


def test_engine_and_model_are_root_owned_and_read_only_to_the_server(docker_cli, cpu_demo_image):
    # nothing under them belongs to anyone but root or is writable by group or others
    script = "find /opt/mopt/engine /opt/mopt/model \\( ! -user root -o -perm /022 \\) -print"
    assert in_image(docker_cli, cpu_demo_image, script).strip() == ""
    # and the serving user (the image's USER) can read them but not write any of them
    probe = ("cd /opt/mopt && for p in engine engine/engine.json engine/engine model $(find engine model -type f); "
             "do test -w $p && echo writable: $p; test -r $p || echo unreadable: $p; done; echo done")
    assert in_image(docker_cli, cpu_demo_image, probe).split() == ["done"]
    assert in_image(docker_cli, cpu_demo_image, "id -u").strip() == "10001"


def test_the_serving_image_leaves_out_what_only_the_compile_needs(docker_cli, cpu_demo_image):
    # defaults.yaml's serving_prune: none of those packages is installed (pip's own record agrees), torch's
    # headers and tests are gone, and the model directory has its tokenizer and config but no weights (the
    # .pt2 holds them). A compile-only command says so in one line, exit 2.
    from builder.render import defaults

    prune = defaults()["serving_prune"]
    names = {n.lower().replace("_", "-") for n in prune["packages"]}
    listing = in_image(docker_cli, cpu_demo_image,
                       "ls /opt/venv/lib/python3*/site-packages | grep -i dist-info; "
                       "ls -d /opt/venv/lib/python3*/site-packages/torch/include 2>&1 || true; "
                       "ls /opt/mopt/model")
    installed = {line.split("-")[0].lower().replace("_", "-") for line in listing.splitlines()
                 if line.endswith(".dist-info")}
    assert "torch" in installed and "tokenizers" in installed and "uvicorn" in installed
    assert not installed & names, installed & names
    assert "No such file" in listing
    assert "tokenizer.json" in listing and "config.json" in listing
    assert not any(line.endswith((".safetensors", ".bin")) for line in listing.splitlines())
    inspect = json.loads(run_docker(["image", "inspect", cpu_demo_image], docker=docker_cli).stdout)[0]
    labels = inspect["Config"]["Labels"]
    assert labels["io.mopt.model.weights"] == "in-engine"
    result = run_docker(["run", "--rm", "--network", "none", cpu_demo_image, "--help"], docker=docker_cli, check=False)
    assert result.returncode == 0  # the serve command itself is all there
    made = run_docker(["run", "--rm", "--network", "none", "--entrypoint", "python", cpu_demo_image, "-m",
                       "mopt_runtime", "make-tiny-qwen3", "--out", "/tmp/m"], docker=docker_cli, check=False)
    assert made.returncode == 2, made.stdout + made.stderr
    assert made.stderr.strip().count("\n") == 0 and "which this image does not ship" in made.stderr
