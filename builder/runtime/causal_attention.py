"""attention "causal": a causal decoder's attention with no mask tensor, so SDPA can take its flash kernel.

Why it is exact: in a causal decoder, token i attends to tokens 0..i only. With padding on the
right, every position a real token attends to holds a real token, so the padding mask changes
nothing for real tokens; the padded rows compute garbage nobody reads (pooling picks the last real
token from the mask). transformers materialises a [batch, 1, seq, seq] mask whenever it is traced
(torch.export never lets it use SDPA's is_causal), which sends SDPA to the slower masked kernel.
Registered under transformers' attention and mask interfaces as ATTN_IMPLEMENTATION.
"""
from __future__ import annotations

import torch
from torch import nn

from .errors import UsageError

ATTN_IMPLEMENTATION = "mopt_causal"


def _causal_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    # query [batch, heads, seq, dim]; key/value [batch, kv_heads, seq, dim] (grouped-query attention).
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None


def attn_implementation(attention: str) -> str:
    """transformers' attn_implementation for an engine's attention param (registering ours)."""
    if attention != "causal":
        return "sdpa"  # exports cleanly and is what the eager reference uses too
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _causal_sdpa)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION


def check_causal(body: nn.Module) -> None:
    """Refuse a model this is not exact for: every attention layer causal, none windowed."""
    layers = [m for m in body.modules() if hasattr(m, "is_causal") and hasattr(m, "scaling")]
    why = None
    if not layers:
        why = "no attention layer declares is_causal"
    elif not all(m.is_causal for m in layers):
        why = "its attention is bidirectional"
    elif any(getattr(m, "sliding_window", None) for m in layers):
        why = "it uses sliding-window attention"
    if why:
        raise UsageError(f"attention 'causal' needs a causal decoder with full attention: "
                         f"{type(body).__name__} does not qualify ({why}); use attention 'mask'")
