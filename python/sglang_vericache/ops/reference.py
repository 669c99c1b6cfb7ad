"""Torch references for the decode kernels: dequantize (or gather), then attention in float32.

These are the ground truth the Triton kernels are tested against, and the CPU path the wrappers
fall back to. Clarity over speed: one request at a time.
"""

from __future__ import annotations

import math

import torch

from sglang_vericache.ops.layout import QuantPagedBatch, QuantPagedKVCache, RecentWindowKV
from sglang_vericache.ops.quant_pack import unpack_codes, values_token_major


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


def dequantize_request_pages(cache: QuantPagedKVCache, batch: QuantPagedBatch, index: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize request `index`'s pages in token order.

    Returns keys, values: [H_kv, T_quant, D] float32 (T_quant may be 0).
    """
    start, end = int(batch.kv_indptr[index]), int(batch.kv_indptr[index + 1])
    heads, page, dim = cache.num_kv_heads, cache.page_size, cache.head_dim
    if end == start:
        empty = torch.zeros(heads, 0, dim, dtype=torch.float32, device=cache.k_packed.device)
        return empty, empty.clone()
    ids = batch.kv_page_indices[start:end].long()
    k_codes = unpack_codes(cache.k_packed[ids], cache.bits).float()  # [n, H, P, D]
    v_codes = unpack_codes(values_token_major(cache.v_packed[ids]), cache.bits).float()
    keys = k_codes * cache.k_scale[ids].float()[:, :, None] + cache.k_zero[ids].float()[:, :, None]
    values = v_codes * cache.v_scale[ids].float()[..., None] + cache.v_zero[ids].float()[..., None]
    n_tokens = (end - start - 1) * page + int(batch.kv_last_page_len[index])
    keys = keys.transpose(0, 1).reshape(heads, -1, dim)[:, :n_tokens]
    values = values.transpose(0, 1).reshape(heads, -1, dim)[:, :n_tokens]
    return keys, values


def quant_paged_decode_reference(q: torch.Tensor, cache: QuantPagedKVCache, window: RecentWindowKV,
                                 batch: QuantPagedBatch, sm_scale: float | None = None
                                 ) -> torch.Tensor:
    """Decode attention over quantized pages plus the full-precision window, in float32.

    q: [B, H_q, D] float. Returns [B, H_q, D] in q.dtype.
    sm_scale defaults to 1 / sqrt(D).
    """
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        keys, values = dequantize_request_pages(cache, batch, b)
        slot, n_win = int(batch.window_slot[b]), int(batch.window_len[b])
        keys = torch.cat([keys, window.keys[slot, :, :n_win].float()], dim=1)
        values = torch.cat([values, window.values[slot, :, :n_win].float()], dim=1)
        out[b] = gqa_attention_fp32(q[b], keys, values, scale).to(q.dtype)
    return out


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
