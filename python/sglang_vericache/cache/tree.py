"""Tiered radix tree: page-aligned token spans -> compressed local KV + full KV in a tier.

Pure bookkeeping over opaque handles (no torch, no I/O): the caller owns the pools and the
tier client and tells the tree what it allocated, wrote, fetched or lost. Every decision is
a deterministic function of the call sequence (logical clock, node ids as tie-breakers), so
TP ranks fed the same (all-reduced) sequence keep identical trees.

Structure invariants (all checked by ``check_integrity``):
- compressed KV is prefix-closed: a node with compressed pages has a parent with them (or
  the root), so the compressed hit of a match is contiguous and eviction goes leaf-up;
- every hold (user lock, write task, fetch task) locks its node's whole path to the root;
- evictable + protected == local slots the tree holds (SGLang's idle check adds ``free``).

Transfers (write-through, fetch, resident full KV) live in ``transfers.py``; this file has
the tree shape, matching, insertion, locking and eviction.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Iterator, Sequence

from sglang_vericache.cache.integrity import check_tree_integrity
from sglang_vericache.cache.node import (
    FullKV,
    FullState,
    Namespace,
    PageSlots,
    TierKey,
    TieredNode,
)
from sglang_vericache.cache.results import EvictResult, InsertResult, Match, Released, TreeLock
from sglang_vericache.cache.transfers import TransferOps


def _common_len(a: tuple[int, ...], b: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]``."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class TieredRadixTree(TransferOps):
    """Radix tree over token ids whose nodes hold compressed local KV and full tier KV.

    page_size: tokens per page (>= 1); every node's span is a whole number of pages.
    Queries (``match``, ``*_size``, ``compressed_prefix``, ``full_prefix_keys``) never
    mutate; every other public method says what it mutates.
    """

    # ------------------------------------------------------------------ queries
    def evictable_size(self) -> int:
        """Local compressed slots held by unlocked nodes (reclaimable by ``evict_local``)."""
        return self._evictable_slots

    def protected_size(self) -> int:
        """Local compressed slots held by locked nodes (a lock, write or fetch on the path)."""
        return self._protected_slots

    def resident_size(self) -> int:
        """Transient device slots holding resident full KV (see ``release_resident``)."""
        return self._resident_slots

    def can_evict(self, num_slots: int) -> bool:
        """Whether ``evict_local(num_slots)`` would free at least ``num_slots`` slots."""
        return num_slots <= self._evictable_slots

    def nodes(self) -> Iterator[TieredNode]:
        """All nodes except the root, parents before children (deterministic order)."""
        stack = list(reversed(list(self.root.children.values())))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(list(node.children.values())))

    def local_slots(self) -> list[int]:
        """Every local compressed slot id the tree holds (O(tree); for accounting checks)."""
        return [s for n in self.nodes() if n.compressed for page in n.compressed for s in page]

    def match(self, tokens: Sequence[int], *, namespace: Namespace = None) -> Match:
        """Longest cached prefix of ``tokens`` (only whole pages count). Read-only: no split,
        no LRU touch (``lock`` touches what the caller decides to use)."""
        ps = self.page_size
        query = tuple(tokens[: len(tokens) - len(tokens) % ps])
        node, pos = self.root, 0
        comp_len = full_len = 0
        comp_node = full_node = self.root
        comp_alive = full_alive = True
        path: list[TieredNode] = []
        while pos < len(query):
            child = node.children.get((namespace, query[pos : pos + ps]))
            if child is None:
                break
            k = _common_len(child.tokens, query, pos)
            k -= k % ps
            comp_alive = comp_alive and child.compressed is not None
            full_alive = full_alive and child.full_state is FullState.STORED
            if not (comp_alive or full_alive):
                break
            path.append(child)
            if comp_alive:
                comp_len, comp_node = pos + k, child
            if full_alive:
                full_len, full_node = pos + k, child
            pos += k
            if k < len(child.tokens):
                break
            node = child
        return Match(comp_len, full_len, comp_node, full_node, tuple(path))

    def compressed_prefix(self, match: Match) -> list[PageSlots]:
        """Compressed pages of the first ``match.compressed_len`` tokens, one per page."""
        pages: list[PageSlots] = []
        for node, n_pages in self._prefix_nodes(match, match.compressed_len):
            assert node.compressed is not None
            pages.extend(node.compressed[:n_pages])
        return pages

    def full_prefix_keys(self, match: Match) -> list[TierKey]:
        """Tier keys of the first ``match.full_len`` tokens, one per page."""
        keys: list[TierKey] = []
        for node, n_pages in self._prefix_nodes(match, match.full_len):
            assert node.full is not None
            keys.extend(node.full.keys[:n_pages])
        return keys

    def _prefix_nodes(self, match: Match, length: int) -> list[tuple[TieredNode, int]]:
        """(node, pages of it inside the first ``length`` tokens) along ``match.path``."""
        out = []
        pages_left = length // self.page_size
        for node in match.path:
            if pages_left <= 0:
                break
            n_pages = min(pages_left, len(node.tokens) // self.page_size)
            out.append((node, n_pages))
            pages_left -= n_pages
        return out

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        tokens: Sequence[int],
        compressed: Sequence[PageSlots] | None,
        full: Sequence[TierKey] | None,
        *,
        full_state: FullState = FullState.NONE,
        namespace: Namespace = None,
    ) -> InsertResult:
        """Cache ``tokens`` (page-aligned) with one compressed page and/or one tier key per page.

        Mutates: splits the node where the tokens diverge mid-node; creates nodes for the
        uncached tail; nodes on the path without compressed KV adopt the caller's pages;
        nodes without a tier handle (and no write in flight) adopt the caller's keys in
        ``full_state``; a NONE handle is promoted when ``full_state`` is STORED; touches the
        path (LRU). Existing compressed pages and tier handles are never replaced.

        full_state: NONE (the caller will write the full KV: see ``InsertResult.to_write``)
            or STORED (already in the tier, e.g. written by another server). Inserting without
            compressed pages requires STORED, so that no node is created without KV.
        Raises ValueError (tree unchanged) on misaligned tokens, wrong handle counts, or a
        tier key already cached at another position.
        """
        ps = self.page_size
        tokens = tuple(tokens)
        if len(tokens) % ps:
            raise ValueError(f"insert needs page-aligned tokens: {len(tokens)} % {ps} != 0")
        num_pages = len(tokens) // ps
        for name, handles in (("compressed", compressed), ("full", full)):
            if handles is not None and len(handles) != num_pages:
                raise ValueError(f"{name}: {len(handles)} handles for {num_pages} pages")
        if full_state is FullState.WRITING:
            raise ValueError("insert cannot start a write: insert NONE, then begin_write")
        if compressed is None and (full is None or full_state is not FullState.STORED):
            raise ValueError("inserting without compressed pages requires STORED tier keys")
        comp = None if compressed is None else tuple(tuple(p) for p in compressed)
        keys = None if full is None else tuple(full)
        if keys is not None:
            self._check_new_keys(tokens, keys, namespace)

        tick = self._tick()
        node, pos = self.root, 0
        prefix_len, duplicates, to_write = 0, [], []
        while pos < len(tokens):
            child = node.children.get((namespace, tokens[pos : pos + ps]))
            if child is None:
                child = self._new_node(node, tokens[pos:], namespace)
                k = len(child.tokens)
            else:
                k = _common_len(child.tokens, tokens, pos)
                k -= k % ps
                if k < len(child.tokens):
                    child = self._split(child, k)
            p0, p1 = pos // ps, (pos + k) // ps
            if child.compressed is not None:
                prefix_len = pos + k
                if comp is not None:
                    duplicates += [p for p, t in zip(comp[p0:p1], child.compressed) if p != t]
            elif comp is not None:
                self._set_compressed(child, comp[p0:p1])
            if keys is not None and child.writing is None:  # a write in flight owns the handle
                if child.full is None:
                    self._set_full(child, FullKV(keys[p0:p1], full_state))
                elif child.full.state is FullState.NONE and full_state is FullState.STORED:
                    child.full = FullKV(child.full.keys, FullState.STORED)
                if child.full_state is FullState.NONE:
                    to_write.append(child)
            child.last_access = tick
            node, pos = child, pos + k
        self._touch_path(node, tick)
        return InsertResult(prefix_len, tuple(duplicates), node, tuple(to_write))

    def _check_new_keys(
        self, tokens: tuple[int, ...], keys: tuple[TierKey, ...], namespace: Namespace
    ) -> None:
        """A key may already be cached only at the same page of the same token path."""
        if len(set(keys)) != len(keys):
            raise ValueError("tier keys repeat within one insert")
        ps = self.page_size
        known = {i: k for i, k in enumerate(keys) if k in self._by_tier_key}
        if not known:
            return
        where: dict[int, TierKey] = {}  # page index on our path -> key the tree holds there
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get((namespace, tokens[pos : pos + ps]))
            if child is None:
                break
            k = _common_len(child.tokens, tokens, pos) // ps * ps
            if child.full is not None:
                for j in range(k // ps):
                    where[pos // ps + j] = child.full.keys[j]
            if k < len(child.tokens):
                break
            node, pos = child, pos + k
        for i, key in known.items():
            if where.get(i) != key:
                raise ValueError(f"tier key at page {i} is already cached at another position")

    # ------------------------------------------------------------------ locks
    def lock(self, node: TieredNode) -> TreeLock:
        """Protect ``node`` and its ancestors from eviction; touch them (LRU).

        Mutates: lock_ref on the path (slots move evictable -> protected), last_access.
        """
        self._require_attached(node)
        lock_id = next(self._lock_ids)
        self._locks[lock_id] = node
        node.pins += 1
        self._add_ref(node, 1)
        self._touch_path(node, self._tick())
        return TreeLock(lock_id, node)

    def unlock(self, lock: TreeLock) -> None:
        """Release a ``lock`` receipt (exactly once; ValueError on a second release).

        Mutates: lock_ref on the path (slots move protected -> evictable); prunes nodes left
        without any KV that are now unlocked leaves."""
        node = self._locks.get(lock.lock_id)
        if node is None or node is not lock.node:
            raise ValueError(f"lock {lock.lock_id} is not held (released twice?)")
        del self._locks[lock.lock_id]
        node.pins -= 1
        self._add_ref(node, -1)
        self._prune_upward(node)

    def touch(self, node: TieredNode) -> None:
        """Mark ``node`` and its ancestors as used now (LRU). Mutates last_access only."""
        self._require_attached(node)
        self._touch_path(node, self._tick())

    # ------------------------------------------------------------------ eviction
    def evict_local(self, num_slots: int) -> EvictResult:
        """Free at least ``num_slots`` local compressed slots, least recently used first.

        Only unlocked nodes whose children hold no compressed pages are evicted (whole
        nodes). A node whose full KV is STORED (or resident) stays as a remote-only node;
        one left without any KV is removed. ``evict_local(0)`` is always a no-op.
        Mutates: compressed handles, evictable size, tree shape. The caller frees the pages.
        """
        heap = [(n.last_access, n.node_id, n) for n in self._local_leaves]
        heapq.heapify(heap)
        pages: list[PageSlots] = []
        freed = 0
        while freed < num_slots and heap:
            _, _, node = heapq.heappop(heap)
            if node not in self._local_leaves:
                continue
            parent = node.parent
            assert node.compressed is not None and parent is not None
            pages.extend(node.compressed)
            freed += node.num_slots
            self._set_compressed(node, None)
            self._prune_upward(node)
            if parent in self._local_leaves:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return EvictResult(tuple(pages), freed)

    def evict_full(self, keys: Iterable[TierKey]) -> int:
        """Forget tier copies the tier reports as gone (evicted, corrupt, or lost).

        A node losing page j keeps its tier handle for pages < j (the node is split there);
        pages >= j of that node are forgotten too (a chained chunk is useless without its
        predecessors). Unknown keys are ignored. Nodes left without any KV are removed
        once unlocked; a locked one (e.g. mid-fetch) stays until its last hold is released.
        Returns the number of pages whose tier handle was dropped.
        Mutates: full handles, the key index, tree shape.
        """
        dropped = 0
        for key in keys:
            node = self._by_tier_key.get(key)
            if node is None:
                continue
            assert node.full is not None
            page = node.full.keys.index(key)
            if page:
                self._split(node, page * self.page_size)  # ``node`` keeps the tail
            dropped += len(node.full.keys)  # type: ignore[union-attr]
            self._set_full(node, None)
            self._prune_upward(node)
        return dropped

    def reset(self) -> Released:
        """Drop every node (SGLang ``flush_cache``). Requires no locks and no transfers in
        flight (RuntimeError otherwise). Returns the pages and resident slots to free."""
        if self._locks or self._writes or self._fetches:
            raise RuntimeError("reset with locks or transfers in flight")
        pages = tuple(p for n in self.nodes() if n.compressed for p in n.compressed)
        resident = tuple(s for n in self.nodes() if n.resident for s in n.resident)
        self._clear()
        return Released(pages, resident)

    def check_integrity(self) -> None:
        """Recompute every invariant from scratch; raise ``IntegrityError`` on the first
        violation. O(tree); tests call it after every operation."""
        check_tree_integrity(self)

    def dump(self) -> str:
        """Indented one-line-per-node listing (SGLang ``pretty_print``)."""
        lines = [repr(self.root)]
        stack = [(c, 1) for c in reversed(list(self.root.children.values()))]
        while stack:
            node, depth = stack.pop()
            lines.append("  " * depth + repr(node))
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        return "\n".join(lines)
