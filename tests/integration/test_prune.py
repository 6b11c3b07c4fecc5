"""`mopt prune` against the real daemon: images no kept state names go, the ones a record names stay,
images without our label are never touched, a container's image is kept, an unreadable record stops it.

Every image here carries a label unique to this test run and prune is limited to it (--label), so the
test never removes the images other tests of the session built."""
from __future__ import annotations

import io
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

from builder.build import KEY_LABEL
from builder.state import ModelRecord, StageRecord, StateDir, VariantRecord
from tests.integration.conftest import mopt_cli

pytestmark = pytest.mark.integration


def _import(docker, tag: str, labels: dict[str, str], content: bytes) -> str:
    """A one-file image made with `docker import` (nothing to pull); returns its id."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("marker")
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    argv = [docker.path, "import"]
    for key, value in labels.items():
        argv += ["--change", f"LABEL {key}={value}"]
    subprocess.run([*argv, "-", tag], input=buf.getvalue(), check=True, capture_output=True)
    return _image_id(docker, tag)


def _image_id(docker, ref: str) -> str | None:
    res = subprocess.run([docker.path, "image", "inspect", "-f", "{{.Id}}", ref], capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else None


def _record(state: Path, final_id: str, stage_ids: list[str]) -> None:
    StateDir(state).write_record("img", "tag", VariantRecord(
        id="img:tag", image_id=final_id, references=(), engine_dir=state / "engines" / "x", engine_sha256="",
        model=ModelRecord(source="generate:test", digest="", dimension=4, substituted=False),
        stages=tuple(StageRecord(name=f"s{i}", key="", image="", image_id=s, skipped=False, seconds=0.0)
                     for i, s in enumerate(stage_ids)), size_bytes=0))


@pytest.fixture()
def run_label(docker_cli):
    label = f"io.mopt.test.prune={uuid.uuid4().hex}"
    yield label
    # Whatever the test left: containers first, then images.
    key = label.split("=")[0]
    listing = subprocess.run([docker_cli.path, "ps", "-aq", "--filter", f"label={label}"], capture_output=True,
                             text=True)
    for cid in listing.stdout.split():
        subprocess.run([docker_cli.path, "rm", "-f", cid], capture_output=True)
    listing = subprocess.run([docker_cli.path, "images", "-q", "--no-trunc", "--filter", f"label={label}"],
                             capture_output=True, text=True)
    for image_id in set(listing.stdout.split()):
        subprocess.run([docker_cli.path, "rmi", "-f", image_id], capture_output=True)
    assert key


def test_prune_keeps_what_records_name_and_removes_the_rest(docker_cli, run_label, tmp_path):
    key, value = run_label.split("=")
    ours = {KEY_LABEL: "test", key: value}
    repo = f"mopt-prune-test-{value[:12]}"
    kept_final = _import(docker_cli, f"{repo}/final:kept", ours, b"final")
    kept_stage = _import(docker_cli, f"{repo}/stage:kept", ours, b"stage")
    stale = _import(docker_cli, f"{repo}/stage:stale", ours, b"stale")
    subprocess.run([docker_cli.path, "tag", stale, f"{repo}/final:stale-alias"], check=True)
    # A dangling image of ours: tagged, then the tag moved to another image.
    dangling = _import(docker_cli, f"{repo}/stage:moving", ours, b"old")
    _import(docker_cli, f"{repo}/stage:moving", ours, b"new")
    not_ours = _import(docker_cli, f"{repo}/other:x", {key: value}, b"not ours")
    _record(tmp_path, kept_final, [kept_stage])

    dry = mopt_cli("prune", "--state-dir", str(tmp_path), "--label", run_label, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would remove 3 images, kept 2" in dry.stdout
    assert _image_id(docker_cli, stale) and _image_id(docker_cli, dangling)

    res = mopt_cli("prune", "--state-dir", str(tmp_path), "--label", run_label)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "removed 3 images, kept 2" in res.stdout
    assert _image_id(docker_cli, stale) is None and _image_id(docker_cli, f"{repo}/final:stale-alias") is None
    assert _image_id(docker_cli, dangling) is None
    assert _image_id(docker_cli, kept_final) == kept_final and _image_id(docker_cli, kept_stage) == kept_stage
    assert _image_id(docker_cli, not_ours) == not_ours  # no stage-key label: never ours to remove

    again = mopt_cli("prune", "--state-dir", str(tmp_path), "--label", run_label)
    assert again.returncode == 0 and "removed 0 images, kept 2" in again.stdout


def test_prune_keeps_an_image_a_container_uses(docker_cli, run_label, tmp_path):
    key, value = run_label.split("=")
    tag = f"mopt-prune-test-{value[:12]}/stage:used"
    image = _import(docker_cli, tag, {KEY_LABEL: "test", key: value}, b"used")
    subprocess.run([docker_cli.path, "create", "--label", run_label, tag, "/marker"], check=True, capture_output=True)
    res = mopt_cli("prune", "--state-dir", str(tmp_path), "--label", run_label)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "removed 0 images" in res.stdout and f"in use, kept: {tag}" in res.stdout
    assert _image_id(docker_cli, image) == image


def test_prune_refuses_on_an_unreadable_record(docker_cli, run_label, tmp_path):
    key, value = run_label.split("=")
    image = _import(docker_cli, f"mopt-prune-test-{value[:12]}/stage:x", {KEY_LABEL: "test", key: value}, b"x")
    broken = tmp_path / "variants" / "img" / "broken.json"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    res = mopt_cli("prune", "--state-dir", str(tmp_path), "--label", run_label)
    assert res.returncode == 2
    assert str(broken) in res.stderr and "unreadable variant record" in res.stderr
    assert "Traceback" not in res.stderr
    assert _image_id(docker_cli, image) == image  # nothing removed
