"""Triton split-K (flash-decoding) attention over quantized paged KV plus a full-precision window.

Stage 1, one program per (request, kv head, split): the split's pages are read as packed bytes,
unpacked with shifts and masks in registers and fed to tensor-core dots; nothing dequantized is
ever written to memory. All query heads of a GQA group share one program, so each page is read
once per kv head; the group is padded to BLOCK_G >= 16 rows for tl.dot. The last split also
covers the recent window. Each split writes its normalised partial output and its log2-sum-exp.
Stage 2, one program per (request, query head): merges the splits by log-sum-exp.

Scales are folded out of the inner products instead of dequantizing every element:
  keys   (per channel):  q . (c * s + z)   = (q * s) . c + q . z      (q * s once per page)
  values (per token):    sum_t p_t (c_t * s_t + z_t) = (p * s) @ c + sum_t p_t z_t
Integer codes become exact 16-bit floats with a bit trick ((c | MAGIC) reinterpreted is
OFFSET + c), and the OFFSET is subtracted from the fp32 dot result using the same rounded
operands, so the fold adds no error beyond rounding q*s and p*s to the dot dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _codes_as_dot_operand(packed, BITS: tl.constexpr, MAGIC: tl.constexpr,
                          DOT_DTYPE: tl.constexpr):
    """[R, W] uint8 -> [R, W * 8 / BITS] codes in channel order, as DOT_DTYPE (+ OFFSET)."""
    wide = packed.to(tl.int16)
    if BITS == 4:
        lo = (wide & 0xF) | MAGIC
        hi = (wide >> 4) | MAGIC
        codes = tl.interleave(lo, hi)
    else:
        c0 = (wide & 0x3) | MAGIC
        c1 = ((wide >> 2) & 0x3) | MAGIC
        c2 = ((wide >> 4) & 0x3) | MAGIC
        c3 = (wide >> 6) | MAGIC
        codes = tl.interleave(tl.interleave(c0, c2), tl.interleave(c1, c3))
    if MAGIC == 0:
        result = codes.to(DOT_DTYPE)
    else:
        result = codes.to(DOT_DTYPE, bitcast=True)
    return result


@triton.jit
def _mma(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """tl.dot with fp32 accumulation. UPCAST: the interpreter's bf16 dot is broken (triton 3.8),
    so there the (already rounded) operands go through an exact fp32 dot instead."""
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        result = tl.dot(a, b, input_precision="ieee")
    else:
        result = tl.dot(a, b)
    return result


@triton.jit
def quant_decode_split_kernel(
    q_ptr, k_packed_ptr, k_scale_ptr, k_zero_ptr, v_packed_ptr, v_scale_ptr, v_zero_ptr,
    win_k_ptr, win_v_ptr,
    kv_indptr_ptr, kv_page_indices_ptr, kv_last_page_len_ptr, window_slot_ptr, window_len_ptr,
    part_o_ptr, part_lse_ptr,
    qk_scale, num_kv_heads, window_capacity, num_splits, stride_qb, stride_qh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_P: tl.constexpr, BITS: tl.constexpr, BLOCK_W: tl.constexpr,
    DOT_DTYPE: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """q: [B, H_q, D]; pools as in ops/layout.py; part_o: [B, H_q, S, D] fp32;
    part_lse: [B, H_q, S] fp32 (log2 domain, -inf for an empty split)."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    WIDTH: tl.constexpr = HEAD_DIM * BITS // 8

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    col = tl.arange(0, WIDTH)
    row = tl.arange(0, BLOCK_P)
    g_ok = g < GROUP
    head_q = pid_h * GROUP + g
    q = tl.load(q_ptr + pid_b.to(tl.int64) * stride_qb + head_q[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0).to(tl.float32) * qk_scale

    page_base = tl.load(kv_indptr_ptr + pid_b)
    num_pages = tl.load(kv_indptr_ptr + pid_b + 1) - page_base
    per_split = tl.cdiv(num_pages, num_splits)
    first = pid_s * per_split
    last = tl.minimum(first + per_split, num_pages)
    last_len = tl.load(kv_last_page_len_ptr + pid_b)
    row_in_page = row < PAGE

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)

    for i in range(first, last):
        page = tl.load(kv_page_indices_ptr + page_base + i).to(tl.int64)
        n_valid = tl.where(i == num_pages - 1, last_len, PAGE)
        head_page = page * num_kv_heads + pid_h
        tok_ok = row < n_valid

        k_bytes = tl.load(k_packed_ptr + head_page * (PAGE * WIDTH) + row[:, None] * WIDTH
                          + col[None, :], mask=row_in_page[:, None], other=0)
        k_scale = tl.load(k_scale_ptr + head_page * HEAD_DIM + d).to(tl.float32)
        k_zero = tl.load(k_zero_ptr + head_page * HEAD_DIM + d).to(tl.float32)
        q_scaled = (q * k_scale[None, :]).to(DOT_DTYPE)
        bias = tl.sum(q * k_zero[None, :], 1) - OFFSET * tl.sum(q_scaled.to(tl.float32), 1)
        k_ops = _codes_as_dot_operand(k_bytes, BITS, MAGIC, DOT_DTYPE)
        s = _mma(q_scaled, tl.trans(k_ops), UPCAST, IEEE) + bias[:, None]
        s = tl.where(tok_ok[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_bytes = tl.load(v_packed_ptr + head_page * (PAGE * WIDTH) + row[:, None] * WIDTH
                          + col[None, :], mask=row_in_page[:, None], other=0)
        v_scale = tl.load(v_scale_ptr + head_page * PAGE + row, mask=tok_ok, other=0.0).to(tl.float32)
        v_zero = tl.load(v_zero_ptr + head_page * PAGE + row, mask=tok_ok, other=0.0).to(tl.float32)
        p_scaled = (p * v_scale[None, :]).to(DOT_DTYPE)
        v_ops = _codes_as_dot_operand(v_bytes, BITS, MAGIC, DOT_DTYPE)
        pv = _mma(p_scaled, v_ops, UPCAST, IEEE)
        corr = tl.sum(p * v_zero[None, :], 1) - OFFSET * tl.sum(p_scaled.to(tl.float32), 1)
        acc = acc * alpha[:, None] + pv + corr[:, None]
        m_i = m_new

    # The recent full-precision window belongs to the last split.
    window_len = tl.load(window_len_ptr + pid_b)
    window_len = tl.where(pid_s == num_splits - 1, window_len, 0)
    slot = tl.load(window_slot_ptr + pid_b).to(tl.int64)
    win_base = (slot * num_kv_heads + pid_h) * window_capacity
    q_dot = q.to(DOT_DTYPE)
    t_local = tl.arange(0, BLOCK_W)
    for t0 in range(0, window_len, BLOCK_W):
        t = t0 + t_local
        t_ok = t < window_len
        offs = (win_base + t[:, None]) * HEAD_DIM + d[None, :]
        k_win = tl.load(win_k_ptr + offs, mask=t_ok[:, None], other=0.0).to(DOT_DTYPE)
        s = _mma(q_dot, tl.trans(k_win), UPCAST, IEEE)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_win = tl.load(win_v_ptr + offs, mask=t_ok[:, None], other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + _mma(p.to(DOT_DTYPE), v_win, UPCAST, IEEE)
        m_i = m_new

    has_tokens = l_i > 0
    out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
    row_id = (pid_b * (num_kv_heads * GROUP) + head_q).to(tl.int64) * num_splits + pid_s
    tl.store(part_o_ptr + row_id[:, None] * HEAD_DIM + d[None, :], out, mask=g_ok[:, None])
    tl.store(part_lse_ptr + row_id, lse, mask=g_ok)


@triton.jit
def merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, num_q_heads, num_splits,
                        stride_ob, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """part_o: [B, H_q, S, D] fp32; part_lse: [B, H_q, S] fp32 (log2); out: [B, H_q, D]."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    split_ok = split < num_splits
    row = (pid_b * num_q_heads + pid_h).to(tl.int64) * num_splits + split
    lse = tl.load(part_lse_ptr + row, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - top)
    parts = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=split_ok[:, None],
                    other=0.0)
    merged = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + pid_b.to(tl.int64) * stride_ob + pid_h * stride_oh + d,
             merged.to(out_ptr.dtype.element_ty))


def kernels_are_interpreted() -> bool:
    """True when these kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(quant_decode_split_kernel, InterpretedFunction)
