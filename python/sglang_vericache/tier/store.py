"""Byte-bounded LRU map: the storage of the zmq KV server and of the host tier.

Not thread-safe: each owner (the server's event loop, the HostTier) uses it from one thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Generic, Hashable, Iterable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Admission(str, Enum):
    STORED = "stored"
    EXISTS = "exists"        # key already present: kept the old value, refreshed its recency
    TOO_LARGE = "too_large"  # larger than the whole capacity: rejected before evicting anything


@dataclass(frozen=True, slots=True)
class PutOutcome:
    admission: Admission
    evicted: int  # entries evicted to make room


class LRUByteStore(Generic[K, V]):
    """key -> (value, nbytes); total nbytes never exceeds ``capacity_bytes``.

    put() evicts least-recently-used entries until the new one fits; an entry larger than
    the capacity is refused *before* anything is evicted, so a failed put never loses data.
    get()/touch() refresh recency; contains() does not.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.evictions = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, key: K) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def peek(self, key: K) -> V | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def touch(self, keys: Iterable[K]) -> None:
        for key in keys:
            if key in self._entries:
                self._entries.move_to_end(key)

    def put(self, key: K, value: V, nbytes: int) -> PutOutcome:
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if key in self._entries:
            self._entries.move_to_end(key)
            return PutOutcome(Admission.EXISTS, 0)
        if nbytes > self.capacity_bytes:
            return PutOutcome(Admission.TOO_LARGE, 0)
        evicted = 0
        while self.used_bytes + nbytes > self.capacity_bytes:
            _, (_, old_bytes) = self._entries.popitem(last=False)
            self.used_bytes -= old_bytes
            evicted += 1
        self._entries[key] = (value, nbytes)
        self.used_bytes += nbytes
        self.evictions += evicted
        return PutOutcome(Admission.STORED, evicted)

    def replace(self, key: K, value: V) -> None:
        """Swap the value of an existing key, same size (fault injection only)."""
        _, nbytes = self._entries[key]
        self._entries[key] = (value, nbytes)

    def remove(self, key: K) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.used_bytes -= entry[1]
        return True

    def check_integrity(self) -> None:
        total = sum(nbytes for _, nbytes in self._entries.values())
        assert total == self.used_bytes, f"used_bytes {self.used_bytes} != sum {total}"
        assert 0 <= self.used_bytes <= self.capacity_bytes, "byte budget exceeded"
        assert all(nbytes >= 0 for _, nbytes in self._entries.values())
