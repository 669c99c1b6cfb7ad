"""match / insert / split: lengths, payload splitting, duplicates, adoption, errors."""

from __future__ import annotations

import pytest

from sglang_vericache.cache import FullState, Residency, TieredRadixTree


def test_empty_tree_matches_nothing(h):
    m = h.tree.match([1, 2, 3])
    assert (m.compressed_len, m.full_len, m.path) == (0, 0, ())
    assert m.compressed_node is h.tree.root and m.full_node is h.tree.root
    h.check()


def test_insert_then_match_full_and_partial(h):
    r = h.insert(list(range(10)))
    assert r.prefix_len == 0 and r.duplicates == ()
    assert r.to_write == (r.last_node,) and len(r.last_node.tokens) == 10
    m = h.tree.match(list(range(10)) + [99])
    assert m.compressed_len == 10 and m.full_len == 0  # full not written yet
    m = h.tree.match([0, 1, 2, 7])
    assert m.compressed_len == 3 and m.compressed_node is r.last_node
    assert h.tree.compressed_prefix(m) == list(r.last_node.compressed[:3])
    assert m.compressed_path == (r.last_node,) and m.full_path == () and m.hit_len == 3


def test_match_paths_when_compressed_and_full_differ(h):
    a = list(range(4))
    h.insert_stored(a)  # [0..3]: compressed + STORED
    h.insert(a + [4, 5])  # [4, 5]: compressed only
    m = h.tree.match(a + [4, 5])
    (n1, n2) = m.path
    assert (m.compressed_len, m.full_len) == (6, 4)
    assert m.compressed_path == (n1, n2) and m.full_path == (n1,)
    assert h.tree.full_prefix_keys(m) == h.keys(a)
    h.evict(100)  # n2 (no tier copy) is removed, n1 becomes remote-only
    m = h.tree.match(a + [4, 5])
    assert (m.compressed_len, m.full_len) == (0, 4)
    assert m.compressed_path == () and m.full_path == (n1,) and m.hit_len == 4


def test_match_is_read_only(h):
    r = h.insert_stored(list(range(8)))
    before = (h.tree.dump(), r.last_node.last_access, h.tree._clock)
    h.tree.match(list(range(4)) + [50, 51])  # partial match inside the node: no split
    assert (h.tree.dump(), r.last_node.last_access, h.tree._clock) == before


def test_split_on_partial_insert_splits_every_payload(harness):
    h = harness(page_size=2)
    a = list(range(12))
    h.insert_stored(a)
    t = h.begin_fetch([h.tree.match(a).path[-1]])
    h.finish_fetch(t)
    node = h.tree.match(a).path[-1]
    comp, keys, res = node.compressed, node.full.keys, node.resident
    b = a[:6] + [100, 101]
    r = h.insert(b)
    head = h.tree.match(b).path[0]
    assert head.tokens == tuple(a[:6]) and node.tokens == tuple(a[6:])
    assert head.compressed == comp[:3] and node.compressed == comp[3:]
    assert head.full.keys == keys[:3] and node.full.keys == keys[3:]
    assert head.full.state is node.full.state is FullState.STORED
    assert head.resident == res[:6] and node.resident == res[6:]
    assert node.parent is head and r.last_node.parent is head
    assert r.prefix_len == 6 and r.duplicates == ()
    assert r.to_write == (r.last_node,)  # only the new tail needs a write
    assert h.tree.match(b).full_len == 6


def test_unaligned_tokens(harness):
    h = harness(page_size=4)
    with pytest.raises(ValueError, match="page-aligned"):
        h.tree.insert([1, 2, 3], [(1,)], None)
    h.insert_stored(list(range(8)))
    m = h.tree.match(list(range(7)))  # only the first whole page counts
    assert m.compressed_len == 4 and m.full_len == 4
    assert h.tree.match([0, 1, 2]).compressed_len == 0


def test_namespaces_do_not_share(h):
    h.insert(list(range(6)), ns="lora-a")
    assert h.tree.match(list(range(6))).compressed_len == 0
    assert h.tree.match(list(range(6)), namespace="lora-b").compressed_len == 0
    assert h.tree.match(list(range(6)), namespace="lora-a").compressed_len == 6
    h.insert(list(range(6)), ns="lora-b")
    assert len(h.tree.root.children) == 2


