"""TurboQuant-style rotation quantizer (arXiv 2504.19874, MSE variant without the QJL residual).

Each key and value vector x (per token, per head) is rotated by a fixed-seed random orthogonal
matrix R (y = x R), which spreads outlier channels evenly so that the coordinates of y / |y| are
close to N(0, 1/D). Each coordinate of sqrt(D) * y / |y| is then quantized with a b-bit Lloyd-Max
codebook for the standard normal. Stored per token and head: packed codes (shared packing) and the
norm |x| in the KV dtype. R and the codebook are functions of (D, seed) and b, regenerated on read
and not counted as per-request storage (one D x D matrix per model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch
from torch import Tensor

from sglang_vericache.compress.base import QuantizedBlock
from sglang_vericache.compress.packing import pack_bits, unpack_bits
from sglang_vericache.compress.quantizing import Quantizer

TURBO_BITS = (2, 4, 8)


@lru_cache(maxsize=16)
def rotation(dim: int, seed: int) -> Tensor:
    """[dim, dim] float32 random orthogonal matrix, a pure function of (dim, seed)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # unique (Haar) orthogonal factor
    return q.to(torch.float32)


@lru_cache(maxsize=8)
def normal_codebook(bits: int) -> tuple[Tensor, Tensor]:
    """(centroids [2^b], boundaries [2^b - 1]) of the Lloyd-Max quantizer for N(0, 1), float32."""
    n = 1 << bits

    def pdf(x: float) -> float:
        return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)

    def cdf(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    cents = [-3.0 + 6.0 * (i + 0.5) / n for i in range(n)]
    for _ in range(300):
        bounds = [(a + b) / 2 for a, b in zip(cents, cents[1:])]
        edges = [-math.inf, *bounds, math.inf]
        new = []
        for lo, hi, old in zip(edges, edges[1:], cents):
            mass = cdf(hi) - cdf(lo)
            new.append((pdf(lo) - pdf(hi)) / mass if mass > 1e-300 else old)
        if max(abs(a - b) for a, b in zip(new, cents)) < 1e-10:
            cents = new
            break
        cents = new
    bounds = [(a + b) / 2 for a, b in zip(cents, cents[1:])]
    return torch.tensor(cents, dtype=torch.float32), torch.tensor(bounds, dtype=torch.float32)


def _encode(x: Tensor, bits: int, seed: int) -> tuple[Tensor, Tensor]:
    """x [H, n, D] -> (packed codes [H, n, D*bits//8] uint8, norm [H, n, 1] in x's dtype)."""
    d = x.shape[-1]
    y = x.float() @ rotation(d, seed)
    norm = y.norm(dim=-1, keepdim=True)
    unit = y * (math.sqrt(d) / norm.clamp_min(1e-30))
    _, bounds = normal_codebook(bits)
    codes = torch.bucketize(unit, bounds).to(torch.uint8)
    return pack_bits(codes, bits), norm.to(x.dtype)


def _decode(packed: Tensor, norm: Tensor, bits: int, seed: int) -> Tensor:
    cents, _ = normal_codebook(bits)
    codes = unpack_bits(packed, bits).long()
    d = codes.shape[-1]
    y = cents[codes] * (norm.float() / math.sqrt(d))
    return (y @ rotation(d, seed).T).to(norm.dtype)


@dataclass(frozen=True, slots=True, eq=False)
class TurboBlock(QuantizedBlock):
    """Rotated, codebook-quantized tokens. packed_*: [H_kv, n, D*bits//8] uint8; *_norm: [H_kv, n, 1]."""

    bits: int
    seed: int
    packed_keys: Tensor
    key_norm: Tensor
    packed_values: Tensor
    value_norm: Tensor

    @property
    def num_tokens(self) -> int:
        return self.packed_keys.shape[1]

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return (self.packed_keys, self.key_norm, self.packed_values, self.value_norm)

    def dequantize(self) -> tuple[Tensor, Tensor]:
        return (_decode(self.packed_keys, self.key_norm, self.bits, self.seed),
                _decode(self.packed_values, self.value_norm, self.bits, self.seed))

    def concat(self, other: QuantizedBlock) -> TurboBlock:
        if not isinstance(other, TurboBlock) or (other.bits, other.seed) != (self.bits, self.seed):
            raise ValueError("TurboBlock.concat: blocks differ in format")
        parts = zip(self.stored_tensors(), other.stored_tensors())
        return TurboBlock(self.bits, self.seed, *(torch.cat(p, dim=1) for p in parts))


@dataclass(frozen=True, slots=True)
class Turbo(Quantizer):
    """Rotation + Lloyd-Max scalar quantization, per token, for keys and values.

    bits: 2, 4 or 8; seed: seed of the random rotation; residual: recent tokens in full precision.
    """

    name: ClassVar[str] = "turbo"
    bits: int = 4
    seed: int = 0
    residual: int = 32

    def __post_init__(self) -> None:
        if self.bits not in TURBO_BITS:
            raise ValueError(f"turbo: bits must be one of {TURBO_BITS}, got {self.bits}")
        if self.seed < 0:
            raise ValueError(f"turbo: seed must be >= 0, got {self.seed}")
        if self.residual < 0:
            raise ValueError(f"turbo: residual must be >= 0, got {self.residual}")

    @property
    def token_group(self) -> int:
        return 1

    @property
    def lossless(self) -> bool:
        return False

    def quantize(self, keys: Tensor, values: Tensor) -> TurboBlock:
        pk, nk = _encode(keys, self.bits, self.seed)
        pv, nv = _encode(values, self.bits, self.seed)
        return TurboBlock(self.bits, self.seed, pk, nk, pv, nv)
