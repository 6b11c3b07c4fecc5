"""The compile step refuses an engine whose cosine vs the fp32 reference is below --min-cosine.

The backend is a stand-in (registered like the real ones) whose engine answers a vector at a chosen
cosine from the reference, so the gate is tested without compiling a model; the rest of the compile
step (staging, tokenizer files, verify through Engine, engine.json) is the real one."""
from __future__ import annotations

import dataclasses
import json
import math
import shlex
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the runtime needs torch")
pytest.importorskip("tokenizers", reason="the runtime needs tokenizers")

from builder.runtime import __main__ as cli  # noqa: E402
from builder.runtime import fingerprint, guard  # noqa: E402
from builder.runtime.backends import BACKENDS, BackendInfo  # noqa: E402
from builder.runtime.compiler import DEFAULT_MIN_COSINE, compile_engine  # noqa: E402
from builder.runtime.errors import CompileError  # noqa: E402
from builder.runtime.params import EngineParams  # noqa: E402
from builder.runtime.tiny_qwen3 import build_tokenizer  # noqa: E402

pytestmark = pytest.mark.runtime
MODULE = "builder.runtime.backends._test_gate"


@pytest.fixture
def backend(monkeypatch):
    """A backend whose engine is off the reference by a set cosine (backend.cosine)."""
    fake = types.ModuleType(MODULE)
    fake.cosine = 1.0
    fake.off_from = 0  # texts of this many tokens and more are off by fake.cosine

    def compile(model_dir, params, out_dir):  # noqa: A001 - the backend interface's name
        (Path(out_dir) / "model.gate").write_bytes(b"engine")
        return {"artifact": "model.gate", "embedding_dim": 2}

    def reference(model_dir, texts, params):
        return [[1.0, 0.0] for _ in texts]

    def load(engine_dir, params):
        def run(input_ids, attention_mask):
            rows = []
            for length in attention_mask.sum(dim=1).tolist():
                c = fake.cosine if length >= fake.off_from else 1.0
                rows.append([c, math.sqrt(1 - c * c)] if not math.isnan(c) else [c, c])
            return torch.tensor(rows)
        return run

    fake.compile, fake.reference, fake.load, fake.version = compile, reference, load, lambda: "gate-1"
    fake.prepare = lambda device: None
    fake.exec_serve = lambda out_dir, data, host, port: None
    monkeypatch.setitem(sys.modules, MODULE, fake)
    monkeypatch.setitem(BACKENDS, "gate", BackendInfo(module=MODULE.rpartition(".")[2], own_server=False,
                                                      version_is_torch=False, prepares=False))
    return fake


@pytest.fixture
def model(tmp_path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "bert"}))
    build_tokenizer().save(str(model / "tokenizer.json"))
    return model


def gate_params() -> EngineParams:
    """Made inside a test: the gate backend exists only while the backend fixture registers it."""
    return EngineParams(backend="gate", max_batch=4, max_seq_len=32)


def refused_message(model: Path, cosine: float, threshold: float) -> str:
    # the stand-in is off by the same cosine at every length: the first class is the worst
    return (f"the gate engine of {model.resolve()} reaches cosine {cosine} vs the fp32 reference (worst: 1-8-token "
            f"texts, min {round(cosine, 6)}), below --min-cosine {threshold}: refused, no engine written")


def assert_nothing_written(out: Path) -> None:
    assert not (out / fingerprint.ENGINE_JSON).exists()
    assert not (out / fingerprint.ENGINE_SUBDIR).exists()
    assert not (out / ".engine.staging").exists()
    assert not (out / "reference.json").exists()


@pytest.mark.parametrize("cosine, threshold", [(0.85, 0.99), (0.989999, 0.99), (0.5, 0.6), (-0.2, 0.0)])
def test_an_engine_below_the_threshold_is_refused(backend, model, tmp_path, cosine, threshold):
    backend.cosine = cosine
    out = tmp_path / "out"
    with pytest.raises(CompileError) as exc:
        compile_engine(model, out, gate_params(), min_cosine=threshold)
    assert exc.value.exit_code == 4
    assert str(exc.value) == refused_message(model, cosine, threshold)
    assert_nothing_written(out)