def test_duplicates_are_only_differing_caller_pages(h):
    h.insert(list(range(5)))
    mine = h.new_pages(7)
    r = h.tree.insert(list(range(7)), mine, None)
    assert r.prefix_len == 5 and r.duplicates == tuple(mine[:5])
    h.pool.free(s for p in r.duplicates for s in p)
    h.check()
    m = h.tree.match(list(range(7)))
    assert h.tree.compressed_prefix(m)[5:] == mine[5:]


def test_identical_pages_are_not_duplicates(h):
    r1 = h.insert(list(range(5)))
    r2 = h.tree.insert(list(range(5)), r1.last_node.compressed, None)
    assert r2.prefix_len == 5 and r2.duplicates == () and r2.to_write == ()  # no keys given
    h.check()


def test_remote_only_insert_and_adoption(h):
    toks = list(range(6))
    with pytest.raises(ValueError, match="STORED"):
        h.tree.insert(toks, None, h.keys(toks))
    r = h.insert(toks, compressed=False, state=FullState.STORED)
    node = r.last_node
    assert node.residency == Residency.REMOTE and h.tree.evictable_size() == 0
    m = h.tree.match(toks)
    assert (m.compressed_len, m.full_len) == (0, 6)
    assert h.tree.full_prefix_keys(m) == h.keys(toks)
    r = h.insert(toks)  # a request recomputed it: the node adopts the compressed pages
    assert r.prefix_len == 0 and r.duplicates == () and r.to_write == ()
    assert node.residency == Residency.COMPRESSED | Residency.REMOTE
    assert h.tree.evictable_size() == 6


def test_none_state_promoted_by_stored_insert(h):
    toks = list(range(4))
    r = h.insert(toks)
    assert r.last_node.full_state is FullState.NONE
    r2 = h.insert(toks, state=FullState.STORED)
    assert r2.last_node is r.last_node and r.last_node.full_state is FullState.STORED
    assert r2.to_write == ()


def test_handle_count_and_state_errors_leave_tree_unchanged(h):
    h.insert(list(range(4)))
    snapshot = h.tree.dump()
    with pytest.raises(ValueError, match="handles"):
        h.tree.insert([1, 2, 3], [(1,)], None)
    with pytest.raises(ValueError, match="handles"):
        h.tree.insert([1, 2], [(1,), (2,)], ["k"])
    with pytest.raises(ValueError, match="begin_write"):
        h.tree.insert([1], [(1,)], ["k"], full_state=FullState.WRITING)
    with pytest.raises(ValueError, match="repeat"):
        h.tree.insert([7, 8], None, ["k", "k"], full_state=FullState.STORED)
    assert h.tree.dump() == snapshot
    h.check()


def test_tier_key_at_another_position_is_rejected(h):
    h.insert(list(range(4)))
    snapshot = h.tree.dump()
    wrong = h.keys(list(range(4)))[2:] + [("x",), ("y",)]
    with pytest.raises(ValueError, match="another position"):
        h.tree.insert([9, 9, 9, 9], None, wrong, full_state=FullState.STORED)
    assert h.tree.dump() == snapshot
    # the same keys at the same positions are fine (re-insert)
    h.tree.insert(list(range(4)), None, h.keys(list(range(4))), full_state=FullState.STORED)
    h.check()


def test_insert_empty_and_insert_without_tier(h):
    r = h.tree.insert([], [], None)
    assert r.last_node is h.tree.root and r.prefix_len == 0
    r = h.insert(list(range(3)), full=False)
    assert r.last_node.full is None and r.to_write == ()
    assert h.tree.match(list(range(3))).full_len == 0


def test_insert_extends_leaf_without_split(h):
    r1 = h.insert(list(range(4)))
    r2 = h.insert(list(range(8)))
    assert r2.last_node.parent is r1.last_node and r2.prefix_len == 4
    assert r2.to_write == (r1.last_node, r2.last_node)


def test_slots_per_page_can_differ_from_page_size(harness):
    h = harness(page_size=4, slots_per_page=1)  # e.g. 4x token dropping
    h.insert(list(range(16)))
    assert h.tree.evictable_size() == 4
    h.insert(list(range(8)) + [50] * 4)
    assert h.tree.evictable_size() == 5


@pytest.mark.parametrize("page_size", [0, -1, 1.5, True])
def test_page_size_validated(page_size):
    with pytest.raises(ValueError):
        TieredRadixTree(page_size)
