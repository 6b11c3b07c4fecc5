"""input "packed": every sequence of a batch in one token stream, no padding (what vLLM's pooling
runner and TEI do).

An engine call takes input_ids [rows, row_len] (all sequences concatenated: [1, tokens] for a call of
mixed lengths, [sequences, length] when every sequence is as long as the others), seq_lengths
[sequences] (int32) and max_len [longest sequence] (a tensor whose length is the longest sequence's: it
carries that size into the graph as a dynamic dim; its values are unused). Lengths rather than
cumulative offsets: a slice of a dynamic dim (offsets[1:]) makes torch.export assume more than one
sequence comes. Positions restart at 0 in each sequence. Every layer but attention works on the real
tokens only; attention keeps sequences apart, chosen per call in the graph (torch.cond on rows > 1):
- a uniform call: dense SDPA on [sequences, heads, length, dim], no mask (nothing is padded), cuDNN's
  kernel first on CUDA: at 64 x 512 it takes half the time of variable-length flash
  (benchmarks/results/attention_probe_h200.json). The dense shape is the input's own: reshaping the
  stream by the sequence count would assume tokens = sequences x longest, which export refuses;
- a mixed call on CUDA, fp16/bf16: variable-length flash attention (aten._flash_attention_forward
  with cumulative sequence lengths), which neither pads nor masks;
- a mixed call elsewhere (CPU, fp32): each sequence's rows gathered into a [sequences, longest] block,
  SDPA with the key-padding (and causal) mask, and the real rows gathered back. Attention then costs
  what it costs padded; the projections, MLPs and norms, most of the work, still see no padding.
Pooling is per sequence (first token, last token, or mean over the sequence's tokens).

Registered under transformers' attention and mask interfaces as ATTN_IMPLEMENTATION: the body gets
no mask, and the pack reaches each attention layer through the forward's keyword arguments.
"""
from __future__ import annotations

from contextlib import nullcontext
from functools import cached_property, partial

import torch
from torch import nn

ATTN_IMPLEMENTATION = "mopt_packed"
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


# Engine precisions whose attention runs in half precision: fp8 engines' bodies are bf16 (quantize.py)
_FLASH_PRECISIONS = ("fp16", "bf16", "fp8")


def gathers_attention(device: str, precision: str) -> bool:
    """Whether an engine of this device and precision gathers attention per sequence (else: flash varlen)."""
    return device != "cuda" or precision not in _FLASH_PRECISIONS


def attention_plan(device: str, precision: str, dense: bool) -> dict[str, str]:
    """What attention a packed engine runs, per kind of call (recorded in engine.json)."""
    from . import varlen_attention

    if gathers_attention(device, precision):
        mixed = "gathered sdpa (masked block)"
    elif varlen_attention.kernel_name() == "triton":
        mixed = "triton varlen (flash varlen for windowed layers)"
    else:
        mixed = "flash varlen"
    return {"mixed": mixed, "uniform": "dense sdpa" if dense else mixed}


class Pack:
    """Where each token of the stream belongs, computed once per call from the sequence lengths; what
    attention needs of it (offsets for flash, the gather block elsewhere) is computed at first use and
    shared by every layer."""

    def __init__(self, lengths: torch.Tensor, rows: torch.Tensor, max_len: torch.Tensor, dense: bool = True):
        tokens = rows.shape[0] * rows.shape[1]
        self.rows = rows  # the call's input_ids [rows, row_len]: its shape says whether the call is uniform
        self.dense = dense  # whether a uniform call takes dense attention (else every call the mixed path)
        self.lengths = lengths.long()  # [sequences]
        self.ends = torch.cumsum(self.lengths, 0)
        self.starts = self.ends - self.lengths
        index = torch.arange(tokens, device=lengths.device)
        self.segment = torch.searchsorted(self.ends, index, right=True)  # [tokens]: its sequence
        self.positions = index - self.starts[self.segment]  # [tokens]: its place in that sequence
        self.tokens = tokens
        self.longest = max_len.shape[0]
        self.max_len = max_len
        self._masks: dict[tuple[bool, int | None], torch.Tensor] = {}

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

    @cached_property
    def stream_rows(self) -> torch.Tensor:
        """[tokens]: each token's row in the [sequences * longest] block, in stream order."""
        return self.segment * self.longest + self.positions

    def block_mask(self, causal: bool, reach: int | None = None) -> torch.Tensor:
        """SDPA's boolean mask over the block: real keys only, no later position when causal, and no key
        more than REACH positions away (a layer's window; None: no window)."""
        if (causal, reach) not in self._masks:
            valid, _ = self.block_rows
            mask = valid[:, None, None, :]
            offsets = torch.arange(self.longest, device=valid.device)
            if causal:
                mask = mask & (offsets[None, :] <= offsets[:, None])[None, None]
            if reach is not None:
                mask = mask & ((offsets[None, :] - offsets[:, None]).abs() <= reach)[None, None]
            self._masks[(causal, reach)] = mask
        return self._masks[(causal, reach)]


def _pack_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    # query [1, heads, tokens, dim]; key/value [1, kv_heads, tokens, dim]. Returns [1, tokens, heads, dim].
    pack: Pack = kwargs["mopt_pack"]
    causal = bool(getattr(module, "is_causal", False))
    reach = window_reach(kwargs.get("sliding_window"))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
    if q.is_cuda and q.dtype in _FLASH_DTYPES:
        mixed = partial(_flash_attention, causal=causal, scaling=scaling, reach=reach)
        operands = (q, k, v, pack.rows, pack.cu_seqlens, pack.max_len)
    else:
        mixed = partial(_gathered_attention, causal=causal, scaling=scaling)
        operands = (q, k, v, pack.rows, pack.block_rows[1], pack.block_mask(causal, reach), pack.stream_rows)
    if not pack.dense:
        return mixed(*operands).flatten(0, 1).unsqueeze(0), None
    dense = partial(_dense_attention, causal=causal, scaling=scaling, reach=reach)
    # Both branches return [rows, row_len, heads, dim], densely strided, as cond requires. Run eagerly
    # the rows are a number and the branch is called; traced they are a symbol and the graph keeps both.
    uniform = pack.rows.shape[0] > 1
    out = (dense if uniform else mixed)(*operands) if isinstance(uniform, bool) else \
        torch.cond(uniform, dense, mixed, operands)
    return out.flatten(0, 1).unsqueeze(0), None


