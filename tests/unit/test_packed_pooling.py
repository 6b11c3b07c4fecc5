"""Per-sequence pooling of packed engines (builder/runtime/packed.py) on tiny hand-made tensors, BEFORE any
L2 normalisation (which would hide a wrong scale): first, last and mean over each sequence's own tokens in
one stream of sequences of different lengths; where Pack puts each token; the engine inputs pack() makes;
PackedEmbeddingModule around a fake body (what it passes the body, normalize on and off, float32 out)."""
from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch", reason="the runtime needs torch")

from builder.runtime.packed import Pack, PackedEmbeddingModule, pack, pool_packed  # noqa: E402

pytestmark = pytest.mark.runtime

# Three sequences of 3, 1 and 4 tokens in one stream of 8 (a mixed call: input_ids [1, 8]).
LENGTHS = [3, 1, 4]
# hidden [tokens, 2]: sequence 0 = rows 0-2, sequence 1 = row 3, sequence 2 = rows 4-7.
HIDDEN = torch.tensor([[1.0, 10.0], [2.0, 20.0], [6.0, 60.0],
                       [7.0, -7.0],
                       [0.0, 4.0], [4.0, 8.0], [8.0, 0.0], [12.0, -4.0]])
# By hand: the mean of each sequence's own rows (and nothing else's).
MEANS = torch.tensor([[3.0, 30.0], [7.0, -7.0], [6.0, 2.0]])
FIRSTS = torch.tensor([[1.0, 10.0], [7.0, -7.0], [0.0, 4.0]])
LASTS = torch.tensor([[6.0, 60.0], [7.0, -7.0], [12.0, -4.0]])


def mixed_pack(lengths=LENGTHS, longest: int | None = None) -> Pack:
    tokens = sum(lengths)
    return Pack(torch.tensor(lengths, dtype=torch.int32), torch.zeros(1, tokens, dtype=torch.long),
                torch.zeros(longest or max(lengths), dtype=torch.int8))


def test_pack_places_every_token_in_its_own_sequence():
    p = mixed_pack()
    assert p.tokens == 8 and p.longest == 4 and p.lengths.dtype == torch.int64
    assert p.starts.tolist() == [0, 3, 4] and p.ends.tolist() == [3, 4, 8]
    assert p.segment.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert p.positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]  # positions restart in each sequence
    assert p.dense is True and p.rows.shape == (1, 8)
    assert Pack(p.lengths, p.rows, p.max_len, dense=False).dense is False


def test_pack_of_a_uniform_call_counts_every_row():
    """A call of equal lengths comes as [sequences, length]: the stream is every row, end to end."""
    p = Pack(torch.tensor([2, 2, 2], dtype=torch.int32), torch.zeros(3, 2, dtype=torch.long),
             torch.zeros(2, dtype=torch.int8))
    assert p.tokens == 6 and p.segment.tolist() == [0, 0, 1, 1, 2, 2] and p.positions.tolist() == [0, 1] * 3


def test_pack_builds_on_the_lengths_device():
    # The engine is exported on the GPU: a CPU arange there would not trace. "meta" stands in for cuda.
    p = Pack(torch.empty(3, dtype=torch.int32, device="meta"), torch.empty(1, 8, dtype=torch.long, device="meta"),
             torch.empty(4, dtype=torch.int8, device="meta"))
    assert p.segment.device.type == p.positions.device.type == "meta" and p.segment.shape == (8,)
    assert pool_packed(torch.empty(8, 2, device="meta"), p, "mean").device.type == "meta"
    assert p.block_mask(True).device.type == "meta" and p.block_mask(True).shape == (3, 1, 4, 4)


def test_the_attention_geometry_of_a_pack():
    """What attention takes of a pack: flash's offsets, the gathered block and its masks (one per
    causality, computed once per call and shared by every layer)."""
    p = mixed_pack()  # lengths 3, 1, 4; the longest 4
    assert p.cu_seqlens.tolist() == [0, 3, 4, 8] and p.cu_seqlens.dtype == torch.int32
    valid, rows = p.block_rows
    assert valid.tolist() == [[True, True, True, False], [True, False, False, False], [True, True, True, True]]
    assert rows.tolist() == [[0, 1, 2, 8], [3, 8, 8, 8], [4, 5, 6, 7]]  # 8: the zero row after the stream
    assert p.stream_rows.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]  # each token's row in the 3 x 4 block
    keys = p.block_mask(False)
    assert keys.shape == (3, 1, 1, 4) and keys[:, 0, 0].tolist() == valid.tolist()
    causal = p.block_mask(True)
    assert causal.shape == (3, 1, 4, 4)
    for s, length in enumerate(LENGTHS):
        want = [[j <= i and j < length for j in range(4)] for i in range(4)]
        assert causal[s, 0].tolist() == want, s
    assert p.block_mask(True) is causal and p.block_mask(False) is keys


