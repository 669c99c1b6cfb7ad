"""HostTier: the full KV in this process's host memory (long-context decoding).

Same submit/poll contract as the remote tiers. On CPU every copy runs inside submit_* and
the result is ready at the next poll(). With CUDA tensors the copies are issued
non-blocking on the current stream between device memory and pinned host memory, and a
task completes when its CUDA event has fired, so the scheduler never waits for PCIe.

A put becomes visible (lookup/fetch hits) only once its copy has completed: a half-copied
chunk is never served. Not thread-safe: use it from the scheduler thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_vericache.host_memory import host_empty
from sglang_vericache.tier.base import (
    FullKVTier, TaskId, TaskKind, TaskResult, TaskStatus, check_batch, prefix_closed,
)
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.keys import ChunkKey
from sglang_vericache.tier.store import Admission, LRUByteStore

_COUNTERS = ("submitted", "chunks_put", "put_rejected", "chunks_fetched", "chunks_missed",
             "lookups", "evictions", "cancelled", "fallbacks")


@dataclass(eq=False)
class _Pending:
    result: TaskResult
    event: torch.cuda.Event | None           # None: already complete
    staged: list[tuple[ChunkKey, torch.Tensor]]  # puts: chunks to publish on completion
    hold: list[torch.Tensor]                 # keeps fetch sources alive during async copies


class HostTier(FullKVTier):
    """capacity_bytes: byte budget (LRU eviction). pin_memory: allocate pinned host chunks
    (default: when CUDA is available) so device<->host copies can be asynchronous."""

    def __init__(self, geometry: KVGeometry, *, capacity_bytes: int,
                 pin_memory: bool | None = None) -> None:
        self.geometry = geometry
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._store: LRUByteStore[bytes, torch.Tensor] = LRUByteStore(capacity_bytes)
        self._pending: dict[TaskId, _Pending] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._next_id = 1

    def submit_put(self, keys: Sequence[ChunkKey], chunks: Sequence[torch.Tensor]) -> TaskId:
        check_batch(self.geometry, keys, chunks, "chunks")
        staged: list[tuple[ChunkKey, torch.Tensor]] = []
        ok: list[bool] = []
        for key, chunk in zip(keys, chunks):
            if self._store.contains(key.digest):
                ok.append(True)
                continue
            if chunk.nbytes > self._store.capacity_bytes:
                ok.append(False)
                self._counters["put_rejected"] += 1
                continue
            host = host_empty(chunk.shape, chunk.dtype, pin_memory=self.pin_memory)
            host.copy_(chunk, non_blocking=chunk.is_cuda and self.pin_memory)
            staged.append((key, host))
            ok.append(True)
        return self._start(TaskKind.PUT, ok, sum(c.nbytes for _, c in staged), staged, [],
                           uses_cuda=any(c.is_cuda for c in chunks))

    def submit_fetch(self, keys: Sequence[ChunkKey], dst: Sequence[torch.Tensor]) -> TaskId:
        check_batch(self.geometry, keys, dst, "dst")
        ok: list[bool] = []
        hold: list[torch.Tensor] = []
        for key, out in zip(keys, dst):
            src = self._store.get(key.digest)
            if src is None:
                break  # prefix semantics
            out.copy_(src, non_blocking=out.is_cuda and src.is_pinned())
            hold.append(src)
            ok.append(True)
        hits = len(ok)
        ok += [False] * (len(keys) - hits)
        self._counters["chunks_fetched"] += hits
        self._counters["chunks_missed"] += len(keys) - hits
        if hits < len(keys):
            self._counters["fallbacks"] += 1
        return self._start(TaskKind.FETCH, ok, sum(t.nbytes for t in hold), [], hold,
                           uses_cuda=any(d.is_cuda for d in dst[:hits]))

    def submit_lookup(self, keys: Sequence[ChunkKey]) -> TaskId:
        check_batch(self.geometry, keys, None, "keys")
        self._counters["lookups"] += 1
        present = [self._store.contains(k.digest) for k in keys]
        self._store.touch(k.digest for k, p in zip(keys, present) if p)
        return self._start(TaskKind.LOOKUP, present, 0, [], [], uses_cuda=False)

    def poll(self) -> dict[TaskId, TaskResult]:
        done: dict[TaskId, TaskResult] = {}
        for task_id, pending in list(self._pending.items()):
            if pending.event is None or pending.event.query():
                self._complete(pending)
                done[task_id] = self._pending.pop(task_id).result
        return done

    def cancel(self, task_id: TaskId) -> None:
        pending = self._pending.get(task_id)
        if pending is None:
            return
        if pending.event is not None:
            # A device copy cannot be recalled: wait for it so the buffers are free on return.
            pending.event.synchronize()
        r = pending.result
        pending.staged.clear()  # a cancelled put publishes nothing
        pending.event = None
        pending.result = TaskResult(r.task_id, r.kind, TaskStatus.CANCELLED,
                                    (False,) * len(r.ok), 0, "cancelled")
        self._counters["cancelled"] += 1

    def close(self) -> None:
        for task_id in list(self._pending):
            self.cancel(task_id)

    def stats(self) -> dict[str, int]:
        out = dict(self._counters)
        out.update(entries=len(self._store), used_bytes=self._store.used_bytes,
                   capacity_bytes=self._store.capacity_bytes, in_flight=len(self._pending))
        return out

    def check_integrity(self) -> None:
        self._store.check_integrity()
        for task_id, pending in self._pending.items():
            assert pending.result.task_id == task_id
        assert all(t < self._next_id for t in self._pending)

    # -- internals ----------------------------------------------------------------------------
    def _start(self, kind: TaskKind, ok: Sequence[bool], nbytes: int,
               staged: list[tuple[ChunkKey, torch.Tensor]], hold: list[torch.Tensor],
               uses_cuda: bool) -> TaskId:
        task_id = TaskId(self._next_id)
        self._next_id += 1
        self._counters["submitted"] += 1
        flags = tuple(ok) if kind is TaskKind.PUT else prefix_closed(ok)
        error = None if all(flags) else f"{sum(flags)}/{len(flags)} chunks ok"
        event: torch.cuda.Event | None = None
        if uses_cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending[task_id] = _Pending(
            TaskResult(task_id, kind, TaskStatus.DONE, flags, nbytes, error), event, staged, hold)
        return task_id

    def _complete(self, pending: _Pending) -> None:
        """Publish a finished put's chunks into the store (only now are they visible)."""
        for key, tensor in pending.staged:
            # Sizes were checked against the capacity at submit, so this cannot be TOO_LARGE.
            outcome = self._store.put(key.digest, tensor, tensor.nbytes)
            self._counters["evictions"] += outcome.evicted
            self._counters["chunks_put"] += outcome.admission is Admission.STORED
        pending.staged.clear()
        pending.hold.clear()
        pending.event = None
