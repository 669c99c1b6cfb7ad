"""Uniform draws for speculative sampling: per-row seeded or from a shared generator.

Speculative sampling consumes three kinds of uniform draws per verify column (see
``verify/spec_sampling.py``): one to sample a draft token from q, one for the accept/reject coin
of that draft, one to sample the correction (residual) or bonus token. Each is named by a
:class:`Draw` so the draws never share a stream.

Rows that carry a seed (SGLang's ``sampling_params.sampling_seed``) take every draw from a
counter-based hash of ``(seed, counter, draw)`` where ``counter = position + column`` and
``position`` is the row's position of its last committed token (column 0 of the verify row): a
draw depends on nothing else (not on the batch, the other rows, or a generator's history), so a
seeded request's output is reproducible run to run as long as its draft lengths are.

Counters are never reused for a decision that reaches the output: a step that commits ``k + 1``
tokens read the draws at counters ``position .. position + k`` to decide them, and the next
step starts at ``position + k + 1``. Draft draws at counters past the rejection point are drawn
again by the next step, but they never influenced the committed tokens, so conditional on what
was committed they are still fresh uniforms; exactness in distribution is kept.

The hash is MurmurHash3's 32-bit block mix and finalizer over four 32-bit words (seed low,
seed high, counter, draw), computed in int64 lanes with every product kept below 2**63 (so no
signed overflow on any device). It is not SGLang's ``murmur_hash32`` stream (that one lives in
``sglang.kernels`` and is keyed per vocabulary column for Gumbel sampling); seeded output need
not equal plain SGLang's sample for the same seed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["Draw", "Randomness", "RowSeeds", "seeded_uniforms"]

_MASK32 = 0xFFFFFFFF
_TWO_POW_32 = float(1 << 32)


class Draw(enum.IntEnum):
    """Which random decision a uniform feeds (a separate hash stream for each)."""

    DRAFT = 1  # sample a draft token from q at this column
    ACCEPT = 2  # accept/reject coin for the draft that follows this column
    RESAMPLE = 3  # correction token (residual) or bonus token (p) at this column


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``(h * c) mod 2**32`` for ``h`` in [0, 2**32), with 16-bit halves so nothing overflows."""
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (h * c_lo + (((h * c_hi) & 0xFFFF) << 16)) & _MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 x86_32 block step: mix one 32-bit word ``k`` into the state ``h``."""
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def seeded_uniforms(seeds: torch.Tensor, counters: torch.Tensor, draw: Draw) -> torch.Tensor:
    """Counter-based uniforms: a pure function of ``(seed, counter, draw)``.

    seeds: [rows] int64, any value (negative seeds use their two's-complement bits).
    counters: [rows, n] int64, non-negative (``position + column``; only the low 32 bits count).
    Returns [rows, n] float64 in the open interval (0, 1), on ``counters.device``.
    """
    seeds = seeds.to(device=counters.device, dtype=torch.int64).unsqueeze(1)
    # The seed words are per row: mix them once, then broadcast over the counters.
    h = _mix(_mix(torch.zeros_like(seeds), seeds & _MASK32), (seeds >> 32) & _MASK32)
    h = _mix(h.expand_as(counters), counters.to(torch.int64) & _MASK32)
    h = _mix(h, torch.full_like(counters, int(draw)))
    h = _fmix32(h ^ 16)  # 16 = bytes hashed, as MurmurHash3's finalizer expects
    # Cell midpoints: never exactly 0 or 1, so ``u < a`` accepts with probability a (within 2**-32).
    return (h.to(torch.float64) + 0.5) / _TWO_POW_32


@dataclass(frozen=True)
class RowSeeds:
    """Per-row seeds for reproducible sampling.

    seeds: [rows] int64, the row's ``sampling_seed`` (read only where ``seeded``).
    positions: [rows] int64, position of the row's last committed token (verify column 0); the
        same ``positions`` SGLang's sampler receives for that row in plain decoding.
    seeded: [rows] bool, rows whose draws come from the hash; the others use the generator.
    """

    seeds: torch.Tensor
    positions: torch.Tensor
    seeded: torch.Tensor

    def __post_init__(self) -> None:
        rows = self.seeds.shape
        if len(rows) != 1 or self.positions.shape != rows or self.seeded.shape != rows:
            raise ValueError("seeds, positions and seeded must all be [rows]")
        if self.seeded.dtype != torch.bool:
            raise TypeError(f"seeded must be a bool tensor, got {self.seeded.dtype}")


@dataclass(frozen=True)
class Randomness:
    """Where a batch's uniform draws come from.

    generator: draws for rows without a seed (a generator the worker owns, e.g. seeded from the
        server's ``random_seed``); its device is where those draws are made.
    row_seeds: per-row seeds, or None when no row of the batch is seeded.
    """

    generator: torch.Generator
    row_seeds: RowSeeds | None = None

    def uniforms(self, draw: Draw, rows: int, first_column: int, width: int,
                 device: torch.device | str) -> torch.Tensor:  # fmt: skip
        """Draws for columns ``first_column .. first_column + width - 1`` of every row.

        Returns [rows, width] float64 on ``device``; each seeded row's column ``c`` is
        ``seeded_uniforms(seed, position + c, draw)``. Generator draws lie in [0, 1).
        """
        out = torch.rand(rows, width, generator=self.generator, dtype=torch.float64,
                         device=self.generator.device).to(device)  # fmt: skip
        seeds = self.row_seeds
        if seeds is None:
            return out
        if seeds.seeds.shape[0] != rows:
            raise ValueError(f"row_seeds cover {seeds.seeds.shape[0]} rows, batch has {rows}")
        cols = torch.arange(first_column, first_column + width, device=device, dtype=torch.int64)
        counters = seeds.positions.to(device=device, dtype=torch.int64).unsqueeze(1) + cols
        hashed = seeded_uniforms(seeds.seeds, counters, draw)
        return torch.where(seeds.seeded.to(device).unsqueeze(1), hashed, out)
