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
    original = json.loads((tiny_engine / "reference.json").read_text())
    (out / "reference.json").write_text(json.dumps({**original, "min_cosine": 0.9991}))  # the recipe's threshold
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
    assert json.loads((served / "reference.json").read_text())["min_cosine"] == 0.9991  # the same gate
    before = (served / "engine.json").stat().st_mtime_ns
    again, _ = guard.resolve(out, env=env)  # next start reuses the cached engine
    assert again == served and (served / "engine.json").stat().st_mtime_ns == before
    ref = json.loads((out / "reference.json").read_text())
    got = Engine.open(served).embed_texts(ref["texts"])
    assert all(sum(a * b for a, b in zip(g, w, strict=True)) >= 0.999
               for g, w in zip(got, ref["embeddings"], strict=True))


MIXED = ["hello", "paris is the capital of france and a large city with many museums", "the cat is on the tree"]


def _padded_embeddings(tiny: Path, attention: str, pad_left: bool) -> tuple[list, list]:
    """(batched embeddings with the given padding side, unpadded one-by-one embeddings) of MIXED."""
    import torch

    from builder.runtime.backends.torch_common import build_module

    params = EngineParams(backend="torch-inductor", pooling="last", attention=attention, max_batch=4, max_seq_len=32)
    module = build_module(str(tiny), params, torch.float32, "cpu")
    enc = TextEncoder(tiny, pooling="last", pad_left=pad_left)
    seqs = enc.encode(MIXED)
    batch = enc.pad(seqs, max(map(len, seqs)))
    with torch.no_grad():
        got = module(torch.tensor(batch.input_ids), torch.tensor(batch.attention_mask)).tolist()
        alone = [module(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0].tolist() for s in seqs]
    return got, alone


def _min_cos(a, b) -> float:
    return min(sum(x * y for x, y in zip(u, v, strict=True)) for u, v in zip(a, b, strict=True))


def test_causal_attention_right_padded_batch_is_exact(tiny):
    """attention 'causal' (no mask tensor, SDPA is_causal) with right padding embeds a mixed-length
    batch like one text at a time, and like the model's own masked attention."""
    got, alone = _padded_embeddings(tiny, "causal", pad_left=False)
    assert _min_cos(got, alone) >= 0.99999
    masked, _ = _padded_embeddings(tiny, "mask", pad_left=True)
    assert _min_cos(got, masked) >= 0.99999
    # The padding side is what makes it exact: left padding without a mask lets real tokens see pads.
    wrong, _ = _padded_embeddings(tiny, "causal", pad_left=True)
    assert _min_cos(wrong, alone) < 0.999


