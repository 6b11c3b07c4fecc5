"""pool() on tiny hand-made tensors (padding never counts) and EmbeddingModule around a fake body:
left-padding position ids, pooling choice, L2 normalisation, float32 output."""
from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch", reason="the runtime needs torch")

from builder.runtime.pooling import EmbeddingModule, pool  # noqa: E402

pytestmark = pytest.mark.runtime

# Two rows of four positions, two features: row 0 right-padded (3 real tokens), row 1 left-padded (2).
HIDDEN = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 9.0], [100.0, 100.0]],
                       [[-100.0, 50.0], [-100.0, 50.0], [2.0, 0.0], [4.0, 6.0]]])
MASK = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])


def test_mean_excludes_padding():
    out = pool(HIDDEN, MASK, "mean")
    assert torch.equal(out, torch.tensor([[3.0, 5.0], [3.0, 3.0]]))


def test_mean_of_a_full_row_and_an_empty_mask():
    hidden = torch.tensor([[[1.0, 1.0], [3.0, 5.0]], [[7.0, 7.0], [9.0, 9.0]]])
    out = pool(hidden, torch.tensor([[1, 1], [0, 0]]), "mean")
    assert torch.equal(out, torch.tensor([[2.0, 3.0], [0.0, 0.0]]))  # no real token: zeros, not NaN


def test_mean_keeps_the_hidden_dtype():
    out = pool(HIDDEN.to(torch.bfloat16), MASK, "mean")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.float(), torch.tensor([[3.0, 5.0], [3.0, 3.0]]))


def test_last_takes_the_last_real_token_with_either_padding():
    assert torch.equal(pool(HIDDEN, MASK, "last"), torch.tensor([[5.0, 9.0], [4.0, 6.0]]))


@pytest.mark.parametrize("mask, index", [
    ([1, 0, 0, 0], 0),  # one token, right-padded
    ([0, 0, 0, 1], 3),  # one token, left-padded
    ([1, 1, 1, 1], 3),  # no padding
    ([0, 1, 1, 0], 2),
])
def test_last_index(mask, index):
    hidden = torch.arange(8.0).reshape(1, 4, 2)
    assert torch.equal(pool(hidden, torch.tensor([mask]), "last"), hidden[:, index])


def test_last_builds_its_positions_on_the_masks_device():
    # The engine is exported on the GPU: a CPU arange there would not trace. "meta" stands in for cuda.
    hidden, mask = torch.empty(2, 4, 3, device="meta"), torch.empty(2, 4, dtype=torch.long, device="meta")
    out = pool(hidden, mask, "last")
    assert out.device.type == "meta" and out.shape == (2, 3)


def test_mean_of_one_token_is_that_token_exactly():
    hidden = torch.tensor([[[0.1, -3.7], [9.0, 9.0]]], dtype=torch.float64)
    assert torch.equal(pool(hidden, torch.tensor([[1, 0]]), "mean"), hidden[:, 0])


def test_cls_takes_position_zero():
    assert torch.equal(pool(HIDDEN, MASK, "cls"), torch.tensor([[1.0, 2.0], [-100.0, 50.0]]))


class FakeBody(torch.nn.Module):
    """hidden[b, t] = (token id, position id): what the module passes in is visible in the output."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.dtype = dtype
        self.calls: list[dict] = []

    def forward(self, input_ids, attention_mask, position_ids=None):
        self.calls.append({"attention_mask": attention_mask, "position_ids": position_ids})
        if position_ids is None:  # a transformers body's default: 0..T-1 on every row
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        hidden = torch.stack([input_ids, position_ids], dim=-1).to(self.dtype)
        return types.SimpleNamespace(last_hidden_state=hidden)


IDS = torch.tensor([[0, 0, 7, 8], [5, 6, 7, 8]])
LEFT_MASK = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])


def test_left_padded_positions_count_real_tokens_only():
    body = FakeBody()
    out = EmbeddingModule(body, "last", normalize=False, left_padded=True)(IDS, LEFT_MASK)
    [call] = body.calls
    assert torch.equal(call["position_ids"], torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3]]))
    assert call["attention_mask"] is LEFT_MASK
    # The padded row's last token sits at position 1, as in the unpadded text [7, 8].
    assert torch.equal(out, torch.tensor([[8.0, 1.0], [8.0, 3.0]]))


def test_right_padded_body_gets_no_position_ids():
    body = FakeBody()
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    out = EmbeddingModule(body, "mean", normalize=False, left_padded=False)(IDS, mask)
    assert body.calls[0]["position_ids"] is None and body.calls[0]["attention_mask"] is mask
    assert torch.equal(out, torch.tensor([[0.0, 0.5], [6.5, 1.5]]))


def test_the_configured_pooling_is_used():
    out = EmbeddingModule(FakeBody(), "cls", normalize=False, left_padded=False)(IDS, LEFT_MASK)
    assert torch.equal(out, torch.tensor([[0.0, 0.0], [5.0, 0.0]]))


def test_normalize_scales_each_row_to_unit_l2_norm():
    module = EmbeddingModule(FakeBody(), "last", normalize=True, left_padded=False)
    ids = torch.tensor([[3, 4], [6, 0]])
    out = module(ids, torch.tensor([[1, 1], [1, 0]]))
    # Rows: last of [3, 4] is (4, 1); last of [6] is (6, 0).
    assert torch.allclose(out, torch.tensor([[4.0, 1.0], [1.0, 0.0]]) / torch.tensor([[17.0 ** 0.5], [1.0]]))


def test_output_is_float32_whatever_the_body_dtype():
    module = EmbeddingModule(FakeBody(torch.bfloat16), "mean", normalize=False, left_padded=False)
    out = module(torch.tensor([[2, 4]]), torch.tensor([[1, 1]]))
    assert out.dtype == torch.float32 and torch.equal(out, torch.tensor([[3.0, 0.5]]))