def test_mean_is_over_each_sequences_own_tokens():
    out = pool_packed(HIDDEN, mixed_pack(), "mean")
    # Exact: a count other than the sequence's own (the stream's 8 tokens, the longest 4, length - 1 ...)
    # or a token of the neighbour changes these numbers; normalisation would hide only the scale.
    assert out.dtype == torch.float32 and torch.equal(out, MEANS)


def test_mean_scale_differs_per_sequence():
    """Sequences whose tokens are equal: the mean is that token, whatever the length (a sum would scale
    with the length, a division by another count would not give back the token)."""
    hidden = torch.tensor([[2.0, -1.0]] * 2 + [[5.0, 3.0]] * 5 + [[-4.0, 0.5]])
    out = pool_packed(hidden, mixed_pack([2, 5, 1]), "mean")
    assert torch.equal(out, torch.tensor([[2.0, -1.0], [5.0, 3.0], [-4.0, 0.5]]))


def test_first_and_last_take_each_sequences_own_ends():
    p = mixed_pack()
    assert torch.equal(pool_packed(HIDDEN, p, "cls"), FIRSTS)
    assert torch.equal(pool_packed(HIDDEN, p, "last"), LASTS)


def test_a_sequence_of_one_token_pools_to_that_token_every_way():
    hidden = torch.tensor([[0.25, -3.5]])
    p = mixed_pack([1])
    for pooling in ("cls", "last", "mean"):
        assert torch.equal(pool_packed(hidden, p, pooling), hidden), pooling


def test_mean_sums_in_float32_whatever_the_hidden_dtype():
    # 256 + 1 + 1 in bfloat16 (8 mantissa bits) rounds to 256 at each step: float32 sums keep 258.
    hidden = torch.tensor([[256.0], [1.0], [1.0], [3.0]], dtype=torch.bfloat16)
    out = pool_packed(hidden, mixed_pack([3, 1]), "mean")
    assert out.dtype == torch.float32 and torch.equal(out, torch.tensor([[86.0], [3.0]]))


def test_pack_makes_the_engine_inputs():
    ids, lengths, max_len = pack([[5, 6, 7], [8], [9, 10]])
    assert ids.tolist() == [[5, 6, 7, 8, 9, 10]] and ids.dtype == torch.long
    assert lengths.tolist() == [3, 1, 2] and lengths.dtype == torch.int32
    assert max_len.shape == (3,) and max_len.dtype == torch.int8 and not max_len.any()
    # Equal lengths: [sequences, length] only for a dense engine.
    assert pack([[1, 2], [3, 4]], dense=True)[0].tolist() == [[1, 2], [3, 4]]
    assert pack([[1, 2], [3, 4]])[0].tolist() == [[1, 2, 3, 4]]
    assert pack([[1, 2], [3]], dense=True)[0].tolist() == [[1, 2, 3]]
    # Token ids are long even when there are none (torch would make an empty list float32).
    assert pack([[]])[0].dtype == torch.long and pack([[]])[0].shape == (1, 0)


class FakeBody(torch.nn.Module):
    """hidden[0, t] = (token id, position id, token type or -1): what the module passes in shows in the output."""

    def __init__(self, config=None, dtype=torch.float32):
        super().__init__()
        self.config = config if config is not None else types.SimpleNamespace(model_type="bert", type_vocab_size=0)
        self.dtype = dtype
        self.calls: list[dict] = []

    def forward(self, input_ids, position_ids, mopt_pack, token_type_ids=None):
        self.calls.append({"input_ids": input_ids, "position_ids": position_ids, "pack": mopt_pack,
                           "token_type_ids": token_type_ids})
        types_ = token_type_ids if token_type_ids is not None else torch.full_like(input_ids, -1)
        hidden = torch.stack([input_ids, position_ids, types_], dim=-1).to(self.dtype)
        return types.SimpleNamespace(last_hidden_state=hidden)


SEQS = [[4, 8, 6], [9], [1, 2, 3, 10]]


def test_the_module_pools_the_bodys_stream_per_sequence_without_normalising():
    body = FakeBody()
    module = PackedEmbeddingModule(body, "mean", normalize=False)
    out = module(*pack(SEQS))
    [call] = body.calls
    assert call["input_ids"].tolist() == [[4, 8, 6, 9, 1, 2, 3, 10]]  # one stream
    assert call["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert call["token_type_ids"] is None and call["pack"].lengths.tolist() == [3, 1, 4]
    # (mean id, mean position, no token type) per sequence, unscaled.
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([[6.0, 1.0, -1.0], [9.0, 0.0, -1.0], [4.0, 1.5, -1.0]]))


