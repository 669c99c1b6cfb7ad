"""One node of the tiered radix tree and the small types its fields are made of.

A node covers a page-aligned span of tokens and holds up to three copies of their KV:

    compressed   local compressed pool: one ``PageSlots`` per page      (None = evicted locally)
    full         the full KV in the tier: one ``TierKey`` per page + a  (None = no tier copy known)
                 ``FullState`` (NONE: keys known, nothing written yet;
                 WRITING: write-through in flight; STORED: complete)
    resident     transient device slots of the full KV, one per token,   (None = not resident)
                 while a verify needs it (filled by a finished fetch)

The tier state is encoded by which fields are set; ``Residency`` is a derived view for
logs and tests, never stored. Nodes are mutated only by ``TieredRadixTree``; callers read
them (and hand them back to the tree) but never assign their fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, Flag, auto
from typing import Hashable

PageSlots = tuple[int, ...]
"""Local compressed-pool slot ids holding one page's compressed KV. Opaque to the tree; the
count may differ from the page size (token dropping keeps fewer slots, may keep none)."""

TierKey = Hashable
"""Opaque key of one page's full KV in the tier (e.g. ``tier.keys.ChunkKey``)."""

TaskId = Hashable
"""Id of an in-flight tier transfer (write or fetch), issued by the tier client."""

Namespace = Hashable
"""Tree namespace (LoRA id, cache salt, model): equal tokens in different namespaces never
share a node. ``None`` is the default namespace."""

ChildKey = tuple[Namespace, tuple[int, ...]]
"""Key of a child in its parent's ``children``: (namespace, first page of its tokens)."""


class FullState(Enum):
    """Completeness of a node's full KV in the tier."""

    NONE = "none"  # keys assigned, nothing written (new, or a write failed): not a tier copy
    WRITING = "writing"  # write-through in flight; the write task locks the node
    STORED = "stored"  # every page complete in the tier: fetchable


class Residency(Flag):
    """Derived summary of where a node's KV is (for logs and tests; never stored)."""

    EMPTY = 0
    COMPRESSED = auto()  # compressed pages in the local pool
    WRITING = auto()  # full KV being written to the tier
    REMOTE = auto()  # full KV STORED in the tier
    FETCHING = auto()  # at least one fetch of the full KV in flight
    RESIDENT = auto()  # full KV resident in transient device slots


@dataclass(frozen=True, slots=True)
class FullKV:
    """Handle to a node's full KV in the tier: one key per page, one state for all pages."""

    keys: tuple[TierKey, ...]
    state: FullState

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("FullKV needs at least one key")
        if not isinstance(self.state, FullState):
            raise TypeError(f"state must be a FullState, got {self.state!r}")


@dataclass(eq=False, slots=True)
class TieredNode:
    """A span of tokens and its KV copies. Identity semantics (``eq=False``): hashable,
    usable in sets, equal only to itself.

    lock_ref: holds in this node's subtree (user locks + in-flight tasks, see
        ``TieredRadixTree.check_integrity``); > 0 means protected from local eviction.
    pins: user locks (``TieredRadixTree.lock``) ending exactly at this node.
    writing: the write task covering this node, if any.
    fetching: fetch tasks covering this node, oldest first.
    last_access: logical clock of the last insert/lock/touch through this node
        (an ancestor's value is never older than a descendant's).
    """

    node_id: int
    namespace: Namespace
    tokens: tuple[int, ...]
    parent: TieredNode | None
    children: dict[ChildKey, TieredNode] = field(default_factory=dict)
    compressed: tuple[PageSlots, ...] | None = None
    full: FullKV | None = None
    resident: tuple[int, ...] | None = None
    lock_ref: int = 0
    pins: int = 0
    writing: TaskId | None = None
    fetching: tuple[TaskId, ...] = ()
    last_access: int = 0

    @property
    def is_root(self) -> bool:
        return self.node_id == 0

    @property
    def num_slots(self) -> int:
        """Local compressed-pool slots this node holds (0 when evicted locally)."""
        if self.compressed is None:
            return 0
        return sum(len(page) for page in self.compressed)

    @property
    def full_state(self) -> FullState:
        """NONE when no tier copy is known (``full is None``) or nothing was written yet."""
        return FullState.NONE if self.full is None else self.full.state

    @property
    def has_kv(self) -> bool:
        """True when some copy of the KV exists: local compressed, resident full, or a tier
        copy that is written or being written. Only the root and (transiently locked or
        interior) tombstones lack KV."""
        return (
            self.compressed is not None
            or self.resident is not None
            or self.full_state is not FullState.NONE
        )

    @property
    def residency(self) -> Residency:
        flags = Residency.EMPTY
        if self.compressed is not None:
            flags |= Residency.COMPRESSED
        if self.full_state is FullState.WRITING:
            flags |= Residency.WRITING
        if self.full_state is FullState.STORED:
            flags |= Residency.REMOTE
        if self.fetching:
            flags |= Residency.FETCHING
        if self.resident is not None:
            flags |= Residency.RESIDENT
        return flags

    def child_key(self, page_size: int) -> ChildKey:
        return (self.namespace, self.tokens[:page_size])

    def __repr__(self) -> str:
        return (
            f"TieredNode(id={self.node_id}, ns={self.namespace!r}, tokens={len(self.tokens)}, "
            f"{self.residency}, slots={self.num_slots}, lock_ref={self.lock_ref}, "
            f"t={self.last_access})"
        )
