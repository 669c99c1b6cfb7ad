"""DEMOTED prefixes: compressed KV kept on the device for sequences whose full KV is in the tier.

With a remote tier a finished turn's prefix is in one of three states::

    FULL      full KV in the pool (a node of SGLang's radix tree)   -> a device hit
    DEMOTED   compressed KV here, full KV in the tier               -> draft at once, fetch, verify
    REMOTE    full KV in the tier only                              -> fetch (or recompute)

A finished turn is written through to the tier and stays FULL while the pool has room; its
compressed KV (built while it decoded) is kept here as well. Eviction takes FULL nodes first:
their full KV is in the tier and their compressed KV here, so pressure demotes before it drops.
Only when the tree has nothing left to evict does ``evict`` drop DEMOTED entries, least
recently used first (they become REMOTE).

Every entry is charged to the KV pool: it holds ``account.slots_for(nbytes)`` slots, taken when
it is kept and given back when it goes, so the allocator's free count is the truth admission
sees. The tree counts ``charged_slots`` in its evictable size (SGLang's idle check
``available + evictable + protected == total`` holds, and admission knows the room is there).

The store is bookkeeping only: states and slot handles are opaque, so it tests without torch.
Scheduler thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

DEMOTED_MAX_BYTES = 512 << 20  # compressed KV kept at most, whatever the pool's size


class PoolAccount(Protocol):
    """Where DEMOTED entries are charged (``srt/prefix/radix_cache.py``: the SGLang allocator)."""

    def slots_for(self, nbytes: int) -> int:
        """Pool slots worth ``nbytes`` (a whole number of pages)."""

    def take(self, n: int) -> Any | None:
        """``n`` slots (evicting FULL nodes for them where needed), or None."""

    def give_back(self, held: Any) -> None:
        """Free slots ``take`` returned."""


@dataclass(slots=True)
class DemotedPrefix:
    """The compressed KV (a ``RequestDraftState``) of positions [0, len(tokens)).

    The state may cover ``trim`` more positions: a verification can commit past the point where
    SGLang stops the request (``max_new_tokens``, a stop string). Those newest tokens are always
    in the full-precision recent window, which is the tail of every view and the same for every
    head, so dropping the last ``trim`` columns leaves exactly positions [0, len(tokens)).
    ``held`` / ``slots``: the pool slots it is charged (``PoolAccount.take``).
    """

    tokens: tuple[int, ...]
    state: Any
    nbytes: int
    trim: int
    held: Any
    slots: int

    def views(self) -> list[tuple[Any, Any]]:
        """Per layer (K, V) [H_kv, T_view - trim, D]."""
        views = self.state.views()
        if not self.trim:
            return views
        return [(k[:, : k.shape[1] - self.trim], v[:, : v.shape[1] - self.trim]) for k, v in views]


class DemotedPrefixes:
    """DEMOTED entries, LRU, charged to the pool (module doc).

    Mutated by ``put`` (the prefix cache, when a turn finishes), ``longest`` (recency), ``evict``
    (the prefix cache, when the tree alone cannot free enough) and ``clear`` (a cache flush).
    """

    def __init__(self, account: PoolAccount, max_bytes: int = DEMOTED_MAX_BYTES) -> None:
        self.account = account
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], DemotedPrefix] = OrderedDict()
        self.nbytes = 0
        self.charged_slots = 0
        self.refused = 0  # entries not kept: over the byte cap, or the pool had no room

    def put(self, tokens: Sequence[int], state: Any, trim: int = 0) -> bool:
        """Keep ``state`` (covering ``tokens`` + ``trim`` more); drops entries it extends.

        Charges its slots to the pool: from free slots, else by evicting FULL nodes, else by
        dropping older DEMOTED entries. False (nothing kept) if none of that makes room.
        """
        key = tuple(tokens)
        if state.covered != len(key) + trim or not key or trim < 0:
            raise ValueError(f"state covers {state.covered} tokens, key has {len(key)} + {trim}")
        if state.nbytes > self.max_bytes:
            self.refused += 1
            return False
        for old in [k for k in self.entries if len(k) <= len(key) and key[: len(k)] == k]:
            self._drop(old)  # a longer turn of the same conversation supersedes it
        while self.entries and self.nbytes + state.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
        slots = self.account.slots_for(state.nbytes)
        held = self.account.take(slots)
        while held is None and self.entries:
            self._drop(next(iter(self.entries)))
            held = self.account.take(slots)
        if held is None:
            self.refused += 1
            return False
        self.entries[key] = DemotedPrefix(key, state, state.nbytes, trim, held, slots)
        self.nbytes += state.nbytes
        self.charged_slots += slots
        return True

    def longest(self, tokens: Sequence[int]) -> DemotedPrefix | None:
        """The longest entry that is a proper prefix of ``tokens`` (marked recently used)."""
        best = None
        for key, entry in self.entries.items():
            if len(key) < len(tokens) and (best is None or len(key) > len(best.tokens)):
                if tuple(tokens[: len(key)]) == key:
                    best = entry
        if best is not None:
            self.entries.move_to_end(best.tokens)
        return best

    def evict(self, num_slots: int) -> int:
        """Drop least recently used entries until ``num_slots`` are freed; returns the slots
        freed (less only when the store is empty)."""
        freed = 0
        while freed < num_slots and self.entries:
            freed += self._drop(next(iter(self.entries)))
        return freed

    def clear(self) -> None:
        """Forget every entry without giving its slots back: a cache flush clears the allocator
        itself right after it resets the tree (SGLang's ``Scheduler.flush_cache``)."""
        self.entries.clear()
        self.nbytes = self.charged_slots = 0

    def _drop(self, key: tuple[int, ...]) -> int:
        entry = self.entries.pop(key)
        self.account.give_back(entry.held)
        self.nbytes -= entry.nbytes
        self.charged_slots -= entry.slots
        return entry.slots

    def check_integrity(self) -> None:
        entries = self.entries.values()
        assert self.nbytes == sum(e.nbytes for e in entries), "byte count drifted"
        assert self.charged_slots == sum(e.slots for e in entries), "slot count drifted"
        assert self.nbytes <= self.max_bytes, "over the byte cap"
        for key, entry in self.entries.items():
            assert entry.tokens == key and entry.state.covered == len(key) + entry.trim, key[:8]
