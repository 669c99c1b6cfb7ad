"""DEMOTED prefixes charged to SGLang's real pool through the ``vericache`` prefix tree.

The tree makes its ``DemotedPrefixes`` only with a remote tier; here it gets one directly (the
tier's part is ``test/e2e/test_remote_prefix.py``). What is checked is the accounting SGLang
relies on: allocator free count + the tree's evictable size + protected size == pool size,
eviction frees FULL nodes before DEMOTED entries, and a flush leaks and double-frees nothing;
and, with a real tier link, that a finished turn comes back FULL under pressure.
"""

from __future__ import annotations

import pytest
import torch
from test_offload import (LAYERS, SLOTS, _fill_row, _full_kv, _tree_slots, _with_host_tier_tree,
                          _with_tree)  # fmt: skip

from sglang_vericache.srt.prefix.draft_ahead import DraftAhead
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


def test_a_finished_turn_comes_back_full_evicting_older_cached_nodes_with_a_tier_up() -> None:
    """With a tier up, a finished request's offloaded full KV comes back into the pool even when
    no slot is free: older cached nodes are evicted for it (LRU), as plain SGLang keeps a
    finished request's KV. It used to come back only into free room, so under pressure the next
    turn of a conversation (seconds later) found nothing on the device and recomputed or
    fetched it, while plain SGLang hit it."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import ReqKvInfo
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    kv, rows, alloc, tree = _with_host_tier_tree(fetch_drafting=False)
    link = tree.remote
    worker = tree.offloader  # the scheduler's one offloader, the worker's too
    total = alloc.available_size()

    turn = list(range(3000, 3040))  # a conversation's turn, decoded from its host copy
    req = SimpleNamespace(rid="t", full_untruncated_fill_ids=turn, origin_input_ids=turn[:30],
                          extra_key=None, cache_salt=None, priority=None,
                          kv=ReqKvInfo(req_pool_idx=1, cache_protected_len=0, kv_allocated_len=40),
                          lock=tree.lock(tree.root_node), last_node=tree.root_node,
                          finished=lambda: True, sampling_params=SimpleNamespace(max_new_tokens=16),
                          output_ids=[])  # fmt: skip
    _fill_row(rows, alloc, 1, 40)
    before = _full_kv(worker, 1, 40)
    worker.offload(1, 0, committed=40, compressed_bytes=0, req=req)
    tree.evict(EvictParams(num_tokens=SLOTS))  # pressure took the slots the tree adopted
    older = list(range(5000, 5064))
    tree.insert(InsertParams(key=RadixKey(older), value=alloc.alloc(64)))  # another session
    hog = alloc.alloc(alloc.available_size())  # running requests hold every free slot
    assert link.tier_up and alloc.available_size() == 0

    tree.checkpoint(req, up_to=40)  # release_kv_cache's calls, in its order
    tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, 40)])
    tree.unlock(req.lock)
    tree.on_release(req, checkpointed=True)

    assert tree.restore_failures == 0
    assert _tree_slots(tree, turn).numel() == 40  # the next turn is a device hit
    assert _tree_slots(tree, older).numel() == 0  # the older session's node made room
    for a, b in zip(before, _full_kv_at(kv, _tree_slots(tree, turn))):
        assert torch.equal(a, b)  # exactly the turn's KV
    assert _accounted(tree, alloc) + hog.numel() == total
    alloc.free(hog)
    tree.evict(EvictParams(num_tokens=SLOTS))
    assert alloc.available_size() == total
    requests = tree.requests  # the release closed the turn's record: nothing held for it
    requests.check_integrity()
    assert set(requests.entry_counts().values()) == {0}, requests.entry_counts()
    link.close()


def _full_kv_at(kv, slots: torch.Tensor) -> list[torch.Tensor]:
    """Per layer [2, H_kv, n, D]: keys and values of pool ``slots``, as ``_full_kv`` reads."""
    idx = slots.to(torch.int64)
    return [torch.stack([kv.get_key_buffer(layer)[idx].transpose(0, 1),
                         kv.get_value_buffer(layer)[idx].transpose(0, 1)])
            for layer in range(LAYERS)]  # fmt: skip
