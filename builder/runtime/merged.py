"""Qwen3's parallel projections merged into one linear layer each: q, k and v of every attention layer
(qkv_proj), gate and up of every MLP (gate_up_proj), as vLLM's QKVParallelLinear and
MergedColumnParallelLinear do.

Each group reads the same input, so one GEMM with the weights stacked along the output dimension does the
work of two or three: the input is read once, and there are fewer, wider GEMMs, which a GPU runs closer
to its peak. In an fp8 engine the merge matters more: each fp8 layer quantizes its input per token (an
amax over the row, then the cast), so three layers over one input quantized it three times; merged, once.
The merge happens before quantization, and per-output-channel weight scales make the merged fp8 layer
compute exactly what the separate ones did.

The merged attention layer needs the forward that splits qkv_proj's output: fused_qk.py's, so attention
is merged only where that forward is already in use (packed CUDA engines with the fused kernel). Only
packed CUDA engines are merged (the compile step); MOPT_MERGED_PROJ=0 at compile time keeps the separate
layers, for comparison (benchmarks/packed_bench.py: `packed:unmerged` against `packed`). Measured on an
H100 at Qwen3-0.6B's 28 layers (docs/performance.md): bf16 as fast at 64 x 512 (1.00x), 1.03x at
16 x 128, batch 1 x 32 in 1.64 ms instead of 1.83; fp8 1.05x at 64 x 512; the same cosines. On the CPU
its arithmetic is checked against the separate layers (tests/unit/test_merged.py, test_fused_qk.py).
"""
from __future__ import annotations

import os
import types

import torch
from torch import nn

from .errors import UsageError
from .fused_qk import is_fused

ENV = "MOPT_MERGED_PROJ"
_ATTENTION = ("q_proj", "k_proj", "v_proj")
_MLP = ("gate_proj", "up_proj")


def wanted() -> bool:
    """MOPT_MERGED_PROJ: 1 (the default) or 0; anything else is a usage error, not a silent choice."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise UsageError(f"{ENV} must be 0 or 1, not {value!r}")
    return value == "1"


def merge_linears(layers: list[nn.Linear]) -> nn.Linear:
    """One linear layer whose output is LAYERS' outputs side by side (their weights stacked by rows)."""
    first = layers[0]
    if any(type(layer) is not nn.Linear for layer in layers):
        raise ValueError("only torch.nn.Linear layers merge (merge before quantizing)")
    if any(layer.in_features != first.in_features or (layer.bias is None) != (first.bias is None)
           or layer.weight.dtype != first.weight.dtype or layer.weight.device != first.weight.device
           for layer in layers):
        raise ValueError("merged layers must share their input width, bias, dtype and device")
    # Made on the meta device, then given the stacked weights: no throwaway initialisation of a layer as
    # large as its parts (the stack fixes the device and dtype)
    merged = nn.Linear(first.in_features, sum(layer.out_features for layer in layers), bias=first.bias is not None,
                       device="meta")
    with torch.no_grad():
        merged.weight = nn.Parameter(torch.cat([layer.weight for layer in layers]))
        if first.bias is not None:
            merged.bias = nn.Parameter(torch.cat([layer.bias for layer in layers]))
    return merged


def _merge_into(module: nn.Module, names: tuple[str, ...], merged_name: str) -> tuple[int, ...]:
    """Replace MODULE's layers NAMES by one layer MERGED_NAME; returns their output widths (the split)."""
    layers = [getattr(module, name) for name in names]
    setattr(module, merged_name, merge_linears(layers))
    for name in names:
        delattr(module, name)
    return tuple(layer.out_features for layer in layers)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up_proj(x).split(self.gate_up_split, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _mergeable(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(type(getattr(module, name, None)) is nn.Linear for name in names)


def merge_projections(body: nn.Module) -> dict[str, int]:
    """Merge, in place, every Qwen3 MLP's gate/up and the q/k/v of every attention layer whose forward is
    fused_qk's (call fuse_qk_norm_rope first); returns how many of each. Call before quantizing."""
    counts = {"qkv": 0, "gate_up": 0}
    for module in body.modules():
        kind = type(module).__name__
        if is_fused(module) and _mergeable(module, _ATTENTION):
            module.qkv_split = _merge_into(module, _ATTENTION, "qkv_proj")
            counts["qkv"] += 1
        elif kind == "Qwen3MLP" and _mergeable(module, _MLP) and hasattr(module, "act_fn"):
            module.gate_up_split = _merge_into(module, _MLP, "gate_up_proj")
            module.forward = types.MethodType(_mlp_forward, module)
            counts["gate_up"] += 1
    return counts
