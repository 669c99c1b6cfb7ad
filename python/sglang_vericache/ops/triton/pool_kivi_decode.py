"""Triton draft attention over draft rows in the KV pool: KIVI pages, then full-precision slots.

A drafted row's compressed KV lives in SGLang's KV pool (``srt/kv/draft_rows.py``): a KIVI body as
pages of pool slots (``compress/kivi_pages.py``: one page of PER_GROUP slots per key group of
GROUP tokens, its bytes laid out across the slots), then its full-precision columns and this
step's draft chain as single slots. One program per (row, KV head, split) reads that head's
bytes where they lie and never writes a dequantized token::

    key page of group g     slot 0: scale [H, D]   slot 1: zero [H, D]   slots 2..: codes [H, G, W]
    value page, same slots  codes [H, G, W] | (whole slots) | scale, zero [2, H, G]
    byte o of a page        byte o % SLOT_BYTES of slot pages[g * PER_GROUP + o // SLOT_BYTES]

    W = D * BITS / 8; channel d of a token is bits (d % (8 / BITS)) * BITS of its byte
    d // (8 / BITS), low bits first (``compress/packing.py``).

A split takes every ``splits``-th unit of its row, a unit being one key group of the body or
BLOCK_N of the float slots (unit u goes to split u % splits, so a short row's few units spread
over the splits too). Each split writes its normalised partial output and its log2-sum-exp;
the wrapper merges them (``ops/pool_kivi_decode.py``). All GQ query heads of a KV head share a
program (the group padded to BLOCK_G >= 16 rows for ``tl.dot``), so a page is read once per
KV head. Keys are dequantized in float32 and rounded once to the KV dtype for the dot, as
``KiviBlock.dequantize`` rounds them; the dots run in DOT (the KV dtype on a GPU; float32
under the interpreter, whose 16-bit dots are wrong), IEEE float32 for a float32 pool (never
TF32: a float32 pool's drafts would round what the C++ kernel does not); softmax statistics
stay in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl


# Only triton.language's builtins and this module's own functions are called in the kernel:
# tl.zeros, tl.max, tl.sum are themselves @triton.jit functions of triton.language, which Triton's
# CPU interpreter (the tests) runs only if triton was first imported with TRITON_INTERPRET set.
@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _softmax_step(scores, values, m_i, l_i, acc):
    """One online-softmax step (log2 domain): scores [BLOCK_G, N] float32, values [N, D]."""
    m_new = tl.maximum(m_i, tl.reduce(scores, 1, _maximum))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, _add)
    acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def pool_kivi_decode_kernel(
    q_ptr,  # [B, H * GQ, D] queries
    k_ptr, v_ptr,  # the layer's pool buffers [S, H, D] in the KV dtype
    kb_ptr, vb_ptr,  # the same buffers as bytes
    col_indptr_ptr, col_slots_ptr,  # [B + 1] int32, [nnz] int64: float slots, view then chain
    page_indptr_ptr, pages_ptr,  # [B + 1] int32, [n_pages] int64: body pages, PER_GROUP a group
    part_o_ptr, part_lse_ptr,  # [B, H * GQ, splits, D], [B, H * GQ, splits] float32
    qk_scale,  # softmax scale * log2(e)
    H: tl.constexpr, GQ: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, PER_GROUP: tl.constexpr, CODE_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    row, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2)
    dtype = k_ptr.dtype.element_ty
    SLOT: tl.constexpr = H * D  # elements of one slot of one buffer
    slot_bytes = SLOT * dtype.primitive_bitwidth // 8
    PER_BYTE: tl.constexpr = 8 // BITS
    W: tl.constexpr = D * BITS // 8
    CODE_MASK: tl.constexpr = (1 << BITS) - 1

    g_rows = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    q_rows = (row * H + head) * GQ + g_rows
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :], mask=(g_rows < GQ)[:, None], other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(DOT)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, D], 0.0, tl.float32)

    # the packed body: key group by key group
    p_lo = tl.load(page_indptr_ptr + row)
    n_groups = (tl.load(page_indptr_ptr + row + 1) - p_lo) // PER_GROUP
    t = tl.arange(0, GROUP)
    code_at = (head * GROUP + t)[:, None] * W + (d // PER_BYTE)[None, :]  # [GROUP, D] bytes
    shift = ((d % PER_BYTE) * BITS)[None, :]
    v_scale_at = head * GROUP + t  # elements into the value scales, then the zeros
    v_zero_at = (H + head) * GROUP + t
    for g in range(split, n_groups, splits):
        page = pages_ptr + p_lo + g * PER_GROUP
        key_scale = tl.load(k_ptr + tl.load(page) * SLOT + head * D + d).to(tl.float32)
        key_zero = tl.load(k_ptr + tl.load(page + 1) * SLOT + head * D + d).to(tl.float32)
        at = 2 * slot_bytes + code_at
        codes = (tl.load(kb_ptr + tl.load(page + at // slot_bytes) * slot_bytes
                         + at % slot_bytes) >> shift) & CODE_MASK  # fmt: skip
        keys = (codes.to(tl.float32) * key_scale[None, :] + key_zero[None, :]).to(dtype)
        scores = tl.dot(q, tl.trans(keys.to(DOT)), input_precision="ieee")
        codes = (tl.load(vb_ptr + tl.load(page + code_at // slot_bytes) * slot_bytes
                         + code_at % slot_bytes) >> shift) & CODE_MASK  # fmt: skip
        v_scale = tl.load(v_ptr + tl.load(page + CODE_SLOTS + v_scale_at // SLOT) * SLOT
                          + v_scale_at % SLOT).to(tl.float32)  # fmt: skip
        v_zero = tl.load(v_ptr + tl.load(page + CODE_SLOTS + v_zero_at // SLOT) * SLOT
                         + v_zero_at % SLOT).to(tl.float32)  # fmt: skip
        values = (codes.to(tl.float32) * v_scale[:, None] + v_zero[:, None]).to(dtype).to(DOT)
        m_i, l_i, acc = _softmax_step(scores, values, m_i, l_i, acc)

    # the float slots: the view's columns, then the chain (unit n_groups + block)
    c_lo = tl.load(col_indptr_ptr + row)
    n_cols = tl.load(col_indptr_ptr + row + 1) - c_lo
    n = tl.arange(0, BLOCK_N)
    first = (split + splits - n_groups % splits) % splits
    for block in range(first, (n_cols + BLOCK_N - 1) // BLOCK_N, splits):
        valid = block * BLOCK_N + n < n_cols
        slots = tl.load(col_slots_ptr + c_lo + block * BLOCK_N + n, mask=valid, other=0)
        at = slots[:, None] * SLOT + head * D + d[None, :]
        keys = tl.load(k_ptr + at, mask=valid[:, None], other=0.0).to(DOT)
        scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
        scores = tl.where(valid[None, :], scores, float("-inf"))
        values = tl.load(v_ptr + at, mask=valid[:, None], other=0.0).to(DOT)
        m_i, l_i, acc = _softmax_step(scores, values, m_i, l_i, acc)

    # a split with no unit writes an empty part (weight 0 in the merge)
    seen = l_i > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    part = q_rows * splits + split
    keep = g_rows < GQ
    tl.store(part_o_ptr + part[:, None] * D + d[None, :], out, mask=keep[:, None])
    tl.store(part_lse_ptr + part, lse, mask=keep)


def kernel_is_interpreted() -> bool:
    """True when this module was imported under Triton's CPU interpreter (TRITON_INTERPRET=1),
    so the kernel runs on CPU tensors (tests)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(pool_kivi_decode_kernel, InterpretedFunction)
