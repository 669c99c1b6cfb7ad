"""Triton split-K (flash-decoding) attention over quantized paged KV plus a full-precision window.

Stage 1, one program per (request, kv head, split): the split's pages are read as packed bytes,
unpacked with shifts and masks in registers and fed to tensor-core dots; nothing dequantized is
ever written to memory. All query heads of a GQA group share one program, so each page is read
once per kv head; the group is padded to BLOCK_G >= 16 rows for tl.dot. The last split also
covers the recent window. Each split writes its normalised partial output and its log2-sum-exp.
Stage 2, one program per (request, query head): merges the splits by log-sum-exp.

Key pages are token-major and value pages byte-major (ops/layout.py): in both dots the packed
operand's reduction dim is then the contiguous one, so the bytes load straight into tensor-core
operand registers instead of passing through shared memory one byte at a time.

Bit planes instead of interleaving: code j of every byte (channels j, j + PL, j + 2 PL, ... with
PL = 8 / BITS codes per byte) forms a plane of D / PL channels, and every product is a sum of
per-plane dots. So a plane is a shift and a mask of the loaded bytes, with no register shuffle.

Integer codes become exact 16-bit floats with a bit trick: (c | MAGIC) reinterpreted is
OFFSET + c (bf16: 0x4300 = 128.0; fp16: 0x6400 = 1024.0).
  keys (per channel scale/zero):  k = fma(c, s, z) in the dot dtype (packed bf16x2/f16x2 FMAs),
                                  i.e. the dequantized key rounded once to the KV dtype;
  values (per token scale/zero):  sum_t p_t (c_t s_t + z_t) = (p * s) @ c + sum_t p_t z_t,
                                  the scale folded into p and the zero term kept as one number per
                                  query row, so value codes go to the dot untouched; the OFFSET is
                                  removed with the same rounded p * s the dot saw.
"""

from __future__ import annotations

import triton
import triton.language as tl


# Lazy rescaling threshold (log2 domain): see the page loop of quant_decode_split_kernel.
RESCALE_LOG2 = tl.constexpr(8.0)


@triton.jit
def _code_plane(packed, PLANE: tl.constexpr, BITS: tl.constexpr, CODE_MASK: tl.constexpr,
                DOT_DTYPE: tl.constexpr, MAGIC: tl.constexpr):
    """Plane PLANE of [R, W] int16 packed bytes as DOT_DTYPE values OFFSET + code (exact)."""
    codes = (packed >> (PLANE * BITS)) & CODE_MASK
    if MAGIC == 0:
        result = codes.to(DOT_DTYPE)
    else:
        result = (codes | MAGIC).to(DOT_DTYPE, bitcast=True)
    return result


@triton.jit
def _dequant_keys(codes, scale, zero, DOT_DTYPE: tl.constexpr, MAGIC: tl.constexpr,
                  OFFSET: tl.constexpr, UPCAST: tl.constexpr):
    """Keys of one plane from its codes [R, W] (OFFSET + code, DOT_DTYPE) and the plane's
    channel scale/zero [W]: fma(code, scale, zero), rounded once to DOT_DTYPE. UPCAST (the
    interpreter, which cannot build 16-bit float constants): the same math in fp32."""
    if UPCAST:
        keys = tl.fma(codes.to(tl.float32) - OFFSET, scale.to(tl.float32)[None, :],
                      zero.to(tl.float32)[None, :]).to(DOT_DTYPE)
    else:
        if MAGIC != 0:
            codes = codes - OFFSET  # exact: small integers
        keys = tl.fma(codes, scale.to(DOT_DTYPE)[None, :], zero.to(DOT_DTYPE)[None, :])
    return keys


