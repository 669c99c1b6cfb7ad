"""The compressor contract: what a compressor sees (Observation), what it returns (CompressedKV).

One call compresses one layer of one request. Keys are post-RoPE, so dropping tokens needs no
re-rotation: a kept token keeps its original position and attention over any subset is exact
for that subset. Every stored tensor is counted in ``CompressedKV.nbytes``; nothing is nominal.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

INDEX_DTYPE = torch.int32  # kept positions are stored as int32 (positions < 2**31)


@dataclass(frozen=True, slots=True)
class Observation:
    """What scorers may look at besides the keys and values of the layer.

    queries: [H_q, W, D] post-RoPE queries of the last W tokens (SnapKV, H2O fallback).
    query_positions: [W] int64 original positions of those queries (causal masking of scores);
        required whenever ``queries`` is given.
    attention: [H_kv, T] float32 accumulated attention each key received (H2O), summed over
        queries and over the query heads of its GQA group.
    num_layers: layer count of the model (per-layer budgets, e.g. ``pyramid``).

    Which compressor needs what: streaming, knorm, kivi, turbo: nothing. snapkv: queries.
    h2o: attention, or else queries (then it scores by the observed queries' attention).
    pyramid(...): num_layers, plus whatever the wrapped dropper needs.
    """

    queries: Tensor | None = None
    query_positions: Tensor | None = None
    attention: Tensor | None = None
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if (self.queries is None) != (self.query_positions is None):
            raise ValueError("Observation: queries and query_positions must be given together")
        if self.queries is not None:
            if self.queries.dim() != 3:
                raise ValueError(f"Observation.queries must be [H_q, W, D], got {tuple(self.queries.shape)}")
            if self.query_positions.shape != (self.queries.shape[1],):
                raise ValueError("Observation.query_positions must be [W] matching queries")
        if self.attention is not None and self.attention.dim() != 2:
            raise ValueError("Observation.attention must be [H_kv, T]")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError("Observation.num_layers must be >= 1")


class QuantizedBlock(ABC):
    """Packed integer storage of ``num_tokens`` tokens per head (immutable)."""

    @property
    @abstractmethod
    def num_tokens(self) -> int: ...

    @abstractmethod
    def stored_tensors(self) -> tuple[Tensor, ...]:
        """Every tensor this block keeps; ``nbytes`` is the sum of their sizes."""

    @abstractmethod
    def dequantize(self) -> tuple[Tensor, Tensor]:
        """Returns (keys, values), each [H_kv, num_tokens, D] in the KV dtype."""

    @abstractmethod
    def concat(self, other: QuantizedBlock) -> QuantizedBlock:
        """A block holding self's tokens followed by other's (same format)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored_tensors())

    @property
    def in_pool(self) -> bool:
        """Whether the bytes are a KV pool's slots (``compress/kivi_pages.PagedKiviBlock``)."""
        return False

    def detached(self) -> QuantizedBlock:
        """This block in tensors of its own: itself, unless its bytes live in memory someone
        else owns (a pool's slots, ``compress/kivi_pages.PagedKiviBlock``), then a copy."""
        return self


