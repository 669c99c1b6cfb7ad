"""DEMOTED prefixes charged to SGLang's real pool through the ``vericache`` prefix tree.

The tree makes its ``DemotedPrefixes`` only with a remote tier; here it gets one directly (the
tier's part is ``test/e2e/test_remote_prefix.py``). What is checked is the accounting SGLang
relies on: allocator free count + the tree's evictable size + protected size == pool size,
eviction frees FULL nodes before DEMOTED entries, and a flush leaks and double-frees nothing.
"""

from __future__ import annotations

import pytest
import torch
from test_offload import SLOTS, _with_tree

from sglang_vericache.srt.draft_ahead import DraftAhead
from sglang_vericache.tier.demoted import DemotedPrefixes

pytestmark = pytest.mark.sglang


class _State:
    """A compressed state's size and coverage (the store reads nothing else of it)."""

    def __init__(self, covered: int, nbytes: int) -> None:
        self.covered, self.nbytes = covered, nbytes


def _demoting_tree(page_size: int):
    kv, rows, alloc, tree, _ = _with_tree(page_size)
    tree.ahead = DraftAhead(DemotedPrefixes(tree))
    return alloc, tree, tree.ahead.store


def _cache_full_node(tree, alloc, tokens: list[int]) -> None:
    """A finished sequence's FULL node: its slots inserted, unlocked (evictable)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tree.insert(InsertParams(key=RadixKey(tokens), value=alloc.alloc(len(tokens))))


def _accounted(tree, alloc) -> int:
    """SGLang's idle invariant's left side: free + evictable + protected."""
    return int(alloc.available_size()) + int(tree.evictable_size()) + int(tree.protected_size())


@pytest.mark.parametrize("page_size", [1, 4])
def test_demoted_entries_are_charged_to_the_pool_and_count_as_evictable(page_size: int) -> None:
    alloc, tree, store = _demoting_tree(page_size)
    slots = tree.slots_for(10 * tree.offloader.slot_bytes + 1)
    assert slots % page_size == 0 and slots >= 11  # whole pages worth the bytes
    assert store.put([1, 2, 3], _State(3, 10 * tree.offloader.slot_bytes + 1))
    assert alloc.available_size() == SLOTS - slots and store.charged_slots == slots
    assert tree.evictable_size() == slots and _accounted(tree, alloc) == SLOTS


@pytest.mark.parametrize("page_size", [1, 4])
def test_eviction_demotes_full_nodes_before_it_drops_demoted_entries(page_size: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    alloc, tree, store = _demoting_tree(page_size)
    slot_bytes = tree.offloader.slot_bytes
    assert store.put([7, 7], _State(2, 8 * slot_bytes))
    _cache_full_node(tree, alloc, list(range(1000, 1064)))
    hog = alloc.alloc(alloc.available_size())  # running requests hold every free slot
    assert _accounted(tree, alloc) + hog.numel() == SLOTS

    freed = tree.evict(EvictParams(num_tokens=16)).num_tokens_evicted
    assert freed == 64 and store.charged_slots == 8  # the FULL node went whole, DEMOTED stays
    assert tree.evict(EvictParams(num_tokens=64 + 4)).num_tokens_evicted == 8  # then DEMOTED
    assert not store.entries and alloc.available_size() == 64 + 8
    alloc.free(hog)
    assert alloc.available_size() == SLOTS and tree.evictable_size() == 0


def test_a_new_entry_demotes_a_full_node_for_its_slots_when_none_is_free() -> None:
    alloc, tree, store = _demoting_tree(1)
    _cache_full_node(tree, alloc, list(range(1000, 1040)))
    hog = alloc.alloc(alloc.available_size())
    assert store.put([5, 6], _State(2, 12 * tree.offloader.slot_bytes))
    assert store.charged_slots == 12 and tree.evictable_size() == 12  # the FULL node went
    assert alloc.available_size() == 40 - 12
    alloc.free(hog)
    assert _accounted(tree, alloc) == SLOTS


def test_a_flush_forgets_demoted_entries_without_a_double_free() -> None:
    alloc, tree, store = _demoting_tree(4)
    _cache_full_node(tree, alloc, list(range(1000, 1016)))
    assert store.put([3, 4], _State(2, 20 * tree.offloader.slot_bytes))
    tree.reset()  # as SGLang's flush_cache: the tree, then the allocator
    alloc.clear()
    assert not store.entries and store.charged_slots == 0
    assert alloc.available_size() == SLOTS and tree.evictable_size() == 0
    again = alloc.alloc(SLOTS)  # every slot is free exactly once
    assert again is not None and torch.unique(again).numel() == SLOTS


def test_slots_evicted_inside_sglangs_free_group_are_taken_at_once() -> None:
    """SGLang holds frees back while it processes a batch's results, which is where a finished
    turn is kept: the FULL node evicted for the entry must be allocatable before the group
    ends, or the entry is refused after the eviction (and older entries dropped for nothing)."""
    alloc, tree, store = _demoting_tree(1)
    _cache_full_node(tree, alloc, list(range(1000, 1040)))
    assert store.put([1, 1], _State(2, 8 * tree.offloader.slot_bytes))
    hog = alloc.alloc(alloc.available_size())
    alloc.free_group_begin()
    try:
        assert store.put([5, 6], _State(2, 12 * tree.offloader.slot_bytes))
        assert list(store.entries) == [(1, 1), (5, 6)] and store.refused == 0
    finally:
        alloc.free_group_end()
    alloc.free(hog)
    assert _accounted(tree, alloc) == SLOTS
