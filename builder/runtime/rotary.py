"""Rotary position tables as a broadcast product, so the compiled q/k norm + RoPE fuse into one kernel.

Some transformers versions (5.17) build RoPE's angle table as a k=1 matmul, inv_freq[d] @ positions[s],
then transpose it: a [d, s] buffer, sequence-fastest. Each attention block reads it beside q and k,
which are head_dim-fastest. Given the two orders, Inductor tiles the rotary embedding in 2D (one tile
dim per order) and cannot fuse it with the per-head RMSNorm reduction over head_dim. The product
positions[..., None] * inv_freq gives the table as [s, d], head_dim-fastest like q and k, so norm and
RoPE fuse. It is the same arithmetic: a k=1 matmul is one fp32 multiply per element, and newer
transformers (5.24) computes it this way. docs/performance.md has the profiles and figures.

Only rotary modules of RoPE type "default" are changed: other types (dynamic, longrope, ...) update
inv_freq per call in a decorator this forward would bypass.
"""
from __future__ import annotations

import types

import torch
from torch import nn


def _product_forward(self, x: torch.Tensor, position_ids: torch.Tensor):
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * self.attention_scaling
    sin = emb.sin() * self.attention_scaling
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _is_default_rope(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RotaryEmbedding")
            and isinstance(getattr(module, "inv_freq", None), torch.Tensor)
            and getattr(module, "rope_type", None) == "default" and hasattr(module, "attention_scaling"))


def rotary_as_product(body: nn.Module) -> int:
    """Give each default-type rotary embedding module of body the product forward; how many."""
    count = 0
    for module in body.modules():
        if _is_default_rope(module):
            module.forward = types.MethodType(_product_forward, module)
            count += 1
    return count
