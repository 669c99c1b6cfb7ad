from __future__ import annotations

import pytest
import torch

from sglang_vericache.ops.layout import QuantPagedBatch
from sglang_vericache.ops.quant_pack import (
    build_quant_paged_batch,
    dequantize_keys,
    dequantize_values,
    pack_codes,
    quantize_keys,
    quantize_values,
    split_quantized_and_window,
    unpack_codes,
    values_byte_major,
    values_token_major,
)
from sglang_vericache.ops.reference import dequantize_request_pages


def test_int4_bit_order_little_end_first() -> None:
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x0F]]


def test_int2_bit_order_little_end_first() -> None:
    codes = torch.tensor([[1, 2, 3, 0, 3, 3, 0, 1]], dtype=torch.uint8)
    # byte 0: 1 | 2<<2 | 3<<4 | 0<<6 = 0x39; byte 1: 3 | 3<<2 | 0<<4 | 1<<6 = 0x4F
    assert pack_codes(codes, 2).tolist() == [[0x39, 0x4F]]


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_roundtrip(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (3, 5, 32), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 5, 32 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantization_error_within_half_step(bits: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    keys = torch.randn(2, 64, 32).to(dtype)
    packed, scale, zero = quantize_keys(keys, bits, group_size=16)
    assert scale.shape == (2, 4, 32) and scale.dtype == dtype
    deq = dequantize_keys(packed, scale, zero, bits, 16)
    step = scale.float().repeat_interleave(16, dim=1)
    slack = 0.02 if dtype != torch.float32 else 1e-5  # scale/zero rounded to the KV dtype
    assert bool(((deq - keys.float()).abs() <= step / 2 + slack).all())

    values = torch.randn(2, 64, 32).to(dtype)
    vp, vs, vz = quantize_values(values, bits)
    assert vs.shape == (2, 64, 1)
    vdeq = dequantize_values(vp, vs, vz, bits)
    assert bool(((vdeq - values.float()).abs() <= vs.float() / 2 + slack).all())


def test_constant_group_quantizes_exactly() -> None:
    keys = torch.full((1, 8, 16), 3.0)
    packed, scale, zero = quantize_keys(keys, 4, group_size=8)
    assert torch.equal(dequantize_keys(packed, scale, zero, 4, 8), keys)


def test_window_split_keeps_partial_group_in_full_precision() -> None:
    assert split_quantized_and_window(100, 16, 8) == 80   # 92 older tokens -> 5 whole pages
    assert split_quantized_and_window(10, 16, 8) == 0
    assert split_quantized_and_window(24, 16, 8) == 16


def test_build_batch_pages_match_direct_quantization() -> None:
    torch.manual_seed(1)
    keys = [torch.randn(2, 70, 32), torch.randn(2, 9, 32)]
    values = [torch.randn(2, 70, 32), torch.randn(2, 9, 32)]
    inp = build_quant_paged_batch(keys, values, page_size=16, bits=4, recent_window=8,
                                  num_pages=10, generator=torch.Generator().manual_seed(3))
    assert inp.batch.kv_indptr.tolist() == [0, 3, 3]
    assert inp.batch.window_len.tolist() == [70 - 48, 9]
    k_deq, v_deq = dequantize_request_pages(inp.cache, inp.batch, 0)
    kp, ks, kz = quantize_keys(keys[0][:, :48], 4, 16)
    vp, vs, vz = quantize_values(values[0][:, :48], 4)
    assert torch.equal(k_deq, dequantize_keys(kp, ks, kz, 4, 16))
    assert torch.equal(v_deq, dequantize_values(vp, vs, vz, 4))
    assert torch.equal(inp.window.keys[0, :, :22], keys[0][:, 48:])
    assert torch.equal(inp.window.values[1, :, :9], values[1])


def test_batch_validation_rejects_bad_metadata() -> None:
    def meta(last: int, wlen: int, indptr: list[int]) -> QuantPagedBatch:
        return QuantPagedBatch(torch.tensor(indptr, dtype=torch.int32),
                               torch.tensor([0, 1], dtype=torch.int32),
                               torch.tensor([last], dtype=torch.int32),
                               torch.tensor([0], dtype=torch.int32),
                               torch.tensor([wlen], dtype=torch.int32))

    meta(16, 0, [0, 2]).validate(16, 2, 4, 1)
    with pytest.raises(ValueError):
        meta(17, 0, [0, 2]).validate(16, 2, 4, 1)
    with pytest.raises(ValueError):
        meta(16, 5, [0, 2]).validate(16, 2, 4, 1)
    with pytest.raises(ValueError):
        meta(16, 0, [0, 0]).validate(16, 2, 4, 1)  # no tokens at all
    with pytest.raises(ValueError):
        meta(16, 0, [0, 2]).validate(16, 1, 4, 1)  # page id 1 outside a 1-page pool


def test_value_pages_are_stored_byte_major() -> None:
    """Physical layout pin (ops/layout.py): v_packed[p, h, j, t] is byte j of token t's packed
    value row; keys stay token-major, k_packed[p, h, t, j]."""
    torch.manual_seed(2)
    keys, values = [torch.randn(2, 40, 16)], [torch.randn(2, 40, 16)]
    inp = build_quant_paged_batch(keys, values, page_size=16, bits=4, recent_window=8,
                                  shuffle_pages=False)
    vp, _, _ = quantize_values(values[0][:, :32], 4)  # [H, T, D/2] token-major rows
    kp, _, _ = quantize_keys(keys[0][:, :32], 4, 16)
    assert inp.cache.v_packed.shape == (2, 2, 8, 16)
    for page in range(2):
        for t in range(16):
            row = page * 16 + t
            assert torch.equal(inp.cache.v_packed[page, :, :, t], vp[:, row])
            assert torch.equal(inp.cache.k_packed[page, :, t], kp[:, row])
    stored = values_byte_major(vp.reshape(2, 2, 16, 8))
    assert stored.is_contiguous() and torch.equal(values_token_major(stored),
                                                  vp.reshape(2, 2, 16, 8))
