"""Engine.embed_tensor's cut of a batch into engine calls (engine.plan_calls): exact against brute force,
within max_batch rows, and the same embeddings whatever the cut."""
from __future__ import annotations

import itertools
import random

import pytest

from builder.runtime.engine import CALL_COST_TOKENS, Engine, bucket_len, plan_calls
from builder.runtime.params import EngineParams


def _cost(lengths, calls, max_seq_len, call_cost):
    return sum((end - start) * bucket_len(lengths[end - 1], max_seq_len) + call_cost for start, end in calls)


def _brute(lengths, max_rows, max_seq_len, call_cost):
    n, best = len(lengths), None
    for mask in itertools.product((0, 1), repeat=n - 1):  # a cut after position i where mask[i]
        bounds = [0, *(i + 1 for i, m in enumerate(mask) if m), n]
        calls = list(itertools.pairwise(bounds))
        if all(end - start <= max_rows for start, end in calls):
            cost = _cost(lengths, calls, max_seq_len, call_cost)
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_plan_is_optimal_and_covers_every_row(seed):
    rng = random.Random(seed)
    n, max_rows = rng.randint(1, 10), rng.randint(1, 6)
    lengths = sorted(rng.randint(1, 200) for _ in range(n))
    call_cost = rng.choice([0, 8, 32, 500, 5000])
    calls = plan_calls(lengths, max_rows, 256, call_cost)
    assert calls[0][0] == 0 and calls[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(calls))  # contiguous, in order
    assert all(0 < end - start <= max_rows for start, end in calls)
    assert _cost(lengths, calls, 256, call_cost) == _brute(lengths, max_rows, 256, call_cost)


def test_cpu_cuts_mixed_lengths_and_gpu_keeps_the_batch_whole():
    lengths = sorted([5] * 16 + [150] * 16)
    assert plan_calls(lengths, 32, 256, CALL_COST_TOKENS["cpu"]) == [(0, 16), (16, 32)]
    assert plan_calls(lengths, 32, 256, CALL_COST_TOKENS["cuda"]) == [(0, 16), (16, 32)]  # 30x the padding
    closer = sorted([100] * 16 + [150] * 16)
    assert plan_calls(closer, 32, 256, CALL_COST_TOKENS["cuda"]) == [(0, 32)]
    assert plan_calls(closer, 32, 256, CALL_COST_TOKENS["cpu"]) == [(0, 16), (16, 32)]
    assert len(plan_calls([7] * 70, 32, 256, CALL_COST_TOKENS["cpu"])) == 3  # equal lengths: fewest calls
    assert plan_calls([], 32, 256, 32) == []


class _Encoder:
    def pad(self, seqs, length):
        class Batch:
            input_ids = [s + [0] * (length - len(s)) for s in seqs]
            attention_mask = [[1] * len(s) + [0] * (length - len(s)) for s in seqs]
        return Batch()


@pytest.mark.parametrize("backend,device", [("torch-aot", "cpu"), ("vllm", "cpu")])
def test_rows_come_back_in_input_order_whatever_the_cut(backend, device):
    """A fake engine whose row is (length, first id): every row lands where its input was; vllm (which
    drops padding itself) gets as few calls as max_batch allows."""
    import torch

    calls = []

    def run(ids, mask):
        calls.append(tuple(ids.shape))
        return torch.stack([mask.sum(1).float(), ids[:, 0].float()], 1)

    params = EngineParams(backend=backend, device=device, max_batch=4, max_seq_len=64, pooling="mean")
    engine = Engine(params, _Encoder(), run, {"embedding_dim": 2})
    rng = random.Random(1)
    seqs = [[i + 1] * rng.choice([1, 2, 3, 40, 60]) for i in range(11)]
    out = engine.embed_tensor(seqs).tolist()
    assert out == [[float(len(s)), float(s[0])] for s in seqs]
    assert all(rows <= 4 for rows, _ in calls)
    if backend == "vllm":
        assert len(calls) == 3  # ceil(11 / 4)
