"""input "packed": every sequence of a batch in one token stream, no padding (what vLLM's pooling
runner and TEI do).

An engine call takes input_ids [tokens] (all sequences concatenated), seq_lengths [sequences] (int32)
and max_len [longest sequence] (a tensor whose length is the longest sequence's: it carries that size
into the graph as a dynamic dim; its values are unused). Lengths rather than cumulative offsets: a
slice of a dynamic dim (offsets[1:]) makes torch.export assume more than one sequence comes.
Positions restart at 0 in each sequence. Every layer but attention works on the real tokens only;
attention keeps sequences apart:
- CUDA, fp16/bf16: variable-length flash attention (aten._flash_attention_forward with cumulative
  sequence lengths), which neither pads nor masks;
- elsewhere (CPU, fp32): each sequence's rows gathered into a [sequences, longest] block, SDPA with
  the key-padding (and causal) mask, and the real rows gathered back. Attention then costs what it
  costs padded; the projections, MLPs and norms, most of the work, still see no padding.
Pooling is per sequence (first token, last token, or mean over the sequence's tokens).

Registered under transformers' attention and mask interfaces as ATTN_IMPLEMENTATION: the body gets
no mask, and the pack reaches each attention layer through the forward's keyword arguments.
"""
from __future__ import annotations

from functools import cached_property

import torch
from torch import nn

ATTN_IMPLEMENTATION = "mopt_packed"
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def gathers_attention(device: str, precision: str) -> bool:
    """Whether an engine of this device and precision gathers attention per sequence (else: flash varlen)."""
    return device != "cuda" or precision not in ("fp16", "bf16")


class Pack:
    """Where each token of the stream belongs, computed once per call from the sequence lengths; what
    attention needs of it (offsets for flash, the gather block elsewhere) is computed at first use and
    shared by every layer."""

    def __init__(self, lengths: torch.Tensor, tokens: int, max_len: torch.Tensor):
        self.lengths = lengths.long()  # [sequences]
        self.ends = torch.cumsum(self.lengths, 0)
        self.starts = self.ends - self.lengths
        index = torch.arange(tokens, device=lengths.device)
        self.segment = torch.searchsorted(self.ends, index, right=True)  # [tokens]: its sequence
        self.positions = index - self.starts[self.segment]  # [tokens]: its place in that sequence
        self.tokens = tokens
        self.longest = max_len.shape[0]
        self.max_len = max_len
        self._masks: dict[bool, torch.Tensor] = {}

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 [sequences + 1] offsets, for flash attention."""
        return torch.cat([self.ends.new_zeros(1), self.ends]).to(torch.int32)

    @cached_property
    def block_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid [sequences, longest], rows [sequences, longest]): each sequence's token rows, padded
        with `tokens` (the index of a zero row appended to the stream)."""
        offsets = torch.arange(self.longest, device=self.lengths.device)
        valid = offsets[None, :] < self.lengths[:, None]
        return valid, torch.where(valid, self.starts[:, None] + offsets[None, :], self.tokens)

    def block_mask(self, causal: bool) -> torch.Tensor:
        """SDPA's boolean mask over the block: real keys only, and no later position when causal."""
        if causal not in self._masks:
            valid, _ = self.block_rows
            mask = valid[:, None, None, :]
            if causal:
                offsets = torch.arange(self.longest, device=valid.device)
                mask = mask & (offsets[None, :] <= offsets[:, None])[None, None]
            self._masks[causal] = mask
        return self._masks[causal]


def _pack_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    # query [1, heads, tokens, dim]; key/value [1, kv_heads, tokens, dim]. Returns [1, tokens, heads, dim].
    pack: Pack = kwargs["mopt_pack"]
    causal = bool(getattr(module, "is_causal", False))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
    if q.is_cuda and q.dtype in _FLASH_DTYPES:
        cu = pack.cu_seqlens
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, pack.longest, pack.longest, 0.0, causal,
                                                      False, scale=scaling)[0]
        return out.unsqueeze(0), None
    return _gathered_attention(q, k, v, pack, causal, scaling).unsqueeze(0), None


def _gathered_attention(q, k, v, pack: Pack, causal: bool, scaling):
    longest = pack.longest
    _, rows = pack.block_rows

    def block(t):  # [tokens, h, d] -> [sequences, h, longest, d]
        padded = torch.cat([t, t.new_zeros(1, *t.shape[1:])])
        return padded[rows].transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(block(q), block(k), block(v),
                                                           attn_mask=pack.block_mask(causal), scale=scaling,
                                                           enable_gqa=k.shape[1] != q.shape[1])
    sequences, heads, _, dim = out.shape
    out = out.transpose(1, 2).reshape(sequences * longest, heads, dim)
    return out[pack.segment * longest + pack.positions]  # the real rows, in stream order


def _no_mask(*args, **kwargs):
    return None


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _pack_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION


def pool_packed(hidden: torch.Tensor, pack: Pack, pooling: str) -> torch.Tensor:
    """hidden [tokens, width] -> [sequences, width]."""
    if pooling == "cls":
        return hidden[pack.starts]
    if pooling == "last":
        return hidden[pack.ends - 1]
    sums = hidden.new_zeros(pack.lengths.shape[0], hidden.shape[1], dtype=torch.float32)
    return sums.index_add(0, pack.segment, hidden.float()) / pack.lengths.unsqueeze(1).float()


class PackedEmbeddingModule(nn.Module):
    """A transformers body (loaded with ATTN_IMPLEMENTATION) + per-sequence pooling (+ L2 norm)."""

    def __init__(self, body: nn.Module, pooling: str, normalize: bool):
        super().__init__()
        self.body = body
        self.pooling = pooling
        self.normalize = normalize
        # BERT-family embeddings slice a buffer of max_position_embeddings token types when given none,
        # which a stream longer than that would overrun.
        self.token_types = getattr(body.config, "type_vocab_size", 0) > 0

    def forward(self, input_ids: torch.Tensor, seq_lengths: torch.Tensor, max_len: torch.Tensor) -> torch.Tensor:
        pack = Pack(seq_lengths, input_ids.shape[0], max_len)
        kwargs = {"position_ids": pack.positions[None], "mopt_pack": pack}
        if self.token_types:
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)[None]
        out = self.body(input_ids=input_ids[None], **kwargs)
        emb = pool_packed(out.last_hidden_state[0], pack, self.pooling).float()
        if self.normalize:
            emb = torch.nn.functional.normalize(emb, p=2.0, dim=-1)
        return emb


def pack(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences of token ids -> the engine's inputs (input_ids, seq_lengths, max_len)."""
    lengths = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    return ids, torch.tensor(lengths, dtype=torch.int32), torch.zeros(max(lengths), dtype=torch.int8)
