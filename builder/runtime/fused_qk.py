"""Qwen3's per-head q/k RMSNorm and rotary embedding as one Triton kernel, kept by torch.export and
AOTInductor as a custom op (torch.library.triton_op).

Each attention layer of Qwen3 normalises every head of q and k over head_dim (RMSNorm with its own
weight), then rotates it by its token's position (RoPE). Compiled from the module, Inductor fuses the two
into one persistent-reduction kernel per tensor, but on the H200 those kernels took about 17.5 ms of a
71 ms batch (64 x 512, 28 layers) while moving about 11 GB, some 3 ms at the card's bandwidth
(docs/performance.md). This kernel does both for q and k in one pass over each token: one program per
token loads its heads as two halves of head_dim (what rotate_half pairs), reduces each head's sum of
squares, and writes the rotated result; every value is read once and written once.

Rounding follows transformers' eager forward, so the kernel and the unfused module agree to the last
bit up to one rounding (tests/unit/test_fused_qk.py): the norm is computed in fp32 and rounded to the
input dtype before the weight multiplies it (Qwen3RMSNorm), the weighted result rounded again; the
rotation is then computed in fp32 from those values and the cos/sin tables (as the model computed them,
in the input dtype) and rounded once, where eager rounds after each multiply and the sum.

Only packed engines on CUDA use it (fuse_qk_norm_rope, called by the compile step): they call
attention through packed.py's function directly and never pass a KV cache, which the replaced forward
leaves out. MOPT_FUSED_QK=0 at compile time keeps transformers' forward (for side-by-side measurement,
benchmarks/packed_bench.py).
"""
from __future__ import annotations

import functools
import os
import types

import torch
from torch import nn

ENV = "MOPT_FUSED_QK"
OP = "mopt::qk_norm_rope"
_ATTENTION_CLASSES = ("Qwen3Attention",)


def wanted() -> bool:
    return os.environ.get(ENV, "1") != "0"


@functools.cache
def op():
    """torch.ops.mopt.qk_norm_rope, registered at first use."""
    import triton
    from torch.library import triton_op, wrap_triton

    from .fused_qk_kernel import qk_norm_rope_kernel as kernel

    @triton_op(OP, mutates_args=())
    def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, dim], k [tokens, kv_heads, dim] (each token's heads contiguous), cos/sin
        [tokens, dim] -> (q, k) normalised per head and rotated, new tensors of the same shapes."""
        # The kernel's addressing: each token's heads back to back (any stride between tokens: q and k may
        # be column slices of a merged projection's output, merged.py), each table row's values adjacent,
        # and cos and sin alike (no copies for what transformers hands over)
        q, k = _heads_adjacent(q), _heads_adjacent(k)
        cos, sin = cos.contiguous(), sin.contiguous()
        q_out, k_out = q.new_empty(q.shape), k.new_empty(k.shape)
        dim = q.shape[2]
        wrap_triton(kernel)[(q.shape[0],)](
            q, k, q_weight, k_weight, cos, sin, q_out, k_out, q.shape[1], k.shape[1],
            q.stride(0), k.stride(0), q_out.stride(0), k_out.stride(0), cos.stride(0), eps,
            HALF=dim // 2, BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])))
        return q_out, k_out

    return torch.ops.mopt.qk_norm_rope.default


def _heads_adjacent(x: torch.Tensor) -> torch.Tensor:
    """X [tokens, heads, dim] itself where each token's heads lie back to back, else a contiguous copy."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, eps: float,
              norm_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused form, as transformers' Qwen3 computes it (same shapes as the op). norm_dtype: round the
    norm's two steps to that dtype while the rest computes in the inputs' (the kernel's roundings, for
    fp32 inputs)."""

    def norm(x, weight):
        f = x.float()
        rounded = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(norm_dtype or x.dtype).to(x.dtype)
        return (weight * rounded).to(norm_dtype or x.dtype).to(x.dtype)

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    c, s = cos[:, None, :], sin[:, None, :]
    qn, kn = norm(q, q_weight), norm(k, k_weight)
    return qn * c + rotate_half(qn) * s, kn * c + rotate_half(kn) * s


def _fits(module: nn.Module) -> bool:
    return (type(module).__name__ in _ATTENTION_CLASSES and module.head_dim % 2 == 0
            and (module.head_dim & (module.head_dim - 1)) == 0)  # tl.arange takes powers of 2


def _fused_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, *args, **kwargs):
    """Qwen3Attention.forward for packed engines: [1, tokens, width] in, the q/k norm and rotation fused."""
    from .packed import _pack_attention

    kwargs.pop("past_key_values", None)
    kwargs.pop("cache", None)
    tokens = hidden_states.shape[1]
    if hasattr(self, "qkv_proj"):  # merged.py: one GEMM, its output split by columns (views, no copies)
        q, k, v = self.qkv_proj(hidden_states[0]).split(self.qkv_split, dim=-1)
    else:
        q, k, v = self.q_proj(hidden_states[0]), self.k_proj(hidden_states[0]), self.v_proj(hidden_states[0])
    q, k = q.view(tokens, -1, self.head_dim), k.view(tokens, -1, self.head_dim)
    v = v.view(1, tokens, -1, self.head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = op()(q, k, self.q_norm.weight, self.k_norm.weight, cos.reshape(tokens, -1), sin.reshape(tokens, -1),
                float(self.q_norm.variance_epsilon))
    out, weights = _pack_attention(self, q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), v, None,
                                   scaling=self.scaling, sliding_window=getattr(self, "sliding_window", None),
                                   **kwargs)
    return self.o_proj(out.reshape(1, tokens, -1).contiguous()), weights


def is_fused(module: nn.Module) -> bool:
    """Whether MODULE's forward is the fused one (fuse_qk_norm_rope gave it)."""
    return getattr(module.forward, "__func__", None) is _fused_forward


def fuse_qk_norm_rope(body: nn.Module) -> int:
    """Give every Qwen3 attention layer of a packed CUDA engine's body the fused forward; returns how many.
    The q and k norms must share their epsilon (they do: both are the config's rms_norm_eps)."""
    fused = 0
    for module in body.modules():
        if _fits(module) and module.q_norm.variance_epsilon == module.k_norm.variance_epsilon:
            module.forward = types.MethodType(_fused_forward, module)
            fused += 1
    return fused
