"""A minimal local slot pool and the accounting identity SGLang checks when idle.

SGLang's scheduler, when idle, requires ``available + evictable + protected == total``
for every pool it knows (``invariant_checker._check_all_pools``; strict: the server dies).
``check_slot_accounting`` is that check for the compressed pool, plus the stronger
"no slot is both free and in the tree". ``LocalSlotPool`` is a real (tiny) allocator for
tests and for a CPU compressed pool; the SGLang glue may use SGLang's own allocator.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from sglang_vericache.cache.integrity import IntegrityError
from sglang_vericache.cache.tree import TieredRadixTree


class LocalSlotPool:
    """Slots 1..num_slots (slot 0 is reserved, as in SGLang, for padding writes).

    alloc takes the oldest freed slots first (FIFO), so runs are deterministic.
    """

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
        self.total = num_slots
        self._free: deque[int] = deque(range(1, num_slots + 1))
        self._is_free = set(self._free)

    def available_size(self) -> int:
        return len(self._free)

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def alloc(self, n: int) -> tuple[int, ...] | None:
        """``n`` slots, or None (nothing taken) when fewer are free."""
        if n < 0:
            raise ValueError(f"alloc({n})")
        if n > len(self._free):
            return None
        slots = tuple(self._free.popleft() for _ in range(n))
        self._is_free.difference_update(slots)
        return slots

    def free(self, slots: Iterable[int]) -> None:
        """Return slots; ValueError (pool unchanged) on an unknown or already free slot."""
        slots = list(slots)
        if len(set(slots)) != len(slots):
            raise ValueError("slot freed twice in one call")
        for s in slots:
            if not 1 <= s <= self.total or s in self._is_free:
                raise ValueError(f"slot {s} is not allocated")
        self._free.extend(slots)
        self._is_free.update(slots)

    def free_slots(self) -> frozenset[int]:
        return frozenset(self._is_free)

    def check_integrity(self) -> None:
        if len(self._is_free) != len(self._free) or set(self._free) != self._is_free:
            raise IntegrityError("free list and free set disagree")
        if any(not 1 <= s <= self.total for s in self._free):
            raise IntegrityError("free slot out of range")


def check_slot_accounting(
    tree: TieredRadixTree, pool: LocalSlotPool, request_slots: int = 0
) -> None:
    """Raise ``IntegrityError`` unless free + evictable + protected + request_slots == total
    and no slot is both free and held by the tree.

    request_slots: compressed slots held by requests and not (yet) inserted into the tree
        (0 when idle, which is when SGLang checks).
    """
    free = pool.available_size()
    evictable, protected = tree.evictable_size(), tree.protected_size()
    if free + evictable + protected + request_slots != pool.total:
        raise IntegrityError(
            f"slot leak: free {free} + evictable {evictable} + protected {protected} "
            f"+ request-held {request_slots} != total {pool.total}"
        )
    held = tree.local_slots()
    both = pool.free_slots().intersection(held)
    if both:
        raise IntegrityError(f"slots both free and in the tree: {sorted(both)[:8]}")
    if len(set(held)) != len(held) or len(held) != evictable + protected:
        raise IntegrityError("tree slot list disagrees with its sizes")
