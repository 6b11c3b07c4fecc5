"""The Triton kernel behind fused_qk.py's op (its doc says what and why). A module of its own: triton is
imported only where the op is registered, in CUDA images, and Triton resolves a kernel's callees from its
module's globals."""
import triton
import triton.language as tl


@triton.jit
def norm_rope_heads(src, dst, w_ptr, n_heads, stride_src, stride_dst, token, c, s, c2, s2, eps,
                    HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token's heads of q or k: RMSNorm over head_dim, then the rotation."""
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF)
    mask = heads[:, None] < n_heads
    within = heads[:, None] * (2 * HALF) + cols[None, :]  # a token's heads lie back to back
    src_offs = token * stride_src + within
    offs = token * stride_dst + within
    x1 = tl.load(src + src_offs, mask=mask, other=0.0)  # the two halves that rotate_half pairs
    x2 = tl.load(src + src_offs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    var = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF)
    rstd = (1.0 / tl.sqrt(var + eps))[:, None]
    w1 = tl.load(w_ptr + cols).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + cols).to(tl.float32)[None, :]
    # Qwen3RMSNorm: normalised in fp32, rounded to the input dtype, times the weight, rounded again
    n1 = ((f1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    n2 = ((f2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    # apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1)
    tl.store(dst + offs, (n1 * c - n2 * s).to(dtype), mask=mask)
    tl.store(dst + offs + HALF, (n2 * c2 + n1 * s2).to(dtype), mask=mask)

@triton.jit
def qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                        q_heads, k_heads, stride_qt, stride_kt, stride_qo, stride_ko, stride_ct, eps,
                        HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    # One program per token: its q heads and its k heads. int64: token * stride passes 2^31 in a long call
    # (a Qwen3-8B engine's 32 heads x 128 from 524,288 tokens), where int32 offsets would wrap.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HALF)
    row = cos_ptr + token * stride_ct
    c = tl.load(row + cols).to(tl.float32)
    c2 = tl.load(row + HALF + cols).to(tl.float32)
    row = sin_ptr + token * stride_ct
    s = tl.load(row + cols).to(tl.float32)
    s2 = tl.load(row + HALF + cols).to(tl.float32)
    norm_rope_heads(q_ptr, q_out_ptr, qw_ptr, q_heads, stride_qt, stride_qo, token, c, s, c2, s2, eps, HALF, BLOCK_H)
    norm_rope_heads(k_ptr, k_out_ptr, kw_ptr, k_heads, stride_kt, stride_ko, token, c, s, c2, s2, eps, HALF, BLOCK_H)
