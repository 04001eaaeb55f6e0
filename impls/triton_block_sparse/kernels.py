"""Triton kernels of block-sparse attention: forward, backward preprocess, dK/dV pass, dQ pass.

The structure follows the Triton tutorial 06 (fused attention, FlashAttention-2): the forward keeps a running
max and sum per query row (online softmax) in float32 and stores the base-2 log-sum-exp for the backward;
the backward recomputes the probabilities from it, one pass accumulating dK/dV per key tile and one
accumulating dQ per query tile. What differs is sparsity: each program visits only the tiles listed for it in
a lookup table (CSR over tiles, fully allowed tiles first), built once from the pattern's block layout
(`tables.py`). Fully allowed tiles are not masked at all; in partially allowed tiles the pattern is applied by
formula (band / strided / axial) or by a per-tile bitmask for irregular ones.

Import this module only through `launch.kernels()`: whether the decorators below build compiled kernels or
interpreter functions is decided by TRITON_INTERPRET when they run, and `launch` decides it.

Shapes: q (B, H, Nq, D), k and v (B, Hkv, N, D), with any strides; o, do, dq contiguous (B, H, Nq, D), dk,
dv contiguous (B, Hkv, N, D); lse, delta contiguous (B*H, Nq) float32. Nq = q_len (`n_rows`) query rows,
the last Nq of the N positions: row r is position r + q_offset (bottom-right alignment), which is what the
formula masks compare; bounds compare rows with Nq and keys with N. Query head h reads KV head
h // n_group (grouped-query attention through the strides, no copy of K or V); the dK/dV program of a KV head
sums over its n_group query heads itself, so no atomics and a fixed order. D is the real head_dim, HEAD_DIM
its power-of-two padding (tl.arange needs one).
"""

import triton
import triton.language as tl

from impls.triton_block_sparse.kernel_masks import (
    MOD_BIAS,
    MOD_SOFTCAP,
    TWO_LOG2E,
    _allowed,
)
from impls.triton_block_sparse.kernels_decode import attn_decode_combine, attn_fwd_decode  # noqa: F401

# The interpreter re-patches triton.language on every call of a jit helper, so the hot loops call at most
# two helpers per tile (the tile function and, in partial tiles, `_allowed`); loads and dots are inline.
# DOT_F32 widens dot operands to float32: the interpreter keeps bfloat16 as raw uint16 and its dot multiplies
# those bits, so on CPU bfloat16 tiles are multiplied as float32 - of values already rounded to bfloat16, so
# each product equals a bfloat16 tensor-core dot's (only the summation order differs). Compiled kernels
# never set it.

# --- forward ------------------------------------------------------------------------------------------------

