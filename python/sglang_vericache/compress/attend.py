"""Reference attention over a (compressed) KV with GQA and causal masking by original positions.

The SGLang attention path calls this on CPU; the Triton kernels are checked against it.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
