"""The shared Quantizer machinery: split kept tokens into a quantized body and a residual window.

Of n kept tokens, the oldest n_q = max(0, (n - residual) // G) * G are quantized in whole groups of
G (``token_group``) and the rest (between ``residual`` and residual + G - 1 tokens) stay in full
precision. ``extend`` appends to the residual and quantizes the groups that fall out of it, so the
existing quantized tokens are never re-quantized (no error accumulates).
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import Tensor

from sglang_vericache.compress.base import (
    INDEX_DTYPE,
    CompressedKV,
    Compressor,
    Observation,
    QuantizedBlock,
    check_kv,
)


class Quantizer(Compressor):
    """Base of the quantizing compressors (frozen dataclasses with a ``residual`` field)."""

    residual: int

    @property
    @abstractmethod
    def token_group(self) -> int:
        """Tokens are quantized in whole groups of this many (per head)."""

    @property
    @abstractmethod
    def lossless(self) -> bool:
        """True when this quantizer stores everything in full precision (e.g. kivi:bits=16)."""

    @abstractmethod
    def quantize(self, keys: Tensor, values: Tensor) -> QuantizedBlock:
        """Quantizes keys/values [H_kv, n, D] (n a multiple of token_group, n > 0)."""

    def pack(self, keys: Tensor, values: Tensor, kept_positions: Tensor | None, num_tokens: int,
             prior: QuantizedBlock | None = None) -> CompressedKV:
        """Stores kept tokens [H_kv, n, D]: whole groups beyond the residual window get quantized.

        kept_positions: [H_kv, n_prior + n] int32 or None (every token kept in order).
        prior: an already quantized block that precedes these tokens (kept as is).
        """
        n = keys.shape[1]
        n_q = 0 if self.lossless else max(0, (n - self.residual) // self.token_group) * self.token_group
        block = prior
        if n_q > 0:
            fresh = self.quantize(keys[:, :n_q].contiguous(), values[:, :n_q].contiguous())
            block = fresh if prior is None else prior.concat(fresh)
        return CompressedKV(
            block,
            keys[:, n_q:].contiguous(),
            values[:, n_q:].contiguous(),
            kept_positions,
            num_tokens,
        )

    def compress(self, layer_id: int, keys: Tensor, values: Tensor, obs: Observation) -> CompressedKV:
        check_kv(keys, values)
        return self.pack(keys, values, None, keys.shape[1])

    def compress_kept(self, ckv: CompressedKV) -> CompressedKV:
        """Quantizes a full-precision CompressedKV (e.g. the output of a dropper)."""
        if ckv.block is not None:
            raise ValueError(f"{self.name}: input is already quantized")
        return self.pack(ckv.residual_keys, ckv.residual_values, ckv.kept_positions, ckv.num_tokens)

    def extend(self, layer_id: int, ckv: CompressedKV, keys: Tensor, values: Tensor,
               positions: Tensor, obs: Observation) -> CompressedKV:
        check_kv(keys, values)
        return self.extend_kept(ckv, keys, values, positions, int(positions.max().item()) + 1)

    def extend_kept(self, ckv: CompressedKV, keys: Tensor, values: Tensor, positions: Tensor,
                    num_tokens: int) -> CompressedKV:
        """Appends kept tokens keys/values [H_kv, n, D] at positions [n] or per head [H_kv, n]
        (int64) to ckv, which then covers ``num_tokens`` tokens; quantizes what leaves the residual.
        """
        res_k = torch.cat([ckv.residual_keys, keys], dim=1)
        res_v = torch.cat([ckv.residual_values, values], dim=1)
        kept = append_positions(ckv, positions, keys.shape[0], num_tokens)
        return self.pack(res_k, res_v, kept, num_tokens, prior=ckv.block)


def append_positions(ckv: CompressedKV, positions: Tensor, num_heads: int, num_tokens: int) -> Tensor | None:
    """Kept positions of ckv followed by ``positions`` ([n] or per head [H_kv, n]), as int32,
    for a layer that then covers ``num_tokens`` tokens. None (no index stored) while every token
    is kept in order.
    """
    positions = positions.to(torch.int64)
    n = positions.shape[-1]
    expected = torch.arange(ckv.num_tokens, ckv.num_tokens + n)
    if ckv.kept_positions is None and num_tokens == ckv.num_tokens + n and bool((positions == expected).all()):
        return None
    new = positions.to(INDEX_DTYPE).expand(num_heads, -1)
    return torch.cat([ckv.positions.to(INDEX_DTYPE), new], dim=1).contiguous()


def clamp_scale(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Scale clamped away from 0 (shared format: >= 1e-8, or the eps of a 16-bit dtype)."""
    eps = 1e-8 if dtype == torch.float32 else torch.finfo(dtype).eps
    return scale.clamp_min(eps)
