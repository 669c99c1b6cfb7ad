"""begin/finish write and fetch, resident full KV, splits and tier loss while in flight."""

from __future__ import annotations

import pytest

from sglang_vericache.cache import FullState, Residency


def test_write_through_locks_until_acked(h):
    r = h.insert(list(range(6)))
    node = r.last_node
    h.tree.begin_write("w1", r.to_write)
    assert node.full_state is FullState.WRITING and node.writing == "w1"
    assert h.tree.protected_size() == 6 and h.tree.evict_local(6).num_slots == 0
    assert h.tree.match(list(range(6))).full_len == 0  # not fetchable until STORED
    h.check()
    assert h.tree.finish_write("w1", True) == (node,)
    assert node.full_state is FullState.STORED and node.writing is None
    assert h.tree.evictable_size() == 6 and h.tree.match(list(range(6))).full_len == 6
    h.check()


def test_failed_write_returns_to_none_and_can_retry(h):
    r = h.insert(list(range(3)))
    h.tree.begin_write(1, r.to_write)
    h.tree.finish_write(1, False)
    assert r.last_node.full_state is FullState.NONE
    assert h.insert(list(range(3))).to_write == (r.last_node,)
    h.tree.begin_write(2, [r.last_node])
    h.tree.finish_write(2, True)
    assert r.last_node.full_state is FullState.STORED
    h.check()


def test_write_errors(h):
    r = h.insert(list(range(4)))
    other = h.insert([7, 7]).last_node
    with pytest.raises(ValueError, match="at least one"):
        h.tree.begin_write(1, [])
    with pytest.raises(ValueError, match="one path"):
        h.tree.begin_write(1, [r.last_node, other])
    h.tree.begin_write(1, [r.last_node])
    with pytest.raises(ValueError, match="already in flight"):
        h.tree.begin_write(1, [other])
    with pytest.raises(ValueError, match="NONE"):
        h.tree.begin_write(2, [r.last_node])
    h.tree.finish_write(1, True)
    with pytest.raises(ValueError, match="not in flight"):
        h.tree.finish_write(1, True)
    with pytest.raises(ValueError, match="root"):
        h.tree.begin_write(3, [h.tree.root])
    no_keys = h.insert([5, 5], full=False).last_node
    with pytest.raises(ValueError, match="NONE"):
        h.tree.begin_write(3, [no_keys])
    h.check()


def test_write_may_skip_stored_nodes_on_the_path(h):
    a = h.insert(list(range(2))).last_node
    r = h.insert(list(range(4)))
    b = r.last_node
    assert r.to_write == (a, b)
    h.tree.begin_write(1, [b])  # only b is written (a's write is left for later)
    h.tree.finish_write(1, True)
    r = h.insert(list(range(6)))
    c = r.last_node
    assert r.to_write == (a, c)  # b, in between, is already STORED
    with pytest.raises(ValueError, match="one path"):
        h.tree.begin_write(9, [c, a])
    h.tree.begin_write(9, r.to_write)
    assert a.writing == c.writing == 9 and b.writing is None
    h.check()
    h.tree.finish_write(9, True)
    assert all(n.full_state is FullState.STORED for n in (a, b, c))
    h.check()


def test_split_during_write_covers_both_halves(h):
    r = h.insert(list(range(8)))
    h.tree.begin_write("w", r.to_write)
    h.insert(list(range(4)) + [9])  # splits the node being written
    head = r.last_node.parent
    assert head.writing == "w" and head.full_state is FullState.WRITING
    assert head.lock_ref == 2  # its own write hold + the tail's
    h.check()
    assert h.tree.finish_write("w", True) == (head, r.last_node)
    assert head.full_state is r.last_node.full_state is FullState.STORED
    assert head.lock_ref == 0
    h.check()


def test_evict_full_during_write(harness):
    h = harness(page_size=2)
    toks = list(range(8))
    r = h.insert(toks)
    h.tree.begin_write("w", r.to_write)
    h.tree.evict_full([h.keys(toks)[3]])  # the tier dropped a page while writing
    h.check()
    nodes = h.tree.finish_write("w", True)
    assert [n.full_state for n in nodes] == [FullState.STORED, FullState.NONE]
    assert nodes[1].full is None
    assert h.tree.match(toks).full_len == 6
    h.check()


