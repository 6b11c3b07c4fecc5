"""The Triton kernel behind varlen_attention.py's op (its doc says what and why). A module of its own, as
fused_qk_kernel.py is: triton is imported only where the op is registered, in CUDA images."""
import triton
import triton.language as tl


@triton.jit
def _key_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, hi, rows, seqlen, qk_scale,
                offs_n, offs_d, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over the key blocks [lo, hi) of one query block (flash attention's inner loop).
    MASKED: the blocks may hold keys past the sequence's end or (CAUSAL) after a query row."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if MASKED:
            inside = cols < seqlen
            k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :], mask=inside[:, None], other=0.0)
        else:
            k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :])
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            keep = inside[None, :]
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None])
            qk = tl.where(keep, qk, float("-inf"))
        # Every row keeps at least one key in the first block it sees (key 0, or its own position on the
        # diagonal), so m_new is finite and no row computes -inf - -inf
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=inside[:, None], other=0.0)
        else:
            v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def varlen_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens, stride_qt, stride_qh, stride_kt, stride_kh,
                            stride_vt, stride_vh, stride_ot, stride_oh, group, qk_scale,
                            CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    # Grid: (query blocks of the longest sequence, q heads, sequences). Programs next to each other in
    # launch order share a sequence and a head, so its keys and values stay in L2 between them.
    # Inductor passes a Python float to a user kernel as fp64 (AOTInductor engines): kept so, the scores, the
    # softmax state and the accumulator would widen to fp64, which tl.dot's fp32 accumulator refuses
    qk_scale = tl.cast(qk_scale, tl.float32)
    start_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(cu_seqlens + seq).to(tl.int64)  # int64: start * stride passes 2^31 in long calls
    seqlen = tl.load(cu_seqlens + seq + 1) - start.to(tl.int32)
    m0 = start_m * BLOCK_M
    if m0 >= seqlen:
        return
    kv_head = head // group  # grouped-query attention: `group` q heads share one k/v head
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = m0 + offs_m
    q = tl.load(q_ptr + start * stride_qt + head * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
                mask=(rows < seqlen)[:, None], other=0.0)
    k_base = k_ptr + start * stride_kt + kv_head * stride_kh
    v_base = v_ptr + start * stride_vt + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Key blocks that need no mask first (before the diagonal, or whole blocks of a bidirectional
    # sequence), then the rest with the masks; BLOCK_N divides BLOCK_M, so the first split is exact
    if CAUSAL:
        unmasked = m0
        end = tl.minimum(m0 + BLOCK_M, seqlen)
    else:
        unmasked = (seqlen // BLOCK_N) * BLOCK_N
        end = seqlen
    acc, l_i, m_i = _key_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, 0, unmasked, rows, seqlen,
                                qk_scale, offs_n, offs_d, False, CAUSAL, BLOCK_N)
    acc, l_i, m_i = _key_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, unmasked, end, rows, seqlen,
                                qk_scale, offs_n, offs_d, True, CAUSAL, BLOCK_N)
    out = acc / l_i[:, None]
    tl.store(out_ptr + start * stride_ot + head * stride_oh + rows[:, None] * stride_ot + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(rows < seqlen)[:, None])