def window_reach(sliding_window: int | None) -> int | None:
    """How many positions away a layer's query may see a key, from the window transformers hands the
    attention function (None: no window). transformers' masks let |q - k| < sliding_window (ModernBERT
    passes its half-window + 1, Mistral/Qwen2 their window): flash attention's window_size is that reach."""
    return None if sliding_window is None else int(sliding_window) - 1


def _dense_attention(q, k, v, rows, *_, causal: bool, scaling, reach: int | None = None):
    """Every sequence as long as the call's row: [rows * row_len] stream -> [rows, heads, row_len, dim]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n, length = rows.shape
    blocks = [t.view(n, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v)]
    mask = None
    if reach is not None:  # a band (and causal within it): SDPA's is_causal does not take a mask beside it
        offsets = torch.arange(length, device=q.device)
        distance = offsets[None, :] - offsets[:, None]
        mask = (distance.abs() <= reach) & ((distance <= 0) if causal else True)
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True) if q.is_cuda else nullcontext():
        out = torch.nn.functional.scaled_dot_product_attention(*blocks, attn_mask=mask,
                                                               is_causal=causal and mask is None, scale=scaling,
                                                               enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2).contiguous()


def _flash_attention(q, k, v, rows, cu_seqlens, max_len, *, causal: bool, scaling, reach: int | None = None):
    from . import varlen_attention

    if varlen_attention.kernel_name() == "triton" and varlen_attention.fits(q, reach):
        scale = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
        out = varlen_attention.op()(q, k, v, cu_seqlens, max_len, causal, scale)
        return out.view(*rows.shape, *out.shape[1:])
    longest = max_len.shape[0]
    window = {} if reach is None else {"window_size_left": reach, "window_size_right": 0 if causal else reach}
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, longest, longest, 0.0, causal,
                                                  False, scale=scaling, **window)[0]
    return out.view(*rows.shape, *out.shape[1:])


def _gathered_attention(q, k, v, rows, block_rows, block_mask, stream_rows, *, causal: bool, scaling):
    """block_rows [sequences, longest]: each sequence's token rows, padded with the index of a zero row
    appended to the stream; stream_rows [tokens]: each token's row in the block's output, in stream order."""
    sequences, longest = block_rows.shape

    def block(t):  # [tokens, h, d] -> [sequences, h, longest, d]
        padded = torch.cat([t, t.new_zeros(1, *t.shape[1:])])
        return padded[block_rows].transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(block(q), block(k), block(v), attn_mask=block_mask,
                                                           scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
    heads, dim = out.shape[1], out.shape[3]
    out = out.transpose(1, 2).reshape(sequences * longest, heads, dim)[stream_rows]
    return out.view(*rows.shape, heads, dim)


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


def first_position(config) -> int:
    """The position id of a sequence's first token in this model's family (families.yaml)."""
    from .families import family

    if family(config.model_type, packed=True).positions == "after_padding_idx":
        return int(config.pad_token_id) + 1
    return 0


class PackedEmbeddingModule(nn.Module):
    """A transformers body (loaded with ATTN_IMPLEMENTATION) + per-sequence pooling (+ L2 norm)."""

    def __init__(self, body: nn.Module, pooling: str, normalize: bool, dense: bool = True):
        super().__init__()
        self.dense = dense  # uniform calls as [sequences, length] with dense attention (pack(dense=True))
        self.body = body
        self.pooling = pooling
        self.normalize = normalize
        # BERT-family embeddings slice a buffer of max_position_embeddings token types when given none,
        # which a stream longer than that would overrun.
        self.token_types = getattr(body.config, "type_vocab_size", 0) > 0
        # RoBERTa's family numbers positions from padding_idx + 1 (families.yaml), the others from 0.
        self.first_position = first_position(body.config)

    def forward(self, input_ids: torch.Tensor, seq_lengths: torch.Tensor, max_len: torch.Tensor) -> torch.Tensor:
        pack = Pack(seq_lengths, input_ids, max_len, self.dense)
        stream = input_ids.reshape(1, -1)
        positions = pack.positions + self.first_position if self.first_position else pack.positions
        kwargs = {"position_ids": positions[None], "mopt_pack": pack}
        if self.token_types:
            kwargs["token_type_ids"] = torch.zeros_like(stream)
        out = self.body(input_ids=stream, **kwargs)
        emb = pool_packed(out.last_hidden_state[0], pack, self.pooling).float()
        if self.normalize:
            emb = torch.nn.functional.normalize(emb, p=2.0, dim=-1)
        return emb


def pack(seqs: list[list[int]], dense: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences of token ids -> the engine's inputs (input_ids, seq_lengths, max_len); input_ids is
    [sequences, length] when every sequence has the same length and the engine is dense, else
    [1, tokens]."""
    lengths = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    ids = ids.view(len(seqs), -1) if dense and len(set(lengths)) == 1 else ids.view(1, -1)
    return ids, torch.tensor(lengths, dtype=torch.int32), torch.zeros(max(lengths), dtype=torch.int8)
