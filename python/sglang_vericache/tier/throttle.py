"""LinkThrottle: the KV server's emulation of a slower remote store (``--bandwidth-mbps``).

Replies carrying payload leave no faster than ``rate_mb_s`` megabytes (10^6 bytes) per second
on a shared outbound link, and put acknowledgements wait for the same rate on the inbound
link. Throttled replies are queued, not slept on, so small requests keep being served.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(order=True)
class _Delayed:
    send_at: float
    seq: int
    frames: list[Any] = field(compare=False)


class LinkThrottle:
    """Schedules replies on two emulated links ("in" / "out"). Not thread-safe."""

    def __init__(self, rate_mb_s: float) -> None:
        if rate_mb_s <= 0:
            raise ValueError("bandwidth must be > 0 MB/s")
        self.rate_mb_s = rate_mb_s
        self._delayed: list[_Delayed] = []
        self._seq = 0
        self._free_at = {"in": 0.0, "out": 0.0}

    def schedule(self, frames: list[Any], link: str, nbytes: int) -> None:
        """Queue ``frames`` until ``nbytes`` have crossed ``link`` after what is queued."""
        now = time.monotonic()
        send_at = max(now, self._free_at[link]) + nbytes / (self.rate_mb_s * 1e6)
        self._free_at[link] = send_at
        self._seq += 1
        heapq.heappush(self._delayed, _Delayed(send_at, self._seq, frames))

    def next_due_s(self) -> float | None:
        """Seconds until the next queued reply is due (None: nothing queued)."""
        if not self._delayed:
            return None
        return max(0.0, self._delayed[0].send_at - time.monotonic())

    def due(self) -> list[list[Any]]:
        """The queued replies whose time has come, oldest first."""
        now = time.monotonic()
        out = []
        while self._delayed and self._delayed[0].send_at <= now:
            out.append(heapq.heappop(self._delayed).frames)
        return out
