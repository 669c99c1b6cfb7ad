"""Tier transfers as tree bookkeeping: write-through, fetch, and resident full KV.

The tier client does the I/O (submit/poll, caller-owned buffers); the tree only records
what is in flight so that the nodes involved cannot be evicted, and applies each
completion exactly once:

    insert ──> full NONE ──begin_write──> WRITING ──finish_write(ok)──> STORED
                  ^                                      │ (failed)
                  └──────────────────────────────────────┘
    STORED ──begin_fetch──> (fetching) ──finish_fetch(slots)──> resident ──release_resident──>

Every task holds one lock on each node it covers (released by its finish). A task's nodes
lie on one root-to-leaf path, in order (each a descendant of the previous; gaps allowed,
e.g. a STORED node between two NONE ones). A node split while a task is in flight leaves
both halves covered and held. Task ids are the tier client's; write and fetch
ids are separate namespaces.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from sglang_vericache.cache.core import TreeCore
from sglang_vericache.cache.node import FullKV, FullState, TaskId, TieredNode
from sglang_vericache.cache.results import FetchResult


class TransferOps(TreeCore):
    """Write-through and fetch bookkeeping (mixed into ``TieredRadixTree``)."""

    def _check_path(self, nodes: Sequence[TieredNode]) -> None:
        if not nodes:
            raise ValueError("a transfer needs at least one node")
        for node in nodes:
            self._require_attached(node)
            if node.is_root:
                raise ValueError("the root holds no KV to transfer")
        for upper, lower in zip(nodes, nodes[1:]):
            if not self._is_proper_ancestor(upper, lower):
                raise ValueError("transfer nodes must lie on one path, root to leaf")

    # ------------------------------------------------------------------ write-through
    def begin_write(self, task: TaskId, nodes: Sequence[TieredNode]) -> None:
        """Record that the full KV of ``nodes`` (state NONE, on one path) is being written.

        Mutates: state NONE -> WRITING; one hold per node until ``finish_write``.
        Raises ValueError (tree unchanged) on a reused task id or a node not in state NONE.
        """
        nodes = list(nodes)
        if task in self._writes:
            raise ValueError(f"write task {task!r} is already in flight")
        self._check_path(nodes)
        for node in nodes:
            if node.full is None or node.full.state is not FullState.NONE:
                raise ValueError(f"begin_write needs full state NONE, got {node!r}")
        self._writes[task] = nodes
        for node in nodes:
            assert node.full is not None
            node.full = FullKV(node.full.keys, FullState.WRITING)
            node.writing = task
            self._add_ref(node, 1)

    def finish_write(self, task: TaskId, ok: bool) -> tuple[TieredNode, ...]:
        """Apply the tier's acknowledgement of write ``task`` (exactly once).

        ok: WRITING -> STORED; failed: WRITING -> NONE (the caller may retry). Nodes whose
        handle was dropped meanwhile (``evict_full``) stay without one.
        Mutates: states, releases the task's holds, prunes nodes left without KV.
        Returns the nodes the task covered. ValueError for an unknown or finished task.
        """
        nodes = self._writes.pop(task, None)
        if nodes is None:
            raise ValueError(f"write task {task!r} is not in flight (finished twice?)")
        for node in nodes:
            node.writing = None
            if node.full is not None:
                state = FullState.STORED if ok else FullState.NONE
                node.full = FullKV(node.full.keys, state)
            self._add_ref(node, -1)
        for node in reversed(nodes):
            self._prune_upward(node)
        return tuple(nodes)

    # ------------------------------------------------------------------ fetch
    def begin_fetch(self, task: TaskId, nodes: Sequence[TieredNode]) -> None:
        """Record that the full KV of ``nodes`` (STORED, on one path) is being fetched into
        caller-owned device slots. Several fetches may cover one node (concurrent
        requests); see ``fetching`` on the node to join one instead.

        Mutates: appends ``task`` to each node's ``fetching``; one hold per node until
        ``finish_fetch``. Raises ValueError (tree unchanged) on a reused task id or a node
        whose full KV is not STORED.
        """
        nodes = list(nodes)
        if task in self._fetches:
            raise ValueError(f"fetch task {task!r} is already in flight")
        self._check_path(nodes)
        for node in nodes:
            if node.full_state is not FullState.STORED:
                raise ValueError(f"begin_fetch needs full state STORED, got {node!r}")
        self._fetches[task] = nodes
        for node in nodes:
            node.fetching = node.fetching + (task,)
            self._add_ref(node, 1)

    def fetch_len(self, task: TaskId) -> int:
        """Tokens covered by in-flight fetch ``task`` (the size of its slot buffer)."""
        return sum(len(n.tokens) for n in self._fetches[task])

    def finish_fetch(self, task: TaskId, resident: Sequence[int] | None) -> FetchResult:
        """Apply the completion of fetch ``task`` (exactly once).

        resident: the device slots the full KV landed in, one per token, in path order
            over the task's nodes (``fetch_len(task)`` of them); None = the fetch failed
            (miss, corrupt chunk, dead tier): nothing becomes resident, and the caller
            should report the lost keys with ``evict_full`` and recompute.
        Mutates: ``resident`` on nodes that were not resident; releases the task's holds;
        prunes nodes left without KV. ValueError (tree unchanged) for an unknown task or a
        wrong slot count.
        """
        nodes = self._fetches.get(task)
        if nodes is None:
            raise ValueError(f"fetch task {task!r} is not in flight (finished twice?)")
        total = sum(len(n.tokens) for n in nodes)
        if resident is not None and len(resident) != total:
            raise ValueError(f"fetch {task!r}: {len(resident)} slots for {total} tokens")
        del self._fetches[task]
        duplicates: list[int] = []
        offset = 0
        for node in nodes:
            node.fetching = tuple(t for t in node.fetching if t != task)
            if resident is not None:
                part = tuple(resident[offset : offset + len(node.tokens)])
                offset += len(node.tokens)
                if node.resident is None:
                    self._set_resident(node, part)
                else:
                    duplicates.extend(part)
            self._add_ref(node, -1)
        for node in reversed(nodes):
            self._prune_upward(node)
        return FetchResult(tuple(nodes), resident is not None, tuple(duplicates))

    # ------------------------------------------------------------------ resident full KV
    def release_resident(self, nodes: Iterable[TieredNode]) -> tuple[int, ...]:
        """Drop the resident full KV of ``nodes`` (after a verify); nodes not resident are
        skipped. Returns the device slots for the caller to free.
        Mutates: ``resident``, resident size; prunes nodes left without KV."""
        nodes = list(nodes)
        slots: list[int] = []
        for node in nodes:
            self._require_attached(node)
        for node in nodes:
            if node.resident is not None:
                slots.extend(node.resident)
                self._set_resident(node, None)
        for node in reversed(nodes):
            if self._is_attached(node):
                self._prune_upward(node)
        return tuple(slots)

    def path_resident(self, node: TieredNode) -> bool:
        """Whether the full KV of every node from the root to ``node`` is resident."""
        n: TieredNode | None = node
        while n is not None and not n.is_root:
            if n.resident is None:
                return False
            n = n.parent
        return True
