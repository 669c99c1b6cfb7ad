"""KIVI bodies in pages of a pool's slots (``compress/kivi_pages.py``): written and read back."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress import Kivi, build_compressor
from sglang_vericache.compress.kivi_pages import KiviPageLayout, PagedKiviBlock
from sglang_vericache.compress.view_store import TensorViewStore


def _block(bits: int, n: int, h: int, d: int, group: int = 32, dtype=torch.float32):
    g = torch.Generator().manual_seed(bits * n + d)
    keys, values = (torch.randn(2, h, n, d, generator=g) * 3).to(dtype)
    return Kivi(bits=bits, group=group).quantize(keys, values)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("h, d, group, dtype", [(3, 64, 32, torch.float32), (2, 16, 16, torch.float32),
                                                (4, 8, 32, torch.float16), (1, 128, 64, torch.bfloat16)])
def test_a_block_reads_back_from_its_pages_as_written(bits, h, d, group, dtype) -> None:
    block = _block(bits, 4 * group, h, d, group, dtype)
    layout = KiviPageLayout.of(block)
    slots = 200
    k_buf, v_buf = torch.randn(2, slots, h, d).to(dtype)
    pages = torch.randperm(slots - 1)[: layout.pages_for(block.num_tokens)] + 1
    before_k, before_v = k_buf.clone(), v_buf.clone()
    paged = PagedKiviBlock.write(block, k_buf, v_buf, pages)
    back = paged.detached()
    for a, b in zip(block.stored_tensors(), back.stored_tensors()):
        assert a.shape == b.shape and torch.equal(a, b)
    others = torch.ones(slots, dtype=torch.bool)
    others[pages] = False  # nothing outside the pages was written
    assert torch.equal(k_buf[others], before_k[others]) and torch.equal(v_buf[others], before_v[others])
    assert paged.in_pool and not block.in_pool
    assert paged.nbytes == 2 * pages.numel() * layout.slot_bytes >= block.nbytes
    for got, want in zip(paged.dequantize(), block.dequantize()):
        assert torch.equal(got, want)


def test_a_page_is_a_few_slots_per_key_group() -> None:
    """int4, G 32, SmolLM2's 3 x 64 heads in float32: 6 slots for 32 tokens (5.3x fewer)."""
    layout = KiviPageLayout(3, 64, 4, 32, torch.float32)
    assert layout.slots_per_group == 6 and layout.pages_for(64) == 12
    assert KiviPageLayout(3, 64, 2, 32, torch.float32).slots_per_group == 4


def test_only_kivi_blocks_of_the_pools_shape_fit() -> None:
    pool = torch.zeros(10, 3, 64)
    assert KiviPageLayout.fits(_block(4, 32, 3, 64), pool)
    assert not KiviPageLayout.fits(_block(4, 32, 2, 64), pool)  # other heads
    assert not KiviPageLayout.fits(_block(4, 32, 3, 64, dtype=torch.float16), pool)  # other dtype
    assert not KiviPageLayout.fits(build_compressor("turbo:bits=4").quantize(
        torch.randn(3, 32, 64), torch.randn(3, 32, 64)), pool)  # fmt: skip


def test_a_store_of_its_own_reads_a_paged_block_out() -> None:
    """What the layer cache's ``move_to(None)`` and ``clone`` rely on: the copy does not change
    when the pages are written over (their slots went back to the pool)."""
    block = _block(4, 64, 3, 64)
    k_buf, v_buf = torch.zeros(2, 40, 3, 64)
    paged = PagedKiviBlock.write(block, k_buf, v_buf, torch.arange(1, 40))
    own = TensorViewStore(3, 64, torch.float32, torch.device("cpu")).hold_block(paged)
    k_buf.normal_()
    assert not own.in_pool
    for a, b in zip(block.stored_tensors(), own.stored_tensors()):
        assert torch.equal(a, b)


def test_a_fold_over_a_paged_body_writes_only_the_groups_it_adds() -> None:
    """What a layer cache's fold does: concat keeps the new groups as a tail (read as the whole
    block meanwhile), and ``written`` puts them on the next pages, leaving the first alone."""
    block, more, most = _block(4, 64, 3, 64), _block(4, 32, 3, 64), _block(4, 64, 3, 64)
    k_buf, v_buf = torch.zeros(2, 40, 3, 64)
    pages = torch.randperm(39) + 1
    paged = PagedKiviBlock.write(block, k_buf, v_buf, pages)
    grown = paged.concat(more).concat(most)  # two folds before a store writes them
    want = block.concat(more).concat(most)
    assert isinstance(grown, PagedKiviBlock) and not grown.in_pool
    assert grown.num_tokens == want.num_tokens and grown.nbytes == paged.nbytes + more.nbytes + most.nbytes
    assert all(torch.equal(a, b) for a, b in zip(grown.stored_tensors(), want.stored_tensors()))
    raw = lambda: torch.cat([k_buf[paged.pages], v_buf[paged.pages]]).view(torch.uint8)  # noqa: E731
    first = raw().clone()  # bytes: codes read as floats may be NaN, which no float equals
    done = grown.written(pages)
    assert done.in_pool and done.tail is None and done.pages.numel() == 30
    assert torch.equal(raw(), first)
    assert all(torch.equal(a, b) for a, b in zip(done.stored_tensors(), want.stored_tensors()))
    with pytest.raises(ValueError, match="differ in format"):
        paged.concat(_block(2, 32, 3, 64))


def test_a_paged_block_fits_the_pool_it_came_from() -> None:
    """A fold hands the store a block already in its pages (maybe with a tail): it must be
    taken as such, not read out into tensors beside the pool."""
    block = _block(4, 64, 3, 64)
    k_buf, v_buf = torch.zeros(2, 40, 3, 64)
    paged = PagedKiviBlock.write(block, k_buf, v_buf, torch.arange(1, 40))
    assert KiviPageLayout.fits(paged, k_buf) and KiviPageLayout.fits(paged.concat(block), k_buf)
    assert KiviPageLayout.of(paged) == KiviPageLayout.of(block)
    assert not KiviPageLayout.fits(paged, torch.zeros(40, 2, 64))
