"""Smoke-test a final image in real containers (testcontainers; Ryuk disabled, cleanup by label).

Checks: /ready (/health on a backend's own server), embedding dimension, L2 normalisation,
determinism, cosine >= the recipe's threshold against the reference outputs computed at compile
time, the start-up guard refusing a tampered engine.json, and the server process not running as root.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import docker
import requests

from .errors import SmokeTestError
from .runtime.gate import length_class

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")  # Ryuk's image cannot be pulled here

from testcontainers.core.container import DockerContainer  # noqa: E402

SMOKE_LABEL = "io.mopt.smoke"
ENGINE_JSON = "/opt/mopt/engine/engine.json"
GUARD_EXIT = 3

Log = Callable[[str], None]


@dataclass(frozen=True)
class SmokeSpec:
    image: str
    port: int
    inputs: tuple[str, ...]
    dimension: int
    min_cosine: float
    normalize: bool
    reference: dict  # reference.json: {"texts": [...], "embeddings": [[...]]}
    engine_json: dict
    start_timeout_s: int = 120
    gpu: bool = False
    task: str = "embedding"  # embedding | chat (OpenAI /v1/chat/completions, e.g. trtllm-serve)
    # A model runtime image (no model inside): the model and the engine cache mounted, the server's
    # arguments, and the reference.json its first start's compile wrote, read once it is ready.
    volumes: tuple[tuple[str, str, str], ...] = ()  # (host path, container path, mode)
    command: tuple[str, ...] = ()
    reference_after_start: Callable[[], dict] | None = None
    baked_engine: bool = True  # the guard check tampers the engine baked into the image


@dataclass(frozen=True)
class SmokeResult:
    passed: bool
    checks: dict = field(default_factory=dict)  # name -> "ok" or the failure
    min_cosine: float = 0.0
    start_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def failures(self) -> list[str]:
        return [f"{name}: {result}" for name, result in self.checks.items() if result != "ok"]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norms if norms else 0.0  # an all-zero vector is like nothing


# The embedding checks' verdicts, apart from the container so they can be tested: each raises
# SmokeTestError with the figure that failed (an assert would vanish under python -O).
NORM_TOLERANCE = 1e-3
REPEAT_TOLERANCE = 1e-5


def check_dimension(vectors: list[list[float]], dimension: int) -> None:
    dims = {len(e) for e in vectors}
    if dims != {dimension}:
        raise SmokeTestError(f"expected dimension {dimension}, got {sorted(dims)}")


def check_normalised(vectors: list[list[float]], normalize: bool) -> None:
    if not normalize:
        return
    norms = [math.sqrt(sum(x * x for x in e)) for e in vectors]
    if not all(abs(n - 1) < NORM_TOLERANCE for n in norms):
        raise SmokeTestError(f"norms {norms} are not 1")


def check_deterministic(first: list[list[float]], again: list[list[float]]) -> None:
    diffs = [abs(x - y) for a, b in zip(first, again, strict=True) for x, y in zip(a, b, strict=True)]
    # max() keeps whichever of a NaN and a number comes first: a NaN anywhere is the worst difference.
    worst = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
    if not worst < REPEAT_TOLERANCE:
        raise SmokeTestError(f"two identical requests differ by up to {worst:.2e}")


def min_reference_cosine(texts: list[str], vectors: list[list[float]], reference: dict) -> float:
    """The lowest cosine of each text's embedding against its reference embedding (reference.json)."""
    ref = dict(zip(reference["texts"], reference["embeddings"], strict=True))
    return min(cosine(e, ref[t]) for t, e in zip(texts, vectors, strict=True))


def smoke_texts(inputs, reference: dict) -> list[str]:
    """The recipe's inputs, then the compile gate's texts (every length class, several scripts) from
    reference.json: the served image is checked on the lengths the engine was gated on."""
    texts = list(inputs)
    return texts + [t for t in reference.get("texts", []) if t not in texts]


def worst_length_class(texts: list[str], vectors: list[list[float]], reference: dict) -> str:
    """'CLASS min X' for the length class (reference.json's token counts) with the lowest cosine."""
    ref = dict(zip(reference["texts"], zip(reference["embeddings"], reference.get("tokens") or
                                             [None] * len(reference["texts"]), strict=True), strict=True))
    worst: dict[str, float] = {}
    for text, vec in zip(texts, vectors, strict=True):
        expected, tokens = ref[text]
        label = "unknown length" if tokens is None else f"{length_class(tokens)}-token texts"
        worst[label] = min(worst.get(label, 1.0), cosine(vec, expected))
    label = min(worst, key=worst.get)
    return f"{label} min {worst[label]:.5f}"


