"""The state dir: paths, variant and smoke records (round trip, atomic write, unreadable records)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.errors import ConfigError
from builder.state import ModelRecord, SmokeRecord, StageRecord, StateDir, VariantRecord


def record(image_id: str = "sha256:final") -> VariantRecord:
    return VariantRecord(
        id="img:tag", image_id=image_id, references=("ns/img:tag", "ns/img:tag-long"),
        engine_dir=Path("/state/engines/abc"), engine_sha256="e" * 64,
        model=ModelRecord(source="local:/m", digest="d" * 64, dimension=384, substituted=False),
        stages=(StageRecord(name="base", key="k1", image="mopt-stage/base:k1", image_id="sha256:base", skipped=True,
                            seconds=0.0),
                StageRecord(name="runtime", key="k2", image="mopt-stage/runtime:k2", image_id="sha256:rt",
                            skipped=False, seconds=12.5),
                StageRecord(name="compile", key="k3", image="/state/engines/abc", image_id="", skipped=False,
                            seconds=3.0)),
        size_bytes=123)


def test_paths_are_under_the_root(tmp_path):
    state = StateDir(tmp_path)
    assert state.render_dir("img", "tag") == tmp_path / "render" / "img" / "tag"
    assert state.record_path("img", "tag") == tmp_path / "variants" / "img" / "tag.json"
    assert state.smoke_path("img", "tag") == tmp_path / "variants" / "img" / "tag.smoke.json"
    assert state.log_file("img", "tag", "final") == tmp_path / "logs" / "img" / "tag" / "final.log"
    assert state.engine_dir("k" * 64) == tmp_path / "engines" / ("k" * 32)
    assert state.context("runtime", "r" * 64) == tmp_path / "contexts" / ("runtime-" + "r" * 32)
    assert state.repro_report("img", "tag") == tmp_path / "reports" / "repro-img-tag.json"
    assert (state.bases, state.models, state.reports, state.registry) == (
        tmp_path / "bases", tmp_path / "models", tmp_path / "reports", tmp_path / "registry")
    state.create()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["render", "contexts", "engines", "models", "logs", "variants", "bases", "reports"])


def test_record_round_trip_and_on_disk_form(tmp_path):
    state = StateDir(tmp_path)
    assert state.read_record("img", "tag") is None
    path = state.write_record("img", "tag", record())
    assert state.read_record("img", "tag") == record()
    data = json.loads(path.read_text())
    # The on-disk form other tools (CI scripts, older mopt) read: plain JSON, stages as a list.
    assert data["image_id"] == "sha256:final" and data["engine_dir"] == "/state/engines/abc"
    assert [s["name"] for s in data["stages"]] == ["base", "runtime", "compile"]
    assert not list(path.parent.glob(".*.tmp"))  # the temporary file of the atomic write is gone
    assert record().stage("runtime").image_id == "sha256:rt"
    with pytest.raises(KeyError, match="no final stage"):
        record().stage("final")
    assert record().image_ids() == {"sha256:final", "sha256:base", "sha256:rt"}


@pytest.mark.parametrize("text", ["{not json", json.dumps({"id": "img:tag"}), "[]"])
def test_unreadable_record_is_one_config_error(tmp_path, text):
    state = StateDir(tmp_path)
    path = state.record_path("img", "tag")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(ConfigError, match="unreadable variant record") as err:
        state.read_record("img", "tag")
    assert str(path) in err.value.message
    with pytest.raises(ConfigError, match="unreadable variant record"):
        list(state.records())


def test_records_lists_variant_records_not_smoke_records(tmp_path):
    state = StateDir(tmp_path)
    state.write_record("a", "cpu", record("sha256:a"))
    state.write_record("b", "cpu", record("sha256:b"))
    state.write_smoke("a", "cpu", SmokeRecord(image_id="sha256:a", key="k", passed=True))
    assert [r.image_id for _, r in state.records()] == ["sha256:a", "sha256:b"]


def test_smoke_passed_only_for_the_same_image(tmp_path):
    state = StateDir(tmp_path)
    built = record("sha256:new")
    assert not state.smoke_passed("img", "tag", built)  # never tested
    state.write_smoke("img", "tag", SmokeRecord(image_id="sha256:old", key="k", passed=True))
    assert not state.smoke_passed("img", "tag", built)  # another image passed
    state.write_smoke("img", "tag", SmokeRecord(image_id="sha256:new", key="k", passed=False))
    assert not state.smoke_passed("img", "tag", built)  # this image failed
    state.write_smoke("img", "tag", SmokeRecord(image_id="sha256:new", key="k", passed=True, checks={"health": "ok"}))
    assert state.smoke_passed("img", "tag", built)
    assert state.read_smoke("img", "tag").checks == {"health": "ok"}
    state.smoke_path("img", "tag").write_text("{broken")
    assert state.read_smoke("img", "tag") is None and not state.smoke_passed("img", "tag", built)
