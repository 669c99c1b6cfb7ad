"""One request waiting for its prefix from the tier: its phase and chunks (plain data; the
state machine that moves it is ``srt/prefix/remote_prefix.RemotePrefixLink``), and the check that
the waiting requests and their shared chunk claims agree."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from sglang_vericache.tier.base import TaskId
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.keys import ChunkKey
from sglang_vericache.tier.shared_fetch import SharedFetches


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

    def wait_s(self, geometry: KVGeometry, fetch_bytes_per_s: float) -> float | None:
        """Seconds until its lookup and fetch land at that bandwidth (None: not measured)."""
        if not fetch_bytes_per_s:
            return None
        left = self.nbytes(geometry)
        if self.phase is PrefixPhase.FETCH:
            left -= (time.monotonic() - self.fetch_started) * fetch_bytes_per_s
        return max(left, 0) / fetch_bytes_per_s


def check_pending(pending: Mapping[str, PendingPrefix], fetches: SharedFetches) -> None:
    """Requests' phases and their chunk claims agree: a request claims chunks exactly while
    its fetch runs or its KV waits to be taken (FETCH, READY), one claim per chunk it wants;
    a lookup has its task; nobody else claims anything. Then ``fetches``' own integrity."""
    holding = (PrefixPhase.FETCH, PrefixPhase.READY)
    claimants = fetches.claimants()
    for rid, state in pending.items():
        assert (rid in claimants) == (state.phase in holding), f"{rid}: claims vs phase"
        if state.phase in holding:
            assert len(fetches.buffers(rid)) == len(state.keys), f"{rid}: claims vs keys"
        assert (state.task is not None) == (state.phase is PrefixPhase.LOOKUP), f"{rid}: task"
        assert state.phase is not PrefixPhase.READY or 0 < state.chunks_ok <= len(state.keys)
    assert claimants <= set(pending), "claims of a request no longer pending"
    fetches.check_integrity()
