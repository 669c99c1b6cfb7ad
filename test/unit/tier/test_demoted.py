"""DEMOTED prefixes as bookkeeping: longest-prefix lookup, LRU, and the slots they are charged.

``_Pool`` is the ``PoolAccount`` contract in integers: ``free`` slots, plus ``full`` slots of
FULL tree nodes that ``take`` may evict. The same store on SGLang's real allocator and tree is
``test/srt/test_demoted_pool.py``.
"""

from __future__ import annotations

import math

import pytest

from sglang_vericache.tier.demoted import DemotedPrefixes

PAGE = 4


class _State:
    def __init__(self, covered: int, nbytes: int) -> None:
        self.covered, self.nbytes = covered, nbytes


class _Pool:
    """10 bytes per slot, pages of 4; ``take`` evicts FULL slots before it gives up."""

    def __init__(self, free: int, full: int = 0) -> None:
        self.free, self.full, self.evicted_full = free, full, 0

    def slots_for(self, nbytes: int) -> int:
        return max(1, math.ceil(nbytes / 10 / PAGE)) * PAGE

    def take(self, n: int) -> int | None:
        if self.free < n:
            evict = min(self.full, n - self.free)
            self.full -= evict
            self.free += evict
            self.evicted_full += evict
        if self.free < n:
            return None
        self.free -= n
        return n

    def give_back(self, held: int) -> None:
        self.free += held


def test_the_longest_proper_prefix_is_found_and_superseded_turns_go() -> None:
    pool = _Pool(free=1000)
    store = DemotedPrefixes(pool)
    assert store.put([1, 2, 3], _State(3, 30))
    assert store.put([7, 8], _State(2, 30))
    assert store.longest([1, 2, 3, 4]).tokens == (1, 2, 3)
    assert store.longest([1, 2, 3]) is None  # a proper prefix only: one token must remain
    assert store.put([1, 2, 3, 4, 5], _State(5, 30))  # the next turn supersedes [1, 2, 3]
    assert list(store.entries) == [(7, 8), (1, 2, 3, 4, 5)]
    assert store.charged_slots == 8 and pool.free == 1000 - 8  # 30 bytes: one page each
    store.check_integrity()
    with pytest.raises(ValueError, match="covers"):
        store.put([1, 2], _State(3, 1))


def test_an_entry_is_charged_from_free_slots_then_full_nodes_then_older_entries() -> None:
    pool = _Pool(free=8, full=4)
    store = DemotedPrefixes(pool)
    assert store.put([1], _State(1, 40))  # one page, free
    assert store.put([2], _State(1, 40))  # one page, free
    assert pool.free == 0 and pool.evicted_full == 0
    assert store.put([3], _State(1, 40))  # the FULL node is demoted before any entry goes
    assert pool.evicted_full == 4 and list(store.entries) == [(1,), (2,), (3,)]
    store.longest([1, 9])  # touch: (2,) is now the least recently used
    assert store.put([4], _State(1, 80))  # two pages: the two least recent entries go
    assert list(store.entries) == [(1,), (4,)]
    assert store.charged_slots == 12 and pool.free == 0
    store.check_integrity()


def test_an_entry_the_pool_cannot_hold_is_refused_and_nothing_leaks() -> None:
    pool = _Pool(free=4)
    store = DemotedPrefixes(pool, max_bytes=1000)
    assert store.put([1], _State(1, 40))
    assert not store.put([2], _State(1, 200))  # 20 slots: the pool has 4 even emptied
    assert not store.put([3], _State(1, 2000))  # over the byte cap: not even tried
    assert store.refused == 2 and not store.entries and pool.free == 4
    store.check_integrity()


def test_the_byte_cap_drops_the_least_recent_entries_first() -> None:
    store = DemotedPrefixes(_Pool(free=1000), max_bytes=100)
    for token in (1, 2, 3):
        assert store.put([token], _State(1, 40))
    assert list(store.entries) == [(2,), (3,)] and store.nbytes == 80
    store.check_integrity()


def test_evict_frees_least_recent_entries_until_enough_slots_are_back() -> None:
    pool = _Pool(free=100)
    store = DemotedPrefixes(pool)
    for token in (1, 2, 3):
        store.put([token], _State(1, 40))
    assert store.evict(5) == 8  # whole entries: two pages
    assert list(store.entries) == [(3,)] and pool.free == 96
    assert store.evict(100) == 4 and store.evict(1) == 0
    assert pool.free == 100 and store.charged_slots == 0
    store.check_integrity()


def test_clear_forgets_entries_without_giving_slots_back() -> None:
    pool = _Pool(free=100)
    store = DemotedPrefixes(pool)
    store.put([1], _State(1, 40))
    store.clear()  # a cache flush clears the allocator itself: giving back would double-free
    assert not store.entries and store.charged_slots == 0 and pool.free == 96
    store.check_integrity()
