"""Bit packing of the shared format (the CPU and Triton draft kernels read it packed).

Element j of the last dimension goes to byte j // (8 // b) at bit offset (j % (8 // b)) * b, low
bits first. int4: [..., D] -> [..., D // 2] uint8; int2: [..., D // 4]; int8: [..., D] (one per byte).
"""

from __future__ import annotations

import torch
from torch import Tensor

PACKABLE_BITS = (2, 4, 8)


def _check_bits(bits: int) -> int:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits}")
    return 8 // bits


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Packs integer codes in [0, 2**bits - 1] along the last dim.

    codes: [..., D] any integer dtype; D must be divisible by 8 // bits.
    Returns [..., D * bits // 8] uint8.
    """
    per_byte = _check_bits(bits)
    d = codes.shape[-1]
    if d % per_byte:
        raise ValueError(f"last dim {d} not divisible by {per_byte} ({bits}-bit packing)")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], d // per_byte, per_byte)
    packed = torch.zeros(c.shape[:-1], dtype=torch.uint8, device=codes.device)
    for slot in range(per_byte):
        packed |= c[..., slot] << (slot * bits)
    return packed


def unpack_bits(packed: Tensor, bits: int) -> Tensor:
    """Inverse of pack_bits. packed: [..., P] uint8 -> [..., P * 8 // bits] uint8 codes."""
    per_byte = _check_bits(bits)
    if per_byte == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
