"""lock / unlock / touch, evict_local (LRU, leaf-up, remote-only), evict_full, reset."""

from __future__ import annotations

import pytest

from sglang_vericache.cache import FullState, Residency, TreeLock


def test_lock_moves_path_to_protected_and_back(h):
    r1 = h.insert(list(range(4)))
    r2 = h.insert(list(range(4)) + [9, 9])
    assert (h.tree.evictable_size(), h.tree.protected_size()) == (6, 0)
    lk = h.tree.lock(r2.last_node)
    assert (h.tree.evictable_size(), h.tree.protected_size()) == (0, 6)
    assert r1.last_node.lock_ref == 1 and h.tree.root.lock_ref == 1
    h.check()
    lk2 = h.tree.lock(r1.last_node)
    assert r1.last_node.lock_ref == 2
    h.tree.unlock(lk)
    assert (h.tree.evictable_size(), h.tree.protected_size()) == (2, 4)
    h.tree.unlock(lk2)
    assert (h.tree.evictable_size(), h.tree.protected_size()) == (6, 0)
    h.check()


def test_unlock_twice_and_forged_receipts_fail(h):
    r = h.insert(list(range(3)))
    lk = h.tree.lock(r.last_node)
    h.tree.unlock(lk)
    with pytest.raises(ValueError, match="not held"):
        h.tree.unlock(lk)
    lk = h.tree.lock(r.last_node)
    with pytest.raises(ValueError, match="not held"):
        h.tree.unlock(TreeLock(lk.lock_id, h.tree.root))
    h.tree.unlock(lk)
    h.check()


def test_lock_of_removed_node_fails(h):
    r = h.insert(list(range(3)), full=False)
    h.evict(3)  # no tier copy: the node is removed
    assert h.tree.match(list(range(3))).path == ()
    with pytest.raises(ValueError, match="not in this tree"):
        h.tree.lock(r.last_node)
    with pytest.raises(ValueError, match="not in this tree"):
        h.tree.touch(r.last_node)


def test_lock_keeps_protecting_after_split(h):
    r = h.insert(list(range(8)))
    lk = h.tree.lock(r.last_node)
    h.insert(list(range(4)) + [7])  # splits the locked node
    head = r.last_node.parent
    assert head.tokens == (0, 1, 2, 3) and head.lock_ref == 1
    assert h.tree.protected_size() == 8 and h.evict(100) == 1  # only the new leaf
    h.tree.unlock(lk)
    assert h.tree.protected_size() == 0
    h.check()


def test_evict_zero_and_can_evict(h):
    h.insert(list(range(5)))
    assert h.evict(0) == 0 and h.tree.evictable_size() == 5
    assert h.tree.can_evict(5) and not h.tree.can_evict(6)


def test_evict_is_lru_over_leaves(h):
    a, b, c = [1, 1, 1], [2, 2, 2], [3, 3, 3]
    ra, rb, rc = h.insert(a), h.insert(b), h.insert(c)
    h.tree.touch(ra.last_node)  # a is now the most recent
    assert h.evict(1) == 3 and rb.last_node.compressed is None
    assert h.evict(1) == 3 and rc.last_node.compressed is None
    assert ra.last_node.compressed is not None


def test_evict_goes_leaf_up_and_skips_locked(h):
    r1 = h.insert(list(range(4)))
    r2 = h.insert(list(range(4)) + [5, 5])
    r3 = h.insert([9, 9])
    lk = h.tree.lock(r3.last_node)
    freed = h.evict(3)  # the child (2 slots) first, then its parent (4)
    assert freed == 6 and h.tree.match(list(range(4))).path == ()
    assert r3.last_node.compressed is not None and h.tree.evict_local(10).num_slots == 0
    h.tree.unlock(lk)
    assert h.evict(10) == 2
    assert h.tree.evictable_size() == 0 and len(h.tree.root.children) == 0
    h.check()
    del r1, r2


def test_evicted_node_with_stored_full_stays_remote_only(h):
    toks = list(range(6))
    h.insert_stored(toks)
    assert h.evict(6) == 6
    m = h.tree.match(toks)
    assert (m.compressed_len, m.full_len) == (0, 6)
    assert m.full_node.residency == Residency.REMOTE
    assert h.tree.evict_local(1).num_slots == 0  # nothing local left


def test_evict_frees_written_parent_but_keeps_it_as_interior(h):
    h.insert_stored(list(range(4)))
    r = h.insert(list(range(4)) + [8, 8], full=False)
    h.evict(100)
    # the unwritten child is gone; the written parent stays remote-only
    assert r.last_node.parent is None
    assert h.tree.match(list(range(6))).full_len == 4


def test_evict_full_splits_and_forgets_the_tail(harness):
    h = harness(page_size=2)
    toks = list(range(8))
    h.insert_stored(toks)
    keys = h.keys(toks)
    assert h.tree.evict_full([keys[2], ("unknown",)]) == 2
    h.check()
    m = h.tree.match(toks)
    assert (m.compressed_len, m.full_len) == (8, 4)
    assert h.tree.full_prefix_keys(m) == keys[:2]
    assert h.tree.evict_full([keys[2]]) == 0  # already forgotten


def test_evict_full_removes_remote_only_leaves(h):
    toks = list(range(4))
    h.insert_stored(toks)
    h.evict(4)
    assert h.tree.evict_full(h.keys(toks)[:1]) == 4
    assert h.tree.root.children == {}
    h.check()


def test_evict_full_on_locked_remote_node_waits_for_unlock(h):
    toks = list(range(4))
    r = h.insert_stored(toks)
    h.evict(4)
    lk = h.tree.lock(r.last_node)
    h.tree.evict_full(h.keys(toks))
    assert r.last_node.residency == Residency.EMPTY and r.last_node.parent is h.tree.root
    h.check()  # a KV-less node may exist while locked
    h.tree.unlock(lk)
    assert h.tree.root.children == {}
    h.check()


def test_tombstone_is_revived_by_insert(h):
    toks = list(range(8))
    h.insert_stored(toks)
    h.evict(100)  # both halves remote-only (one node)
    h.insert_stored(toks[:4] + [7, 7])  # split: head [0..3] remote, tail [4..7] remote
    h.evict(100)
    h.tree.evict_full(h.keys(toks)[:1])  # the head's tier copy is gone: tombstone
    head = h.tree.root.children[(None, (0,))]
    assert not head.has_kv and head.children
    assert h.tree.match(toks).hit_len == 0  # the tombstone blocks the path
    h.check()
    h.insert(toks)  # a request recomputed the prefix
    m = h.tree.match(toks)
    assert m.compressed_len == 8 and head.has_kv


def test_reset_returns_everything_and_requires_idle(h):
    r = h.insert(list(range(5)))
    lk = h.tree.lock(r.last_node)
    with pytest.raises(RuntimeError):
        h.tree.reset()
    h.tree.unlock(lk)
    released = h.tree.reset()
    h.pool.free(s for p in released.pages for s in p)
    assert h.tree.root.children == {} and h.tree.evictable_size() == 0
    assert released.resident == ()
    h.check()
    h.insert(list(range(5)))  # usable again
    assert h.tree.match(list(range(5))).compressed_len == 5


def test_insert_and_lock_touch_lru(h):
    ra = h.insert([1, 1])
    rb = h.insert([2, 2])
    lk = h.tree.lock(ra.last_node)
    h.tree.unlock(lk)
    assert ra.last_node.last_access > rb.last_node.last_access
    h.evict(1)
    assert rb.last_node.parent is None and ra.last_node.compressed is not None
    assert ra.last_node.full_state is FullState.NONE