def test_an_engine_that_answers_nan_is_refused(backend, model, tmp_path):
    backend.cosine = float("nan")
    with pytest.raises(CompileError,
                       match=r"reaches cosine nan vs the fp32 reference \(worst: .*\), below --min-cosine 0.5"):
        compile_engine(model, tmp_path / "out", gate_params(), min_cosine=0.5)
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("cosine, threshold", [(0.85, 0.85), (0.9, 0.85), (1.0, 0.999)])
def test_an_engine_at_or_above_the_threshold_is_written(backend, model, tmp_path, cosine, threshold):
    backend.cosine = cosine
    out = tmp_path / "out"
    summary = compile_engine(model, out, gate_params(), min_cosine=threshold)
    assert summary["engine_min_cosine"] == cosine
    assert json.loads((out / "reference.json").read_text())["engine_min_cosine"] == cosine
    assert guard.check(out)["engine_sha256"] == summary["engine_sha256"]  # complete and servable


def test_the_default_threshold(backend, model, tmp_path):
    assert DEFAULT_MIN_COSINE == 0.99
    backend.cosine = 0.95
    with pytest.raises(CompileError) as exc:
        compile_engine(model, tmp_path / "out", gate_params())
    assert str(exc.value) == refused_message(model, 0.95, 0.99)
    backend.cosine = 0.99
    assert compile_engine(model, tmp_path / "out", gate_params())["engine_min_cosine"] == 0.99


def test_a_refused_recompile_leaves_no_earlier_engine_behind(backend, model, tmp_path):
    out = tmp_path / "out"
    compile_engine(model, out, gate_params())
    backend.cosine = 0.5
    with pytest.raises(CompileError):
        compile_engine(model, out, gate_params())
    assert not (out / fingerprint.ENGINE_JSON).exists() and not (out / fingerprint.ENGINE_SUBDIR).exists()


def test_the_gate_compares_the_exact_figure_not_the_rounded_one(backend, model, tmp_path):
    backend.cosine = 0.9899996  # 0.99 when rounded to 6 places, as engine.json records it
    with pytest.raises(CompileError) as err:
        compile_engine(model, tmp_path / "out", gate_params(), min_cosine=0.99)
    assert "reaches cosine 0.98999" in err.value.message and "below --min-cosine 0.99" in err.value.message


def test_a_refused_compile_leaves_no_earlier_reference_or_stats(backend, model, tmp_path):
    out = tmp_path / "out"
    compile_engine(model, out, gate_params())
    assert (out / "reference.json").is_file() and (out / ".compile-stats.json").is_file()
    backend.cosine = 0.5
    with pytest.raises(CompileError):
        compile_engine(model, out, gate_params())
    assert not (out / "reference.json").exists() and not (out / ".compile-stats.json").exists()


def test_without_verify_there_is_no_figure_to_gate(backend, model, tmp_path):
    backend.cosine = 0.1
    summary = compile_engine(model, tmp_path / "out", gate_params(), verify=False, min_cosine=0.99)
    assert summary["engine_min_cosine"] is None
    assert (tmp_path / "out" / fingerprint.ENGINE_JSON).is_file()


def compile_cli(model: Path, out: Path, *extra: str) -> int:
    return cli.main(["compile", "--model", str(model), "--out", str(out), "--backend", "gate", "--max-batch", "4",
                     "--max-seq-len", "32", *extra])


def test_cli_refuses_with_exit_4_and_the_figure(backend, model, tmp_path, capsys):
    backend.cosine = 0.85
    assert compile_cli(model, tmp_path / "out", "--min-cosine", "0.97") == 4
    assert capsys.readouterr().err == f"error: {refused_message(model, 0.85, 0.97)}\n"
    assert_nothing_written(tmp_path / "out")


