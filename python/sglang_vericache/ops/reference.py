"""Torch references for the GPU decode kernels: gather (or dequantize), then attention in float32.

The ground truth FlashInfer's paged decode (``dropped_decode.py``) and the Triton pool decode
(``pool_kivi_decode.py``) are checked against at start-up and in the tests. Clarity over speed:
one request at a time.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from sglang_vericache.compress.kivi_pages import PagedKiviBlock


def gqa_attention_fp32(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       sm_scale: float) -> torch.Tensor:
    """One query token over T keys with grouped heads, in float32.

    q: [H_q, D]; keys, values: [H_kv, T, D] (T >= 1; H_q divisible by H_kv).
    Returns [H_q, D] float32. Query head h reads kv head h // (H_q // H_kv).
    """
    heads_q, dim = q.shape
    heads_kv = keys.shape[0]
    group = heads_q // heads_kv
    qf = q.float().reshape(heads_kv, group, dim)
    scores = torch.einsum("hgd,htd->hgt", qf, keys.float()) * sm_scale
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hgt,htd->hgd", probs, values.float()).reshape(heads_q, dim)


def paged_decode_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                           kv_indptr: torch.Tensor, kv_page_indices: torch.Tensor,
                           kv_last_page_len: torch.Tensor, sm_scale: float | None = None
                           ) -> torch.Tensor:
    """Decode attention over full-precision pages (FlashInfer's NHD layout), in float32.

    q: [B, H_q, D]; k_pages, v_pages: [num_pages, P, H_kv, D]; kv_indptr: [B+1] int32;
    kv_page_indices: [nnz] int32; kv_last_page_len: [B] int32 in 1..P (each request >= 1 page).
    Returns [B, H_q, D] in q.dtype.
    """
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    page = k_pages.shape[1]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        start, end = int(kv_indptr[b]), int(kv_indptr[b + 1])
        ids = kv_page_indices[start:end].long()
        n_tokens = (end - start - 1) * page + int(kv_last_page_len[b])
        keys = k_pages[ids].reshape(-1, *k_pages.shape[2:])[:n_tokens].transpose(0, 1)
        values = v_pages[ids].reshape(-1, *v_pages.shape[2:])[:n_tokens].transpose(0, 1)
        out[b] = gqa_attention_fp32(q[b], keys, values, scale).to(q.dtype)
    return out


def pool_kivi_decode_reference(q: torch.Tensor, key_buffer: torch.Tensor,
                               value_buffer: torch.Tensor, columns: Sequence[torch.Tensor],
                               bodies: Sequence[PagedKiviBlock | None], sm_scale: float
                               ) -> torch.Tensor:  # fmt: skip
    """Decode attention over draft rows in a pool, in float32: row b's KIVI body in its pages
    (dequantized, as ``KiviBlock.dequantize`` rounds it to the KV dtype; None: no body), then
    the pool slots ``columns[b]`` ([n_b] int64).

    q: [B, H_q, D]; key_buffer, value_buffer: a layer's pool buffers [S, H_kv, D].
    Returns [B, H_q, D] in q.dtype.
    """
    out = torch.empty_like(q)
    for b, (slots, body) in enumerate(zip(columns, bodies)):
        at = slots.to(key_buffer.device)
        keys = key_buffer[at].transpose(0, 1).float()
        values = value_buffer[at].transpose(0, 1).float()
        if body is not None:
            body_keys, body_values = body.dequantize()
            keys = torch.cat([body_keys.float(), keys], dim=1)
            values = torch.cat([body_values.float(), values], dim=1)
        out[b] = gqa_attention_fp32(q[b], keys, values, sm_scale).to(q.dtype)
    return out
