"""The tiny Qwen3 generator (deterministic, offline tokenizer, Qwen3-Embedding conventions) and a
last-token-pooled engine compiled from it; also the opt-in recompile-on-mismatch path."""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the runtime needs torch")
pytest.importorskip("transformers", reason="the runtime needs transformers")

from builder.runtime import fingerprint, guard  # noqa: E402
from builder.runtime.compiler import compile_engine  # noqa: E402
from builder.runtime.engine import Engine  # noqa: E402
from builder.runtime.errors import GuardError  # noqa: E402
from builder.runtime.params import EngineParams  # noqa: E402
from builder.runtime.tiny_qwen3 import EOS, make_tiny_qwen3  # noqa: E402
from builder.runtime.tokenization import TextEncoder  # noqa: E402

pytestmark = pytest.mark.runtime
REPO = Path(__file__).resolve().parents[2]
TASK = "Given a web search query, retrieve relevant passages"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tiny_engine(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-engine") / "out"
    params = EngineParams(max_batch=4, max_seq_len=32, pooling="last", instruction=TASK,
                          model_dir=str(tiny), model_name="tiny-qwen3")
    image = {"repository": "mopt/tiny", "tags_by_sm": {"cpu": "cpu"}}
    summary = compile_engine(tiny, out, params, image=image,
                             reference_texts=["hello world", "the cat is on the tree", "paris is in france"])
    assert summary["engine_min_cosine"] >= 0.999
    return out


def test_generator_cli_is_deterministic(tmp_path, tiny):
    proc = subprocess.run([sys.executable, "-m", "builder.runtime", "make-tiny-qwen3", "--out",
                           str(tmp_path / "a"), "--seed", "0"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model_sha256"] == sha(tiny / "model.safetensors")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert sha(tmp_path / "a" / name) == sha(tiny / name)
    other = make_tiny_qwen3(tmp_path / "b", seed=1)
    assert sha(other / "model.safetensors") != sha(tiny / "model.safetensors")


def test_generator_checkpoint_shape_and_vocab(tiny):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny)
    assert cfg.model_type == "qwen3" and cfg.num_hidden_layers == 2 and cfg.hidden_size == 64
    assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2 and cfg.head_dim == 16
    enc = TextEncoder(tiny, pooling="last")
    assert enc.vocab_size == cfg.vocab_size
    assert enc.tok.token_to_id(EOS) == enc.eos_id == cfg.eos_token_id


def test_qwen3_conventions(tiny):
    enc = TextEncoder(tiny, pooling="last", instruction=TASK)
    ids = enc.encode(["hello world", "cat"])
    assert all(seq[-1] == enc.eos_id for seq in ids)  # end-of-text appended
    assert enc.encode(["hello world" + EOS])[0].count(enc.eos_id) == 1  # not appended twice
    batch = enc.pad(ids, 8)
    assert batch.attention_mask[1][:5] == [0] * 5 and batch.input_ids[1][-2:] == ids[1]  # left padding
    assert enc.format_query("what is paris") == f"Instruct: {TASK}\nQuery:what is paris"
    assert TextEncoder(tiny, pooling="mean").pad([[5]], 3).input_ids == [[5, enc.pad_id, enc.pad_id]]


def test_tiny_engine_last_token_pooling_matches_reference(tiny_engine, tiny):
    data = fingerprint.read(tiny_engine)
    assert data["params"]["pooling"] == "last" and data["embedding_dim"] == 64
    ref = json.loads((tiny_engine / "reference.json").read_text())
    eng = Engine.open(tiny_engine)
    got = eng.embed_texts(ref["texts"])  # left-padded batch vs unpadded one-by-one reference
    for g, w in zip(got, ref["embeddings"], strict=True):
        assert abs(math.hypot(*g) - 1) < 1e-4
        assert sum(a * b for a, b in zip(g, w, strict=True)) >= 0.999
    # Queries get the instruction, so they embed differently from the bare text.
    assert eng.embed_texts(["hello world"], query=True)[0] != got[0]


def test_tiny_engine_last_pooling_uses_last_token(tiny_engine):
    eng = Engine.open(tiny_engine)
    a, b = eng.embed_texts(["cat dog", "dog cat"])
    assert sum(x * y for x, y in zip(a, b, strict=True)) < 0.999  # order matters for a causal model


def test_recompile_on_mismatch_into_cache(tiny_engine, tmp_path):
    data = json.loads((tiny_engine / "engine.json").read_text())
    out = tmp_path / "old"
    (out).mkdir()
    (out / "engine").symlink_to(tiny_engine / "engine", target_is_directory=True)
    (out / "reference.json").write_bytes((tiny_engine / "reference.json").read_bytes())
    (out / "engine.json").write_text(json.dumps({**data, "torch": "2.0.0"}))
    with pytest.raises(GuardError, match="torch 2.0.0"):
        guard.resolve(out, env={})
    env = {guard.ENV_RECOMPILE: "1", guard.ENV_CACHE: str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "builder.runtime", "check", "--engine-dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    served = Path(json.loads(proc.stdout)["engine_dir"])
    assert served.parent == tmp_path / "cache"
    new = fingerprint.read(served)
    assert new["recompiled_from"] == str(out.resolve()) and "torch 2.0.0" in new["recompile_reason"]
    before = (served / "engine.json").stat().st_mtime_ns
    again, _ = guard.resolve(out, env=env)  # next start reuses the cached engine
    assert again == served and (served / "engine.json").stat().st_mtime_ns == before
    ref = json.loads((out / "reference.json").read_text())
    got = Engine.open(served).embed_texts(ref["texts"])
    assert all(sum(a * b for a, b in zip(g, w, strict=True)) >= 0.999
               for g, w in zip(got, ref["embeddings"], strict=True))