@dataclass(frozen=True, slots=True)
class CompressedKV:
    """Compressed KV of one layer of one request.

    Kept tokens are ``block`` tokens (quantized, oldest) followed by ``residual`` tokens (full
    precision, most recent). Per head, kept tokens are in increasing position order and every head
    keeps the same count (rectangular).

    block: QuantizedBlock over the first n_q kept tokens, or None.
    residual_keys / residual_values: [H_kv, n_r, D] in the KV dtype.
    kept_positions: [H_kv, n_q + n_r] int32 original positions, or None when every token
        0..num_tokens-1 is kept in order (nothing dropped, so no index is stored or counted).
    num_tokens: T, the number of original tokens this layer covers (kept or dropped).
    """

    block: QuantizedBlock | None
    residual_keys: Tensor
    residual_values: Tensor
    kept_positions: Tensor | None
    num_tokens: int

    def __post_init__(self) -> None:
        if self.residual_keys.shape != self.residual_values.shape or self.residual_keys.dim() != 3:
            raise ValueError("CompressedKV: residual keys/values must both be [H_kv, n_r, D]")
        kept = self.num_kept
        if self.kept_positions is None:
            if kept != self.num_tokens:
                raise ValueError("CompressedKV: kept_positions=None requires every token kept")
        else:
            if self.kept_positions.dtype != INDEX_DTYPE:
                raise ValueError("CompressedKV: kept_positions must be int32")
            if self.kept_positions.shape != (self.residual_keys.shape[0], kept):
                raise ValueError(
                    f"CompressedKV: kept_positions {tuple(self.kept_positions.shape)} != "
                    f"[H_kv={self.residual_keys.shape[0]}, kept={kept}]"
                )

    @property
    def num_kept(self) -> int:
        """T_kept: tokens kept per head."""
        n_q = self.block.num_tokens if self.block is not None else 0
        return n_q + self.residual_keys.shape[1]

    @property
    def num_heads(self) -> int:
        return self.residual_keys.shape[0]

    @property
    def head_dim(self) -> int:
        return self.residual_keys.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.residual_keys.dtype

    @property
    def positions(self) -> Tensor:
        """[H_kv, T_kept] int64 original positions of the kept tokens."""
        if self.kept_positions is None:
            pos = torch.arange(self.num_tokens, dtype=torch.int64, device=self.residual_keys.device)
            return pos.expand(self.num_heads, -1).contiguous()
        return self.kept_positions.to(torch.int64)

    @property
    def nbytes(self) -> int:
        """Exact bytes stored: packed ints + scales (block) + residual + kept index."""
        total = self.block.nbytes if self.block is not None else 0
        total += self.residual_keys.numel() * self.residual_keys.element_size() * 2
        if self.kept_positions is not None:
            total += self.kept_positions.numel() * self.kept_positions.element_size()
        return total

    def full_nbytes(self) -> int:
        """Bytes the uncompressed K and V of num_tokens tokens take in the KV dtype."""
        return 2 * self.num_heads * self.num_tokens * self.head_dim * self.residual_keys.element_size()

    def dequantize(self) -> tuple[Tensor, Tensor]:
        """(keys, values), each [H_kv, T_kept, D] in the KV dtype, in the order of ``positions``."""
        if self.block is None:
            return self.residual_keys, self.residual_values
        qk, qv = self.block.dequantize()
        return (
            torch.cat([qk, self.residual_keys], dim=1),
            torch.cat([qv, self.residual_values], dim=1),
        )


def full_kv(keys: Tensor, values: Tensor, positions: Tensor | None = None) -> CompressedKV:
    """A CompressedKV that stores keys/values [H_kv, T, D] as they are.

    positions: [H_kv, T] or [T] int original positions, or None for 0..T-1 (no index stored).
    """
    if positions is None:
        return CompressedKV(None, keys, values, None, keys.shape[1])
    if positions.dim() == 1:
        positions = positions.expand(keys.shape[0], -1)
    pos = positions.to(INDEX_DTYPE).contiguous()
    num_tokens = int(pos.max().item()) + 1 if pos.numel() else 0
    return CompressedKV(None, keys, values, pos, num_tokens)


class Compressor(ABC):
    """A KV compressor: a frozen dataclass whose fields are its hyperparameters.

    Contract:
    - ``compress`` is pure: it reads its arguments and returns a new CompressedKV; nothing mutates.
    - ``extend`` folds tokens that leave the decode-time recent window into an existing
      CompressedKV and returns a new one (droppers re-select to stay within budget; quantizers
      quantize whole groups); the input is not mutated.
    - ``spec`` is the canonical spec string: ``build_compressor(c.spec) == c``.
    Subclasses set ``name`` (the spec name) and are registered in ``spec.py``.
    """

    name: ClassVar[str]

    @abstractmethod
    def compress(self, layer_id: int, keys: Tensor, values: Tensor, obs: Observation) -> CompressedKV:
        """Compress one layer of one request.

        keys, values: [H_kv, T, D] (keys post-RoPE), token t at original position t.
        obs: what scorers may look at (see Observation for which compressor needs what).
        """

    @abstractmethod
    def extend(
        self,
        layer_id: int,
        ckv: CompressedKV,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        obs: Observation,
    ) -> CompressedKV:
        """Fold new tokens into ``ckv``.

        keys, values: [H_kv, n, D] in the KV dtype, the oldest tokens of the decode-time window.
        positions: [n] int64 original positions (all greater than every position in ckv).
        """

    @property
    def spec(self) -> str:
        return self.name + _fields_spec(self)

    def __str__(self) -> str:
        return self.spec


def format_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _fields_spec(obj: object) -> str:
    parts = [f"{f.name}={format_value(getattr(obj, f.name))}" for f in dataclasses.fields(obj)]
    return ":" + ",".join(parts) if parts else ""


def check_kv(keys: Tensor, values: Tensor) -> None:
    """Validates keys/values are matching [H_kv, T, D] tensors."""
    if keys.dim() != 3 or keys.shape != values.shape:
        raise ValueError(
            f"keys/values must both be [H_kv, T, D]; got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