@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_base, v_base, kb, slot, offs_m, offs_d, d_ok,
              stride_kn, stride_kd, stride_vn, stride_vd, mask_words,
              n_keys, qk_scale, q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo, period,
              bias_base, cap2, n_rows, MOD_KIND: tl.constexpr, MASKED: tl.constexpr, MASK_KIND: tl.constexpr,
              HAS_DILATION: tl.constexpr,
              HAS_GLOBAL: tl.constexpr, WORDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              DOT_F32: tl.constexpr):
    """One key tile of the online softmax for a query tile: returns the updated (acc, l_i, m_i)."""
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_ok = (offs_n[:, None] < n_keys) & d_ok if MASKED else d_ok  # a full tile lies inside the sequence
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N) float32, log2 units
    if MOD_KIND == MOD_SOFTCAP:
        qk = cap2 * (1.0 - 2.0 / (tl.math.exp2(qk * (TWO_LOG2E / cap2)) + 1.0))
    elif MOD_KIND == MOD_BIAS:
        at = offs_m[:, None] + q_offset - offs_n[None, :] + n_keys - 1
        qk += tl.load(bias_base + at, mask=(offs_m[:, None] < n_rows) & (offs_n[None, :] < n_keys), other=0.0)
    if MASKED:
        ok = _allowed(offs_m[:, None], offs_n[None, :], slot, mask_words, q_offset, band_lo, band_hi, dilation,
                      global_rows, global_cols, global_lo, period, MASK_KIND, HAS_DILATION, HAS_GLOBAL,
                      BLOCK_M, BLOCK_N, WORDS)
        qk = tl.where(ok & (offs_n[None, :] < n_keys), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet: no NaN
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
    p = tl.math.exp2(qk - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
    p = p.to(v.dtype)
    if DOT_F32:
        acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc * alpha[:, None])
    else:
        acc = tl.dot(p, v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def attn_fwd(Q, K, V, O, LSE,
             stride_qb, stride_qh, stride_qn, stride_qd,
             stride_kb, stride_kh, stride_kn, stride_kd,
             stride_vb, stride_vh, stride_vn, stride_vd,
             row_offsets, row_full, row_cols, row_slots, mask_words,
             n_heads, n_group, n_rows, n_keys, qk_scale,
             q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo, period, BIAS, cap2,
             MASK_KIND: tl.constexpr, HAS_DILATION: tl.constexpr, HAS_GLOBAL: tl.constexpr,
             WORDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr, MOD_KIND: tl.constexpr):
    """Grid (cdiv(Nq, BLOCK_M), B * H): one query tile of one head; writes O and the base-2 LSE.

    Query head h reads KV head h // n_group.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // n_heads).to(tl.int64)
    off_h = (pid_bh % n_heads).to(tl.int64)
    off_hkv = off_h // n_group
    k_base = K + off_b * stride_kb + off_hkv * stride_kh
    v_base = V + off_b * stride_vb + off_hkv * stride_vh
    bias_base = BIAS + off_h * (2 * n_keys - 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d[None, :] < D  # the padding of head_dim to a power of two
    row_ok = offs_m[:, None] < n_rows
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=row_ok & d_ok, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    start = tl.load(row_offsets + pid_m)
    first_partial = start + tl.load(row_full + pid_m)
    end = tl.load(row_offsets + pid_m + 1)
    for t in range(start, first_partial):  # fully allowed tiles: no mask at all
        kb = tl.load(row_cols + t)
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, kb, 0, offs_m, offs_d, d_ok,
                                  stride_kn, stride_kd, stride_vn, stride_vd, mask_words,
                                  n_keys, qk_scale, q_offset, band_lo, band_hi, dilation, global_rows, global_cols,
                                  global_lo, period, bias_base, cap2, n_rows, MOD_KIND, False, MASK_KIND,
                                  HAS_DILATION, HAS_GLOBAL, WORDS, BLOCK_M, BLOCK_N, DOT_F32)
    for t in range(first_partial, end):
        kb = tl.load(row_cols + t)
        slot = tl.load(row_slots + t)
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, kb, slot, offs_m, offs_d, d_ok,
                                  stride_kn, stride_kd, stride_vn, stride_vd, mask_words,
                                  n_keys, qk_scale, q_offset, band_lo, band_hi, dilation, global_rows, global_cols,
                                  global_lo, period, bias_base, cap2, n_rows, MOD_KIND, True, MASK_KIND,
                                  HAS_DILATION, HAS_GLOBAL, WORDS, BLOCK_M, BLOCK_N, DOT_F32)

    has_keys = l_i > 0.0  # False for a query row with no allowed key: output 0, LSE +inf (backward p = 0)
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, m_i + tl.math.log2(l_safe), float("inf"))
    row_base = pid_bh.to(tl.int64) * n_rows  # into (B*H, Nq) LSE and contiguous (B, H, Nq, D) O
    tl.store(O + row_base * D + offs_m[:, None] * D + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok & d_ok)
    tl.store(LSE + row_base + offs_m, lse, mask=offs_m < n_rows)


# --- backward -----------------------------------------------------------------------------------------------

@triton.jit
def attn_bwd_preprocess(O, DO, DELTA, n_rows, BLOCK_M: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """delta = rowsum(O * dO) in float32, (B*H, Nq). Grid (cdiv(Nq, BLOCK_M), B * H)."""
    pid_m = tl.program_id(0)
    row_base = tl.program_id(1).to(tl.int64) * n_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (offs_m[:, None] < n_rows) & (offs_d[None, :] < D)
    offs = row_base * D + offs_m[:, None] * D + offs_d[None, :]
    o = tl.load(O + offs, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + row_base + offs_m, tl.sum(o * do, axis=1), mask=offs_m < n_rows)


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, qb, slot, offs_n, offs_d, d_ok,
               stride_qn, stride_qd, mask_words, n_rows, n_keys, qk_scale, q_offset, band_lo, band_hi, dilation,
               global_rows, global_cols, global_lo, period, bias_base, cap2, MOD_KIND: tl.constexpr,
               MASKED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DILATION: tl.constexpr,
               HAS_GLOBAL: tl.constexpr, WORDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               D: tl.constexpr, DOT_F32: tl.constexpr):
    """One query tile's contribution to a key tile's dK, dV (transposed: scores are (BLOCK_N, BLOCK_M))."""
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    # Query rows past Nq load as zero with LSE +inf, so their probabilities are 0 even in a full tile.
    q_ok = (offs_m[:, None] < n_rows) & d_ok
    q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, mask=q_ok, other=0.0)
    do = tl.load(do_base + offs_m[:, None] * D + offs_d[None, :], mask=q_ok, other=0.0)
    lse = tl.load(lse_base + offs_m, mask=offs_m < n_rows, other=float("inf"))
    delta = tl.load(delta_base + offs_m, mask=offs_m < n_rows, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    qk_t = tl.dot(k, tl.trans(q)) * qk_scale
    if MOD_KIND == MOD_SOFTCAP:  # keep tanh for the derivative 1 - tanh^2
        th_t = 1.0 - 2.0 / (tl.math.exp2(qk_t * (TWO_LOG2E / cap2)) + 1.0)
        qk_t = cap2 * th_t
    elif MOD_KIND == MOD_BIAS:
        at = offs_m[None, :] + q_offset - offs_n[:, None] + n_keys - 1
        qk_t += tl.load(bias_base + at, mask=(offs_m[None, :] < n_rows) & (offs_n[:, None] < n_keys), other=0.0)
    if MASKED:
        ok = _allowed(offs_m[None, :], offs_n[:, None], slot, mask_words, q_offset, band_lo, band_hi, dilation,
                      global_rows, global_cols, global_lo, period, MASK_KIND, HAS_DILATION, HAS_GLOBAL,
                      BLOCK_M, BLOCK_N, WORDS)
        qk_t = tl.where(ok & (offs_n[:, None] < n_keys), qk_t, float("-inf"))
    p_t = tl.math.exp2(qk_t - lse[None, :])
    dp_t = tl.dot(v, tl.trans(do))
    ds_t = p_t * (dp_t - delta[None, :])
    if MOD_KIND == MOD_SOFTCAP:
        ds_t = ds_t * (1.0 - th_t * th_t)
    if DOT_F32:  # round to the input dtype as the compiled kernel does, then multiply in float32
        dv = tl.dot(p_t.to(q_base.dtype.element_ty).to(tl.float32), do, dv)
        dk = tl.dot(ds_t.to(q_base.dtype.element_ty).to(tl.float32), q, dk)
    else:
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA,
                  stride_qb, stride_qh, stride_qn, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  col_offsets, col_full, col_rows, col_slots, mask_words,
                  n_kv_heads, n_group, n_rows, n_keys, sm_scale, qk_scale,
                  q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo, period, BIAS, cap2,
                  MASK_KIND: tl.constexpr, HAS_DILATION: tl.constexpr, HAS_GLOBAL: tl.constexpr,
                  WORDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr, MOD_KIND: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), B * Hkv): dK, dV of one key tile of one KV head.

    Sums over the n_group query heads that read this KV head, each over the query tiles of the key tile's
    table column, in a fixed order: deterministic, without atomics.
    """
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    off_b = (pid_bkv // n_kv_heads).to(tl.int64)
    off_hkv = (pid_bkv % n_kv_heads).to(tl.int64)
    n_heads = n_kv_heads * n_group
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d[None, :] < D
    kv_ok = (offs_n[:, None] < n_keys) & d_ok
    k = tl.load(K + off_b * stride_kb + off_hkv * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
    v = tl.load(V + off_b * stride_vb + off_hkv * stride_vh + offs_n[:, None] * stride_vn
                + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    start = tl.load(col_offsets + pid_n)
    first_partial = start + tl.load(col_full + pid_n)
    end = tl.load(col_offsets + pid_n + 1)
    for g in range(0, n_group):  # the query heads of this KV head
        off_h = off_hkv * n_group + g
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        row_base = (off_b * n_heads + off_h) * n_rows  # into (B*H, Nq) LSE / delta and (B, H, Nq, D) dO
        do_base = DO + row_base * D
        lse_base = LSE + row_base
        delta_base = DELTA + row_base
        bias_base = BIAS + off_h * (2 * n_keys - 1)
        for t in range(start, first_partial):
            qb = tl.load(col_rows + t)
            dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, qb, 0,
                                offs_n, offs_d, d_ok, stride_qn, stride_qd, mask_words, n_rows, n_keys, qk_scale,
                                q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo, period,
                                bias_base, cap2, MOD_KIND, False, MASK_KIND, HAS_DILATION, HAS_GLOBAL, WORDS,
                                BLOCK_M, BLOCK_N, D, DOT_F32)
        for t in range(first_partial, end):
            qb = tl.load(col_rows + t)
            slot = tl.load(col_slots + t)
            dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, qb, slot,
                                offs_n, offs_d, d_ok, stride_qn, stride_qd, mask_words, n_rows, n_keys, qk_scale,
                                q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo, period,
                                bias_base, cap2, MOD_KIND, True, MASK_KIND, HAS_DILATION, HAS_GLOBAL, WORDS,
                                BLOCK_M, BLOCK_N, D, DOT_F32)
    out_offs = pid_bkv.to(tl.int64) * n_keys * D + offs_n[:, None] * D + offs_d[None, :]  # (B, Hkv, N, D)
    tl.store(DK + out_offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + out_offs, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _dq_tile(dq, q, do, lse, delta, k_base, v_base, kb, slot, offs_m, offs_d, d_ok,
             stride_kn, stride_kd, stride_vn, stride_vd, mask_words,
             n_keys, qk_scale, q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo, period,
             bias_base, cap2, n_rows, MOD_KIND: tl.constexpr, MASKED: tl.constexpr, MASK_KIND: tl.constexpr,
             HAS_DILATION: tl.constexpr,
             HAS_GLOBAL: tl.constexpr, WORDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             DOT_F32: tl.constexpr):
    """One key tile's contribution to a query tile's dQ."""
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_ok = (offs_n[:, None] < n_keys) & d_ok if MASKED else d_ok
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
    in_dtype = k.dtype
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k)) * qk_scale
    if MOD_KIND == MOD_SOFTCAP:  # keep tanh for the derivative 1 - tanh^2
        th = 1.0 - 2.0 / (tl.math.exp2(qk * (TWO_LOG2E / cap2)) + 1.0)
        qk = cap2 * th
    elif MOD_KIND == MOD_BIAS:
        at = offs_m[:, None] + q_offset - offs_n[None, :] + n_keys - 1
        qk += tl.load(bias_base + at, mask=(offs_m[:, None] < n_rows) & (offs_n[None, :] < n_keys), other=0.0)
    if MASKED:
        ok = _allowed(offs_m[:, None], offs_n[None, :], slot, mask_words, q_offset, band_lo, band_hi, dilation,
                      global_rows, global_cols, global_lo, period, MASK_KIND, HAS_DILATION, HAS_GLOBAL,
                      BLOCK_M, BLOCK_N, WORDS)
        qk = tl.where(ok & (offs_n[None, :] < n_keys), qk, float("-inf"))
    p = tl.math.exp2(qk - lse[:, None])
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    if MOD_KIND == MOD_SOFTCAP:
        ds = ds * (1.0 - th * th)
    ds = ds.to(in_dtype)
    if DOT_F32:
        ds = ds.to(tl.float32)
    return tl.dot(ds, k, dq)


@triton.jit
def attn_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA,
                stride_qb, stride_qh, stride_qn, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                row_offsets, row_full, row_cols, row_slots, mask_words,
                n_heads, n_group, n_rows, n_keys, sm_scale, qk_scale,
                q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo, period, BIAS, cap2,
                MASK_KIND: tl.constexpr, HAS_DILATION: tl.constexpr, HAS_GLOBAL: tl.constexpr,
                WORDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr, MOD_KIND: tl.constexpr):
    """Grid (cdiv(Nq, BLOCK_M), B * H): dQ of one query tile, over the key tiles of its table row (query head h
    reads KV head h // n_group)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // n_heads).to(tl.int64)
    off_h = (pid_bh % n_heads).to(tl.int64)
    off_hkv = off_h // n_group
    row_base = pid_bh.to(tl.int64) * n_rows
    k_base = K + off_b * stride_kb + off_hkv * stride_kh
    v_base = V + off_b * stride_vb + off_hkv * stride_vh
    bias_base = BIAS + off_h * (2 * n_keys - 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d[None, :] < D
    q_ok = (offs_m[:, None] < n_rows) & d_ok
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=q_ok, other=0.0)
    do = tl.load(DO + row_base * D + offs_m[:, None] * D + offs_d[None, :], mask=q_ok, other=0.0)
    lse = tl.load(LSE + row_base + offs_m, mask=offs_m < n_rows, other=float("inf"))
    delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < n_rows, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    start = tl.load(row_offsets + pid_m)
    first_partial = start + tl.load(row_full + pid_m)
    end = tl.load(row_offsets + pid_m + 1)
    for t in range(start, first_partial):
        kb = tl.load(row_cols + t)
        dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, kb, 0, offs_m, offs_d, d_ok,
                      stride_kn, stride_kd, stride_vn, stride_vd, mask_words,
                      n_keys, qk_scale, q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo,
                      period, bias_base, cap2, n_rows, MOD_KIND, False, MASK_KIND, HAS_DILATION, HAS_GLOBAL, WORDS,
                      BLOCK_M, BLOCK_N, DOT_F32)
    for t in range(first_partial, end):
        kb = tl.load(row_cols + t)
        slot = tl.load(row_slots + t)
        dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, kb, slot, offs_m, offs_d, d_ok,
                      stride_kn, stride_kd, stride_vn, stride_vd, mask_words,
                      n_keys, qk_scale, q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo,
                      period, bias_base, cap2, n_rows, MOD_KIND, True, MASK_KIND, HAS_DILATION, HAS_GLOBAL, WORDS,
                      BLOCK_M, BLOCK_N, DOT_F32)
    tl.store(DQ + row_base * D + offs_m[:, None] * D + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=q_ok)
