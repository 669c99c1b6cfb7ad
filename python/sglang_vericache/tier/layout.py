"""Tensor helpers for the chunk layout of ``geometry.py``: split, join, allocate."""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_vericache.tier.geometry import KVGeometry


def split_chunks(kv: torch.Tensor, geometry: KVGeometry) -> list[torch.Tensor]:
    """Copy a sequence's full KV into contiguous per-chunk tensors ready for ``submit_put``.

    kv: [L, 2, H_kv, T, D] geometry.dtype, any device. Returns ceil(T / chunk_tokens)
    contiguous tensors on kv's device, [L, 2, H_kv, n_i, D] each (copies, never views).
    """
    if kv.dim() != 5:
        raise ValueError(f"kv must be [L, 2, H_kv, T, D], got shape {tuple(kv.shape)}")
    out: list[torch.Tensor] = []
    start = 0
    for n in geometry.chunk_lengths(kv.shape[3]):
        chunk = kv[:, :, :, start:start + n, :].clone(memory_format=torch.contiguous_format)
        geometry.check_chunk(chunk, n)
        out.append(chunk)
        start += n
    return out


def join_chunks(chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of split_chunks: [L, 2, H_kv, sum(n_i), D] (a new tensor)."""
    if not chunks:
        raise ValueError("join_chunks needs at least one chunk")
    return torch.cat(list(chunks), dim=3)


def alloc_chunks(geometry: KVGeometry, num_tokens: int, device: torch.device | str = "cpu",
                 pin_memory: bool = False) -> list[torch.Tensor]:
    """Empty destination buffers for ``submit_fetch`` covering ``num_tokens`` tokens."""
    return [torch.empty(geometry.chunk_shape(n), dtype=geometry.torch_dtype, device=device,
                        pin_memory=pin_memory)
            for n in geometry.chunk_lengths(num_tokens)]


def gather_chunk(k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor],
                 slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Build one chunk from a token-slot KV pool (SGLang's MHATokenToKVPool layout).

    k_layers / v_layers: L tensors [num_slots, H_kv, D] (one per layer, any device).
    slots: [n] int64 pool slots of the chunk's tokens, in token order (same device).
    out: optional [L, 2, H_kv, n, D] destination (e.g. pinned host memory).
    Returns out (or a new tensor on the pool's device): [L, 2, H_kv, n, D] contiguous.
    """
    if len(k_layers) != len(v_layers) or not k_layers:
        raise ValueError("need the same number (>0) of K and V layers")
    n = slots.numel()
    head = k_layers[0]
    if out is None:
        out = torch.empty((len(k_layers), 2, head.shape[1], n, head.shape[2]),
                          dtype=head.dtype, device=head.device)
    for layer, (k, v) in enumerate(zip(k_layers, v_layers)):
        out[layer, 0].copy_(k[slots].transpose(0, 1), non_blocking=True)
        out[layer, 1].copy_(v[slots].transpose(0, 1), non_blocking=True)
    return out


def scatter_chunk(chunk: torch.Tensor, k_layers: Sequence[torch.Tensor],
                  v_layers: Sequence[torch.Tensor], slots: torch.Tensor) -> None:
    """Inverse of gather_chunk: write chunk [L, 2, H_kv, n, D] into the pool at ``slots``."""
    if chunk.shape[0] != len(k_layers) or len(k_layers) != len(v_layers):
        raise ValueError("chunk layers do not match the pool")
    for layer, (k, v) in enumerate(zip(k_layers, v_layers)):
        k[slots] = chunk[layer, 0].transpose(0, 1).to(k.device, non_blocking=True)
        v[slots] = chunk[layer, 1].transpose(0, 1).to(v.device, non_blocking=True)
