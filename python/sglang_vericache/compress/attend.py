"""Attention over a (compressed) KV with GQA: the reference, and the grouped SDPA the CPU runs.

``attend`` masks causally by original positions in float32; the Triton kernels are checked
against it. ``grouped_sdpa`` is what the attention backend's verify and short prefix extends
call; ``suffix_causal_sdpa`` serves the long ones (later prefill chunks, requests batched with
them).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention


def attend(q: Tensor, q_positions: Tensor, keys: Tensor, values: Tensor, key_positions: Tensor,
           scale: float) -> Tensor:
    """softmax(q k^T * scale) v with key_pos <= query_pos, accumulated in float32.

    q: [H_q, n, D] post-RoPE queries; q_positions: [n] int64 original positions.
    keys, values: [H_kv, T, D] (keys post-RoPE), H_q a multiple of H_kv (GQA).
    key_positions: [H_kv, T] int64 original positions of the keys (per head: dropping may differ).
    Returns [H_q, n, D] in q's dtype. A query that sees no key gets zeros.
    """
    h_q, n, d = q.shape
    h_kv, t, _ = keys.shape
    if h_q % h_kv:
        raise ValueError(f"attend: H_q={h_q} is not a multiple of H_kv={h_kv}")
    if key_positions.shape != (h_kv, t):
        raise ValueError(f"attend: key_positions {tuple(key_positions.shape)} != {(h_kv, t)}")
    g = h_q // h_kv
    qf = q.float().view(h_kv, g, n, d)
    logits = torch.einsum("kgnd,ktd->kgnt", qf, keys.float()) * scale
    visible = key_positions.to(torch.int64)[:, None, None, :] <= q_positions.to(torch.int64)[None, None, :, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = torch.einsum("kgnt,ktd->kgnd", probs, values.float())
    return out.reshape(h_q, n, d).to(q.dtype)


def grouped_sdpa(q: Tensor, keys: Tensor, values: Tensor, scale: float,
                 mask: Tensor | None = None) -> Tensor:  # fmt: skip
    """torch's SDPA with each KV head read once for its whole group of query heads.

    ``enable_gqa`` runs every query head over its KV head separately, so a KV head is read
    H_q / H_kv times; folding the group into the query axis reads it once. On this CPU (2
    threads, SmolLM2's 9/3 heads, 6k keys) that is 1.4-1.6x faster for the 3-8 queries a verify
    has per row, and 5-8% slower for one query (drafts and decode keep ``enable_gqa``)::

        q [H_q, n, D] = [H_kv * g, n, D]  ->  [H_kv, g * n, D]   (row j * n + t: head j, query t)
        mask [n, T]                        ->  [g * n, T]         (the same rows per head)

    q: [H_q, n, D]; keys, values: [H_kv, T, D] in q's dtype (any strides with a contiguous
    last dim; the caller converts once, not per query block); mask: [n, T] bool, True where
    a query may attend, or already grouped ([g * n, T], ``group_mask``: a caller whose layers
    share one mask groups it once), or None. Returns [H_q, n, D_v].
    """
    h_q, n, d = q.shape
    h_kv = keys.shape[0]
    g = h_q // h_kv
    grouped = q.reshape(h_kv, g * n, d)
    if mask is not None and mask.shape[0] != g * n:
        mask = group_mask(mask, g)
    out = scaled_dot_product_attention(grouped.unsqueeze(0), keys.unsqueeze(0),
                                       values.unsqueeze(0), attn_mask=mask, scale=scale)
    return out[0].view(h_q, n, values.shape[-1])


def group_mask(mask: Tensor, group: int) -> Tensor:
    """mask [n, T] -> [group * n, T], the rows ``grouped_sdpa`` gives each query head group."""
    return mask.repeat(group, 1) if group > 1 else mask


def suffix_causal_sdpa(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """Causal attention of the last n of T positions, as SGLang's torch_native extend computes
    it: the queries padded at the front to T rows and one ``is_causal`` SDPA (CPU flash).

        padded q  [ zeros : P = T - n rows | the n queries ]   query row i sees keys <= i
        keys      [ 0 ............................... T )

    The padding's rows are work thrown away, but flash attention needs no mask and skips the
    blocks above the diagonal: at SmolLM2's 9/3 heads on 2 threads it costs ~16 ns per
    (row, key) pair under the diagonal, T^2 / 2 pairs, against ~21 ns for each of the n * T
    pairs of a masked SDPA (which reads its mask and skips no block), so it is the cheaper one
    once n >= ~0.4 T (``PADDED_MIN_SHARE``). The same call on the same values as torch_native
    gives the same floats, so a chunked prefill keeps plain SGLang's KV (the masked SDPA gave
    equal floats too on every shape compared: the choice is speed only).

    q: [H_q, n, D]; keys, values: [H_kv, T, D] in q's dtype, H_q a multiple of H_kv.
    Returns [H_q, n, D_v] (a view into the padded output).
    """
    h_q, n, d = q.shape
    t = keys.shape[1]
    padded = q
    if n != t:
        padded = q.new_zeros((h_q, t, d))
        padded[:, t - n :] = q
    out = scaled_dot_product_attention(padded.unsqueeze(0), keys.unsqueeze(0),
                                       values.unsqueeze(0), scale=scale, is_causal=True,
                                       enable_gqa=h_q != keys.shape[0])  # fmt: skip
    return out[0, :, t - n :]


# The share of a row's keys that are new queries from which ``suffix_causal_sdpa`` beats the
# masked path (its docstring): T^2 / 2 * 16 ns < n * T * 21 ns at n / T > 0.38.
PADDED_MIN_SHARE = 0.4
