"""Torch helpers for the shared KIVI format: quantize, pack, unpack, dequantize, page a batch.

Pure torch (CPU friendly). ``compress/`` implements the same math independently; both follow the
format in ``ops/layout.py``'s docstring, and tests here pin the bit order with literal bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_vericache.ops.layout import (
    QuantPagedBatch,
    QuantPagedKVCache,
    RecentWindowKV,
    codes_per_byte,
)

SCALE_FLOOR = 1e-8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack b-bit codes along the last dim, little end first.

    codes: [..., D] uint8 with values in 0..2^bits-1; D divisible by 8 // bits.
    Returns [..., D * bits // 8] uint8.
    """
    per_byte = codes_per_byte(bits)
    if codes.shape[-1] % per_byte:
        raise ValueError(f"last dim {codes.shape[-1]} not divisible by {per_byte}")
    lead, width = codes.shape[:-1], codes.shape[-1] // per_byte
    grouped = codes.to(torch.int32).reshape(*lead, width, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.int32, device=codes.device) * bits
    return (grouped << shifts).sum(dim=-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_codes. packed: [..., W] uint8. Returns [..., W * 8 // bits] uint8."""
    per_byte = codes_per_byte(bits)
    shifts = torch.arange(per_byte, dtype=torch.int32, device=packed.device) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte).to(torch.uint8)


def _quantize(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization of x (float32) against broadcastable min/max.

    Scale and zero are rounded to the KV dtype first and codes are computed against the stored
    values, so dequantization reproduces the nearest level of what is actually kept.
    """
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).clamp_min(SCALE_FLOOR).to(dtype)
    zero = lo.to(dtype)
    divisor = scale.float().clamp_min(SCALE_FLOOR)
    codes = torch.round((x - zero.float()) / divisor).clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero


def quantize_keys(keys: torch.Tensor, bits: int, group_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel key quantization over groups of consecutive tokens.

    keys: [H_kv, T, D] float (T divisible by group_size).
    Returns (packed [H_kv, T, D*bits/8] uint8, scale [H_kv, T/G, D], zero [H_kv, T/G, D]) with
    scale/zero in keys.dtype.
    """
    heads, tokens, dim = keys.shape
    if tokens % group_size:
        raise ValueError(f"T={tokens} is not a multiple of the key group size {group_size}")
    grouped = keys.float().reshape(heads, tokens // group_size, group_size, dim)
    lo = grouped.amin(dim=2, keepdim=True)
    hi = grouped.amax(dim=2, keepdim=True)
    codes, scale, zero = _quantize(grouped, lo, hi, bits, keys.dtype)
    return (pack_codes(codes.reshape(heads, tokens, dim), bits),
            scale.squeeze(2), zero.squeeze(2))


def quantize_values(values: torch.Tensor, bits: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token value quantization over all channels.

    values: [H_kv, T, D] float.
    Returns (packed [H_kv, T, D*bits/8] uint8, scale [H_kv, T, 1], zero [H_kv, T, 1]) with
    scale/zero in values.dtype (the shared format's Gv = D case).
    """
    x = values.float()
    codes, scale, zero = _quantize(x, x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True),
                                   bits, values.dtype)
    return pack_codes(codes, bits), scale, zero


def dequantize_keys(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    group_size: int) -> torch.Tensor:
    """packed: [H_kv, T, D*bits/8] uint8; scale/zero: [H_kv, T/G, D].
    Returns [H_kv, T, D] float32."""
    codes = unpack_codes(packed, bits).float()
    scale_t = scale.float().repeat_interleave(group_size, dim=1)
    zero_t = zero.float().repeat_interleave(group_size, dim=1)
    return codes * scale_t + zero_t


def dequantize_values(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      bits: int) -> torch.Tensor:
    """packed: [H_kv, T, D*bits/8] uint8; scale/zero: [H_kv, T, 1]. Returns [H_kv, T, D] float32."""
    return unpack_codes(packed, bits).float() * scale.float() + zero.float()


def values_byte_major(packed_pages: torch.Tensor) -> torch.Tensor:
    """Packed value pages as the pool stores them (see ops/layout.py, physical page layout).

    packed_pages: [..., P, D*bits/8] uint8 (token-major, as pack_codes gives per token).
    Returns [..., D*bits/8, P] uint8, contiguous: byte j of every token of the page in a row.
    """
    return packed_pages.transpose(-1, -2).contiguous()


def values_token_major(stored_pages: torch.Tensor) -> torch.Tensor:
    """Inverse of values_byte_major: [..., D*bits/8, P] -> [..., P, D*bits/8] uint8 (a view)."""
    return stored_pages.transpose(-1, -2)


@dataclass(frozen=True, slots=True)
class PagedQuantBatchInputs:
    """Everything one decode over a quantized paged batch reads (build_quant_paged_batch)."""

    cache: QuantPagedKVCache
    window: RecentWindowKV
    batch: QuantPagedBatch


def split_quantized_and_window(num_tokens: int, page_size: int, recent_window: int) -> int:
    """Tokens that go to quantized pages: whole pages older than the recent window.

    Tokens that do not fill a whole key group stay in full precision, so the window holds
    between recent_window and recent_window + page_size - 1 tokens (or all of them if fewer).
    """
    older = max(num_tokens - recent_window, 0)
    return (older // page_size) * page_size


def build_quant_paged_batch(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], *,
                            page_size: int, bits: int, recent_window: int,
                            num_pages: int | None = None, shuffle_pages: bool = True,
                            generator: torch.Generator | None = None) -> PagedQuantBatchInputs:
    """Quantize and page a batch of dense per-request K/V (for tests, benches and the glue).

    keys[b], values[b]: [H_kv, T_b, D] float, one per request (post-RoPE keys).
    Pages are drawn from a pool of num_pages (default: exactly enough) in shuffled order when
    shuffle_pages, so tests exercise the page indirection. Request b gets window slot b.
    """
    if len(keys) != len(values) or not keys:
        raise ValueError("need one keys and one values tensor per request")
    heads, _, dim = keys[0].shape
    dtype, device = keys[0].dtype, keys[0].device
    width = dim // codes_per_byte(bits)
    quant_tokens = [split_quantized_and_window(k.shape[1], page_size, recent_window) for k in keys]
    pages_per_req = [n // page_size for n in quant_tokens]
    total_pages = sum(pages_per_req)
    pool_pages = max(num_pages if num_pages is not None else total_pages, 1)
    if pool_pages < total_pages:
        raise ValueError(f"pool of {pool_pages} pages cannot hold {total_pages}")
    order = (torch.randperm(pool_pages, generator=generator) if shuffle_pages
             else torch.arange(pool_pages))[:total_pages].to(torch.int32)
    window_cap = max(max(k.shape[1] - q for k, q in zip(keys, quant_tokens)), 1)

    k_packed = torch.zeros(pool_pages, heads, page_size, width, dtype=torch.uint8, device=device)
    v_packed = torch.zeros(pool_pages, heads, width, page_size, dtype=torch.uint8, device=device)
    k_scale = torch.zeros(pool_pages, heads, dim, dtype=dtype, device=device)
    k_zero = torch.zeros_like(k_scale)
    v_scale = torch.zeros(pool_pages, heads, page_size, dtype=dtype, device=device)
    v_zero = torch.zeros_like(v_scale)
    win_k = torch.zeros(len(keys), heads, window_cap, dim, dtype=dtype, device=device)
    win_v = torch.zeros_like(win_k)

    indptr, cursor = [0], 0
    window_len = []
    for b, (k, v) in enumerate(zip(keys, values)):
        n_quant, n_pages = quant_tokens[b], pages_per_req[b]
        ids = order[cursor: cursor + n_pages].long().to(device)
        cursor += n_pages
        indptr.append(cursor)
        if n_pages:
            kp, ks, kz = quantize_keys(k[:, :n_quant], bits, page_size)
            vp, vs, vz = quantize_values(v[:, :n_quant], bits)
            k_packed[ids] = kp.reshape(heads, n_pages, page_size, width).transpose(0, 1)
            v_packed[ids] = values_byte_major(
                vp.reshape(heads, n_pages, page_size, width).transpose(0, 1))
            k_scale[ids] = ks.transpose(0, 1)
            k_zero[ids] = kz.transpose(0, 1)
            v_scale[ids] = vs.reshape(heads, n_pages, page_size).transpose(0, 1)
            v_zero[ids] = vz.reshape(heads, n_pages, page_size).transpose(0, 1)
        n_win = k.shape[1] - n_quant
        win_k[b, :, :n_win] = k[:, n_quant:]
        win_v[b, :, :n_win] = v[:, n_quant:]
        window_len.append(n_win)

    batch = len(keys)
    meta = QuantPagedBatch(
        kv_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
        kv_page_indices=order.to(device) if total_pages else torch.zeros(1, dtype=torch.int32,
                                                                           device=device),
        kv_last_page_len=torch.full((batch,), page_size, dtype=torch.int32, device=device),
        window_slot=torch.arange(batch, dtype=torch.int32, device=device),
        window_len=torch.tensor(window_len, dtype=torch.int32, device=device),
    )
    cache = QuantPagedKVCache(k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, bits)
    return PagedQuantBatchInputs(cache, RecentWindowKV(win_k, win_v), meta)
