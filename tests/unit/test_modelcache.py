"""The engine cache of a mounted model (builder/runtime/modelcache.py: serve/warm --model-id): a miss
compiles (a real AOTInductor compile of the tiny Qwen3, in a child process, behind the accuracy gate),
a hit loads, a tampered or foreign entry is refused and rebuilt, a changed model gets its own entry,
two processes on one cache compile once, a read-only cache serves what it holds and nothing else."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the runtime needs torch")
pytest.importorskip("transformers", reason="the runtime needs transformers")

from builder.runtime import fingerprint, modelcache  # noqa: E402
from builder.runtime.__main__ import main  # noqa: E402
from builder.runtime.errors import GuardError, UsageError  # noqa: E402
from builder.runtime.hostinfo import HostFacts  # noqa: E402
from builder.runtime.params import EngineParams  # noqa: E402
from builder.runtime.tiny_qwen3 import make_tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.runtime
REPO = Path(__file__).resolve().parents[2]
PARAMS = EngineParams(max_batch=2, max_seq_len=32, pooling="last")
FLAGS = ["--pooling", "last", "--max-seq-len", "32", "--max-batch", "2"]


def source(model: Path, cache: Path, params: EngineParams = PARAMS) -> modelcache.ModelSource:
    return modelcache.model_source(str(model), str(cache), params, {"pooling", "max_seq_len", "max_batch"},
                                   min_cosine=0.99)


def warm(model: Path, cache: Path, *extra: str) -> subprocess.Popen:
    """`python -m builder.runtime warm` as a process of its own (what a second container is)."""
    return subprocess.Popen([sys.executable, "-m", "builder.runtime", "warm", "--model-id", str(model),
                             "--cache-dir", str(cache), *FLAGS, *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def outcome_of(proc: subprocess.Popen, timeout: float = 600) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("mounted") / "model", seed=3)


@pytest.fixture(scope="module")
def filled(tiny, tmp_path_factory) -> tuple[Path, modelcache.CacheResult]:
    cache = tmp_path_factory.mktemp("cache")
    first = modelcache.resolve_cached(source(tiny, cache))
    return cache, first


def test_a_miss_compiles_behind_the_gate_and_a_hit_loads(tiny, filled, capsys):
    cache, first = filled
    assert first.outcome == "compiled" and first.engine_dir.parent == cache.resolve() / "engines"
    data = fingerprint.read(first.engine_dir)
    assert data["cache"]["key"] == first.key and data["model_digest"] == fingerprint.model_digest(tiny)
    reference = json.loads((first.engine_dir / "reference.json").read_text())
    assert reference["engine_min_cosine"] >= 0.99 and reference["min_cosine"] == 0.99
    assert not list((cache / "engines").glob(".tmp-*")), "the compile's temporary dir was renamed into place"
    again = modelcache.resolve_cached(source(tiny, cache))
    assert (again.outcome, again.engine_dir, again.key) == ("hit", first.engine_dir, first.key)
    assert again.data["engine_sha256"] == data["engine_sha256"]
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert {"event": "engine-cache", "outcome": "hit", "key": first.key}.items() <= events[-1].items()


def test_the_mount_path_and_served_name_do_not_change_the_key(tiny, filled, tmp_path):
    cache, first = filled
    elsewhere = tmp_path / "same-model-elsewhere"
    shutil.copytree(tiny, elsewhere)
    assert modelcache.resolve_cached(source(elsewhere, cache)).key == first.key


def test_a_tampered_entry_is_refused_and_rebuilt(tiny, filled, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(filled[0], cache)
    entry = cache / "engines" / filled[1].key
    weights = next(p for p in (entry / "engine").rglob("*") if p.is_file() and p.suffix != ".json")
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # a flipped byte (a zero written over a zero is none)
    rebuilt = modelcache.resolve_cached(source(tiny, cache))
    assert rebuilt.outcome == "rebuilt" and "integrity" in rebuilt.reason
    assert modelcache.resolve_cached(source(tiny, cache)).outcome == "hit"
    assert not list((cache / "engines").glob(".refused-*")), "the refused entry is removed"


def test_an_entry_recording_another_key_or_model_is_refused(tiny, filled, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(filled[0], cache)
    key = filled[1].key
    entry = cache / "engines" / key
    facts = modelcache_facts()
    digest = fingerprint.model_digest(tiny)
    assert modelcache._entry_problem(entry, key, digest, facts)[0] is None
    data = json.loads((entry / "engine.json").read_text())
    fingerprint.write(entry, {**data, "cache": {"key": "0" * 32}})
    assert "records key" in modelcache._entry_problem(entry, key, digest, facts)[0]
    fingerprint.write(entry, {**data, "model_digest": "1" * 64})
    assert "another model digest" in modelcache._entry_problem(entry, key, digest, facts)[0]
    fingerprint.write(entry, data)
    (entry / "engine" / "planted.so").write_bytes(b"\x7fELF")  # a file the engine's record does not list
    assert "does not list: planted.so" in modelcache._entry_problem(entry, key, digest, facts)[0]
    (entry / "engine.json").unlink()
    assert "incomplete" in modelcache._entry_problem(entry, key, digest, facts)[0]


def modelcache_facts() -> HostFacts:
    from builder.runtime.hostinfo import host_facts

    return host_facts()


def test_a_changed_model_gets_its_own_entry_and_its_digest_is_taken_again(tiny, filled, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    shutil.copytree(filled[0], cache)
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    hashed = []
    real = fingerprint.model_digest
    monkeypatch.setattr(fingerprint, "model_digest", lambda d: hashed.append(d) or real(d))
    first = modelcache.model_digest(model, cache)
    assert modelcache.model_digest(model, cache) == first and len(hashed) == 1, "the stat memo answers"
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "mopt_test_note": "edited"}))
    changed = modelcache.model_digest(model, cache)
    assert changed != first and len(hashed) == 2
    facts = modelcache_facts()
    rid = modelcache.runtime_identity()
    key = modelcache.cache_key
    assert key(changed, PARAMS, rid, facts, 0.99, "AVX2") != key(first, PARAMS, rid, facts, 0.99, "AVX2")


def test_a_read_only_cache_serves_what_it_holds_and_refuses_the_rest(tiny, filled, tmp_path, monkeypatch):
    cache, first = filled
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(".lock") or flags & os.O_CREAT:
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(modelcache.os, "open", read_only)
    assert modelcache.resolve_cached(source(tiny, cache)).outcome == "hit"
    other = replace(PARAMS, max_seq_len=16)
    with pytest.raises(GuardError, match="read-only and holds no engine"):
        modelcache.resolve_cached(source(tiny, cache, other))


def test_a_failed_compile_leaves_no_entry_and_exits_with_its_code(tiny, tmp_path):
    model = tmp_path / "unknown-arch"
    shutil.copytree(tiny, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "no-such-family",
                                                   "architectures": ["NoSuchModel"]}))
    proc = warm(model, tmp_path / "cache")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: compiling")
    assert not [p for p in (tmp_path / "cache" / "engines").iterdir() if not p.name.endswith(".lock")]


@pytest.mark.parametrize(("model_id", "cache", "message"), [
    ("hf://Qwen/Qwen3-Embedding-0.6B", "c", "only a mounted model directory"),
    ("/no/such/dir", "c", "not a directory"),
    ("MODEL", None, "needs --cache-dir"),
    ("MODEL", "MODEL/cache", "overlap"),
])
def test_bad_arguments_are_one_line_usage_errors(tiny, tmp_path, model_id, cache, message):
    model_id = str(tiny) if model_id == "MODEL" else model_id
    cache = cache and (cache.replace("MODEL", str(tiny)) if cache.startswith("MODEL") else str(tmp_path / cache))
    with pytest.raises(UsageError, match=message):
        modelcache.model_source(model_id, cache, PARAMS, set(), min_cosine=0.99)


def test_a_model_without_a_fast_tokenizer_is_refused(tiny, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    (model / "tokenizer.json").unlink()
    with pytest.raises(UsageError, match="no tokenizer.json"):
        modelcache.model_source(str(model), str(tmp_path / "c"), PARAMS, set(), min_cosine=0.99)


def test_serve_needs_an_engine_dir_or_a_model(monkeypatch, capsys):
    monkeypatch.delenv("MOPT_ENGINE_DIR", raising=False)
    monkeypatch.delenv("MOPT_MODEL_ID", raising=False)
    assert main(["serve"]) == 2
    assert capsys.readouterr().err.strip() == "error: give --engine-dir (MOPT_ENGINE_DIR) or --model-id (MOPT_MODEL_ID)"


def test_engine_params_from_the_image_and_flags(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOPT_ENGINE_PARAMS", json.dumps({"max_seq_len": 16, "precision": "fp32"}))
    from builder.runtime.__main__ import _model_source, build_parser

    args = build_parser().parse_args(["warm", "--model-id", str(tiny), "--cache-dir", str(tmp_path),
                                      "--max-batch", "3", "--pooling", "last"])
    got = _model_source(args).params
    assert (got.max_seq_len, got.max_batch, got.pooling, got.model_dir) == (16, 3, "last", str(tiny.resolve()))
    monkeypatch.setenv("MOPT_ENGINE_PARAMS", json.dumps({"max_seq_len": "16"}))
    args = build_parser().parse_args(["warm", "--model-id", str(tiny), "--cache-dir", str(tmp_path)])
    with pytest.raises(UsageError, match="max_seq_len must be int"):
        _model_source(args)


def test_an_unreadable_model_is_one_usage_error(tiny, tmp_path, monkeypatch):
    def unreadable(_):
        raise PermissionError(13, "Permission denied", str(tiny / "model.safetensors"))

    monkeypatch.setattr(fingerprint, "model_digest", unreadable)
    with pytest.raises(UsageError, match="Permission denied .*model.safetensors"):
        modelcache.resolve_cached(source(tiny, tmp_path / "fresh"))


def test_engine_dir_and_model_id_both_given_is_a_usage_error(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MOPT_ENGINE_DIR", raising=False)
    assert main(["serve", "--engine-dir", str(tmp_path), "--model-id", str(tiny), "--cache-dir",
                 str(tmp_path / "c")]) == 2
    assert "not both" in capsys.readouterr().err
