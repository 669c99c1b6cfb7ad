"""Split-K decode kernel with swapped MMA roles: tokens (and channels) are the M dimension.

Same inputs, outputs and math as quant_decode_kernels.quant_decode_split_kernel (whose merge
kernel combines the splits), but every product is computed transposed:
  scores^T [P, G]  = K [P, D] @ Q^T [D, G]           (keys as stored: token-major rows)
  out^T    [D, G] += V^T [D, P] @ (p * v_scale)^T    (values as stored: byte-major rows)
so both packed operands are the A operand with their reduction dim contiguous as stored, and the
GQA group is the small N dimension (its own size, padded by Triton), which keeps the query
tiles and the accumulators small ([WIDTH, BLOCK_G] fp32 per plane).
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang_vericache.ops.triton.quant_decode_kernels import (
    RESCALE_LOG2,
    _channel_planes,
    _code_planes,
    _mma,
)


@triton.jit
def _dequant_rows(codes, scale, zero, DOT_DTYPE: tl.constexpr, MAGIC: tl.constexpr,
                  OFFSET: tl.constexpr, UPCAST: tl.constexpr):
    """Keys [R, W] from codes (OFFSET + code, DOT_DTYPE) and per-channel scale/zero [W]."""
    if UPCAST:
        keys = tl.fma(codes.to(tl.float32) - OFFSET, scale.to(tl.float32)[None, :],
                      zero.to(tl.float32)[None, :]).to(DOT_DTYPE)
    else:
        if MAGIC != 0:
            codes = codes - OFFSET
        keys = tl.fma(codes, scale.to(DOT_DTYPE)[None, :], zero.to(DOT_DTYPE)[None, :])
    return keys


@triton.jit
def quant_decode_split_kernel_swapped(
    q_ptr, k_packed_ptr, k_scale_ptr, k_zero_ptr, v_packed_ptr, v_scale_ptr, v_zero_ptr,
    win_k_ptr, win_v_ptr,
    kv_indptr_ptr, kv_page_indices_ptr, kv_last_page_len_ptr, window_slot_ptr, window_len_ptr,
    part_o_ptr, part_lse_ptr,
    qk_scale, num_kv_heads, window_capacity, num_splits, stride_qb, stride_qh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_P: tl.constexpr, BITS: tl.constexpr, BLOCK_W: tl.constexpr,
    DOT_DTYPE: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ASM_P0: tl.constexpr, ASM_P1: tl.constexpr, ASM_P2: tl.constexpr, ASM_P3: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
):
    """Arguments as quant_decode_split_kernel (part_o [B, H_q, S, D], part_lse [B, H_q, S])."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    PL: tl.constexpr = 8 // BITS
    WIDTH: tl.constexpr = HEAD_DIM // PL

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    w = tl.arange(0, WIDTH)
    row = tl.arange(0, BLOCK_P)
    g_ok = g < GROUP
    head_q = pid_h * GROUP + g
    # Query planes transposed, [WIDTH, BLOCK_G]: plane j holds channels w * PL + j.
    q_cols = q_ptr + pid_b.to(tl.int64) * stride_qb + head_q[None, :] * stride_qh
    qt0 = tl.load(q_cols + (w * PL)[:, None], mask=g_ok[None, :], other=0.0).to(DOT_DTYPE)
    qt1 = tl.load(q_cols + (w * PL + 1)[:, None], mask=g_ok[None, :], other=0.0).to(DOT_DTYPE)
    qt2 = qt0
    qt3 = qt1
    if PL == 4:
        qt2 = tl.load(q_cols + (w * PL + 2)[:, None], mask=g_ok[None, :], other=0.0).to(DOT_DTYPE)
        qt3 = tl.load(q_cols + (w * PL + 3)[:, None], mask=g_ok[None, :], other=0.0).to(DOT_DTYPE)

    page_base = tl.load(kv_indptr_ptr + pid_b)
    num_pages = tl.load(kv_indptr_ptr + pid_b + 1) - page_base
    per_split = tl.cdiv(num_pages, num_splits)
    first = pid_s * per_split
    last = tl.minimum(first + per_split, num_pages)
    last_len = tl.load(kv_last_page_len_ptr + pid_b)
    row_in_page = row < PAGE

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    zero_acc = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc0 = tl.zeros([WIDTH, BLOCK_G], dtype=tl.float32)
    acc1 = tl.zeros([WIDTH, BLOCK_G], dtype=tl.float32)
    acc2 = tl.zeros([WIDTH, BLOCK_G], dtype=tl.float32)
    acc3 = tl.zeros([WIDTH, BLOCK_G], dtype=tl.float32)

    for i in range(first, last):
        page = tl.load(kv_page_indices_ptr + page_base + i).to(tl.int64)
        n_valid = tl.where(i == num_pages - 1, last_len, PAGE)
        head_page = page * num_kv_heads + pid_h
        tok_ok = row < n_valid
        base = head_page * (PAGE * WIDTH)
        k_bytes = tl.load(k_packed_ptr + base + row[:, None] * WIDTH + w[None, :],
                          mask=row_in_page[:, None], other=0)
        v_bytes = tl.load(v_packed_ptr + base + w[:, None] * PAGE + row[None, :],
                          mask=row_in_page[None, :], other=0)
        s0, s1, s2, s3 = _channel_planes(tl.load(k_scale_ptr + head_page * HEAD_DIM + d), PL)
        z0, z1, z2, z3 = _channel_planes(tl.load(k_zero_ptr + head_page * HEAD_DIM + d), PL)
        v_scale = tl.load(v_scale_ptr + head_page * PAGE + row, mask=tok_ok, other=0.0)
        v_zero = tl.load(v_zero_ptr + head_page * PAGE + row, mask=tok_ok, other=0.0)

        c0, c1, c2, c3 = _code_planes(k_bytes, BITS, DOT_DTYPE, MAGIC, ASM_P0, ASM_P1, ASM_P2,
                                      ASM_P3)
        st = _mma(_dequant_rows(c0, s0, z0, DOT_DTYPE, MAGIC, OFFSET, UPCAST), qt0, UPCAST, IEEE)
        st += _mma(_dequant_rows(c1, s1, z1, DOT_DTYPE, MAGIC, OFFSET, UPCAST), qt1, UPCAST, IEEE)
        if PL == 4:
            st += _mma(_dequant_rows(c2, s2, z2, DOT_DTYPE, MAGIC, OFFSET, UPCAST), qt2,
                       UPCAST, IEEE)
            st += _mma(_dequant_rows(c3, s3, z3, DOT_DTYPE, MAGIC, OFFSET, UPCAST), qt3,
                       UPCAST, IEEE)
        st = tl.where(tok_ok[:, None], st * qk_scale, float("-inf"))  # [BLOCK_P, BLOCK_G]

        m_page = tl.max(st, 0)
        if (not LAZY_RESCALE) or tl.max(m_page - m_i, 0) > RESCALE_LOG2:
            m_new = tl.maximum(m_i, m_page)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            zero_acc = zero_acc * alpha
            acc0 = acc0 * alpha[None, :]
            acc1 = acc1 * alpha[None, :]
            if PL == 4:
                acc2 = acc2 * alpha[None, :]
                acc3 = acc3 * alpha[None, :]
            m_i = m_new
        pt = tl.exp2(st - m_i[None, :])
        l_i += tl.sum(pt, 0)
        pt_scaled = (pt * v_scale.to(tl.float32)[:, None]).to(DOT_DTYPE)
        zero_acc += tl.sum(pt * v_zero.to(tl.float32)[:, None]
                           - OFFSET * pt_scaled.to(tl.float32), 0)
        c0, c1, c2, c3 = _code_planes(v_bytes, BITS, DOT_DTYPE, MAGIC, ASM_P0, ASM_P1, ASM_P2,
                                      ASM_P3)
        acc0 += _mma(c0, pt_scaled, UPCAST, IEEE)
        acc1 += _mma(c1, pt_scaled, UPCAST, IEEE)
        if PL == 4:
            acc2 += _mma(c2, pt_scaled, UPCAST, IEEE)
            acc3 += _mma(c3, pt_scaled, UPCAST, IEEE)

    # Recent full-precision window (last split): keys [T, W] per plane, values [W, T].
    window_len = tl.load(window_len_ptr + pid_b)
    window_len = tl.where(pid_s == num_splits - 1, window_len, 0)
    slot = tl.load(window_slot_ptr + pid_b).to(tl.int64)
    win_base = (slot * num_kv_heads + pid_h) * window_capacity
    t_local = tl.arange(0, BLOCK_W)
    for t0 in range(0, window_len, BLOCK_W):
        t = t0 + t_local
        t_ok = t < window_len
        k_offs = (win_base + t[:, None]) * HEAD_DIM + (w * PL)[None, :]
        v_offs = (win_base + t[None, :]) * HEAD_DIM + (w * PL)[:, None]
        k_mask = t_ok[:, None]
        v_mask = t_ok[None, :]
        st = _mma(tl.load(win_k_ptr + k_offs, mask=k_mask, other=0.0).to(DOT_DTYPE), qt0,
                  UPCAST, IEEE)
        st += _mma(tl.load(win_k_ptr + k_offs + 1, mask=k_mask, other=0.0).to(DOT_DTYPE), qt1,
                   UPCAST, IEEE)
        if PL == 4:
            st += _mma(tl.load(win_k_ptr + k_offs + 2, mask=k_mask, other=0.0).to(DOT_DTYPE),
                       qt2, UPCAST, IEEE)
            st += _mma(tl.load(win_k_ptr + k_offs + 3, mask=k_mask, other=0.0).to(DOT_DTYPE),
                       qt3, UPCAST, IEEE)
        st = tl.where(t_ok[:, None], st * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(st, 0))
        alpha = tl.exp2(m_i - m_new)
        pt = tl.exp2(st - m_new[None, :])
        l_i = l_i * alpha + tl.sum(pt, 0)
        zero_acc = zero_acc * alpha
        pt_dot = pt.to(DOT_DTYPE)
        acc0 = acc0 * alpha[None, :] + _mma(
            tl.load(win_v_ptr + v_offs, mask=v_mask, other=0.0).to(DOT_DTYPE), pt_dot,
            UPCAST, IEEE)
        acc1 = acc1 * alpha[None, :] + _mma(
            tl.load(win_v_ptr + v_offs + 1, mask=v_mask, other=0.0).to(DOT_DTYPE), pt_dot,
            UPCAST, IEEE)
        if PL == 4:
            acc2 = acc2 * alpha[None, :] + _mma(
                tl.load(win_v_ptr + v_offs + 2, mask=v_mask, other=0.0).to(DOT_DTYPE), pt_dot,
                UPCAST, IEEE)
            acc3 = acc3 * alpha[None, :] + _mma(
                tl.load(win_v_ptr + v_offs + 3, mask=v_mask, other=0.0).to(DOT_DTYPE), pt_dot,
                UPCAST, IEEE)
        m_i = m_new

    has_tokens = l_i > 0
    inv_l = 1.0 / tl.where(has_tokens, l_i, 1.0)
    lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
    row_id = (pid_b * (num_kv_heads * GROUP) + head_q).to(tl.int64) * num_splits + pid_s
    out_cols = part_o_ptr + row_id[None, :] * HEAD_DIM + (w * PL)[:, None]
    zero_part = (zero_acc * inv_l)[None, :]
    tl.store(out_cols, acc0 * inv_l[None, :] + zero_part, mask=g_ok[None, :])
    tl.store(out_cols + 1, acc1 * inv_l[None, :] + zero_part, mask=g_ok[None, :])
    if PL == 4:
        tl.store(out_cols + 2, acc2 * inv_l[None, :] + zero_part, mask=g_ok[None, :])
        tl.store(out_cols + 3, acc3 * inv_l[None, :] + zero_part, mask=g_ok[None, :])
    tl.store(part_lse_ptr + row_id, lse, mask=g_ok)
