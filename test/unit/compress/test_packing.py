"""Packing follows the shared format bit for bit; packed bytes are what nbytes reports."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress import Observation, build_compressor, pack_bits, unpack_bits


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip_and_layout(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (3, 5, 16), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 16 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits), codes.to(torch.uint8))
    per = 8 // bits
    for j in range(16):  # element j -> byte j // per at bit offset (j % per) * bits
        got = (packed[..., j // per] >> ((j % per) * bits)) & ((1 << bits) - 1)
        assert torch.equal(got, codes[..., j].to(torch.uint8))


def test_pack_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(3, 5, dtype=torch.uint8), 4)
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_bytes_match_formula(bits: int, dtype: torch.dtype) -> None:
    h, t, d, g, r = 2, 200, 32, 32, 40
    k = torch.randn(h, t, d).to(dtype)
    c = build_compressor(f"kivi:bits={bits},group={g},residual={r}").compress(0, k, k, Observation())
    n_q = (t - r) // g * g
    e = torch.finfo(dtype).bits // 8
    expected = (
        2 * h * n_q * d * bits // 8  # packed keys + values
        + 2 * h * (n_q // g) * d * e  # key scale + zero, per channel per group
        + 2 * h * n_q * 1 * e  # value scale + zero, per token
        + 2 * h * (t - n_q) * d * e  # residual keys + values
    )
    assert c.nbytes == expected
    stored = sum(x.numel() * x.element_size() for x in c.block.stored_tensors())
    stored += 2 * c.residual_keys.numel() * c.residual_keys.element_size()
    assert c.nbytes == stored
    assert c.block.key_scale.shape == (h, n_q // g, d) and c.block.value_scale.shape == (h, n_q, 1)
    assert c.block.key_scale.dtype == dtype and c.block.packed_keys.shape == (h, n_q, d * bits // 8)


def test_turbo_and_dropper_bytes() -> None:
    h, t, d = 2, 100, 32
    k = torch.randn(h, t, d)
    c = build_compressor("turbo:bits=4,residual=10").compress(0, k, k, Observation())
    assert c.nbytes == 2 * h * 90 * d // 2 + 2 * h * 90 * 4 + 2 * h * 10 * d * 4
    c = build_compressor("knorm:ratio=0.25,window=4,sink=0").compress(0, k, k, Observation())
    assert c.num_kept == 25
    assert c.nbytes == 2 * h * 25 * d * 4 + h * 25 * 4  # kept K/V + int32 index
