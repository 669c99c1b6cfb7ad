"""A drafted request whose full KV stays in the pool (pressure placement) lodges its compressed KV
in free pool slots (a resident draft row); an allocation that SGLang promised and finds short
takes them back through the prefix tree's eviction, after every cached node. On SGLang's real
pools, allocators and the ``vericache`` prefix tree."""

from __future__ import annotations

import pytest
import torch
from test_draft_rows import _assert_same, _state, _views
from test_offload import SLOTS, _fill_row, _with_tree

pytestmark = pytest.mark.sglang

T = 96  # the state's tokens (test_draft_rows builds it), and the row's


def _resident(page_size: int, spec: str = "snapkv:ratio=0.25,window=8"):
    """A tree, an offloader, and row 1 holding T tokens of full KV in the pool, drafted."""
    kv, rows, alloc, tree, off = _with_tree(page_size)
    _fill_row(rows, alloc, 1, T)
    return alloc, tree, off, _state(spec)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("spec", ["snapkv:ratio=0.25,window=8", "kivi:bits=4,group=16,residual=16"])
def test_a_resident_state_lodges_in_free_slots_counted_as_held_not_evictable(page_size, spec) -> None:
    alloc, tree, off, state = _resident(page_size, spec)
    want, free, evictable = _views(state), alloc.available_size(), tree.evictable_size()
    assert off.hold_resident(1, state)
    held = off.ledger.reserved(1)
    assert held > 0 and alloc.available_size() == free - held
    assert tree.evictable_size() == evictable, "admission must see the slots as held"
    assert all(cache.draft_slots() is not None for cache in state.layers)
    assert state.nbytes_in_pool > 0
    _assert_same(want, _views(state))
    assert off.hold_resident(1, state), "a second call holds what it has"
    assert off.ledger.reserved(1) == held
    off.ledger.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_an_allocation_sglang_finds_short_takes_resident_rows_back_after_cached_nodes(
        page_size: int) -> None:  # fmt: skip
    """SGLang's own allocation path (``evict_to_free_tokens``, as a chunked prompt's next chunk
    or a decode step allocates) evicts cached nodes first, then resident draft rows; the state
    keeps drafting from buffers of its own, its views unchanged. Our own allocations (restoring
    a finished turn) evict cached nodes only."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    alloc, tree, off, state = _resident(page_size)
    assert off.hold_resident(1, state)
    held, want = off.ledger.reserved(1), _views(state)
    cached = [7] * 8  # a finished sequence's cached, unlocked node
    tree.insert(InsertParams(key=RadixKey(cached), value=alloc.alloc(8)))
    taken = alloc.alloc(alloc.available_size())  # everything else is spoken for
    assert alloc.available_size() == 0
    alloc.evict_to_free_tokens(tree, 8)  # the cached node covers it: the row stays
    assert alloc.available_size() >= 8 and off.ledger.reserved(1) == held
    alloc.alloc(alloc.available_size())
    tree.evict_cached(4)  # an allocation of ours (a finished turn's restore): cached nodes only
    assert alloc.available_size() == 0 and off.ledger.reserved(1) == held
    alloc.evict_to_free_tokens(tree, 4)
    assert off.ledger.reserved(1) == 0 and alloc.available_size() == held
    assert off.ledger.evicted_resident_slots == held
    assert all(cache.draft_slots() is None for cache in state.layers)
    _assert_same(want, _views(state))
    assert taken.numel() > 0
    off.ledger.check_integrity()


def test_free_slots_that_do_not_cover_a_state_leave_it_beside_the_pool() -> None:
    alloc, tree, off, state = _resident(1)
    alloc.alloc(alloc.available_size() - off.slots_for(state.nbytes))  # its bytes, no room
    free = alloc.available_size()
    assert not off.hold_resident(1, state)
    assert alloc.available_size() == free and off.ledger.reserved(1) == 0
    assert all(cache.draft_slots() is None for cache in state.layers)


def test_without_a_prefix_tree_to_evict_through_nothing_lodges() -> None:
    """With the radix cache disabled SGLang never evicts for an allocation: a resident row's
    slots could not be taken back, so none are taken."""
    alloc, tree, off, state = _resident(1)
    tree.disable = True
    assert not off.hold_resident(1, state)
    assert off.ledger.reserved(1) == 0


def test_when_pressure_offloads_the_row_its_draft_row_stays_where_it_is() -> None:
    alloc, tree, off, state = _resident(1)
    assert off.hold_resident(1, state)
    held, want = off.ledger.draft_rows[1].held.clone(), _views(state)
    free = alloc.available_size()
    result = off.offload(1, owned_from=0, committed=T, min_tokens=1, state=state)
    assert result.moved == T and result.reserved == 0  # nothing new held, nothing copied
    assert torch.equal(off.ledger.draft_rows[1].held, held)
    assert alloc.available_size() == free + T
    assert off.evict_resident(SLOTS) == 0, "an offloaded row's draft row is not resident"
    _assert_same(want, _views(state))
    off.ledger.check_integrity(off.table)


def test_a_rebuilt_state_takes_its_predecessors_place() -> None:
    alloc, tree, off, state = _resident(1)
    free = alloc.available_size()
    assert off.hold_resident(1, state)
    rebuilt = _state("snapkv:ratio=0.25,window=8")
    assert off.hold_resident(1, rebuilt)
    assert off.ledger.draft_rows[1].tenant is rebuilt
    assert all(cache.draft_slots() is None for cache in state.layers), "the old one moved out"
    assert alloc.available_size() == free - off.ledger.reserved(1)
    off.ledger.check_integrity()

