"""Staging a verify's host-resident full KV on the pool's device (``srt/kv/full_kv_stage.py``) on
SGLang's real pool and allocator: staged reads hold exactly the bytes unstaged reads do, come
from the staged copy, respect the budget, and are gone after ``release``.

On CPU the prefetcher copies synchronously; the same calls run its side stream on a GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.sglang

SLOTS, H_KV, D, LAYERS, ROWS, MAX_LEN = 512, 2, 8, 3, 4, 200


def _offloaded_rows(device: str):
    """A pool with three offloaded rows: 1 and 2 wholly offloaded (140 and 60 tokens of 150
    and 70), 3 with a tree-owned prefix of 10 before its host range [10, 120) of 140."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from sglang_vericache.srt.kv.offloader import PoolOffloader

    kv = MHATokenToKVPool(SLOTS, 1, torch.float32, H_KV, D, LAYERS, device, False)
    for layer in range(LAYERS):
        kv.get_key_buffer(layer).copy_(torch.randn_like(kv.get_key_buffer(layer)))
        kv.get_value_buffer(layer).copy_(torch.randn_like(kv.get_value_buffer(layer)))
    rows = ReqToTokenPool(ROWS, MAX_LEN, device, False)
    alloc = TokenToKVPoolAllocator(SLOTS, torch.float32, device, kv, False)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    ends = {1: 150, 2: 70, 3: 140}
    for row, end in ends.items():
        rows.req_to_token[row, :end] = alloc.alloc(end).to(torch.int32)
    before = {row: _reads(off, row, end) for row, end in ends.items()}
    off.offload(1, owned_from=0, committed=140)
    off.offload(2, owned_from=0, committed=60)
    off.offload(3, owned_from=10, committed=120)
    return off, ends, before


def _reads(off, row: int, end: int) -> list[torch.Tensor]:
    """[2, H_kv, end, D] per layer, read as the verify reads (``OffloadLedger.read``)."""
    return [torch.stack(off.layer_reader(row, end)(layer)) for layer in range(LAYERS)]


def _row_bytes(off, row: int) -> int:
    return off.ledger.span(row).host.nbytes


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_staged_reads_equal_the_host_reads_and_come_from_the_copy(device: str) -> None:
    from sglang_vericache.srt.kv.full_kv_stage import FullKVStager

    off, ends, before = _offloaded_rows(device)
    stager = FullKVStager(off.ledger, device, budget_bytes=1 << 30)
    staged = stager.stage([1, 2, 3, 0])  # row 0 holds no host range: nothing to stage
    assert staged == sum(_row_bytes(off, row) for row in ends)
    stager.check_integrity()
    stager.ready()
    for row, end in ends.items():
        entry = off.ledger.span(row)
        assert entry.staged is not None and entry.staged.device.type == device
        host = entry.host.restore()
        for layer, want in enumerate(_reads(off, row, end)):
            assert torch.equal(want, before[row][layer])
        keys, _ = off.ledger.read_range(off.pool, off.table, 0, row, entry.lo, entry.hi)
        assert keys.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    stager.release()
    assert all(off.ledger.span(row).staged is None for row in ends)
    assert stager.bytes_staged == 0
    stager.check_integrity()
    for row, end in ends.items():  # back to the host buffer, same bytes
        assert all(torch.equal(a, b) for a, b in zip(_reads(off, row, end), before[row]))


def test_the_budget_skips_a_row_that_does_not_fit_but_not_a_smaller_one_after_it() -> None:
    from sglang_vericache.srt.kv.full_kv_stage import FullKVStager

    off, ends, before = _offloaded_rows("cpu")
    budget = _row_bytes(off, 3) + _row_bytes(off, 2)  # row 1 (140 tokens) does not fit after 3
    stager = FullKVStager(off.ledger, "cpu", budget)
    assert stager.stage([3, 1, 2]) == budget
    assert [off.ledger.span(r).staged is not None for r in (1, 2, 3)] == [False, True, True]
    stager.check_integrity()
    for row, end in ends.items():  # staged or not, every row reads its exact bytes
        assert all(torch.equal(a, b) for a, b in zip(_reads(off, row, end), before[row]))
    assert stager.stage([1]) == _row_bytes(off, 1)  # a new step releases the last one first
    assert [off.ledger.span(r).staged is not None for r in (1, 2, 3)] == [True, False, False]
    stager.release()


def test_tokens_offloaded_after_staging_are_read_from_the_host() -> None:
    """A staged copy holds the host range as it was: later host tokens come from the host."""
    from sglang_vericache.srt.kv.full_kv_stage import FullKVStager

    off, _, before = _offloaded_rows("cpu")
    stager = FullKVStager(off.ledger, "cpu", budget_bytes=1 << 30)
    stager.stage([1])
    off.offload(1, owned_from=0, committed=150, min_tokens=1)  # host range now [0, 150)
    assert off.ledger.span(1).staged.shape[3] == 140
    assert all(torch.equal(a, b) for a, b in zip(_reads(off, 1, 150), before[1]))
    stager.release()


def test_a_host_memory_pool_stages_nothing() -> None:
    from sglang_vericache.srt.kv.full_kv_stage import FullKVStager

    off, ends, _ = _offloaded_rows("cpu")
    stager = FullKVStager.for_pool(off.ledger, "cpu")
    assert stager.budget_bytes == 0
    assert stager.stage(list(ends)) == 0
    assert all(off.ledger.span(row).staged is None for row in ends)
    stager.check_integrity()
