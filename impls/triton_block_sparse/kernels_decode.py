"""Decode kernels: a few query rows over a long KV cache, split over the keys (flash-decoding).

The prefill forward (`kernels.attn_fwd`) runs one program per (query tile, query head). With one query row
that is B * H programs, each walking every key tile of its row alone: 32 programs on a GPU of 132
multiprocessors, each reading its KV head's cache again for every query head of its group. Measured on an H200
(GQA 32/8, D128, bfloat16, 128K keys): 2.69 ms, 4.6% of the calibrated read bandwidth, against SDPA's 153 us.

Here one program takes one (sequence, KV head) and one split of the row's key tiles, with every query row of
the KV head's group packed into the rows of its tile: row r is query head `kv_head * G + r // Nq`, query row
`r % Nq`. Each key tile is read once for the whole group, and B * Hkv * S programs fill the GPU. Each split
writes its normalised output and base-2 log-sum-exp in float32; `attn_decode_combine` merges the splits per
query row by their log-sum-exps, into the same O and LSE as the prefill forward (LSE +inf where a row has no
key). The tables are the prefill's (`tables.py`) for a single query tile of TILE_M rows, so every mask kind
works unchanged; the bias score modifications (per query head) are left to the prefill path.

Import this module only through `mode.kernels()` (kernels.py re-exports it).
"""

import triton
import triton.language as tl

from impls.triton_block_sparse.kernel_masks import MOD_SOFTCAP, TWO_LOG2E, _allowed


@triton.jit
def _decode_tile(acc, l_i, m_i, q, k_base, v_base, kb, slot, rows, offs_d, d_ok,
                 stride_kn, stride_kd, stride_vn, stride_vd, mask_words,
                 n_keys, qk_scale, q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo, period,
                 cap2, MOD_KIND: tl.constexpr, MASKED: tl.constexpr, MASK_KIND: tl.constexpr,
                 HAS_DILATION: tl.constexpr, HAS_GLOBAL: tl.constexpr, WORDS: tl.constexpr, TILE_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """One key tile of the online softmax for the packed rows: returns the updated (acc, l_i, m_i)."""
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_ok = (offs_n[:, None] < n_keys) & d_ok if MASKED else d_ok
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N) float32, log2 units
    if MOD_KIND == MOD_SOFTCAP:
        qk = cap2 * (1.0 - 2.0 / (tl.math.exp2(qk * (TWO_LOG2E / cap2)) + 1.0))
    if MASKED:
        ok = _allowed(rows[:, None], offs_n[None, :], slot, mask_words, q_offset, band_lo, band_hi, dilation,
                      global_rows, global_cols, global_lo, period, MASK_KIND, HAS_DILATION, HAS_GLOBAL,
                      TILE_M, BLOCK_N, WORDS)
        qk = tl.where(ok & (offs_n[None, :] < n_keys), qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet: no NaN
    p = tl.math.exp2(qk - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
    if DOT_F32:
        acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None])
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def attn_fwd_decode(Q, K, V, O_PART, LSE_PART,
                    stride_qb, stride_qh, stride_qn, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    row_offsets, row_full, row_cols, row_slots, mask_words,
                    n_kv_heads, n_group, n_rows, n_keys, qk_scale, tiles_per_split, n_out_rows,
                    q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo, period, BIAS, cap2,
                    MASK_KIND: tl.constexpr, HAS_DILATION: tl.constexpr, HAS_GLOBAL: tl.constexpr,
                    WORDS: tl.constexpr, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr, MOD_KIND: tl.constexpr):
    """Grid (S, B * Hkv): split s of one KV head's key tiles, for its G * Nq packed query rows (BLOCK_M >= that).

    Writes O_PART (S, B*H*Nq, D) and LSE_PART (S, B*H*Nq), float32: the split's normalised output and base-2
    log-sum-exp (-inf where the split holds no key of the row). BIAS is unused (no bias modification here).
    """
    pid_s = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    off_b = (pid_bkv // n_kv_heads).to(tl.int64)
    off_hkv = (pid_bkv % n_kv_heads).to(tl.int64)
    packed = tl.arange(0, BLOCK_M)
    head = off_hkv * n_group + packed // n_rows  # the query head of each packed row
    rows = packed % n_rows  # its row of the q_len x N matrix
    row_ok = packed < n_group * n_rows
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d[None, :] < D
    q = tl.load(Q + off_b * stride_qb + head[:, None] * stride_qh + rows[:, None] * stride_qn
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = K + off_b * stride_kb + off_hkv * stride_kh
    v_base = V + off_b * stride_vb + off_hkv * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    start = tl.load(row_offsets)
    first_partial = start + tl.load(row_full)
    end = tl.load(row_offsets + 1)
    lo = start + pid_s * tiles_per_split
    hi = tl.minimum(lo + tiles_per_split, end)
    for t in range(lo, tl.minimum(hi, first_partial)):  # fully allowed tiles: no mask at all
        kb = tl.load(row_cols + t)
        acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, k_base, v_base, kb, 0, rows, offs_d, d_ok,
                                     stride_kn, stride_kd, stride_vn, stride_vd, mask_words, n_keys, qk_scale,
                                     q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo,
                                     period, cap2,
                                     MOD_KIND, False, MASK_KIND, HAS_DILATION, HAS_GLOBAL, WORDS, TILE_M, BLOCK_N,
                                     DOT_F32)
    for t in range(tl.maximum(lo, first_partial), hi):
        kb = tl.load(row_cols + t)
        slot = tl.load(row_slots + t)
        acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, k_base, v_base, kb, slot, rows, offs_d, d_ok,
                                     stride_kn, stride_kd, stride_vn, stride_vd, mask_words, n_keys, qk_scale,
                                     q_offset, band_lo, band_hi, dilation, global_rows, global_cols, global_lo,
                                     period, cap2,
                                     MOD_KIND, True, MASK_KIND, HAS_DILATION, HAS_GLOBAL, WORDS, TILE_M, BLOCK_N,
                                     DOT_F32)

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, m_i + tl.math.log2(l_safe), float("-inf"))
    out_row = (off_b * (n_kv_heads * n_group) + head) * n_rows + rows  # into the (B*H*Nq) rows
    part = pid_s.to(tl.int64) * n_out_rows + out_row
    tl.store(O_PART + part[:, None] * D + offs_d[None, :], out, mask=row_ok[:, None] & d_ok)
    tl.store(LSE_PART + part, lse, mask=row_ok)


@triton.jit
def attn_decode_combine(O_PART, LSE_PART, O, LSE, n_splits, n_out_rows,
                        BLOCK_S: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Grid (B*H*Nq,): one query row's splits merged by their log-sum-exps into O (the inputs' dtype) and the
    base-2 LSE (+inf where no split held a key: output 0, as the prefill forward writes it)."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < n_splits
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < D
    lse_s = tl.load(LSE_PART + splits * n_out_rows + row, mask=s_ok, other=float("-inf"))
    top = tl.max(lse_s, 0)
    has_keys = top > float("-inf")
    top_safe = tl.where(has_keys, top, 0.0)
    weight = tl.where(s_ok & (lse_s > float("-inf")), tl.math.exp2(lse_s - top_safe), 0.0)
    total = tl.sum(weight, 0)
    parts = tl.load(O_PART + (splits[:, None] * n_out_rows + row) * D + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(has_keys, total, 1.0)
    tl.store(O + row * D + offs_d, out.to(O.dtype.element_ty), mask=d_ok)
    tl.store(LSE + row, tl.where(has_keys, top_safe + tl.math.log2(tl.where(has_keys, total, 1.0)), float("inf")))
