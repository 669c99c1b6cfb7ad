"""Compressed KV lodged in pool slots: the same views as a buffer of its own, on SGLang's pool."""

from __future__ import annotations

import gc

import pytest
import torch

from sglang_vericache.compress import build_compressor
from sglang_vericache.compress.layer_cache import GROW_MIN

pytestmark = pytest.mark.sglang

SLOTS, H_KV, H_Q, D, LAYERS, T = 1024, 2, 4, 8, 3, 96
SPECS = ["snapkv:ratio=0.25,window=8", "h2o:ratio=0.25", "streaming:sink=4,window=32",
         "kivi:bits=4,group=16,residual=16", "snapkv:ratio=0.5+kivi:bits=2,group=16,residual=8",
         "pyramid(knorm:ratio=0.25):beta=4", "full"]


def _pool_and_alloc():
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kv = MHATokenToKVPool(SLOTS, 1, torch.float32, H_KV, D, LAYERS, "cpu", False)
    return kv, TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", kv, False)


def _kv(seed: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(H_KV, n, D, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(H_KV, n, D, generator=g) for _ in range(LAYERS)]
    queries = [torch.randn(H_Q, n, D, generator=g) for _ in range(LAYERS)]
    return keys, values, queries


def _state(spec: str):
    from sglang_vericache.srt.kv.draft_state import RequestDraftState

    keys, values, queries = _kv(0, T)
    return RequestDraftState.build(build_compressor(spec), lambda l: (keys[l], values[l]), T,
                                   [q[:, -8:] for q in queries], LAYERS)  # fmt: skip


def _grow(state, steps: list[int]) -> None:
    """Commit ``sum(steps)`` tokens in chunks, as verify steps do (folds included)."""
    keys, values, queries = _kv(1, sum(steps))
    at = 0
    for n in steps:
        sl = slice(at, at + n)
        for layer, cache in enumerate(state.layers):
            cache.append(keys[layer][:, sl], values[layer][:, sl],
                         torch.arange(state.covered, state.covered + n), queries[layer][:, sl])
        state.covered += n
        at += n


def _row(kv, alloc, take=None):
    from sglang_vericache.srt.kv.draft_rows import DraftRow

    take = take or (lambda n: alloc.alloc(n).to(torch.int64))
    return DraftRow(kv, take)


def _views(state) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t.clone() for t in cache.view()) for cache in state.layers]


def _assert_same(a, b) -> None:
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            assert torch.equal(s, t)


@pytest.mark.parametrize("spec", SPECS)
def test_a_lodged_state_grows_exactly_like_one_in_its_own_buffers(spec: str) -> None:
    kv, alloc = _pool_and_alloc()
    own, lodged = _state(spec), _state(spec)
    row = _row(kv, alloc)
    assert row.lodge(lodged) == LAYERS and row.tenant is lodged
    _assert_same(_views(own), _views(lodged))
    for state in (own, lodged):
        _grow(state, [1, 7, 3, 150, 2])  # past several folds
        state.check_integrity()
    row.check_integrity()
    _assert_same(_views(own), _views(lodged))
    # the same bytes, but for a packed body's pages, whole slots a key group (int2 / int4 at
    # group 16, H_kv 2, D 8: 3 / 4 slots of 128 bytes for 16 tokens' 320 / 384 bytes)
    assert own.nbytes <= lodged.nbytes <= 1.5 * own.nbytes
    indices = sum(0 if c.compressed.kept_positions is None else c.compressed.kept_positions.nbytes
                  for c in lodged.layers)  # fmt: skip
    assert lodged.nbytes - lodged.nbytes_in_pool == indices  # the rest is in the pool
    # every full-precision column is in the row's slots, and the pool counts them as used
    columns = max(cache.float_len for cache in lodged.layers)
    assert row.slots.numel() >= columns
    assert alloc.available_size() == SLOTS - row.num_held
    for layer, cache in enumerate(lodged.layers):
        body, (rk, _), (wk, _) = cache.packed_view_parts()
        stored = kv.get_key_buffer(layer)[row.slots[: cache.float_len]].transpose(0, 1)
        assert torch.equal(stored, torch.cat([rk, wk], dim=1))


def test_evicting_a_live_tenant_keeps_its_kv_and_frees_the_slots_for_reuse() -> None:
    kv, alloc = _pool_and_alloc()
    state = _state("snapkv:ratio=0.25,window=8")
    row = _row(kv, alloc)
    row.lodge(state)
    before = _views(state)
    row.evict()  # what the offloader does before it frees the reservation
    alloc.free(row.slots)
    for layer in range(LAYERS):  # whoever gets the slots next writes over them
        kv.get_key_buffer(layer).zero_()
        kv.get_value_buffer(layer).zero_()
    _assert_same(before, _views(state))
    assert all(cache.draft_slots() is None for cache in state.layers)
    assert row.tenant is None


def test_a_dead_tenant_is_not_copied_out() -> None:
    kv, alloc = _pool_and_alloc()
    state = _state("h2o:ratio=0.25")
    row = _row(kv, alloc)
    row.lodge(state)
    del state
    gc.collect()
    assert row.tenant is None
    row.evict()  # nothing to copy, no error


def test_a_new_tenant_evicts_the_previous_one() -> None:
    kv, alloc = _pool_and_alloc()
    first, second = _state("snapkv:ratio=0.25,window=8"), _state("h2o:ratio=0.25")
    row = _row(kv, alloc)
    row.lodge(first)
    want = _views(first)
    row.lodge(second)
    assert all(cache.draft_slots() is None for cache in first.layers)
    _grow(second, [40])
    _assert_same(want, _views(first))  # the second's writes did not reach the first


