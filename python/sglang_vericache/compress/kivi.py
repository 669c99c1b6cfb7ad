"""KIVI (arXiv 2402.02750): asymmetric integer quantization, keys per-channel, values per-token.

Layout is the shared format of CONTEXT.md, which the Triton kernels read:
- keys: per channel over groups of G consecutive tokens; scale/zero [H_kv, n // G, D];
- values: per token over all D channels; scale/zero [H_kv, n, 1];
- codes q in [0, 2^b - 1], x ~= q * scale + zero, zero = min, scale = (max - min) / (2^b - 1);
- codes packed along D (``packing.pack_bits``); scales/zeros in the KV dtype.
The dequantization error is at most scale / 2 per element (round to nearest, stored scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sglang_vericache.compress.base import QuantizedBlock
from sglang_vericache.compress.packing import pack_bits, unpack_bits
from sglang_vericache.compress.quantizing import Quantizer, clamp_scale

KIVI_BITS = (2, 4, 8, 16)  # 16: stored unquantized in the KV dtype (lossless reference point)


def quantize_asymmetric(x: Tensor, dim: int, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Min/max quantization of x along ``dim``.

    x: any float tensor. Returns (codes uint8 shaped like x, scale, zero) where scale/zero keep
    ``dim`` with size 1 and are in x's dtype; codes are computed against the stored scale/zero.
    """
    levels = (1 << bits) - 1
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    scale = clamp_scale(((hi - lo) / levels).to(x.dtype), x.dtype)
    zero = lo.to(x.dtype)
    codes = torch.round((xf - zero.float()) / scale.float()).clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero


@dataclass(frozen=True, slots=True, eq=False)
class KiviBlock(QuantizedBlock):
    """Packed KIVI tokens of one layer (immutable).

    packed_keys / packed_values: [H_kv, n, D * bits // 8] uint8.
    key_scale / key_zero: [H_kv, n // group, D]; value_scale / value_zero: [H_kv, n, 1] (KV dtype).
    """

    bits: int
    group: int
    packed_keys: Tensor
    key_scale: Tensor
    key_zero: Tensor
    packed_values: Tensor
    value_scale: Tensor
    value_zero: Tensor

    @property
    def num_tokens(self) -> int:
        return self.packed_keys.shape[1]

    def stored_tensors(self) -> tuple[Tensor, ...]:
        return (self.packed_keys, self.key_scale, self.key_zero,
                self.packed_values, self.value_scale, self.value_zero)

    def dequantize(self) -> tuple[Tensor, Tensor]:
        h, n, _ = self.packed_keys.shape
        dtype = self.key_scale.dtype
        qk = unpack_bits(self.packed_keys, self.bits).float()
        d = qk.shape[-1]
        qk = qk.view(h, n // self.group, self.group, d)
        keys = qk * self.key_scale.float().unsqueeze(2) + self.key_zero.float().unsqueeze(2)
        qv = unpack_bits(self.packed_values, self.bits).float()
        values = qv * self.value_scale.float() + self.value_zero.float()
        return keys.view(h, n, d).to(dtype), values.to(dtype)

    def concat(self, other: QuantizedBlock) -> KiviBlock:
        if not isinstance(other, KiviBlock) or (other.bits, other.group) != (self.bits, self.group):
            raise ValueError("KiviBlock.concat: blocks differ in format")
        parts = zip(self.stored_tensors(), other.stored_tensors())
        return KiviBlock(self.bits, self.group, *(torch.cat(p, dim=1) for p in parts))


@dataclass(frozen=True, slots=True)
class Kivi(Quantizer):
    """KIVI int2/int4 (and int8) with a full-precision residual window of recent tokens.

    bits: 2, 4 or 8 (16 = no quantization); group: key group size G in tokens;
    residual: recent tokens kept in full precision (plus those not yet filling a key group).
    """

    name: ClassVar[str] = "kivi"
    bits: int = 4
    group: int = 32
    residual: int = 32

    def __post_init__(self) -> None:
        if self.bits not in KIVI_BITS:
            raise ValueError(f"kivi: bits must be one of {KIVI_BITS}, got {self.bits}")
        if self.group < 1:
            raise ValueError(f"kivi: group must be >= 1, got {self.group}")
        if self.residual < 0:
            raise ValueError(f"kivi: residual must be >= 0, got {self.residual}")

    @property
    def token_group(self) -> int:
        return self.group

    @property
    def lossless(self) -> bool:
        return self.bits == 16

    def quantize(self, keys: Tensor, values: Tensor) -> KiviBlock:
        h, n, d = keys.shape
        if n % self.group:
            raise ValueError(f"kivi: {n} tokens is not a multiple of group {self.group}")
        k_codes, k_scale, k_zero = quantize_asymmetric(keys.view(h, n // self.group, self.group, d), 2, self.bits)
        v_codes, v_scale, v_zero = quantize_asymmetric(values, 2, self.bits)
        return KiviBlock(
            self.bits,
            self.group,
            pack_bits(k_codes.view(h, n, d), self.bits),
            k_scale.squeeze(2).contiguous(),
            k_zero.squeeze(2).contiguous(),
            pack_bits(v_codes, self.bits),
            v_scale.contiguous(),
            v_zero.contiguous(),
        )
