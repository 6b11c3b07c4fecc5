"""CUDA graphs of a packed engine's small calls (builder/runtime/cudagraphs.py): which captured shape a
call is padded to, how the padding is laid out, and, on the CPU with the eager packed modules, that the
padding sequences change none of the real rows (the graphs themselves need a GPU: benchmarks/
served_vs_raw.py runs them on the H200 and records the probe)."""
from __future__ import annotations

import pytest
import torch

from builder.runtime import cudagraphs
from builder.runtime.cudagraphs import fits, graph_shapes, pad_call, padding_lengths, pick
from builder.runtime.packed import pack
from builder.runtime.params import EngineParams
from tests.unit.test_packed import modules, random_seqs, tiny_qwen3  # noqa: F401  (a fixture)
from tests.unit.test_runtime_minilm import minilm_dir

SHAPES = graph_shapes(64, 32768)


def test_the_captured_shapes_stay_within_the_engines_limits():
    assert (128, 2) in SHAPES and (2048, 64) in SHAPES and len(SHAPES) == 48 and max(SHAPES)[0] == 2048
    assert graph_shapes(16, 1024) == [(t, n) for t in (128, 256, 384, 512, 768, 1024) for n in (2, 4, 8, 16)]
    assert graph_shapes(1, 100) == []


@pytest.mark.parametrize("tokens, sequences, shape, ok", [
    (128, 2, (128, 2), True),     # exactly the shape: no padding
    (127, 2, (128, 2), False),    # a token left over and no sequence to hold it
    (100, 1, (128, 2), True),     # 28 tokens in one padding sequence
    (100, 1, (128, 4), True),     # 28 tokens over 3 sequences
    (126, 1, (128, 4), False),    # 2 tokens cannot fill 3 sequences
    (129, 1, (128, 2), False),    # too many tokens
    (10, 5, (128, 4), False),     # too many sequences
    (10, 1, (1000, 2), False),    # 990 tokens in one sequence of at most 512
    (10, 1, (1000, 3), True),     # 990 tokens over two of 495
])
def test_a_call_fits_a_shape_when_its_padding_makes_valid_sequences(tokens, sequences, shape, ok):
    assert fits(tokens, sequences, shape, longest=512) is ok


@pytest.mark.parametrize("tokens, sequences, want", [
    (1, 1, (128, 2)), (100, 3, (128, 4)), (128, 2, (128, 2)), (129, 2, (256, 4)), (2000, 20, (2048, 32)),
    (2048, 64, (2048, 64)), (2049, 1, None), (3000, 31, None), (10, 64, None),
    (1030, 63, (1536, 64)),  # 506 padding tokens in the one spare sequence
    (1537, 63, (2048, 64)),  # 511 padding tokens in the one spare sequence
    (1000, 64, None),        # a full call has no spare sequence for its padding
])
def test_pick_takes_the_smallest_shape_that_fits(tokens, sequences, want):
    assert pick(1025, 31, SHAPES, longest=256) == (1536, 64)  # 511 tokens fit 33 padding sequences of <= 256, not one
    got = pick(tokens, sequences, SHAPES, longest=512)
    assert got == want
    if got is not None:
        assert fits(tokens, sequences, got, 512)
        assert not any(fits(tokens, sequences, s, 512) for s in SHAPES if s < got)


def test_padding_is_spread_evenly_and_keeps_every_sequence_nonempty():
    assert padding_lengths(0, 0) == []
    assert padding_lengths(28, 3) == [10, 9, 9]
    assert padding_lengths(3, 3) == [1, 1, 1]
    for extra, seqs in [(990, 2), (7, 7), (1000, 33)]:
        got = padding_lengths(extra, seqs)
        assert sum(got) == extra and len(got) == seqs and max(got) - min(got) <= 1 and min(got) >= 1


def test_pad_call_appends_zero_tokens_and_the_padding_sequences():
    ids, lengths, _ = pack([[5, 6, 7], [8, 9]])
    padded_ids, padded_lengths = pad_call(ids, lengths, (8, 4))
    assert padded_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]] and padded_ids.dtype == ids.dtype
    assert padded_lengths.tolist() == [3, 2, 2, 1] and padded_lengths.dtype == torch.int32


def test_pad_call_keeps_the_call_on_its_device():
    """A call already on the GPU (a benchmark's, or a caller's) is padded there: no CPU tensor is mixed in."""
    ids, lengths, _ = (t.to("meta") for t in pack([[5, 6, 7], [8, 9]]))
    padded_ids, padded_lengths = pad_call(ids, lengths, (8, 4))
    assert padded_ids.device.type == padded_lengths.device.type == "meta"
    assert padded_ids.shape == (1, 8) and padded_lengths.shape == (4,)


@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_padding_sequences_change_none_of_the_real_rows(family, tiny_qwen3):  # noqa: F811
    """What a graph replays: the call padded to its shape. The real rows must be those of the call as it
    is, for mean pooling over a bidirectional encoder and last-token pooling over a causal decoder."""
    model_dir, pooling = (minilm_dir(), "mean") if family == "encoder" else (tiny_qwen3, "last")
    packed, _ = modules(model_dir, pooling)
    seqs = random_seqs(packed.body.config.vocab_size)
    ids, lengths, max_len = pack(seqs)
    shape = pick(ids.numel(), len(seqs), graph_shapes(8, 512), longest=64)
    assert shape is not None and shape != (ids.numel(), len(seqs))
    padded_ids, padded_lengths = pad_call(ids, lengths, shape)
    with torch.no_grad():
        want = packed(ids, lengths, max_len)
        # max_len at its upper bound, as the graphs are captured
        got = packed(padded_ids, padded_lengths, torch.zeros(64, dtype=torch.int8))[:len(seqs)]
    assert (got - want).abs().max().item() < 1e-5


def test_graphs_are_for_flash_engines_on_the_gpu_and_can_be_turned_off(monkeypatch):
    """graphed() leaves every other engine's runner as it is (and never touches CUDA for them)."""
    runner = object()
    for params in (EngineParams(max_batch=8, max_seq_len=64, input_form="packed", device="cpu"),
                   EngineParams(max_batch=8, max_seq_len=64, input_form="packed", device="cuda", precision="fp32"),
                   EngineParams(max_batch=8, max_seq_len=64, device="cuda", precision="bf16")):
        assert cudagraphs.graphed(runner, params, 100, None) is runner
    flash = EngineParams(max_batch=8, max_seq_len=64, input_form="packed", device="cuda", precision="bf16")
    monkeypatch.delenv(cudagraphs.ENV, raising=False)  # off unless asked for
    assert cudagraphs.graphed(runner, flash, 100, None) is runner
    for value, on in [("1", True), ("on", True), ("", False), ("off", False), ("no", False), ("False", False)]:
        monkeypatch.setenv(cudagraphs.ENV, value)
        assert cudagraphs.wanted() is on


def test_a_failed_capture_leaves_the_engine_without_graphs(monkeypatch, caplog):
    flash = EngineParams(max_batch=8, max_seq_len=64, input_form="packed", device="cuda", precision="bf16")
    monkeypatch.setenv(cudagraphs.ENV, "1")

    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cudagraphs, "GraphedPackedRunner", broken)
    monkeypatch.setattr(cudagraphs.torch.cuda, "synchronize", lambda *a: None)
    runner = object()
    with caplog.at_level("WARNING", logger="builder.runtime.cudagraphs"):
        assert cudagraphs.graphed(runner, flash, 100, None) is runner
    assert "CUDA graphs off: capturing the engine failed (RuntimeError: operation not permitted" in caplog.text
