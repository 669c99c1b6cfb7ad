"""State of the tiered radix tree and the primitive mutations that keep it consistent.

Every change to a node's compressed pages, tier handle, resident slots, lock count,
children or parent goes through one of these primitives, which update the derived
bookkeeping in the same step:

    _evictable_slots / _protected_slots   local compressed slots by lock state
    _resident_slots                       transient device slots of resident full KV
    _local_leaves                         eviction candidates (unlocked, compressed,
                                          no child with compressed pages)
    _by_tier_key                          tier key -> node holding it (for ``evict_full``)

Public operations (``tree.py``, ``transfers.py``) are compositions of these primitives.
"""

from __future__ import annotations

import itertools

from sglang_vericache.cache.node import (
    FullKV,
    Namespace,
    PageSlots,
    TaskId,
    TierKey,
    TieredNode,
)


class TreeCore:
    """Holds the tree's state; not used directly (see ``TieredRadixTree``)."""

    def __init__(self, page_size: int = 1) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = page_size
        self._clear()

    def _clear(self) -> None:
        self._node_ids = itertools.count(1)
        self._lock_ids = itertools.count(1)
        self.root = TieredNode(node_id=0, namespace=None, tokens=(), parent=None)
        self._clock = 0
        self._evictable_slots = 0
        self._protected_slots = 0
        self._resident_slots = 0
        self._local_leaves: set[TieredNode] = set()
        self._by_tier_key: dict[TierKey, TieredNode] = {}
        self._locks: dict[int, TieredNode] = {}
        self._writes: dict[TaskId, list[TieredNode]] = {}
        self._fetches: dict[TaskId, list[TieredNode]] = {}

    # ------------------------------------------------------------------ clock / shape
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch_path(self, node: TieredNode, tick: int) -> None:
        """Set last_access = tick from ``node`` up (ancestors never older than children)."""
        n: TieredNode | None = node
        while n is not None and not n.is_root:
            n.last_access = tick
            n = n.parent

    def _is_attached(self, node: TieredNode) -> bool:
        if node.is_root:
            return node is self.root
        parent = node.parent
        return parent is not None and parent.children.get(node.child_key(self.page_size)) is node

    @staticmethod
    def _is_proper_ancestor(a: TieredNode, b: TieredNode) -> bool:
        n = b.parent
        while n is not None:
            if n is a:
                return True
            n = n.parent
        return False

    def _require_attached(self, node: TieredNode) -> None:
        if not self._is_attached(node):
            raise ValueError(f"{node!r} is not in this tree (removed, or another tree's)")

    def _new_node(
        self, parent: TieredNode, tokens: tuple[int, ...], namespace: Namespace
    ) -> TieredNode:
        """Attach an empty unlocked leaf (the caller gives it KV in the same operation)."""
        node = TieredNode(next(self._node_ids), namespace, tokens, parent)
        node.last_access = self._clock
        parent.children[node.child_key(self.page_size)] = node
        self._refresh_leaf(parent)
        return node

    def _split(self, node: TieredNode, k: int) -> TieredNode:
        """Split ``node`` after ``k`` tokens (page-aligned, 0 < k < len). Returns the new
        parent holding the head; ``node`` keeps the tail and its children, locks and pins.

        Per-node payloads are cut at the same point (pages for compressed/full, tokens for
        resident). In-flight tasks covering ``node`` now cover the head too, and each takes
        a hold on it, so every task still holds every node it covers.
        """
        ps = self.page_size
        assert node.parent is not None and 0 < k < len(node.tokens) and k % ps == 0
        kp = k // ps
        parent = node.parent
        head = TieredNode(next(self._node_ids), node.namespace, node.tokens[:k], parent)
        head.last_access = node.last_access
        if node.compressed is not None:
            head.compressed, node.compressed = node.compressed[:kp], node.compressed[kp:]
        if node.full is not None:
            head.full = FullKV(node.full.keys[:kp], node.full.state)
            node.full = FullKV(node.full.keys[kp:], node.full.state)
            for key in head.full.keys:
                self._by_tier_key[key] = head
        if node.resident is not None:
            head.resident, node.resident = node.resident[:k], node.resident[k:]
        head.writing, head.fetching = node.writing, node.fetching
        for task in [node.writing] if node.writing is not None else []:
            nodes = self._writes[task]
            nodes.insert(nodes.index(node), head)
        for task in node.fetching:
            nodes = self._fetches[task]
            nodes.insert(nodes.index(node), head)
        holds = (node.writing is not None) + len(node.fetching)
        head.lock_ref = node.lock_ref + holds
        node.tokens = node.tokens[k:]
        parent.children[head.child_key(ps)] = head  # same key: the first page is unchanged
        head.children[node.child_key(ps)] = node
        node.parent = head
        # Slot totals are unchanged: head and node are both locked or both unlocked (a task
        # hold implies node.lock_ref > 0). The ancestors gain the head's task holds.
        if holds:
            self._add_ref(parent, holds)
        self._refresh_leaf(head)
        self._refresh_leaf(node)
        return head

    def _detach(self, node: TieredNode) -> None:
        """Remove an unlocked, KV-less leaf."""
        assert not node.children and node.lock_ref == 0 and not node.has_kv
        parent = node.parent
        assert parent is not None
        del parent.children[node.child_key(self.page_size)]
        if node.full is not None:
            self._set_full(node, None)
        node.parent = None
        self._local_leaves.discard(node)
        self._refresh_leaf(parent)

    def _prune_upward(self, node: TieredNode) -> None:
        """Remove ``node`` and then its ancestors while each is an unlocked KV-less leaf."""
        n: TieredNode | None = node
        while (
            n is not None
            and not n.is_root
            and self._is_attached(n)
            and not n.children
            and n.lock_ref == 0
            and not n.has_kv
        ):
            parent = n.parent
            self._detach(n)
            n = parent

    # ------------------------------------------------------------------ payloads
    def _set_compressed(self, node: TieredNode, pages: tuple[PageSlots, ...] | None) -> None:
        delta = -node.num_slots
        node.compressed = pages
        delta += node.num_slots
        if node.lock_ref > 0:
            self._protected_slots += delta
        else:
            self._evictable_slots += delta
        self._refresh_leaf(node)
        if node.parent is not None:
            self._refresh_leaf(node.parent)

    def _set_full(self, node: TieredNode, full: FullKV | None) -> None:
        if node.full is not None:
            for key in node.full.keys:
                del self._by_tier_key[key]
        node.full = full
        if full is not None:
            for key in full.keys:
                self._by_tier_key[key] = node

    def _set_resident(self, node: TieredNode, slots: tuple[int, ...] | None) -> None:
        self._resident_slots -= len(node.resident) if node.resident is not None else 0
        node.resident = slots
        self._resident_slots += len(slots) if slots is not None else 0

    # ------------------------------------------------------------------ locks
    def _add_ref(self, node: TieredNode, delta: int) -> None:
        """Add ``delta`` holds to ``node``'s path (node up to the root); move the slots of
        nodes that change lock state between evictable and protected."""
        n: TieredNode | None = node
        while n is not None:
            before = n.lock_ref
            n.lock_ref += delta
            if n.lock_ref < 0:
                raise RuntimeError(f"lock_ref below zero on {n!r}")
            if (before == 0) != (n.lock_ref == 0):
                slots = n.num_slots
                if before == 0:
                    self._evictable_slots -= slots
                    self._protected_slots += slots
                else:
                    self._protected_slots -= slots
                    self._evictable_slots += slots
                self._refresh_leaf(n)
            n = n.parent

    def _refresh_leaf(self, node: TieredNode) -> None:
        if node.is_root:
            return
        is_leaf = (
            node.compressed is not None
            and node.lock_ref == 0
            and not any(c.compressed is not None for c in node.children.values())
        )
        if is_leaf:
            self._local_leaves.add(node)
        else:
            self._local_leaves.discard(node)
