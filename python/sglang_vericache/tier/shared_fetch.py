"""One fetch per chunk, shared by every request waiting for it.

Requests that share a prefix (one system prompt, parallel samples of one prompt, agent sessions
of one tool set) name the same leading chunks (keys are chained hashes of the tokens so far).
``SharedFetches`` keeps, per chunk digest, one host buffer and whether it landed verified, and
the requests that claim it. A request's claim on chunks another request is already fetching
reuses them; only the rest are fetched, as one task::

    request A wants  [c0 c1 c2]        -> fetch task 1: c0 c1 c2
    request B wants  [c0 c1 c2 c3 c4]  -> fetch task 2: c3 c4     (c0..c2 shared with A)
    task 1 lands c0 ok, c1 corrupt     -> A and B both settle once their chunks have; each
                                          request's usable chunks are its leading verified ones

A buffer lives while a request claims it; releasing the last claim drops it, and cancels a
fetch task nobody waits for any more. A chunk that failed is not shared any more: its
claimants keep their answer (their usable chunks end before it), and the next request that
wants it fetches it afresh (the tier may hold it again: a later lookup said so). Not
thread-safe: the scheduler thread only.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from torch import Tensor

from sglang_vericache.tier.base import FullKVTier, TaskId, TaskResult, TaskStatus
from sglang_vericache.tier.keys import ChunkKey
from sglang_vericache.tier.layout import alloc_chunks


@dataclass(slots=True, eq=False)
class _Chunk:
    digest: bytes
    buffer: Tensor  # [L, 2, H_kv, chunk, D] host
    task: TaskId
    ok: bool | None = None  # None while its fetch is in flight
    claims: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Task:
    chunks: list[_Chunk]
    started: float = field(default_factory=time.monotonic)


class SharedFetches:
    """Chunk fetches shared by the requests waiting for them (module doc)."""

    def __init__(self, tier: FullKVTier,
                 claims: MutableMapping[str, list[_Chunk]] | None = None) -> None:  # fmt: skip
        """claims: where each request's claimed chunks are kept, in order (a server's: its
        request record's ``fetch_claims``); a dict by default."""
        self.tier = tier
        self._shared: dict[bytes, _Chunk] = {}  # digest -> the chunk a new claim shares
        self._tasks: dict[TaskId, _Task] = {}
        self._claims: MutableMapping[str, list[_Chunk]] = {} if claims is None else claims

    def new_bytes(self, keys: list[ChunkKey]) -> int:
        """Host bytes ``want(keys)`` would add (chunks nobody is fetching, or that failed)."""
        return sum(self.tier.geometry.chunk_nbytes(k.num_tokens) for k in keys
                   if k.digest not in self._shared)  # fmt: skip

    def want(self, rid: str, keys: list[ChunkKey]) -> int:
        """Claim ``keys`` (consecutive chunks of one prefix) for ``rid``; fetch those nobody is
        fetching (or that failed), as one task. Returns how many chunks were submitted (0: all
        shared). ``rid`` must hold no claims (``release`` it first)."""
        if rid in self._claims:
            raise ValueError(f"request {rid} already claims chunks; release it first")
        new = [k for k in keys if k.digest not in self._shared]
        if new:
            buffers = alloc_chunks(self.tier.geometry, sum(k.num_tokens for k in new))
            task = self.tier.submit_fetch(new, buffers)
            chunks = [_Chunk(k.digest, b, task) for k, b in zip(new, buffers)]
            self._tasks[task] = _Task(chunks)
            self._shared.update((c.digest, c) for c in chunks)
        claimed = [self._shared[k.digest] for k in keys]
        for chunk in claimed:
            chunk.claims.add(rid)
        self._claims[rid] = claimed
        return len(new)

    def owns(self, task: TaskId) -> bool:
        return task in self._tasks

    def complete(self, task: TaskId, result: TaskResult) -> tuple[int, float]:
        """Apply a finished fetch task: its chunks are verified or not (a failed one is no
        longer shared). Returns (bytes that arrived verified, seconds the task took) for the
        caller's bandwidth estimate."""
        info = self._tasks.pop(task)
        ok = result.ok if result.status is TaskStatus.DONE else (False,) * len(info.chunks)
        landed = 0
        for chunk, good in zip(info.chunks, ok):
            chunk.ok = bool(good)
            landed += chunk.buffer.nbytes if good else 0
            if not good and self._shared.get(chunk.digest) is chunk:
                del self._shared[chunk.digest]
        return landed, time.monotonic() - info.started

    def settled(self, rid: str) -> bool:
        """Every chunk ``rid`` claims has landed or failed."""
        return all(c.ok is not None for c in self._claims[rid])

    def leading_ok(self, rid: str) -> int:
        """How many of ``rid``'s chunks, from its first, landed verified."""
        n = 0
        for chunk in self._claims[rid]:
            if not chunk.ok:
                break
            n += 1
        return n

    def buffers(self, rid: str) -> list[Tensor]:
        """``rid``'s chunk buffers in order (read them only where ``leading_ok`` says)."""
        return [c.buffer for c in self._claims[rid]]

    def claimants(self) -> set[str]:
        """The requests holding claims."""
        return set(self._claims)

    def release(self, rid: str) -> None:
        """Drop ``rid``'s claims (none: nothing to do): unclaimed buffers go, fetches nobody
        waits for are cancelled."""
        for chunk in self._claims.pop(rid, []):
            chunk.claims.discard(rid)
            if not chunk.claims and self._shared.get(chunk.digest) is chunk:
                del self._shared[chunk.digest]
        live = {c.task for c in self._held() if c.ok is None}
        for task in [t for t in self._tasks if t not in live]:
            del self._tasks[task]
            self.tier.cancel(task)

    def nbytes(self) -> int:
        """Host bytes of every buffer held (in flight or landed, not yet released)."""
        return sum(c.buffer.nbytes for c in self._held())

    def _held(self) -> list[_Chunk]:
        """Every chunk some request claims, once each."""
        return list({id(c): c for chunks in self._claims.values() for c in chunks}.values())

    def check_integrity(self) -> None:
        """Claims on both sides agree; every held chunk that did not fail is the one copy new
        claims share; only failed chunks are held unshared; tasks hold only chunks in flight."""
        for rid, chunks in self._claims.items():
            assert all(rid in c.claims for c in chunks), "claim missing on its chunk"
        for chunk in self._held():
            assert all(any(c is chunk for c in self._claims.get(r, ())) for r in chunk.claims), \
                "stale claim"
            assert chunk.ok is False or self._shared.get(chunk.digest) is chunk, "two copies"
            assert chunk.ok is not None or chunk.task in self._tasks, "in flight without a task"
        for chunk in self._shared.values():
            assert chunk.claims and chunk.ok is not False, "shared: unclaimed, or failed"
        assert all(c.ok is None for t in self._tasks.values() for c in t.chunks), "done task"