@triton.jit
def _channel_planes(x, PL: tl.constexpr):
    """[D] per-channel values -> PL plane vectors [D / PL] (plane j: channels w * PL + j),
    from one contiguous load; for PL == 2 planes 2, 3 repeat 0, 1 and are unused."""
    if PL == 2:
        p0, p1 = tl.split(tl.reshape(x, [x.shape[0] // 2, 2]))
        p2 = p0
        p3 = p1
    else:
        even, odd = tl.split(tl.reshape(x, [x.shape[0] // 4, 2, 2]))
        p0, p2 = tl.split(even)
        p1, p3 = tl.split(odd)
    return p0, p1, p2, p3


@triton.jit
def _code_planes(packed, BITS: tl.constexpr, DOT_DTYPE: tl.constexpr, MAGIC: tl.constexpr,
                 ASM_P0: tl.constexpr, ASM_P1: tl.constexpr, ASM_P2: tl.constexpr,
                 ASM_P3: tl.constexpr):
    """All bit planes of [R, W] uint8 packed codes as DOT_DTYPE values OFFSET + code (exact).

    ASM_Pj (GPU, 16-bit dot dtypes): PTX turning 4 packed bytes into plane j's four 16-bit
    floats (see unpack_asm); "" selects the portable path (the interpreter, fp32). One asm per
    plane lets each plane be unpacked directly in its dot-operand layout. For int4, planes 2
    and 3 repeat 0 and 1 and are unused.
    """
    if ASM_P0 != "":
        p0 = _asm_plane(packed, ASM_P0, DOT_DTYPE)
        p1 = _asm_plane(packed, ASM_P1, DOT_DTYPE)
        p2 = p0
        p3 = p1
        if BITS == 2:
            p2 = _asm_plane(packed, ASM_P2, DOT_DTYPE)
            p3 = _asm_plane(packed, ASM_P3, DOT_DTYPE)
    else:
        wide = packed.to(tl.int16)
        p0 = _code_plane(wide, 0, BITS, (1 << BITS) - 1, DOT_DTYPE, MAGIC)
        p1 = _code_plane(wide, 1, BITS, (1 << BITS) - 1, DOT_DTYPE, MAGIC)
        p2 = p0
        p3 = p1
        if BITS == 2:
            p2 = _code_plane(wide, 2, BITS, (1 << BITS) - 1, DOT_DTYPE, MAGIC)
            p3 = _code_plane(wide, 3, BITS, (1 << BITS) - 1, DOT_DTYPE, MAGIC)
    return p0, p1, p2, p3


@triton.jit
def _asm_plane(packed, ASM: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """[R, W] uint8 -> [R, W] DOT_DTYPE through one plane's PTX (4 bytes in, 2 b32 out)."""
    return tl.inline_asm_elementwise(asm=ASM, constraints="=r,=r,r", args=[packed],
                                     dtype=DOT_DTYPE.value, is_pure=True, pack=4)


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
    ASM_P0: tl.constexpr, ASM_P1: tl.constexpr, ASM_P2: tl.constexpr, ASM_P3: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
):
    """q: [B, H_q, D]; pools as in ops/layout.py; part_o: [B, H_q, S, D] fp32;
    part_lse: [B, H_q, S] fp32 (log2 domain, -inf for an empty split)."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    PL: tl.constexpr = 8 // BITS  # codes per byte = bit planes
    WIDTH: tl.constexpr = HEAD_DIM // PL  # bytes per token row = channels per plane

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    w = tl.arange(0, WIDTH)
    row = tl.arange(0, BLOCK_P)
    g_ok = g < GROUP
    head_q = pid_h * GROUP + g
    q_rows = q_ptr + pid_b.to(tl.int64) * stride_qb + head_q[:, None] * stride_qh
    # Query planes [BLOCK_G, WIDTH]: plane j holds channels w * PL + j. Unused planes are dead
    # code for int4 (PL == 2) and vanish at compile time.
    q0 = tl.load(q_rows + (w * PL)[None, :], mask=g_ok[:, None], other=0.0).to(DOT_DTYPE)
    q1 = tl.load(q_rows + (w * PL + 1)[None, :], mask=g_ok[:, None], other=0.0).to(DOT_DTYPE)
    q2 = q0
    q3 = q1
    if PL == 4:
        q2 = tl.load(q_rows + (w * PL + 2)[None, :], mask=g_ok[:, None], other=0.0).to(DOT_DTYPE)
        q3 = tl.load(q_rows + (w * PL + 3)[None, :], mask=g_ok[:, None], other=0.0).to(DOT_DTYPE)

    page_base = tl.load(kv_indptr_ptr + pid_b)
    num_pages = tl.load(kv_indptr_ptr + pid_b + 1) - page_base
    per_split = tl.cdiv(num_pages, num_splits)
    first = pid_s * per_split
    last = tl.minimum(first + per_split, num_pages)
    last_len = tl.load(kv_last_page_len_ptr + pid_b)
    row_in_page = row < PAGE

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    zero_acc = tl.zeros([BLOCK_G], dtype=tl.float32)  # sum_t p_t z_t: the same for every channel
    acc0 = tl.zeros([BLOCK_G, WIDTH], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_G, WIDTH], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_G, WIDTH], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_G, WIDTH], dtype=tl.float32)

    for i in range(first, last):
        page = tl.load(kv_page_indices_ptr + page_base + i).to(tl.int64)
        n_valid = tl.where(i == num_pages - 1, last_len, PAGE)
        head_page = page * num_kv_heads + pid_h
        tok_ok = row < n_valid
        tile = head_page * (PAGE * WIDTH) + row[:, None] * WIDTH + w[None, :]
        tile_t = head_page * (PAGE * WIDTH) + w[:, None] * PAGE + row[None, :]

        k_bytes = tl.load(k_packed_ptr + tile, mask=row_in_page[:, None], other=0)
        s0, s1, s2, s3 = _channel_planes(tl.load(k_scale_ptr + head_page * HEAD_DIM + d), PL)
        z0, z1, z2, z3 = _channel_planes(tl.load(k_zero_ptr + head_page * HEAD_DIM + d), PL)
        c0, c1, c2, c3 = _code_planes(k_bytes, BITS, DOT_DTYPE, MAGIC, ASM_P0, ASM_P1, ASM_P2,
                                      ASM_P3)
        s = _mma(q0, tl.trans(_dequant_keys(c0, s0, z0, DOT_DTYPE, MAGIC, OFFSET, UPCAST)),
                 UPCAST, IEEE)
        s += _mma(q1, tl.trans(_dequant_keys(c1, s1, z1, DOT_DTYPE, MAGIC, OFFSET, UPCAST)),
                  UPCAST, IEEE)
        if PL == 4:
            s += _mma(q2, tl.trans(_dequant_keys(c2, s2, z2, DOT_DTYPE, MAGIC, OFFSET, UPCAST)),
                      UPCAST, IEEE)
            s += _mma(q3, tl.trans(_dequant_keys(c3, s3, z3, DOT_DTYPE, MAGIC, OFFSET, UPCAST)),
                      UPCAST, IEEE)
        s = tl.where(tok_ok[None, :], s * qk_scale, float("-inf"))

        # LAZY_RESCALE: the running max (and with it l, the zero term and the accumulators)
        # moves only when some row's page max exceeds it by more than RESCALE_LOG2; otherwise
        # p stays <= 2^RESCALE_LOG2 against the stale max, exact in fp32 and fine for a 16-bit
        # dot operand. The first page always rescales (m_i = -inf; every page has a valid token).
        m_page = tl.max(s, 1)
        if (not LAZY_RESCALE) or tl.max(m_page - m_i, 0) > RESCALE_LOG2:
            m_new = tl.maximum(m_i, m_page)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            zero_acc = zero_acc * alpha
            acc0 = acc0 * alpha[:, None]
            acc1 = acc1 * alpha[:, None]
            if PL == 4:
                acc2 = acc2 * alpha[:, None]
                acc3 = acc3 * alpha[:, None]
            m_i = m_new
        p = tl.exp2(s - m_i[:, None])
        l_i += tl.sum(p, 1)

        # Value pages are byte-major ([WIDTH, PAGE], ops/layout.py): loaded as stored, then
        # transposed as a view, so the reduction dim (tokens) is the contiguous one.
        v_bytes = tl.trans(tl.load(v_packed_ptr + tile_t, mask=row_in_page[None, :], other=0))
        v_scale = tl.load(v_scale_ptr + head_page * PAGE + row, mask=tok_ok, other=0.0)
        v_zero = tl.load(v_zero_ptr + head_page * PAGE + row, mask=tok_ok, other=0.0)
        p_scaled = (p * v_scale.to(tl.float32)[None, :]).to(DOT_DTYPE)
        zero_acc += tl.sum(p * v_zero.to(tl.float32)[None, :]
                           - OFFSET * p_scaled.to(tl.float32), 1)
        c0, c1, c2, c3 = _code_planes(v_bytes, BITS, DOT_DTYPE, MAGIC, ASM_P0, ASM_P1, ASM_P2,
                                      ASM_P3)
        acc0 += _mma(p_scaled, c0, UPCAST, IEEE)
        acc1 += _mma(p_scaled, c1, UPCAST, IEEE)
        if PL == 4:
            acc2 += _mma(p_scaled, c2, UPCAST, IEEE)
            acc3 += _mma(p_scaled, c3, UPCAST, IEEE)

    # The recent full-precision window belongs to the last split; it is read plane by plane
    # (strided channels) so that it accumulates into the same planes.
    window_len = tl.load(window_len_ptr + pid_b)
    window_len = tl.where(pid_s == num_splits - 1, window_len, 0)
    slot = tl.load(window_slot_ptr + pid_b).to(tl.int64)
    win_base = (slot * num_kv_heads + pid_h) * window_capacity
    t_local = tl.arange(0, BLOCK_W)
    for t0 in range(0, window_len, BLOCK_W):
        t = t0 + t_local
        t_ok = t < window_len
        offs = (win_base + t[:, None]) * HEAD_DIM + (w * PL)[None, :]
        mask = t_ok[:, None]
        s = _mma(q0, tl.trans(tl.load(win_k_ptr + offs, mask=mask, other=0.0).to(DOT_DTYPE)),
                 UPCAST, IEEE)
        s += _mma(q1, tl.trans(tl.load(win_k_ptr + offs + 1, mask=mask, other=0.0)
                               .to(DOT_DTYPE)), UPCAST, IEEE)
        if PL == 4:
            s += _mma(q2, tl.trans(tl.load(win_k_ptr + offs + 2, mask=mask, other=0.0)
                                   .to(DOT_DTYPE)), UPCAST, IEEE)
            s += _mma(q3, tl.trans(tl.load(win_k_ptr + offs + 3, mask=mask, other=0.0)
                                   .to(DOT_DTYPE)), UPCAST, IEEE)
        s = tl.where(t_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        zero_acc = zero_acc * alpha
        p_dot = p.to(DOT_DTYPE)
        acc0 = acc0 * alpha[:, None] + _mma(
            p_dot, tl.load(win_v_ptr + offs, mask=mask, other=0.0).to(DOT_DTYPE), UPCAST, IEEE)
        acc1 = acc1 * alpha[:, None] + _mma(
            p_dot, tl.load(win_v_ptr + offs + 1, mask=mask, other=0.0).to(DOT_DTYPE), UPCAST, IEEE)
        if PL == 4:
            acc2 = acc2 * alpha[:, None] + _mma(
                p_dot, tl.load(win_v_ptr + offs + 2, mask=mask, other=0.0).to(DOT_DTYPE),
                UPCAST, IEEE)
            acc3 = acc3 * alpha[:, None] + _mma(
                p_dot, tl.load(win_v_ptr + offs + 3, mask=mask, other=0.0).to(DOT_DTYPE),
                UPCAST, IEEE)
        m_i = m_new

    has_tokens = l_i > 0
    inv_l = 1.0 / tl.where(has_tokens, l_i, 1.0)
    lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
    row_id = (pid_b * (num_kv_heads * GROUP) + head_q).to(tl.int64) * num_splits + pid_s
    out_rows = part_o_ptr + row_id[:, None] * HEAD_DIM + (w * PL)[None, :]
    zero_part = (zero_acc * inv_l)[:, None]
    tl.store(out_rows, acc0 * inv_l[:, None] + zero_part, mask=g_ok[:, None])
    tl.store(out_rows + 1, acc1 * inv_l[:, None] + zero_part, mask=g_ok[:, None])
    if PL == 4:
        tl.store(out_rows + 2, acc2 * inv_l[:, None] + zero_part, mask=g_ok[:, None])
        tl.store(out_rows + 3, acc3 * inv_l[:, None] + zero_part, mask=g_ok[:, None])
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


def unpack_asm(bits: int, magic: int, plane: int) -> str:
    """PTX for one plane in _code_planes: 4 packed bytes in ($2), the plane's four 16-bit floats
    out ($0 = codes of bytes 0,1; $1 = bytes 2,3; low lane first). prmt spreads two bytes into
    the low 8 bits of two 16-bit lanes; then (lanes >> plane * bits) & mask | magic is one shift
    and one lop3 per pair (bits shifted down from the upper lane fall outside the lane's mask)."""
    masks, magics = ((1 << bits) - 1) * 0x10001, magic * 0x10001
    lines = [".reg .b32 t0, t1;", "prmt.b32 t0, $2, 0, 0x4140;", "prmt.b32 t1, $2, 0, 0x4342;"]
    if plane:
        lines += [f"shr.b32 t0, t0, {plane * bits};", f"shr.b32 t1, t1, {plane * bits};"]
    lines += [f"lop3.b32 $0, t0, {masks}, {magics}, 0xea;",
              f"lop3.b32 $1, t1, {masks}, {magics}, 0xea;"]
    return "{\n" + "\n".join(lines) + "\n}"


def kernels_are_interpreted() -> bool:
    """True when these kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 when
    this module was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(quant_decode_split_kernel, InterpretedFunction)
