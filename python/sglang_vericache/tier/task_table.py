"""TaskTableTier: the submit/poll bookkeeping shared by the tiers that work on a background
thread (ZmqTier in ``client.py``, LMCacheTier in ``lmcache.py``).

In-flight tasks, results not yet returned by poll() and the client-side counters live under
one lock, because a task can be finished from several threads at once (its reply on the I/O
thread, a timeout or disconnect, cancel() or close() on the caller's): the first finish
publishes the one result, later ones are ignored. Subclasses register their tasks
(``_tasks``, ``_next_id`` and the "submitted" counter, under ``_lock``), do the work, and
say how a failure is logged.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from sglang_vericache.tier.base import (
    FullKVTier,
    TaskId,
    TaskKind,
    TaskResult,
    TaskStatus,
    check_batch,
    prefix_closed,
)
from sglang_vericache.tier.keys import ChunkKey


@dataclass(eq=False)
class TrackedTask:
    """One task in the table: what it carries and whether it was cancelled (LMCacheTier's
    record as it is; ZmqTier's adds its deadlines and wire state, ``outbox.ClientTask``)."""

    task_id: TaskId
    kind: TaskKind
    keys: list[ChunkKey]
    tensors: list[torch.Tensor]  # put: the chunks to store; fetch: where they land
    cancelled: bool = False
    # held while chunks are copied into the caller's tensors
    copy_lock: threading.Lock = field(default_factory=threading.Lock)


T = TypeVar("T", bound=TrackedTask)


class TaskTableTier(FullKVTier, Generic[T]):
    """poll / cancel / stats / check_integrity over a locked table of tasks. Thread-safe.

    counters: the names of this tier's counters; "submitted", "completed", "failures",
    "cancelled" and "fallbacks" must be among them (``_finish`` and the subclass's
    ``_submit`` maintain those).
    """

    def __init__(self, counters: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[TaskId, T] = {}
        self._results: dict[TaskId, TaskResult] = {}
        self._counters = dict.fromkeys(counters, 0)
        self._next_id = 1
        self._closed = False

    @abstractmethod
    def _submit(self, kind: TaskKind, keys: Sequence[ChunkKey],
                tensors: Sequence[torch.Tensor]) -> TaskId:
        """Register a task for already-checked arguments and hand it to the worker thread."""

    @abstractmethod
    def _log_failure(self, task: T, error: str | None) -> None:
        """Log a task that finished FAILED (each tier names its own server)."""

    # -- public API (any thread) ----------------------------------------------------------
    def submit_fetch(self, keys: Sequence[ChunkKey], dst: Sequence[torch.Tensor]) -> TaskId:
        check_batch(self.geometry, keys, dst, "dst")
        return self._submit(TaskKind.FETCH, keys, dst)

    def submit_lookup(self, keys: Sequence[ChunkKey]) -> TaskId:
        check_batch(self.geometry, keys, None, "keys")
        return self._submit(TaskKind.LOOKUP, keys, [])

    def poll(self) -> dict[TaskId, TaskResult]:
        with self._lock:
            out, self._results = self._results, {}
        return out

    def cancel(self, task_id: TaskId) -> None:
        with self._lock:
            task = self._tasks.get(task_id)
            if task is None:
                return
            task.cancelled = True
        with task.copy_lock:  # waits for at most one chunk copy already under way
            pass
        self._finish(task, TaskStatus.CANCELLED, [False] * len(task.keys), error="cancelled")

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def check_integrity(self) -> None:
        with self._lock:
            assert not set(self._tasks) & set(self._results), "a task is pending and done"
            assert all(t.task_id == i for i, t in self._tasks.items())
            assert all(r.task_id == i for i, r in self._results.items())
            c = self._counters
            assert c["completed"] + len(self._tasks) == c["submitted"], "lost a task"
            assert all(v >= 0 for v in c.values())

    # -- bookkeeping -----------------------------------------------------------------------
    def _close_tasks(self) -> bool:
        """Mark the tier closed and cancel every pending task; False if it already was."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            pending = list(self._tasks.values())
        for task in pending:
            self.cancel(task.task_id)
        return True

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _finish(self, task: T, status: TaskStatus, ok: Sequence[bool],
                error: str | None = None, nbytes: int = 0, epoch: bytes | None = None) -> None:
        """Publish a task's one result (later calls for the same task are ignored)."""
        if task.kind is not TaskKind.PUT:
            ok = prefix_closed(ok)
        result = TaskResult(task.task_id, task.kind, status, tuple(ok), nbytes, error, epoch)
        with self._lock:
            if self._tasks.pop(task.task_id, None) is None:
                return
            self._results[task.task_id] = result
            self._counters["completed"] += 1
            if status is TaskStatus.FAILED:
                self._counters["failures"] += 1
            elif status is TaskStatus.CANCELLED:
                self._counters["cancelled"] += 1
            if task.kind is TaskKind.FETCH and not result.all_ok \
                    and status is not TaskStatus.CANCELLED:
                self._counters["fallbacks"] += 1
        if status is TaskStatus.FAILED:
            self._log_failure(task, error)