def check_accuracy(min_cos: float, min_cosine: float, worst: Callable[[], str] | None = None) -> None:
    """worst(): which length class fell short, said in the failure."""
    if not min_cos >= min_cosine:
        where = f" (worst: {worst()})" if worst is not None else ""
        raise SmokeTestError(f"cosine vs reference {min_cos:.5f} < threshold {min_cosine}{where}")


def cleanup(client: docker.DockerClient | None = None) -> int:
    """Remove every container a smoke test left (by label); returns how many."""
    client = client or docker.from_env()
    containers = client.containers.list(all=True, filters={"label": SMOKE_LABEL})
    for container in containers:
        container.remove(force=True)
    return len(containers)


def _device_kwargs(spec: SmokeSpec) -> dict:
    if not spec.gpu:
        return {}
    return {"device_requests": [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]}


def _embed(base: str, texts: list[str]) -> list[list[float]]:
    response = requests.post(f"{base}/v1/embeddings", json={"input": texts, "model": "smoke"}, timeout=120)
    if response.status_code != 200:
        raise SmokeTestError(f"POST /v1/embeddings answered {response.status_code}: {response.text[:300]}")
    data = response.json()["data"]
    return [item["embedding"] for item in sorted(data, key=lambda d: d["index"])]


def _wait_healthy(container: DockerContainer, base: str, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        wrapped = container.get_wrapped_container()
        wrapped.reload()
        if wrapped.status == "exited":
            logs = wrapped.logs().decode(errors="replace")[-800:]
            raise SmokeTestError(f"the container exited (code {wrapped.attrs['State']['ExitCode']}) before "
                                 f"becoming healthy:\n{logs}")
        try:
            if _ready(base):
                return time.monotonic() - start
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise SmokeTestError(f"/ready did not answer 200 within {timeout:.0f}s")


def _ready(base: str) -> bool:
    """mopt's server answers /ready 200 once its engine has loaded (/health already while loading); a
    backend's own server (tensorrt-llm) has no /ready and answers /health once it serves."""
    status = requests.get(f"{base}/ready", timeout=2).status_code
    if status == 404:
        status = requests.get(f"{base}/health", timeout=2).status_code
    return status == 200


def _check(checks: dict, name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
        checks[name] = "ok"
    except (SmokeTestError, AssertionError, requests.RequestException, KeyError, ValueError) as exc:
        checks[name] = str(exc) or type(exc).__name__


def _guard_refuses_tampered(spec: SmokeSpec, run_id: str) -> None:
    client = docker.from_env()
    tampered = dict(spec.engine_json, engine_sha256="0" * 64)
    with tempfile.TemporaryDirectory(prefix="mopt-smoke-") as tmp:
        path = Path(tmp) / "engine.json"
        path.write_text(json.dumps(tampered))
        path.chmod(0o644)
        Path(tmp).chmod(0o755)
        container = client.containers.run(  # the image's own start (ENTRYPOINT, MOPT_ENGINE_DIR)
            spec.image, detach=True, labels={SMOKE_LABEL: run_id},
            volumes={str(path): {"bind": ENGINE_JSON, "mode": "ro"}}, **_device_kwargs(spec))
        try:
            code = container.wait(timeout=spec.start_timeout_s)["StatusCode"]
            logs = container.logs().decode(errors="replace")
        finally:
            container.remove(force=True)
    if code != GUARD_EXIT:
        raise SmokeTestError(f"a tampered engine.json should stop the server with exit {GUARD_EXIT}, got {code}: "
                             f"{logs[-300:]}")
    if "sha256" not in logs:
        raise SmokeTestError(f"the guard's message does not name the sha256 mismatch: {logs[-300:]}")


def _chat(base: str, prompt: str) -> str:
    response = requests.post(f"{base}/v1/chat/completions", timeout=300, json={
        "model": "smoke", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0})
    if response.status_code != 200:
        raise SmokeTestError(f"POST /v1/chat/completions answered {response.status_code}: {response.text[:300]}")
    content = response.json()["choices"][0]["message"]["content"]
    if not isinstance(content, str) or not content.strip():
        raise SmokeTestError(f"the completion for {prompt!r} is empty")
    return content


def chat_checks(base: str, prompts: list[str]) -> dict[str, str]:
    """A chat server's checks: every prompt gets a non-empty completion, and greedy decoding repeats."""
    checks: dict[str, str] = {}
    first: list[str] = []
    _check(checks, "completion", lambda: first.extend(_chat(base, p) for p in prompts))

    def deterministic() -> None:
        again = [_chat(base, p) for p in prompts]
        assert again == first, f"temperature-0 completions differ between two requests: {first!r} vs {again!r}"

    if checks["completion"] == "ok":
        _check(checks, "deterministic", deterministic)
    else:
        checks["deterministic"] = "skipped: no completion"
    return checks


def _container(spec: SmokeSpec, run_id: str) -> DockerContainer:
    container = (DockerContainer(spec.image).with_exposed_ports(spec.port)
                 .with_kwargs(labels={SMOKE_LABEL: run_id}, **_device_kwargs(spec)))
    for host, target, mode in spec.volumes:
        container = container.with_volume_mapping(host, target, mode)
    return container.with_command(list(spec.command)) if spec.command else container


def _after_start(spec: SmokeSpec) -> tuple[SmokeSpec, str]:
    """SPEC with the reference its container's first start wrote (a model runtime image), or why none."""
    if spec.reference_after_start is None:
        return spec, ""
    try:
        return replace(spec, reference=spec.reference_after_start()), ""
    except (OSError, ValueError, KeyError, StopIteration) as exc:
        return spec, f"no reference.json from the first start's compile: {exc!r}"


def smoke_test(spec: SmokeSpec, log: Log = print) -> SmokeResult:
    start = time.monotonic()
    run_id = uuid.uuid4().hex[:12]
    checks: dict[str, str] = {}
    min_cos = 0.0
    start_seconds = 0.0
    container = _container(spec, run_id)
    try:
        container.start()
        base = f"http://{container.get_container_host_ip()}:{container.get_exposed_port(spec.port)}"
        try:
            start_seconds = _wait_healthy(container, base, spec.start_timeout_s)
            checks["health"] = "ok"
        except SmokeTestError as exc:
            checks["health"] = str(exc)
            return SmokeResult(False, checks, 0.0, 0.0, round(time.monotonic() - start, 1))
        spec, missing = _after_start(spec)
        if missing:
            checks["reference"] = missing
            return SmokeResult(False, checks, 0.0, round(start_seconds, 2), round(time.monotonic() - start, 1))
        texts = list(spec.inputs) if spec.task == "chat" else smoke_texts(spec.inputs, spec.reference)
        first: list[list[float]] = []

        def dimension() -> None:
            first.extend(_embed(base, texts))
            check_dimension(first, spec.dimension)

        def deterministic() -> None:
            check_deterministic(first, _embed(base, texts))

        def accuracy() -> None:
            nonlocal min_cos
            min_cos = min_reference_cosine(texts, first, spec.reference)  # reported even when below
            check_accuracy(min_cos, spec.min_cosine, lambda: worst_length_class(texts, first, spec.reference))

        def not_root() -> None:
            code, out = container.get_wrapped_container().exec_run(["sh", "-c", "grep '^Uid:' /proc/1/status"])
            uid = out.decode().split()[1] if code == 0 and out.split() else "?"
            assert uid not in ("0", "?"), f"the server runs as uid {uid}"

        if spec.task == "chat":
            checks.update(chat_checks(base, texts))
        else:
            for name, fn in (("dimension", dimension), ("normalised", lambda: check_normalised(first, spec.normalize)),
                             ("deterministic", deterministic), ("accuracy", accuracy)):
                if name != "dimension" and checks.get("dimension") != "ok":
                    checks[name] = "skipped: no embeddings"
                    continue
                _check(checks, name, fn)
        _check(checks, "non-root", not_root)
        if spec.baked_engine:
            _check(checks, "guard-refuses-tampered-engine", lambda: _guard_refuses_tampered(spec, run_id))
    except docker.errors.DockerException as exc:
        checks["container"] = f"docker: {exc}"
    finally:
        try:
            container.stop()
        except Exception:  # noqa: BLE001 - best effort; the label sweep below removes it anyway
            pass
        client = docker.from_env()
        for leftover in client.containers.list(all=True, filters={"label": f"{SMOKE_LABEL}={run_id}"}):
            leftover.remove(force=True)
    passed = all(result == "ok" for result in checks.values())
    return SmokeResult(passed, checks, round(min_cos, 6), round(start_seconds, 2), round(time.monotonic() - start, 1))
