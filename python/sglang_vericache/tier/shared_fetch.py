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
fetch task nobody waits for any more. Not thread-safe: the scheduler thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from torch import Tensor

from sglang_vericache.tier.base import FullKVTier, TaskId, TaskResult, TaskStatus
from sglang_vericache.tier.keys import ChunkKey
from sglang_vericache.tier.layout import alloc_chunks


@dataclass(slots=True)
class _Chunk:
    buffer: Tensor  # [L, 2, H_kv, chunk, D] host
    task: TaskId
    ok: bool | None = None  # None while its fetch is in flight
    claims: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Task:
    digests: list[bytes]
    started: float = field(default_factory=time.monotonic)


class SharedFetches:
    """Chunk fetches shared by the requests waiting for them (module doc)."""

    def __init__(self, tier: FullKVTier) -> None:
        self.tier = tier
        self._chunks: dict[bytes, _Chunk] = {}
        self._tasks: dict[TaskId, _Task] = {}
        self._claims: dict[str, list[bytes]] = {}  # rid -> its chunks, in order

    def new_bytes(self, keys: list[ChunkKey]) -> int:
        """Host bytes ``want(keys)`` would add (chunks nobody is fetching yet)."""
        return sum(self.tier.geometry.chunk_nbytes(k.num_tokens) for k in keys
                   if k.digest not in self._chunks)  # fmt: skip

    def want(self, rid: str, keys: list[ChunkKey]) -> int:
        """Claim ``keys`` (consecutive chunks of one prefix) for ``rid``; fetch those nobody is
        fetching, as one task. Returns how many chunks were submitted (0: all shared)."""
        if rid in self._claims:
            raise ValueError(f"request {rid} already claims chunks; release it first")
        new = [k for k in keys if k.digest not in self._chunks]
        if new:
            buffers = alloc_chunks(self.tier.geometry, sum(k.num_tokens for k in new))
            task = self.tier.submit_fetch(new, buffers)
            self._tasks[task] = _Task([k.digest for k in new])
            for key, buffer in zip(new, buffers):
                self._chunks[key.digest] = _Chunk(buffer, task)
        for key in keys:
            self._chunks[key.digest].claims.add(rid)
        self._claims[rid] = [k.digest for k in keys]
        return len(new)

    def owns(self, task: TaskId) -> bool:
        return task in self._tasks

    def complete(self, task: TaskId, result: TaskResult) -> tuple[int, float]:
        """Apply a finished fetch task: its chunks are verified or not. Returns (bytes that
        arrived verified, seconds the task took) for the caller's bandwidth estimate."""
        info = self._tasks.pop(task)
        ok = result.ok if result.status is TaskStatus.DONE else (False,) * len(info.digests)
        landed = 0
        for digest, good in zip(info.digests, ok):
            chunk = self._chunks.get(digest)
            if chunk is not None and chunk.task == task:
                chunk.ok = bool(good)
                landed += chunk.buffer.nbytes if good else 0
        return landed, time.monotonic() - info.started

    def settled(self, rid: str) -> bool:
        """Every chunk ``rid`` claims has landed or failed."""
        return all(self._chunks[d].ok is not None for d in self._claims[rid])

    def leading_ok(self, rid: str) -> int:
        """How many of ``rid``'s chunks, from its first, landed verified."""
        n = 0
        for digest in self._claims[rid]:
            if not self._chunks[digest].ok:
                break
            n += 1
        return n

    def buffers(self, rid: str) -> list[Tensor]:
        """``rid``'s chunk buffers in order (read them only where ``leading_ok`` says)."""
        return [self._chunks[d].buffer for d in self._claims[rid]]

    def release(self, rid: str) -> None:
        """Drop ``rid``'s claims: unclaimed buffers go, fetches nobody waits for are cancelled."""
        for digest in self._claims.pop(rid, []):
            chunk = self._chunks[digest]
            chunk.claims.discard(rid)
            if not chunk.claims:
                del self._chunks[digest]
        live = {c.task for c in self._chunks.values()}
        for task in [t for t in self._tasks if t not in live]:
            del self._tasks[task]
            self.tier.cancel(task)

    def nbytes(self) -> int:
        """Host bytes of every buffer held (in flight or landed, not yet released)."""
        return sum(c.buffer.nbytes for c in self._chunks.values())

    def check_integrity(self) -> None:
        for rid, digests in self._claims.items():
            for digest in digests:
                assert rid in self._chunks[digest].claims, "claim missing on its chunk"
        for digest, chunk in self._chunks.items():
            assert chunk.claims, "a chunk nobody claims is still held"
            assert all(digest in self._claims[r] for r in chunk.claims), "stale claim"
            assert chunk.ok is not None or chunk.task in self._tasks, "in flight without a task"