def test_cli_default_threshold_and_pass(backend, model, tmp_path, capsys):
    backend.cosine = 0.98
    assert compile_cli(model, tmp_path / "a") == 4
    assert capsys.readouterr().err == f"error: {refused_message(model, 0.98, 0.99)}\n"
    assert compile_cli(model, tmp_path / "b", "--min-cosine", "0.98") == 0
    assert json.loads(capsys.readouterr().out)["engine_min_cosine"] == 0.98


@pytest.mark.parametrize("value", ["1.5", "-2", "nan"])
def test_cli_refuses_a_threshold_outside_the_cosine_range(backend, model, tmp_path, capsys, value):
    assert compile_cli(model, tmp_path / "out", "--min-cosine", value) == 2
    assert capsys.readouterr().err == f"error: --min-cosine must be in -1..1, got {float(value)}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("variant_id, flag", [("minilm-embed:cpu", "  --min-cosine 0.995 \\\n"),
                                              ("qwen3-embed:cu130-sm90-aot", "  --min-cosine 0.995 \\\n"),
                                              ("qwen3-chat:cu130-sm90-trtllm", None)])  # --no-verify: no figure
def test_the_recipes_min_cosine_reaches_the_compile_step(variant_id, flag):
    from builder.matrix import load_matrix
    from builder.plan import make_plan
    from builder.render import render_variant

    repo = Path(__file__).resolve().parents[2]
    matrix = load_matrix(repo / "matrix.yaml")
    plan = make_plan(matrix)
    variant = next(v for v in plan.variants if v.id == variant_id)
    images = tuple(dataclasses.replace(e, recipe=dataclasses.replace(e.recipe, min_cosine=0.995))
                   if e.name == variant.image else e for e in matrix.images)
    script = render_variant(dataclasses.replace(matrix, images=images), variant, repo / "templates", "0" * 64,
                            plan.variants).files["compile.sh"]
    # The rendered command line, as the runtime CLI in the image parses it.
    command = shlex.split(script.split("exec python -m mopt_runtime ", 1)[1].replace("\\\n", " "))
    args = cli.build_parser().parse_args(command)
    if flag is None:
        assert args.min_cosine is None and args.verify is False
    else:
        assert script.count("--min-cosine") == 1 and flag in script
        assert args.min_cosine == 0.995 and args.verify is True


def test_the_gate_covers_every_length_and_names_the_worst_class(backend, model, tmp_path):
    """An engine right on short texts and wrong from 17 tokens on (a window ignored, say) is refused, the
    message naming the class; a passing engine records min and mean per class in engine.json."""
    backend.cosine, backend.off_from = 0.9, 17
    with pytest.raises(CompileError, match=r"reaches cosine 0.9 .*\(worst: 9-32-token texts, min 0.9\)"):
        compile_engine(model, tmp_path / "out", gate_params())
    backend.cosine = 0.995
    compile_engine(model, tmp_path / "out", gate_params())
    ref = json.loads((tmp_path / "out" / "reference.json").read_text())
    assert set(ref["tokens"]) >= {1, 2, 4, 8, 16, 32} and max(ref["tokens"]) == 32
    classes = fingerprint.read(tmp_path / "out")["accuracy_by_length"]
    assert classes == ref["classes"] and list(classes) == ["1-8", "9-32"]
    assert classes["1-8"]["min"] == 1.0 and classes["9-32"]["min"] == 0.995 < classes["9-32"]["mean"] < 1.0
    whole = fingerprint.read(tmp_path / "out")["accuracy"]
    counts = {name: c["texts"] for name, c in classes.items()}
    mean = (counts["1-8"] * classes["1-8"]["mean"] + counts["9-32"] * classes["9-32"]["mean"]) / sum(counts.values())
    assert whole == {"precision": "fp32", "texts": len(ref["texts"]), "min": 0.995, "mean": round(mean, 6),
                     "min_cosine": 0.99}