def test_fetch_makes_full_kv_resident(h):
    toks = list(range(5))
    r = h.insert_stored(toks)
    h.evict(5)
    m = h.tree.match(toks)
    t = h.begin_fetch(m.path)
    assert r.last_node.fetching == (t,) and Residency.FETCHING in r.last_node.residency
    assert not h.tree.path_resident(r.last_node)
    assert h.tree.fetch_len(t) == 5
    res = h.finish_fetch(t)
    assert res.ok and res.nodes == (r.last_node,) and res.duplicates == ()
    assert h.tree.path_resident(r.last_node) and h.tree.resident_size() == 5
    assert r.last_node.lock_ref == 0
    h.release([r.last_node])
    assert h.tree.resident_size() == 0 and r.last_node.residency == Residency.REMOTE


def test_fetch_errors_and_exactly_once(h):
    r = h.insert(list(range(3)))
    with pytest.raises(ValueError, match="STORED"):
        h.tree.begin_fetch(1, [r.last_node])
    h.insert_stored(list(range(3)))
    h.tree.begin_fetch(1, [r.last_node])
    with pytest.raises(ValueError, match="already in flight"):
        h.tree.begin_fetch(1, [r.last_node])
    with pytest.raises(ValueError, match="slots for"):
        h.tree.finish_fetch(1, [1, 2])
    h.check()  # the wrong-size finish changed nothing
    h.tree.finish_fetch(1, None)
    with pytest.raises(ValueError, match="not in flight"):
        h.tree.finish_fetch(1, None)
    assert r.last_node.resident is None and r.last_node.lock_ref == 0
    h.check()


def test_concurrent_fetches_on_one_node(h):
    toks = list(range(6))
    r = h.insert_stored(toks)
    h.evict(6)
    t1 = h.begin_fetch([r.last_node])
    t2 = h.begin_fetch([r.last_node])
    assert r.last_node.fetching == (t1, t2) and r.last_node.lock_ref == 2
    res2 = h.finish_fetch(t2)  # completions may arrive out of order
    assert res2.ok and r.last_node.lock_ref == 1
    first = r.last_node.resident
    res1 = h.finish_fetch(t1)
    assert len(res1.duplicates) == 6 and r.last_node.resident == first  # freed by harness
    assert r.last_node.fetching == () and r.last_node.lock_ref == 0
    h.check()


def test_concurrent_fetch_one_fails(h):
    toks = list(range(4))
    r = h.insert_stored(toks)
    h.evict(4)
    t1, t2 = h.begin_fetch([r.last_node]), h.begin_fetch([r.last_node])
    assert not h.finish_fetch(t1, ok=False).ok
    assert r.last_node.resident is None and r.last_node.lock_ref == 1
    assert h.finish_fetch(t2).ok and r.last_node.resident is not None
    h.check()


def test_split_during_fetch_distributes_slots(harness):
    h = harness(page_size=2)
    toks = list(range(8))
    r = h.insert_stored(toks)
    h.evict(100)
    t = h.begin_fetch([r.last_node])
    h.insert(toks[:4] + [50, 51])  # split the node being fetched
    head = r.last_node.parent
    assert head.fetching == (t,) and h.tree.fetch_len(t) == 8
    h.check()
    slots = h.device.alloc(8)
    res = h.tree.finish_fetch(t, slots)
    assert res.nodes == (head, r.last_node)
    assert head.resident == slots[:4] and r.last_node.resident == slots[4:]
    h.check()
    h.release(res.nodes)


def test_fetch_failure_then_tier_loss_removes_remote_only_node(h):
    toks = list(range(4))
    r = h.insert_stored(toks)
    h.evict(4)
    t = h.begin_fetch([r.last_node])
    h.tree.evict_full(h.keys(toks))  # tier says: gone (e.g. corrupt chunk)
    assert r.last_node.parent is h.tree.root  # held by the fetch
    h.check()
    res = h.finish_fetch(t, ok=False)
    assert not res.ok and h.tree.root.children == {}
    h.check()


def test_resident_node_survives_tier_loss_until_released(h):
    toks = list(range(4))
    r = h.insert_stored(toks)
    h.evict(4)
    h.finish_fetch(h.begin_fetch([r.last_node]))
    h.tree.evict_full(h.keys(toks))
    assert r.last_node.residency == Residency.RESIDENT and r.last_node.has_kv
    h.check()
    h.release([r.last_node])
    assert h.tree.root.children == {}
    h.check()


def test_release_resident_skips_non_resident(h):
    r = h.insert_stored(list(range(3)))
    assert h.tree.release_resident([r.last_node, h.tree.root]) == ()
    assert h.tree.path_resident(h.tree.root)
    h.check()
