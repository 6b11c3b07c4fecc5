"""Packed engines (builder/runtime/packed.py) on the CPU: every sequence of a call in one token stream.
Exactness against the model run one text at a time, for a bidirectional encoder (the real
all-MiniLM-L6-v2, mean pooling) and a causal decoder with grouped-query attention (the tiny Qwen3,
last-token pooling); the exported graph takes one sequence of one token as well as many; a compiled
torch-aot or torch-inductor engine matches its reference and keeps each call within its token budget."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from builder.runtime.backends import BACKENDS
from builder.runtime.backends.torch_common import build_module, export_graph, tuned_example
from builder.runtime.engine import Engine, pack_calls
from builder.runtime.errors import UsageError
from builder.runtime.packed import pack
from builder.runtime.params import EngineParams
from builder.runtime.tiny_qwen3 import make_tiny_qwen3
from tests.unit.test_runtime_minilm import minilm_dir, runtime_cli

LENGTHS = (5, 17, 1, 64, 33, 2)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


def modules(model_dir, pooling: str, attention: str = "mask"):
    """(packed module, padded module) of the same weights, fp32 on the CPU."""
    padded = EngineParams(pooling=pooling, max_batch=8, max_seq_len=64, attention=attention)
    packed = EngineParams(pooling=pooling, max_batch=8, max_seq_len=64, input_form="packed")
    return (build_module(str(model_dir), packed, torch.float32, "cpu"),
            build_module(str(model_dir), padded, torch.float32, "cpu"))


def one_at_a_time(module, seqs):
    with torch.no_grad():
        return torch.stack([module(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0] for s in seqs])


def random_seqs(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_a_packed_call_equals_each_text_alone(family, tiny_qwen3):
    model_dir, pooling = (minilm_dir(), "mean") if family == "encoder" else (tiny_qwen3, "last")
    packed, padded = modules(model_dir, pooling)
    seqs = random_seqs(packed.body.config.vocab_size)
    with torch.no_grad():
        got = packed(*pack(seqs))
    want = one_at_a_time(padded, seqs)
    assert got.shape == want.shape == (len(seqs), packed.body.config.hidden_size)
    assert (got - want).abs().max().item() < 1e-5
    # Each sequence's result does not depend on its neighbours: alone, reversed, in another mix.
    with torch.no_grad():
        alone = packed(*pack(seqs[3:4]))
        reversed_ = packed(*pack(seqs[::-1])).flip(0)
    assert (alone[0] - got[3]).abs().max().item() < 1e-5 and (reversed_ - got).abs().max().item() < 1e-5
    # A call of equal lengths goes as [sequences, length] and takes dense attention: the same results.
    same = random_seqs(packed.body.config.vocab_size, (9, 9, 9), seed=3)
    ids, _, _ = pack(same, dense=True)
    assert ids.shape == (3, 9) and pack(same[:1], dense=True)[0].shape == (1, 9)
    assert pack(same)[0].shape == (1, 27)  # an engine without dense packing: one stream
    with torch.no_grad():
        assert (packed(*pack(same, dense=True)) - one_at_a_time(padded, same)).abs().max().item() < 1e-5


def test_a_decoder_token_attends_to_its_own_sequence_only(tiny_qwen3):
    """Changing one sequence's tokens moves its own vector and no other's (no leak across the stream)."""
    packed, _ = modules(tiny_qwen3, "last")
    seqs = random_seqs(packed.body.config.vocab_size)
    changed = [list(s) for s in seqs]
    changed[1] = random_seqs(packed.body.config.vocab_size, (17,), seed=9)[0]
    with torch.no_grad():
        before, after = packed(*pack(seqs)), packed(*pack(changed))
    moved = (before - after).abs().amax(dim=1)
    assert moved[1] > 1e-3 and torch.all(torch.cat([moved[:1], moved[2:]]) == 0)


@pytest.mark.parametrize("dense", [False, True])
def test_the_exported_graph_takes_one_token_and_many_sequences(dense, monkeypatch):
    """The exported graph, one stream per call, and with the dense switch (torch.cond) that no backend
    enables today (AOTInductor miscompiles it, backends/__init__.py): exact as exported."""
    if dense:
        monkeypatch.setitem(BACKENDS, "torch-aot", replace(BACKENDS["torch-aot"], packed_dense=("cpu",)))
    params = EngineParams(pooling="mean", max_batch=8, max_seq_len=64, input_form="packed", max_batch_tokens=128)
    module = build_module(str(minilm_dir()), params, torch.float32, "cpu")
    exported, dims = export_graph(module, tuned_example(params, "cpu", False), params)
    assert dims == "packed"
    graph = exported.module()
    padded = build_module(str(minilm_dir()), EngineParams(pooling="mean", max_batch=8, max_seq_len=64),
                          torch.float32, "cpu")
    for lengths in ((1,), (64, 64), (1, 2, 3, 4, 5, 6, 7, 8), (2, 2, 2, 2, 2, 2, 2, 2), (16, 16, 16, 16)):
        seqs = random_seqs(1000, lengths)
        with torch.no_grad():  # dense: uniform calls take the graph's dense branch, mixed ones the gathered
            assert (graph(*pack(seqs, dense=dense)) - one_at_a_time(padded, seqs)).abs().max().item() < 1e-5


def test_pack_calls_fill_the_budget_and_the_row_cap():
    lengths = [1, 2, 3, 4, 10, 10, 30, 60]
    calls = pack_calls(lengths, max_rows=3, max_tokens=20)
    assert calls == [(0, 3), (3, 5), (5, 6), (6, 7), (7, 8)]
    for start, end in calls:
        assert end - start <= 3 and (sum(lengths[start:end]) <= 20 or end - start == 1)
    assert pack_calls([], 3, 20) == []
    assert pack_calls([50], 3, 20) == [(0, 1)]  # longer than the budget: alone


@pytest.mark.parametrize("changes, message", [
    ({"backend": "tensorrt", "precision": "fp16", "device": "cuda"},
     "--input packed is implemented for torch-aot, torch-inductor, not tensorrt"),
    ({"max_batch_tokens": 10}, "--max-batch-tokens must be in max_seq_len..max_batch \\* max_seq_len"),
    ({"max_batch_tokens": 8 * 64 + 1}, "--max-batch-tokens must be in"),
    ({"input_form": "ragged"}, "--input must be one of"),
])
def test_bad_packed_params_are_usage_errors(changes, message):
    base = {"pooling": "mean", "max_batch": 8, "max_seq_len": 64, "input_form": "packed"}
    with pytest.raises(UsageError, match=message):
        EngineParams(**(base | changes))


def test_a_packed_engine_pads_nothing_and_batch_tokens_default_to_the_full_batch():
    params = EngineParams(pooling="last", max_batch=8, max_seq_len=64, input_form="packed")
    assert not params.pad_left and params.batch_tokens == 8 * 64
    assert EngineParams(pooling="last", max_batch=8, max_seq_len=64).pad_left


@pytest.fixture(scope="module", params=["torch-aot", "torch-inductor"])
def packed_engine(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "out"
    texts = out.parent / "texts.json"
    texts.write_text(json.dumps(["a cat sat on the mat", "x", "Paris is the capital of France."]))
    proc = runtime_cli("compile", "--model", str(minilm_dir()), "--out", str(out), "--backend", request.param,
                       "--device", "cpu", "--precision", "fp32", "--max-batch", "8", "--max-seq-len", "64",
                       "--pooling", "mean", "--normalize", "--input", "packed", "--max-batch-tokens", "96",
                       "--reference-texts", str(texts), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_compiled_packed_engine_matches_its_reference_within_its_budget(packed_engine):
    out, summary = packed_engine
    assert summary["engine_min_cosine"] >= 0.9999
    info = json.loads((out / "engine.json").read_text())
    assert info["params"]["input_form"] == "packed" and info["params"]["max_batch_tokens"] == 96
    assert info["params"]["shape_policy"].startswith("packed")
    if info["backend"] == "torch-aot":
        assert info["export_dims"] == "packed" and info["input_form"] == "packed"
        assert info["packed_attention"] == {"mixed": "gathered sdpa (masked block)",
                                            "uniform": "gathered sdpa (masked block)"}
    else:  # torch-inductor: the standalone artifact, its kernels shipped (a start builds none)
        manifest = json.loads((out / "engine" / "compile_cache.json").read_text())
        assert manifest["form"] == "artifact" and manifest["artifact"]["export_dims"] == "packed"
        assert manifest["artifact"]["tuned_for"] == "2 sequences, 96 tokens"
    engine = Engine.open(out)
    calls = []
    run = engine.run
    engine.run = lambda *inputs: calls.append(inputs) or run(*inputs)
    ref = json.loads((out / "reference.json").read_text())
    texts = ref["texts"] * 5  # 15 inputs: several calls, of mixed lengths
    got = engine.embed_texts(texts) + engine.embed_texts(ref["texts"][:1] * 4)  # one uniform call
    for g, w in zip(got, ref["embeddings"] * 5 + ref["embeddings"][:1] * 4, strict=True):
        assert sum(a * b for a, b in zip(g, w, strict=True)) / math.hypot(*g) / math.hypot(*w) >= 0.9999
    assert len(calls) > 1
    forms = set()
    for ids, lengths, longest in calls:
        assert ids.numel() == int(lengths.sum()) <= 96 and len(lengths) <= 8
        assert len(longest) == int(lengths.max())
        uniform = bool((lengths == lengths[0]).all()) and len(lengths) > 1
        assert ids.shape == (1, ids.numel())  # every call one stream (no backend packs dense today)
        forms.add(uniform)
    assert forms == {True, False}  # uniform and mixed calls both ran


def test_the_server_batches_a_packed_engine_by_its_token_budget(packed_engine):
    """serve's worker process (the images' default) in front of the packed engine: the batcher takes
    the engine's budget, /info says so, and embeddings over several calls match the reference."""
    import urllib.request

    from builder.runtime.service import EmbeddingService, ServerLimits
    from builder.runtime.worker import EngineProcess

    out, _ = packed_engine
    engine = EngineProcess(out).start()
    # A stall deadline far past 5 s: scripts/test.sh runs this file beside the integration tier at the lowest
    # CPU weight, where the worker went 5 s without CPU once (a fresh run of 001efcf: exit 71, a 503).
    service = EmbeddingService(engine, ServerLimits(max_batch=8, max_wait_ms=20, engine_stall_s=300))
    assert service.max_batch_tokens == 96
    larger = EmbeddingService(engine, ServerLimits(max_batch_tokens=10_000))
    larger.batcher.close()  # not larger.close(): that closes the shared engine too
    assert larger.max_batch_tokens == 96  # a larger budget would only be cut again by the engine
    from tests.serving import Running

    running = Running(service)
    url = f"http://127.0.0.1:{running.port}"
    try:
        info = json.loads(urllib.request.urlopen(url + "/info", timeout=60).read())
        assert info["input_form"] == "packed" and info["limits"]["max_batch_tokens"] == 96
        ref = json.loads((out / "reference.json").read_text())
        body = json.dumps({"input": ref["texts"] * 6, "model": "x"}).encode()
        request = urllib.request.Request(url + "/v1/embeddings", data=body,
                                         headers={"Content-Type": "application/json"})
        data = json.loads(urllib.request.urlopen(request, timeout=120).read())["data"]
        for item, want in zip(data, ref["embeddings"] * 6, strict=True):
            got = item["embedding"]
            assert sum(a * b for a, b in zip(got, want, strict=True)) / math.hypot(*got) / math.hypot(*want) >= 0.9999
    finally:
        running.stop()  # closes the service and its engine
        engine.close()


def test_a_compiled_packed_decoder_matches_its_reference(tiny_qwen3, tmp_path):
    """The causal decoder as the image compiles it (qwen3-embed's recipe: torch-aot, packed). A graph
    with the dense switch compiled to cosine 0.81 here: the compile step's accuracy gate is what
    refused it, and this test is what sees it before an image build does."""
    proc = runtime_cli("compile", "--model", str(tiny_qwen3), "--out", str(tmp_path / "out"), "--backend",
                       "torch-aot", "--device", "cpu", "--precision", "fp32", "--max-batch", "8", "--max-seq-len",
                       "64", "--pooling", "last", "--normalize", "--input", "packed", "--max-batch-tokens", "256",
                       timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["engine_min_cosine"] >= 0.9999
    engine = Engine.open(tmp_path / "out")
    seqs = random_seqs(100, (5, 17, 1, 9, 9, 9))  # the tiny Qwen3 has 121 token ids
    _, padded = modules(tiny_qwen3, "last")
    got = engine.embed_tensor(seqs)
    want = torch.nn.functional.normalize(one_at_a_time(padded, seqs), dim=-1)
    assert (got - want).abs().max().item() < 1e-4
