"""One request waiting for its prefix from the tier: its phase and chunks (plain data; the
state machine that moves it is ``srt/remote_prefix.RemotePrefixLink``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from sglang_vericache.tier.base import TaskId
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.keys import ChunkKey


class PrefixPhase(Enum):
    """Where a waiting request's tier prefix stands: LOOKUP (asking which chunks the tier
    holds) -> FETCH (getting them) -> READY (arrived, verified); MISS at any point (nothing to
    load: recompute)."""

    LOOKUP = "lookup"
    FETCH = "fetch"
    READY = "ready"
    MISS = "miss"


@dataclass(slots=True)
class PendingPrefix:
    """One waiting request: the chunks past its device match and its lookup task (its fetch
    is in ``SharedFetches``, shared with requests waiting for the same chunks)."""

    first_chunk: int
    keys: list[ChunkKey]
    task: TaskId | None
    phase: PrefixPhase
    chunks_ok: int = 0
    created: float = field(default_factory=time.monotonic)  # also: when the lookup started
    probed: float = field(default_factory=time.monotonic)  # the scheduler's latest probe
    fetch_started: float = 0.0

    def nbytes(self, geometry: KVGeometry) -> int:
        """Bytes of full KV its chunks hold (what its fetch transfers)."""
        return sum(geometry.chunk_nbytes(k.num_tokens) for k in self.keys)
