"""The full-KV tier interface: asynchronous submit/poll over caller-owned chunk tensors.

Shaped after LMCache's L2 adapter contract (submit_* / pop-completed, results once):

- ``submit_put / submit_fetch / submit_lookup`` validate their arguments (ValueError on a
  wrong shape/dtype/count: a programming error), start the work and return a ``TaskId`` at
  once. They never wait for the network, the server or a device copy.
- ``poll()`` returns the results completed since the last call, each task exactly once
  (cancelled and failed tasks included), and never blocks.
- Buffers belong to the caller. A put's source chunks must stay unmodified, and a fetch's
  destination chunks must not be read or written, until poll() has returned that task's
  result (or cancel() has returned). After that the tier never touches them again.
- Failures never raise from poll(): a dead, slow or misbehaving tier turns into a result
  with ``status`` FAILED (or per-chunk ``ok`` False), a log line and a counter. The caller
  then recomputes the KV locally: slower, never wrong.
- A fetched chunk is ``ok`` only if it arrived whole, matched its checksums and manifest
  (geometry namespace, token count, size). ``ok`` has prefix semantics for fetch and
  lookup: once one chunk is missing or bad, all later ones are reported not ok, and the
  contents of their destination buffers are unspecified.

Chunks are [L, 2, H_kv, n, D] tensors of the tier's geometry dtype (``geometry.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import NewType, Sequence

import torch

from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.keys import ChunkKey

TaskId = NewType("TaskId", int)


class TaskKind(str, Enum):
    PUT = "put"
    FETCH = "fetch"
    LOOKUP = "lookup"


class TaskStatus(str, Enum):
    DONE = "done"            # the tier answered; ``ok`` says which chunks succeeded
    FAILED = "failed"        # transport/protocol failure or timeout: every ok is False
    CANCELLED = "cancelled"  # cancel() ran before completion: every ok is False


@dataclass(frozen=True, slots=True)
class TaskResult:
    """ok: one flag per submitted key (put: stored or already present; fetch: verified and
    copied into dst; lookup: stored complete), prefix-closed for fetch and lookup.
    nbytes: payload bytes moved. error: why not everything is ok (None when all are).
    epoch: the store generation that answered (the zmq server draws one at every start);
    None when the tier has no such notion (host: lives and dies with its owner) or did not
    answer. A different epoch than before means everything stored earlier may be gone."""

    task_id: TaskId
    kind: TaskKind
    status: TaskStatus
    ok: tuple[bool, ...]
    nbytes: int = 0
    error: str | None = None
    epoch: bytes | None = None

    @property
    def num_ok_prefix(self) -> int:
        """Leading chunks that are ok (the usable prefix for fetch/lookup)."""
        for i, flag in enumerate(self.ok):
            if not flag:
                return i
        return len(self.ok)

    @property
    def all_ok(self) -> bool:
        return self.status is TaskStatus.DONE and all(self.ok)


def prefix_closed(flags: Sequence[bool]) -> tuple[bool, ...]:
    """[T, T, F, T] -> (T, T, F, F): a chunk is usable only if every earlier one is."""
    out: list[bool] = []
    alive = True
    for flag in flags:
        alive = alive and bool(flag)
        out.append(alive)
    return tuple(out)


class FullKVTier(ABC):
    """Where the full (uncompressed) KV lives. See the module docstring for the contract.

    Thread-safety is per implementation (ZmqTier: any thread; HostTier: one thread).
    ``stats()`` returns client-side counters (failures, timeouts, checksum_mismatch, ...).
    """

    geometry: KVGeometry

    @abstractmethod
    def submit_put(self, keys: Sequence[ChunkKey], chunks: Sequence[torch.Tensor]) -> TaskId:
        """Store chunks[i] under keys[i]. chunks[i]: [L, 2, H_kv, keys[i].num_tokens, D]
        geometry dtype, contiguous (CPU for remote tiers; any device for the host tier)."""

    @abstractmethod
    def submit_fetch(self, keys: Sequence[ChunkKey], dst: Sequence[torch.Tensor]) -> TaskId:
        """Fill dst[i] ([L, 2, H_kv, keys[i].num_tokens, D] geometry dtype, contiguous, any
        device) with the chunk stored under keys[i], for the leading run of stored chunks."""

    @abstractmethod
    def submit_lookup(self, keys: Sequence[ChunkKey]) -> TaskId:
        """Which leading keys are stored complete (prefix-closed ok flags)."""

    @abstractmethod
    def poll(self) -> dict[TaskId, TaskResult]:
        """Completed results since the last call; each task exactly once; never blocks."""

    @abstractmethod
    def cancel(self, task_id: TaskId) -> None:
        """Stop caring about a task. After it returns the tier no longer touches the task's
        buffers; its result (CANCELLED, or the earlier completion) is still returned once by
        poll(). A no-op for unknown or already-returned tasks."""

    @abstractmethod
    def close(self) -> None:
        """Cancel everything in flight and release resources. Idempotent."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Client-side counters."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the bookkeeping invariants (every submitted task is either in flight or
        completed exactly once; counters agree). Tests call it after each operation."""


def check_batch(geometry: KVGeometry, keys: Sequence[ChunkKey],
                tensors: Sequence[torch.Tensor] | None, what: str) -> None:
    """Validate a submit's arguments (ValueError on mismatch)."""
    if any(not isinstance(k, ChunkKey) for k in keys):
        raise ValueError("keys must be ChunkKey instances (see keys.chunk_keys)")
    if tensors is None:
        return
    if len(tensors) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(tensors)} {what} tensors")
    for i, (key, tensor) in enumerate(zip(keys, tensors)):
        geometry.check_chunk(tensor, key.num_tokens, f"{what}[{i}]")
