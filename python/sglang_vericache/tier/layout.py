"""Tensor helpers for the chunk layout of ``geometry.py``: split, join, allocate, and a chunk's
bytes as they cross the wire (viewed without a copy, written into a destination buffer)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_vericache.host_memory import host_empty
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
    if torch.device(device).type == "cpu":
        return [host_empty(geometry.chunk_shape(n), geometry.torch_dtype, pin_memory=pin_memory)
                for n in geometry.chunk_lengths(num_tokens)]  # fmt: skip
    return [torch.empty(geometry.chunk_shape(n), dtype=geometry.torch_dtype, device=device)
            for n in geometry.chunk_lengths(num_tokens)]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (works for bf16/fp8 too)."""
    return memoryview(tensor.view(torch.uint8).reshape(-1).numpy())


def copy_bytes_into(dst: torch.Tensor, frame: memoryview) -> None:
    """Write ``frame`` (``dst.nbytes`` bytes, e.g. a received chunk) into contiguous ``dst``."""
    dst.view(torch.uint8).reshape(-1).copy_(torch.frombuffer(frame, dtype=torch.uint8))
