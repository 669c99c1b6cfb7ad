"""``check_integrity`` for the tiered radix tree: recompute everything, compare.

Invariants (each violation raises ``IntegrityError`` naming the node):

 shape      parent/child links agree; a child's key is (namespace, first page of its tokens);
            children share their parent's namespace (root children may differ); spans are
            non-empty and page-aligned; node ids unique; no cycles.
 payloads   compressed: one page per page of tokens; full: one key per page; resident: one
            slot per token. No local slot, device slot or tier key appears twice.
 closure    a node with compressed pages has a parent with compressed pages (or the root).
 tier       the key index maps exactly the keys held, to their node; WRITING <=> covered by
            a write task (a node may lose its handle mid-write); every fetch task's nodes list
            it in ``fetching`` and vice versa.
 locks      lock_ref == pins + (write task) + (fetch tasks) + sum(children's lock_ref);
            pins == live ``TreeLock``s at the node; a task's nodes are attached and lie
            on one root-to-leaf path, in order.
 KV         no unlocked leaf without KV (compressed, resident, or a written/writing tier
            copy); KV-less nodes survive only while locked or as interior tombstones.
 sizes      evictable/protected/resident totals equal the recomputed sums.
 LRU        last_access <= clock; a parent is never older than its child; the eviction
            candidate set equals {unlocked, compressed, no compressed child}.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from sglang_vericache.cache.node import FullKV, FullState, TieredNode

if TYPE_CHECKING:
    from sglang_vericache.cache.core import TreeCore


class IntegrityError(AssertionError):
    """A tree invariant does not hold (a bookkeeping bug, never bad user input)."""


def _require(cond: bool, msg: str, node: TieredNode | None = None) -> None:
    if not cond:
        raise IntegrityError(f"{msg}: {node!r}" if node is not None else msg)


def check_tree_integrity(tree: TreeCore) -> None:
    ps = tree.page_size
    root = tree.root
    _require(root.node_id == 0 and root.parent is None and root.tokens == (), "bad root", root)
    _require(root.compressed is None and root.full is None and root.resident is None,
             "root holds KV", root)
    _require(root.writing is None and not root.fetching, "root in a transfer", root)

    pins = Counter(id(n) for n in tree._locks.values())
    seen: dict[int, TieredNode] = {}
    ids: set[int] = set()
    local_slots: set[int] = set()
    device_slots: set[int] = set()
    keys_held: dict[object, TieredNode] = {}
    evictable = protected = resident = 0
    leaves: set[TieredNode] = set()

    stack = [root]
    while stack:
        node = stack.pop()
        _require(id(node) not in seen, "node reached twice (cycle or shared child)", node)
        seen[id(node)] = node
        _require(node.node_id not in ids, "duplicate node id", node)
        ids.add(node.node_id)
        holds = pins[id(node)] + (node.writing is not None) + len(node.fetching)
        _require(node.pins == pins[id(node)], "pins differ from live locks", node)
        _require(node.lock_ref == holds + sum(c.lock_ref for c in node.children.values()),
                 "lock_ref != own holds + children's lock_ref", node)
        _require(node.last_access <= tree._clock, "last_access ahead of the clock", node)
        for key, child in node.children.items():
            _require(child.parent is node, "child's parent link is wrong", child)
            _require(key == child.child_key(ps), "child key != (namespace, first page)", child)
            _require(node.is_root or child.namespace == node.namespace,
                     "namespace differs from parent", child)
            _require(node.is_root or node.last_access >= child.last_access,
                     "parent older than child (LRU)", child)
            stack.append(child)
        if node.is_root:
            continue

        n_tok = len(node.tokens)
        _require(n_tok > 0 and n_tok % ps == 0, "span empty or not page-aligned", node)
        pages = n_tok // ps
        parent = node.parent
        assert parent is not None
        if node.compressed is not None:
            _require(len(node.compressed) == pages, "compressed pages != token pages", node)
            _require(parent.is_root or parent.compressed is not None,
                     "compressed node under a node without compressed KV", node)
            for page in node.compressed:
                _require(isinstance(page, tuple), "a page's slots must be a tuple", node)
                for slot in page:
                    _require(slot not in local_slots, f"local slot {slot} held twice", node)
                    local_slots.add(slot)
            if node.lock_ref > 0:
                protected += node.num_slots
            else:
                evictable += node.num_slots
        if node.full is not None:
            _require(isinstance(node.full, FullKV) and len(node.full.keys) == pages,
                     "tier keys != token pages", node)
            for key in node.full.keys:
                _require(key not in keys_held, f"tier key {key!r} held twice", node)
                keys_held[key] = node
        if node.resident is not None:
            _require(len(node.resident) == n_tok, "resident slots != tokens", node)
            for slot in node.resident:
                _require(slot not in device_slots, f"device slot {slot} held twice", node)
                device_slots.add(slot)
            resident += n_tok
        if node.full_state is FullState.WRITING:
            _require(node.writing is not None, "WRITING without a write task", node)
        if node.writing is not None:
            _require(node.full is None or node.full.state is FullState.WRITING,
                     "in a write task but not WRITING", node)
            _require(node in tree._writes.get(node.writing, ()), "write task lacks node", node)
        _require(len(set(node.fetching)) == len(node.fetching), "fetch task listed twice", node)
        for task in node.fetching:
            _require(node in tree._fetches.get(task, ()), "fetch task lacks node", node)
        _require(node.has_kv or bool(node.children) or node.lock_ref > 0,
                 "unlocked leaf without any KV", node)
        if (node.compressed is not None and node.lock_ref == 0
                and not any(c.compressed is not None for c in node.children.values())):
            leaves.add(node)

    _require(root.lock_ref == root.pins + sum(c.lock_ref for c in root.children.values()),
             "root lock_ref inconsistent", root)
    _require(evictable == tree._evictable_slots,
             f"evictable {tree._evictable_slots} != recomputed {evictable}")
    _require(protected == tree._protected_slots,
             f"protected {tree._protected_slots} != recomputed {protected}")
    _require(resident == tree._resident_slots,
             f"resident {tree._resident_slots} != recomputed {resident}")
    _require(leaves == tree._local_leaves, "eviction candidate set out of date")
    _require(len(keys_held) == len(tree._by_tier_key)
             and all(tree._by_tier_key.get(k) is n for k, n in keys_held.items()),
             "tier key index out of date")
    for lock_node in tree._locks.values():
        _require(id(lock_node) in seen, "a live lock points outside the tree", lock_node)
    for kind, tasks in (("write", tree._writes), ("fetch", tree._fetches)):
        for task, nodes in tasks.items():
            _require(bool(nodes), f"{kind} task {task!r} covers nothing")
            for a, b in zip(nodes, nodes[1:]):
                _require(tree._is_proper_ancestor(a, b),
                         f"{kind} task {task!r} is not ordered along one path", b)
            for node in nodes:
                _require(id(node) in seen, f"{kind} task {task!r} covers a removed node", node)
                covered = node.writing == task if kind == "write" else task in node.fetching
                _require(covered, f"node does not list {kind} task {task!r}", node)
