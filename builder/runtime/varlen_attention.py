"""Variable-length attention for packed CUDA engines as one Triton kernel, kept by torch.export and
AOTInductor as a custom op (torch.library.triton_op), as fused_qk.py's kernel is.

A packed engine's attention takes every sequence of a call as one token stream, kept apart by cumulative
sequence lengths. torch's own kernel for that, aten._flash_attention_forward, is FlashAttention 2: on
Hopper it does not use the card's warpgroup matrix instructions, and at Qwen3-0.6B's 64 x 512 it took
0.52 ms a layer on the H200 against 0.28 ms for cuDNN's dense kernel (attention_probe_h200.json),
about a fifth of a packed call. cuDNN's variable-length form was slow and wrong with grouped-query heads
in the same probe, and FlashAttention 3 is not part of torch. Triton compiles tl.dot to those
instructions on sm_90, so this kernel is flash attention's forward written for the packed stream: one
program per (query block, head, sequence), online softmax in fp32 (exp2), the key blocks before the
diagonal without masks, causal or bidirectional, grouped-query heads read in place.

The op returns what aten._flash_attention_forward's first output is: [tokens, heads, head_dim] in q's
dtype. It is used where its shapes fit (fp16/bf16, head_dim a power of two from 16 to 256, no sliding
window), else packed.py keeps aten's kernel. It is opt-in, MOPT_VARLEN_KERNEL=triton at compile time: alone it
takes 0.30 ms a layer at Qwen3-0.6B's 64 x 512 on an H100 against aten's 0.51, but an engine compiled with
it has not yet run on a GPU (docs/performance.md). Exactness against per-sequence SDPA:
tests/unit/test_varlen_attention.py (Triton's interpreter on the CPU); speed: benchmarks/attention_probe.py.
"""
from __future__ import annotations

import functools
import os

import torch

from .errors import UsageError

ENV = "MOPT_VARLEN_KERNEL"
TILES_ENV = "MOPT_VARLEN_TILES"
OP = "mopt::varlen_attention"
KERNELS = ("triton", "flash")
DEFAULT = "flash"

# Tile sizes and launch settings by head_dim (BLOCK_M query rows, BLOCK_N keys a step; BLOCK_N divides
# BLOCK_M). 64 x 32, 4 warps, 3 stages: the H100's best of 28 for head_dim 128 at 64 x 512 and on log-normal
# lengths (benchmarks/attention_probe.py --sweep, results/attention_probe_h100_triton.json); the other head
# sizes take the same tiles, not swept (they fit shared memory: the unit tests compile them for sm_90).
CONFIGS = {16: (64, 32, 4, 3), 32: (64, 32, 4, 3), 64: (64, 32, 4, 3), 128: (64, 32, 4, 3), 256: (64, 32, 4, 2)}


def tiles(dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for HEAD_DIM: CONFIGS's, or MOPT_VARLEN_TILES's (four integers,
    comma-separated: another GPU's best, from benchmarks/attention_probe.py --sweep)."""
    value = os.environ.get(TILES_ENV)
    if not value:
        return CONFIGS[dim]
    try:
        block_m, block_n, warps, stages = (int(x) for x in value.split(","))
        valid = (16 <= block_n <= block_m and _power_of_two(block_m) and _power_of_two(block_n)
                 and warps in (1, 2, 4, 8, 16) and 1 <= stages <= 8)
    except ValueError:
        valid = False
    if not valid:
        raise UsageError(f"{TILES_ENV}={value!r}: expected BLOCK_M,BLOCK_N,WARPS,STAGES, powers of two with "
                         "BLOCK_N <= BLOCK_M (e.g. 128,64,8,3)")
    return block_m, block_n, warps, stages


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def kernel_name() -> str:
    """Which variable-length kernel packed CUDA engines compile with (MOPT_VARLEN_KERNEL)."""
    name = os.environ.get(ENV, DEFAULT)
    if name not in KERNELS:
        raise UsageError(f"{ENV}={name!r}: expected one of {', '.join(KERNELS)}")
    if name == "triton":
        tiles(128)  # a bad MOPT_VARLEN_TILES: refused with the kernel's choice, before any export
    return name


def fits(q: torch.Tensor, reach: int | None) -> bool:
    """Whether the kernel serves this call's attention: half precision, a power-of-two head_dim the
    configurations know, no sliding window (those layers keep aten's kernel, which takes a window)."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in CONFIGS and reach is None


@functools.cache
def op():
    """torch.ops.mopt.varlen_attention, registered at first use."""
    import triton
    from torch.library import triton_op, wrap_triton

    from .varlen_attention_kernel import varlen_attention_kernel as kernel

    @triton_op(OP, mutates_args=())
    def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_len: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
        """q [tokens, heads, dim], k/v [tokens, kv_heads, dim] (any token and head strides, the last dim
        contiguous), cu_seqlens int32 [sequences + 1], max_len a tensor as long as the longest sequence
        (its size is what matters) -> [tokens, heads, dim]."""
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out = q.new_empty(q.shape)
        dim = q.shape[2]
        block_m, block_n, warps, stages = tiles(dim)
        grid = (triton.cdiv(max_len.shape[0], block_m), q.shape[1], cu_seqlens.shape[0] - 1)  # symbolic sizes too
        wrap_triton(kernel)[grid](
            q, k, v, out, cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), q.shape[1] // k.shape[1], scale * 1.4426950408889634,  # log2(e)
            CAUSAL=causal, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        return out

    return torch.ops.mopt.varlen_attention.default


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], causal: bool,
              scale: float) -> torch.Tensor:
    """Per-sequence SDPA in fp32: what the op computes, [tokens, heads, dim] in fp32."""
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].transpose(0, 1)[None].float() for t in (q, k, v))
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=ks.shape[1] != qs.shape[1])[0].transpose(0, 1))
        start += n
    return torch.cat(outs)