def test_a_row_that_cannot_grow_leaves_the_columns_in_buffers_of_their_own() -> None:
    kv, alloc = _pool_and_alloc()
    budget = iter([True])  # one grant, then the pool is full
    take = lambda n: alloc.alloc(n).to(torch.int64) if next(budget, False) else None  # noqa: E731
    own, state = _state("snapkv:ratio=0.25,window=8"), _state("snapkv:ratio=0.25,window=8")
    row = _row(kv, alloc, take)
    assert row.lodge(state) == LAYERS
    for s in (own, state):
        _grow(s, [300])
    _assert_same(_views(own), _views(state))
    assert all(cache.draft_slots() is None for cache in state.layers)  # moved out to grow


def test_the_offloader_lodges_a_state_and_gives_every_slot_back() -> None:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from sglang_vericache.srt.kv.offloader import PoolOffloader

    kv, alloc = _pool_and_alloc()
    rows = ReqToTokenPool(2, 512, "cpu", False)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    slots = alloc.alloc(T)
    rows.req_to_token[1, :T] = slots.to(torch.int32)
    state = _state("snapkv:ratio=0.25,window=8")
    free = alloc.available_size()
    result = off.offload(1, owned_from=0, committed=T, state=state)
    assert result.moved == T
    draft_row = off.ledger.draft_rows[1]
    assert draft_row.tenant is state
    assert all(cache.draft_slots() is not None for cache in state.layers)
    column = 2 * H_KV * D * 4
    assert state.nbytes_in_pool == sum(c.float_len for c in state.layers) * column
    assert 0 < state.nbytes - state.nbytes_in_pool < state.nbytes // 10  # kept-position indices
    held = off.ledger.reserved(1)
    assert held >= max(cache.float_len for cache in state.layers)
    assert alloc.available_size() == free + T - held
    want = _views(state)
    off.drop(1)  # the request left; its state lives on (e.g. parked as a demoted prefix)
    assert alloc.available_size() == free + T
    _assert_same(want, _views(state))
    assert all(cache.draft_slots() is None for cache in state.layers)
    assert state.nbytes_in_pool == 0


def test_a_draft_row_outlives_its_rows_offloads_and_release_gives_every_slot_back() -> None:
    """The ledger keeps a row's draft row apart from its host range: later offloads of the row
    find it (nothing held twice); releasing it for admission frees every slot while the host
    range stays, and a state still alive keeps its KV, copied out."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from sglang_vericache.srt.kv.offloader import PoolOffloader

    kv, alloc = _pool_and_alloc()
    rows = ReqToTokenPool(2, 512, "cpu", False)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    rows.req_to_token[1, : T + 8] = alloc.alloc(T + 8).to(torch.int32)
    state = _state("kivi:bits=4,group=16,residual=16")
    free = alloc.available_size()
    result = off.offload(1, owned_from=0, committed=T, state=state)
    held = off.ledger.reserved(1)
    # what its bytes need, and room for the window to grow in (``GROW_MIN`` columns)
    assert 0 < off.slots_for(state.nbytes) <= result.reserved == held
    assert held <= off.slots_for(state.nbytes) + GROW_MIN
    assert state.nbytes_in_pool == state.nbytes  # KIVI's packed codes too, in pages
    assert all(cache.block.in_pool for cache in state.layers)
    draft_row, want = off.ledger.draft_rows[1], _views(state)
    assert off.offload(1, owned_from=0, committed=T + 8, state=state).reserved == 0
    assert off.ledger.draft_rows[1] is draft_row and draft_row.tenant is state
    assert alloc.available_size() == free + T + 8 - held
    off.ledger.check_integrity(rows.req_to_token)
    assert off.release_reserved(1) == held  # dropped for admission: every slot back
    assert alloc.available_size() == free + T + 8 and off.ledger.reserved(1) == 0
    assert off.ledger.span(1).host.length == T + 8  # the full KV stays offloaded
    _assert_same(want, _views(state))  # a live state keeps its KV, copied out
    off.drop(1)
    assert not off.ledger.draft_rows and not off.ledger.rows


def test_a_plain_row_holds_nothing() -> None:
    """An offload-only row (no compressed KV) gets no draft row."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from sglang_vericache.srt.kv.offloader import PoolOffloader

    kv, alloc = _pool_and_alloc()
    rows = ReqToTokenPool(2, 512, "cpu", False)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    rows.req_to_token[0, :T] = alloc.alloc(T).to(torch.int32)
    assert off.offload(0, owned_from=0, committed=T).reserved == 0
    assert not off.ledger.draft_rows


def test_a_body_paged_in_another_row_is_copied_into_this_rows_pages() -> None:
    """A store handed a body that lives in another row's pages writes its own copy (its layout
    taken from the paged block) instead of pointing at slots it does not hold."""
    from sglang_vericache.compress import Kivi
    from sglang_vericache.compress.kivi_pages import PagedKiviBlock
    from sglang_vericache.srt.kv.draft_rows import PoolViewStore

    kv, alloc = _pool_and_alloc()
    block = Kivi(bits=4, group=16).quantize(torch.randn(H_KV, 64, D), torch.randn(H_KV, 64, D))
    first, second = _row(kv, alloc), _row(kv, alloc)
    in_first = PoolViewStore(first, 1).hold_block(block)
    in_second = PoolViewStore(second, 1).hold_block(in_first)
    assert isinstance(in_second, PagedKiviBlock) and in_second.in_pool
    assert torch.equal(in_second.pages, second.pages[: in_second.pages.numel()])
    assert not set(second.pages.tolist()) & set(first.pages.tolist())
    for got, want in zip(in_second.stored_tensors(), block.stored_tensors()):
        assert torch.equal(got, want)
