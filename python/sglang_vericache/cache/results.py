"""Small immutable results returned by ``TieredRadixTree`` operations."""

from __future__ import annotations

from typing import NamedTuple

from sglang_vericache.cache.node import PageSlots, TieredNode


class Match(NamedTuple):
    """Read-only prefix match (``TieredRadixTree.match``).

    Both lengths are in tokens, page-aligned and contiguous from the root:

        tokens   |<------------------------ query (page-aligned part) ------------------>|
        tree     [ C+R ][ C+R ][ C   ][ R   ][ R   ]    C = compressed local, R = STORED in tier
        compressed_len  |<------------------>|
        full_len        |<--------->|        (stops at the first page without a STORED copy)
                        |<------ max -------------------->| = path

    compressed_node / full_node: deepest node the respective length reaches (the root when
        the length is 0); it may be matched only partly (the length then ends inside it).
    path: nodes the longer of the two lengths touches, root excluded, root to leaf.
    """

    compressed_len: int
    full_len: int
    compressed_node: TieredNode
    full_node: TieredNode
    path: tuple[TieredNode, ...]

    @property
    def compressed_path(self) -> tuple[TieredNode, ...]:
        """Nodes holding the compressed hit: what drafting reads and ``lock`` protects."""
        return self._path_to(self.compressed_node)

    @property
    def full_path(self) -> tuple[TieredNode, ...]:
        """Nodes holding the full hit, root to leaf: what a verify fetches (``begin_fetch``)."""
        return self._path_to(self.full_node)

    def _path_to(self, node: TieredNode) -> tuple[TieredNode, ...]:
        if node.is_root:
            return ()
        return self.path[: self.path.index(node) + 1]

    @property
    def hit_len(self) -> int:
        """Tokens with some usable copy: drafting needs compressed, verify needs full."""
        return max(self.compressed_len, self.full_len)


class InsertResult(NamedTuple):
    """What ``TieredRadixTree.insert`` kept and what the caller still owns.

    prefix_len: tokens whose compressed KV the tree already held before this insert. The
        caller's compressed pages there were not taken.
    duplicates: the caller's pages in [0, prefix_len) that differ from the tree's: the
        caller frees them (pages identical to the tree's are the tree's own and are skipped).
        Pages in [prefix_len, len) now belong to the tree (new nodes, or adopted by nodes
        that had been evicted locally).
    last_node: node ending exactly at the inserted length (splits make one exist).
    to_write: nodes on the inserted path whose full KV is in state NONE, root to leaf: the
        caller writes them through to the tier (``begin_write``). Empty when the insert
        carried no tier keys.
    """

    prefix_len: int
    duplicates: tuple[PageSlots, ...]
    last_node: TieredNode
    to_write: tuple[TieredNode, ...]


class EvictResult(NamedTuple):
    """Compressed pages freed by ``evict_local``: the caller returns them to its pool.

    num_slots: ``sum(len(p) for p in pages)``; may exceed the request (whole nodes are
        evicted) or fall short (nothing evictable left).
    """

    pages: tuple[PageSlots, ...]
    num_slots: int


class FetchResult(NamedTuple):
    """Outcome of ``finish_fetch``.

    nodes: the nodes the fetch covered, root to leaf (after any splits while in flight).
    ok: the full KV arrived and is now resident on every node that was not already.
    duplicates: device slots the caller gave for nodes that were already resident (filled by
        an earlier concurrent fetch): the caller frees them. On failure, the caller frees all
        of its buffers; ``duplicates`` is empty.
    """

    nodes: tuple[TieredNode, ...]
    ok: bool
    duplicates: tuple[int, ...]


class TreeLock(NamedTuple):
    """Receipt of ``TieredRadixTree.lock``; release it exactly once with ``unlock``."""

    lock_id: int
    node: TieredNode


class Released(NamedTuple):
    """Everything ``TieredRadixTree.reset`` dropped that lives in caller-owned pools."""

    pages: tuple[PageSlots, ...]
    resident: tuple[int, ...]