def test_the_module_uses_its_pooling_and_pack_mode():
    out = PackedEmbeddingModule(FakeBody(), "last", normalize=False)(*pack(SEQS))
    assert torch.equal(out, torch.tensor([[6.0, 2.0, -1.0], [9.0, 0.0, -1.0], [10.0, 3.0, -1.0]]))
    body = FakeBody()
    module = PackedEmbeddingModule(body, "cls", normalize=False, dense=False)
    assert module.dense is False and module.pooling == "cls" and module.body is body
    assert torch.equal(module(*pack(SEQS)), torch.tensor([[4.0, 0.0, -1.0], [9.0, 0.0, -1.0], [1.0, 0.0, -1.0]]))
    assert body.calls[0]["pack"].dense is False
    assert PackedEmbeddingModule(FakeBody(), "cls", normalize=False).dense is True


def test_roberta_positions_start_after_the_padding_index():
    """RoBERTa's family numbers a sequence's positions from pad_token_id + 1 (families.yaml); the offset
    goes to the body with every sequence's own positions."""
    body = FakeBody(types.SimpleNamespace(model_type="roberta", type_vocab_size=1, pad_token_id=1))
    module = PackedEmbeddingModule(body, "cls", normalize=False)
    assert module.first_position == 2
    module(*pack(SEQS))
    assert body.calls[0]["position_ids"].tolist() == [[2, 3, 4, 2, 2, 3, 4, 5]]


def test_a_uniform_call_pools_each_row():
    body = FakeBody()
    out = PackedEmbeddingModule(body, "mean", normalize=False)(*pack([[2, 4], [6, 8]], dense=True))
    assert body.calls[0]["input_ids"].tolist() == [[2, 4, 6, 8]]
    assert torch.equal(out, torch.tensor([[3.0, 0.5, -1.0], [7.0, 0.5, -1.0]]))


def test_normalize_scales_each_sequence_to_unit_l2_norm():
    body = FakeBody(types.SimpleNamespace(model_type="bert", type_vocab_size=2))
    out = PackedEmbeddingModule(body, "last", normalize=True)(*pack([[3, 4], [5]]))
    # Last tokens: (4, 1, 0) and (5, 0, 0), token types given as zeros.
    assert body.calls[0]["token_type_ids"].tolist() == [[0, 0, 0]]
    want = torch.tensor([[4.0, 1.0, 0.0], [1.0, 0.0, 0.0]]) / torch.tensor([[17.0 ** 0.5], [1.0]])
    assert torch.allclose(out, want, atol=1e-7)
    assert torch.allclose(out.norm(dim=-1), torch.ones(2))


@pytest.mark.parametrize("config, given", [
    (types.SimpleNamespace(model_type="bert", type_vocab_size=2), True),
    (types.SimpleNamespace(model_type="bert", type_vocab_size=1), True),
    (types.SimpleNamespace(model_type="bert", type_vocab_size=0), False),
    (types.SimpleNamespace(model_type="qwen3"), False),  # a config without token types at all (decoders)
])
def test_token_types_only_for_bodies_that_have_them(config, given):
    body = FakeBody(config)
    PackedEmbeddingModule(body, "mean", normalize=False)(*pack(SEQS))
    types_ = body.calls[0]["token_type_ids"]
    assert (types_ is not None) == given
    if given:
        assert types_.tolist() == [[0] * 8]


def test_the_output_is_float32_whatever_the_body_dtype():
    out = PackedEmbeddingModule(FakeBody(dtype=torch.bfloat16), "mean", normalize=False)(*pack([[2, 4], [7]]))
    assert out.dtype == torch.float32 and torch.equal(out, torch.tensor([[3.0, 0.5, -1.0], [7.0, 0.0, -1.0]]))
    out = PackedEmbeddingModule(FakeBody(dtype=torch.bfloat16), "cls", normalize=False)(*pack([[2, 4], [7]]))
    assert out.dtype == torch.float32


def test_a_windowed_block_mask_keeps_real_keys_within_reach_only():
    """Two sequences (3 and 1 tokens); reach 1: each query sees its neighbours, never a padded key."""
    pack_ = Pack(torch.tensor([3, 1], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.long),
                 torch.zeros(3, dtype=torch.int8), dense=False)
    got = pack_.block_mask(causal=False, reach=1)[:, 0].tolist()
    assert got == [[[True, True, False], [True, True, True], [False, True, True]],
                   [[True, False, False], [True, False, False], [False, False, False]]]  # padded rows: unused
    causal = pack_.block_mask(causal=True, reach=1)[0, 0].tolist()
    assert causal == [[True, False, False], [True, True, False], [False, True, True]]
    assert pack_.block_mask(causal=False)[:, 0].tolist() == [[[True, True, True]], [[True, False, False]]]  # real keys
