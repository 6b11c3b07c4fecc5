"""A substitute model is never shipped as the real one: its own tags and labels, refused by publish and
export unless asked for, named by plan and the report."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.errors import ConfigError, PublishError
from builder.matrix import load_matrix
from builder.models import LocalModel, choose, image_tags, model_labels, substitute_tag
from builder.plan import make_plan
from builder.release import _publish_item
from builder.report import ReleaseReport, VariantReport
from builder.state import ModelRecord, SmokeRecord, StateDir, VariantRecord
from tests.conftest import REPO, run_mopt

DECLARED = "hf://Qwen/Qwen3-Embedding-0.6B@main"
SUBSTITUTE = "generate:tiny-qwen3?seed=0"


@pytest.fixture(scope="module")
def matrix():
    return load_matrix(REPO / "matrix.yaml")


def qwen_variant(matrix):
    return next(v for v in make_plan(matrix, ("qwen3-embed:cpu",)).variants)


def record(substituted: bool) -> VariantRecord:
    model = ModelRecord(source=SUBSTITUTE if substituted else DECLARED, digest="d" * 64,
                        dimension=64 if substituted else 1024, substituted=substituted,
                        declared=DECLARED if substituted else "", why="the Hub is out of reach" if substituted else "")
    return VariantRecord(id="qwen3-embed:cpu", image_id="sha256:" + "f" * 64,
                         references=("mopt/qwen3-embed:cpu", "mopt/qwen3-embed:cpu-long"),
                         engine_dir=Path("/e"), engine_sha256="e" * 64, model=model, stages=(), size_bytes=1)


def test_a_substitute_gets_marked_tags_and_the_real_model_its_own():
    assert image_tags("cu121-sm86", "cu121-sm86-long", True) == ("cu121-sm86-substitute",
                                                                 "cu121-sm86-long-substitute")
    assert image_tags("cu121-sm86", "cu121-sm86-long", False) == ("cu121-sm86", "cu121-sm86-long")


def test_a_tag_too_long_to_mark_is_refused_not_cut():
    assert len(substitute_tag("t" * 117)) == 128
    with pytest.raises(ConfigError, match="too long to mark as a substitute"):
        substitute_tag("t" * 118)


def test_labels_name_the_model_inside():
    real = LocalModel(source=DECLARED, path=Path("/m"), digest="a" * 64, dimension=1024, substituted=False,
                      declared=DECLARED)
    assert model_labels(real, "Qwen3 text embeddings") == {
        "io.mopt.model": DECLARED, "io.mopt.model.digest": "a" * 64, "io.mopt.model.substitute": "false"}
    fake = LocalModel(source=SUBSTITUTE, path=Path("/m"), digest="b" * 64, dimension=64, substituted=True,
                      declared=DECLARED, why="The Hub is\n  unreachable.")
    labels = model_labels(fake, "Qwen3 text embeddings")
    assert labels["io.mopt.model"] == SUBSTITUTE and labels["io.mopt.model.digest"] == "b" * 64
    assert labels["io.mopt.model.substitute"] == "true" and labels["io.mopt.model.declared"] == DECLARED
    assert labels["io.mopt.model.substitute.reason"] == "The Hub is unreachable."
    assert labels["org.opencontainers.image.description"].startswith(f"SUBSTITUTE: {SUBSTITUTE} stands in for")


@pytest.mark.parametrize("policy, hub_up, substituted", [
    ("auto", False, True), ("auto", True, False), ("source", False, False), ("substitute", True, True)])
def test_the_policy_decides_the_model(matrix, policy, hub_up, substituted):
    asked = []

    def hub():
        asked.append(1)
        return hub_up

    choice = choose(matrix.image("qwen3-embed").recipe, policy, hub)
    assert choice.substituted is substituted
    assert choice.source.text == (SUBSTITUTE if substituted else DECLARED)
    assert choice.dimension == (64 if substituted else 1024)
    assert len(asked) == (1 if policy == "auto" else 0)


def _passed(state: StateDir, rec: VariantRecord) -> None:
    state.write_record("qwen3-embed", "cpu", rec)
    state.write_smoke("qwen3-embed", "cpu", SmokeRecord(image_id=rec.image_id, key="k", passed=True))


def test_publish_refuses_a_substitute_unless_allowed_and_then_marks_its_tags(matrix, tmp_path):
    state, variant = StateDir(tmp_path), qwen_variant(matrix)
    _passed(state, record(True))
    with pytest.raises(PublishError, match="a substitute for hf://Qwen") as refused:
        _publish_item(state, variant, record(True), allow_substitute=False)
    assert refused.value.exit_code == 6 and "--allow-substitute" in refused.value.message
    item = _publish_item(state, variant, record(True), allow_substitute=True)
    assert (item.short_tag, item.long_tag) == ("cpu-substitute", variant.long_tag + "-substitute")
    item = _publish_item(state, variant, record(False), allow_substitute=False)
    assert (item.short_tag, item.long_tag) == ("cpu", variant.long_tag)


def test_cli_publish_and_export_refuse_a_substitute_with_exit_6(tmp_path):
    state = StateDir(tmp_path / "state")
    _passed(state, record(True))
    base = ("--select", "qwen3-embed:cpu", "--state-dir", str(tmp_path / "state"))
    result = run_mopt("publish", *base, "--registry", "127.0.0.1:9")  # nothing listens: nothing is tried
    assert result.returncode == 6, result.stderr
    assert "a substitute for hf://Qwen/Qwen3-Embedding-0.6B@main" in result.stderr
    assert "Traceback" not in result.stderr
    report = json.loads((tmp_path / "state" / "reports" / "latest.json").read_text())
    row = report["variants"][0]
    assert row["failed_step"] == "publish" and row["tag"] == "cpu-substitute" and SUBSTITUTE in row["substitute"]
    result = run_mopt("export", *base, "--out", str(tmp_path / "bundle"))
    assert result.returncode == 6 and "not exporting it" in result.stderr, result.stderr
    assert not (tmp_path / "bundle").exists()


def test_plan_names_the_variants_a_build_would_substitute():
    offline = {"MOPT_OFFLINE": "1", "COLUMNS": "200"}
    result = run_mopt("plan", "--format", "json", "--select", "qwen3-embed:cpu", "--select", "minilm-embed:cpu",
                      env=offline)
    assert result.returncode == 0, result.stderr
    models = json.loads(result.stdout)["models"]
    assert models["qwen3-embed:cpu"]["substituted"] is True and models["qwen3-embed:cpu"]["source"] == SUBSTITUTE
    assert "unreachable" in models["qwen3-embed:cpu"]["why"]
    assert models["minilm-embed:cpu"]["substituted"] is False
    table = run_mopt("plan", "--select", "qwen3-embed:cpu", "--select", "minilm-embed:cpu", env=offline)
    assert f"qwen3-embed's variants would carry {SUBSTITUTE}, tagged TAG-substitute" in table.stderr
    assert "minilm-embed's" not in table.stderr
    source = run_mopt("plan", "--format", "json", "--select", "qwen3-embed:cpu", "--models", "source", env=offline)
    assert json.loads(source.stdout)["models"]["qwen3-embed:cpu"] == {"source": DECLARED, "substituted": False,
                                                                      "why": ""}


def test_the_report_lists_substitutions():
    report = ReleaseReport(started=0.0, steps=["build"], finished=1.0)
    report.variants.append(VariantReport(id="qwen3-embed:cpu", image="qwen3-embed", flavour="aot",
                                         tag="cpu-substitute", long_tag="x-substitute", built=True,
                                         substitute=f"{SUBSTITUTE} for {DECLARED}: the Hub\n is out of reach"))
    report.variants.append(VariantReport(id="minilm-embed:cpu", image="minilm-embed", flavour="aot", tag="cpu",
                                         long_tag="y", built=True))
    text = report.markdown()
    assert "## substituted models" in text
    assert f"- `qwen3-embed:cpu`: {SUBSTITUTE} for {DECLARED}: the Hub is out of reach" in text
    assert "minilm-embed:cpu`:" not in text.split("## substituted models")[1]
    assert "substitute model" in report.html()


def test_records_keep_what_was_declared_and_why(tmp_path):
    state = StateDir(tmp_path)
    state.write_record("qwen3-embed", "cpu", record(True))
    assert state.read_record("qwen3-embed", "cpu") == record(True)
    # A record written before these fields existed still reads.
    path = state.record_path("qwen3-embed", "cpu")
    data = json.loads(path.read_text())
    del data["model"]["declared"], data["model"]["why"]
    path.write_text(json.dumps(data))
    assert state.read_record("qwen3-embed", "cpu").model.declared == ""
