"""`mopt prune` against the real daemon: images no kept state names go, the ones a record names stay,
images without our label are never touched, a container's image is kept with every tag, another
state dir's images are kept without being named, what a build in progress elsewhere made is kept,
an unreadable record stops it.

Every image here carries a label unique to this test run and prune is limited to it (--label), so the
test never removes the images other tests of the session built."""
from __future__ import annotations

import io
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from builder.build import KEY_LABEL
from builder.state import ModelRecord, StageRecord, StateDir, VariantRecord
from builder.statelock import state_lock
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
    alias = f"mopt-prune-test-{value[:12]}/final:alias"  # a second tag: docker rmi would only untag it
    subprocess.run([docker_cli.path, "tag", tag, alias], check=True)
    res = mopt_cli("prune", "--state-dir", str(tmp_path), "--label", run_label)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "removed 0 images" in res.stdout and f"kept: {alias} {tag}: a container uses it" in res.stdout
    assert _image_id(docker_cli, image) == image and _image_id(docker_cli, alias) == image


def test_prune_keeps_another_state_dirs_images_unnamed(docker_cli, run_label, tmp_path):
    """Another checkout's state dir, known to this host because mopt worked in it, keeps its images
    though the prune names only its own state dir (what scripts/test.sh does)."""
    key, value = run_label.split("=")
    repo = f"mopt-prune-test-{value[:12]}"
    theirs = _import(docker_cli, f"{repo}/final:theirs", {KEY_LABEL: "test", key: value}, b"theirs")
    stale = _import(docker_cli, f"{repo}/stage:stale", {KEY_LABEL: "test", key: value}, b"stale")
    other, own = tmp_path / "other-checkout", tmp_path / "own"
    _record(other, theirs, [])
    with state_lock(other, "an earlier build", log=lambda m: None):  # how a state dir becomes known
        pass
    res = mopt_cli("prune", "--state-dir", str(own), "--label", run_label)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "removed 1 images, kept 1" in res.stdout
    assert _image_id(docker_cli, theirs) == theirs and _image_id(docker_cli, stale) is None


def test_prune_keeps_what_a_build_in_progress_made(docker_cli, run_label, tmp_path):
    """An image made after another state dir's build took its lock may be that build's, not yet in
    its records: kept until the build is over."""
    key, value = run_label.split("=")
    repo = f"mopt-prune-test-{value[:12]}"
    old = _import(docker_cli, f"{repo}/stage:old", {KEY_LABEL: "test", key: value}, b"old")
    time.sleep(1.5)  # image creation times are in whole seconds on some daemons
    building = tmp_path / "building"
    (building / "variants").mkdir(parents=True)
    with state_lock(building, "mopt build", log=lambda m: None):
        fresh = _import(docker_cli, f"{repo}/stage:fresh", {KEY_LABEL: "test", key: value}, b"fresh")
        res = mopt_cli("prune", "--state-dir", str(tmp_path / "own"), "--label", run_label)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"kept: {repo}/stage:fresh: made since {building} was locked by pid" in res.stdout
    assert _image_id(docker_cli, fresh) == fresh and _image_id(docker_cli, old) is None
    res = mopt_cli("prune", "--state-dir", str(tmp_path / "own"), "--label", run_label)
    assert "removed 1 images" in res.stdout and _image_id(docker_cli, fresh) is None  # the build is over


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
