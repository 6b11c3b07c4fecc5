"""Pooling and normalisation from the model's own sentence-transformers files (builder/runtime/
conventions.py), through the compile command: a CLS-pooled model gets CLS pooling without a flag, a flag
or params file that contradicts the files is one usage error (exit 2) unless --force-pooling."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from builder.runtime.conventions import apply_conventions, read_conventions
from builder.runtime.errors import UsageError
from builder.runtime.params import EngineParams
from tests.unit.test_runtime_minilm import minilm_dir

REPO = Path(__file__).resolve().parents[2]


def st_model(tmp_path: Path, pooling: dict | None, normalize: bool, prompts: dict | None = None) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (tmp_path / "1_Pooling").mkdir(parents=True, exist_ok=True)
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if prompts is not None:
        (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    return tmp_path


@pytest.mark.parametrize("pooling, want", [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode_lasttoken": True}, "last"),
    ({}, None),
])
def test_the_pooling_module_decides(tmp_path, pooling, want):
    conv = read_conventions(st_model(tmp_path, pooling, normalize=True, prompts={"query": "q: ", "bad": 3}))
    assert conv.pooling == want and conv.normalize is True and conv.prompts == {"query": "q: "}


def test_without_sentence_transformers_files_nothing_is_said(tmp_path):
    conv = read_conventions(tmp_path)
    assert (conv.pooling, conv.normalize, conv.prompts) == (None, None, {})
    assert read_conventions(st_model(tmp_path, None, normalize=False)).normalize is False


def test_an_unserved_pooling_mode_is_refused(tmp_path):
    with pytest.raises(UsageError, match=r"pooling \(pooling_mode_max_tokens\) is not one mopt serves"):
        read_conventions(st_model(tmp_path, {"pooling_mode_max_tokens": True}, normalize=False))


def test_the_files_fill_what_is_not_given_and_refuse_what_contradicts(tmp_path):
    model = st_model(tmp_path, {"pooling_mode_cls_token": True}, normalize=False)
    params = EngineParams(max_batch=4, max_seq_len=32)  # pooling mean, normalize false by default
    assert apply_conventions(params, model, given=set()).pooling == "cls"
    assert apply_conventions(params, model, given={"pooling"}, force=True).pooling == "mean"
    with pytest.raises(UsageError, match=r"^pooling mean contradicts the model's sentence-transformers files "
                                         r"\(pooling cls, in .*\): drop it to use the model's, "
                                         r"or pass --force-pooling$"):
        apply_conventions(params, model, given={"pooling"})
    with pytest.raises(UsageError, match=r"^normalize true contradicts .*\(normalize false"):
        apply_conventions(EngineParams(max_batch=4, max_seq_len=32, normalize=True, pooling="cls"), model,
                          given={"normalize", "pooling"})


@pytest.mark.timeout(600)
def test_a_cls_pooled_model_compiles_with_cls_pooling_without_a_flag(tmp_path):
    """MiniLM's weights with its Pooling module switched to CLS: the compile takes CLS from the files, the
    engine's vectors are the CLS vectors (its reference says so, and the gate checks the engine against
    it), and --pooling mean is refused without --force-pooling."""
    model = tmp_path / "model"
    shutil.copytree(minilm_dir(), model)
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))

    def compile_(*flags):
        return subprocess.run([sys.executable, "-m", "builder.runtime", "compile", "--model", str(model), "--out",
                               str(tmp_path / "out"), "--max-batch", "4", "--max-seq-len", "32", *flags],
                              cwd=REPO, capture_output=True, text=True, timeout=500)

    refused = compile_("--pooling", "mean")
    assert refused.returncode == 2 and "pooling mean contradicts the model's sentence-transformers files" \
        in refused.stderr and "Traceback" not in refused.stderr
    done = compile_()
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "out" / "engine.json").read_text())
    assert data["params"]["pooling"] == "cls" and data["params"]["normalize"] is True
    assert json.loads((tmp_path / "out" / "reference.json").read_text())["pooling"] == "cls"