def test_causal_attention_params_pad_right_and_graph_has_no_mask(tiny):
    import torch

    from builder.runtime.backends import torch_common

    params = EngineParams(backend="torch-inductor", pooling="last", attention="causal", max_batch=4, max_seq_len=32)
    assert not params.pad_left and EngineParams(pooling="last").pad_left
    exported, _ = torch_common.export_graph(torch_common.build_module(str(tiny), params, torch.float32, "cpu"),
                                    torch_common.example_inputs(4, 16, "cpu", params.pad_left), params)
    sdpa = [n for n in exported.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert sdpa and all(n.args[3] is None and n.args[5] is True for n in sdpa)  # attn_mask None, is_causal


def test_causal_attention_refused_for_bidirectional_model(tmp_path):
    from transformers import BertConfig, BertModel

    from builder.runtime.errors import UsageError
    from builder.runtime.pooling import load_body

    BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(tmp_path / "bert")
    with pytest.raises(UsageError, match="bidirectional"):
        load_body(str(tmp_path / "bert"), __import__("torch").float32, "cpu", "causal")
    with pytest.raises(UsageError, match="--attention causal is implemented for"):
        EngineParams(backend="tensorrt", attention="causal")


def test_causal_attention_engine_cli(tiny, tmp_path):
    """The compile CLI with --attention causal: verified against the fp32 reference on mixed lengths."""
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(MIXED))
    proc = subprocess.run([sys.executable, "-m", "builder.runtime", "compile", "--model", str(tiny), "--out",
                           str(tmp_path / "out"), "--backend", "torch-aot", "--pooling", "last", "--attention",
                           "causal", "--max-batch", "4", "--max-seq-len", "32", "--reference-texts", str(texts)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["engine_min_cosine"] >= 0.9999
    eng = Engine.open(tmp_path / "out")
    assert eng.params.attention == "causal" and not eng.encoder.pad_left


STATIC_LIBSTDCXX_CXX = """#!/bin/sh
# g++, but a shared-library link carries a libstdc++ of its own (what the H200 machine's compiler did)
case " $* " in *" -shared "*) exec g++ "$@" -static-libstdc++ ;; esac
exec g++ "$@"
"""


def test_torch_aot_package_that_does_not_load_fails_the_compile(tiny, tmp_path):
    """A .so with its own libstdc++ (the cause of the CUDA .pt2 crash on the H200 machine) fails in
    the load check of the compile step, exit 4, with the cause named; no engine.json is written."""
    cxx = tmp_path / "g++-static-libstdcxx"
    cxx.write_text(STATIC_LIBSTDCXX_CXX)
    cxx.chmod(0o755)
    # TMPDIR: torch's package loader leaves its unpacked copy behind when the load fails
    env = dict(os.environ, CXX=str(cxx), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"),
               TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "builder.runtime", "compile", "--model", str(tiny), "--out",
                           str(tmp_path / "out"), "--backend", "torch-aot", "--pooling", "last", "--max-batch", "2",
                           "--max-seq-len", "16", "--no-verify"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "does not load: a fresh process loading it" in proc.stderr
    assert f"the C++ compiler ({cxx}) linked a libstdc++ of its own" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list((tmp_path / "out").iterdir()) == []  # no engine.json, no half-built staging dir


def test_torch_aot_load_needs_no_inductor_import(tiny_engine):
    """The serve path of a torch-aot engine: guard, load, first embedding without importing
    torch._inductor or Dynamo (their imports are seconds of a GPU start)."""
    code = ("import sys; from builder.runtime.engine import Engine; from builder.runtime.guard import resolve\n"
            "d, info = resolve(sys.argv[1]); e = Engine.from_info(d, info); v = e.embed_texts(['hello world'])\n"
            "print(info['backend'], len(v[0]), sorted(m for m in ('torch._inductor', 'torch._dynamo') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_engine)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["torch-aot", "64", "[]"]


def test_torch_aot_tunes_for_the_largest_shape_by_default(tiny_engine, monkeypatch):
    """The export example's sizes are the hints Inductor tunes kernels for: max_batch x max_seq_len
    unless MOPT_TUNE_SHAPE says otherwise; engine.json records the shape."""
    from builder.runtime.backends.torch_common import ENV_TUNE_SHAPE, tune_shape
    from builder.runtime.errors import UsageError

    assert fingerprint.read(tiny_engine)["tuned_for"] == "4x32"
    params = EngineParams(max_batch=64, max_seq_len=512)
    monkeypatch.delenv(ENV_TUNE_SHAPE, raising=False)
    assert tune_shape(params) == (64, 512)
    assert tune_shape(EngineParams(max_batch=1, max_seq_len=128)) == (1, 128)
    monkeypatch.setenv(ENV_TUNE_SHAPE, "16X128")
    assert tune_shape(params) == (16, 128)
    for bad, says in (("64", "expected BATCHxSEQ"), ("1x128", "batch must be 2..64"), ("8x1024", "sequence 2..512")):
        monkeypatch.setenv(ENV_TUNE_SHAPE, bad)
        with pytest.raises(UsageError, match=says):
            tune_shape(params)


def test_bad_tune_shape_is_one_message_exit_2(tiny, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "builder.runtime", "compile", "--model", str(tiny), "--out",
                           str(tmp_path / "out"), "--backend", "torch-aot", "--pooling", "last", "--max-batch", "4",
                           "--max-seq-len", "32", "--no-verify"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MOPT_TUNE_SHAPE="8x32"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "MOPT_TUNE_SHAPE='8x32': batch must be 2..4" in proc.stderr and "Traceback" not in proc.stderr
    assert list((tmp_path / "out").iterdir()) == []  # no engine.json, no half-built staging dir


def test_exported_graph_fuses_rms_norm_like_the_module(tiny):
    """The engines' graph has no export dtype asserts, and so Inductor fuses each RMSNorm's reduction
    with its normalisation (and the rotary embedding after it): no kernel computes mean(x^2) alone.
    With the asserts kept (torch 2.13 here), the per-head q/k norms split into a reduction kernel and
    a pointwise one."""
    import re

    import torch
    from torch._inductor.utils import run_and_get_code

    from builder.runtime.backends import torch_common

    params = EngineParams(backend="torch-aot", pooling="last", attention="causal", max_batch=4, max_seq_len=32)
    module = torch_common.build_module(str(tiny), params, torch.float32, "cpu")
    example = torch_common.example_inputs(4, 32, "cpu", params.pad_left)
    with torch.no_grad():
        exported, _ = torch_common.export_graph(module, example, params)
        assert not [n for n in exported.graph.nodes if "_assert_tensor_metadata" in str(n.target)]
        torch._dynamo.reset()
        _, code = run_and_get_code(torch.compile(exported.module(), dynamic=True), *example)
    kernels = set(re.findall(r"cpp_fused_\w+", "\n".join(code)))
    norms = [k for k in kernels if "mean" in k and "pow" in k]
    assert norms and all("rsqrt" in k for k in norms), sorted(kernels)


def test_inductor_options_from_the_environment(monkeypatch):
    """MOPT_INDUCTOR_OPTIONS adds Inductor config patches to the compile mode's, checked against
    this torch's config names; bad input is a UsageError naming the variable."""
    from builder.runtime.backends.torch_common import ENV_INDUCTOR_OPTIONS, inductor_options
    from builder.runtime.errors import UsageError

    monkeypatch.delenv(ENV_INDUCTOR_OPTIONS, raising=False)
    assert inductor_options("default") == {}
    assert "triton.cudagraphs" not in inductor_options("max-autotune-no-cudagraphs")
    monkeypatch.setenv(ENV_INDUCTOR_OPTIONS, '{"triton.max_tiles": 1}')
    assert inductor_options("default") == {"triton.max_tiles": 1}
    for bad, says in (("{", "not JSON"), ("[1]", "expected a JSON object"),
                      ('{"triton.no_such_knob": 1}', "not Inductor config names .*triton.no_such_knob")):
        monkeypatch.setenv(ENV_INDUCTOR_OPTIONS, bad)
        with pytest.raises(UsageError, match=f"{ENV_INDUCTOR_OPTIONS}: {says}"):
            inductor_options("default")


def _matmul_rotary_forward(self, x, position_ids):
    """RoPE tables as transformers 5.17 builds them (the H200 machine's): a k=1 matmul, transposed."""
    import torch

    inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
    freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def test_rotary_tables_as_a_product_same_values_no_matmul(tiny, monkeypatch):
    """The engines' module computes RoPE's tables as a broadcast product (rotary.py): the same values
    as transformers' k=1 matmul, with no matmul left in the exported graph (whose [d, s] output kept
    Inductor from fusing q/k norm + RoPE on the H200). The reference keeps the model's own forward."""
    import torch

    from builder.runtime.backends import torch_common
    from builder.runtime.rotary import rotary_as_product

    rotary_cls = type(torch_common.load_body(str(tiny), torch.float32, "cpu").rotary_emb)
    monkeypatch.setattr(rotary_cls, "forward", _matmul_rotary_forward)  # as on transformers 5.17
    params = EngineParams(backend="torch-aot", pooling="last", attention="causal", max_batch=4, max_seq_len=32)
    example = torch_common.example_inputs(4, 32, "cpu", params.pad_left)

    def rotary_matmuls(module) -> int:
        with torch.no_grad():
            exported, _ = torch_common.export_graph(module, example, params)
        # linears export as mm/addmm and attention as SDPA: a bmm or matmul here is the rotary table's
        return sum(1 for n in exported.graph.nodes if n.target in (torch.ops.aten.bmm.default,
                                                                   torch.ops.aten.matmul.default))

    model = torch_common.build_module(str(tiny), params, torch.float32, "cpu", model_rotary=True)
    ours = torch_common.build_module(str(tiny), params, torch.float32, "cpu")
    assert rotary_matmuls(model) >= 1 and rotary_matmuls(ours) == 0
    positions = torch.arange(32).unsqueeze(0).repeat(2, 1)
    x = torch.zeros(1, dtype=torch.bfloat16)
    for got, want in zip(ours.body.rotary_emb(x, positions), model.body.rotary_emb(x, positions), strict=True):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(ours(*example), model(*example))
    other = torch_common.load_body(str(tiny), torch.float32, "cpu")
    other.rotary_emb.rope_type = "dynamic"  # its decorator updates inv_freq per call: left alone
    assert rotary_as_product(other) == 0
