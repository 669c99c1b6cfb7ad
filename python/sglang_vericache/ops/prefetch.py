"""Asynchronous host -> device copies of a verification's full KV, overlapped with drafting.

On CUDA each task's copies run on one side stream from caller-owned pinned host buffers into
caller-owned device buffers, ordered by events: the side stream first waits for what must finish
before the destinations may be overwritten (`after`: an event recorded after their last reader;
by default all work already queued on the submitting stream), then a completion event is
recorded. poll() queries events and never blocks.

Overlap hazard: with the default `after`, a copy submitted while the drafting stream is current
waits for every draft kernel already queued there, so a host that runs ahead of the GPU turns the
"overlapped" copy into one that starts only after drafting. Pass an event that marks the
destinations' last reader instead.
Off CUDA (CPU devices) the copy runs synchronously inside submit() and completes at once, so the
same submit/poll loop drives both.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

CopyPair = tuple[torch.Tensor, torch.Tensor]  # (host source, device destination), same shape

# Most bytes a copy may move beyond a strided view's own (as a fraction of them) to take the view
# with its gaps in one contiguous copy instead of one copy per contiguous run.
SPAN_WASTE = 0.25


def device_copy_pairs(src: torch.Tensor, device: torch.device | str,
                      max_waste: float = SPAN_WASTE) -> tuple[list[CopyPair], torch.Tensor]:
    """Copies that bring a strided host view ``src`` to ``device``, and the device tensor (same
    shape and strides as ``src``, or contiguous) that holds it once they ran.

    A view of a wider buffer (a host KV row: [L, 2, H_kv, n, D] of [L, 2, H_kv, capacity, D]) is
    contiguous only in runs ([n, D] per layer, K/V and head). Where its memory span, gaps
    included, exceeds its own bytes by at most ``max_waste``, one copy of the span serves (the
    destination keeps the gaps); else one copy per run into a contiguous destination::

        host span   |run0|gap|run1|gap|run2|      span <= (1 + max_waste) x runs: copy it whole
        device      |run0|run1|run2|               else: one copy per run

    Each copy's source is contiguous, so a pinned buffer's copy stays asynchronous (torch would
    stage a strided source through a pageable temporary, synchronously).
    """
    if src.is_contiguous():
        dst = torch.empty_like(src, device=device)
        return [(src, dst)], dst
    span = 1 + sum((size - 1) * stride for size, stride in zip(src.shape, src.stride()))
    if min(src.stride()) >= 0 and span <= (1 + max_waste) * src.numel():
        flat_src = src.as_strided((span,), (1,))
        flat_dst = torch.empty(span, dtype=src.dtype, device=device)
        return [(flat_src, flat_dst)], flat_dst.as_strided(src.shape, src.stride())
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    inner = _contiguous_tail_dims(src)
    outer = src.shape[: src.dim() - inner]
    pairs = [(src[index], dst[index]) for index in itertools.product(*map(range, outer))]
    return pairs, dst


def _contiguous_tail_dims(t: torch.Tensor) -> int:
    """How many trailing dimensions of ``t`` are laid out contiguously (row-major)."""
    expected, count = 1, 0
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if size != 1 and stride != expected:
            break
        expected *= size
        count += 1
    return count


@dataclass(slots=True)
class _Task:
    pairs: tuple[CopyPair, ...]
    done_event: torch.cuda.Event | None
    nbytes: int
    start_event: torch.cuda.Event | None = None  # only with record_timing


@dataclass(frozen=True, slots=True)
class CopyTiming:
    """A finished task's device-side interval: events recorded on the side stream just before its
    first copy began and just after its last copy ended (timing-enabled CUDA events)."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    nbytes: int


class FullKVPrefetcher:
    """submit/poll full-KV copies with task ids; each finished id is returned by poll() once.

    device: where the destinations live. record_timing: also record a start event per task and
    keep (start, end) for finished tasks until take_timing() (benchmarks; CUDA only).
    Mutates nothing but its own task table; the tensors in a task must stay untouched by the
    caller until poll() has returned that task's id. Not thread-safe: drive it from the
    scheduler thread.
    """

    def __init__(self, device: torch.device | str, record_timing: bool = False) -> None:
        self.device = torch.device(device)
        # torch.cuda.Stream() comes from PyTorch's pool, created cudaStreamNonBlocking: it never
        # synchronises implicitly with the legacy default stream.
        self._stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None)
        self._record_timing = record_timing and self._stream is not None
        self._ids = itertools.count()
        self._in_flight: dict[int, _Task] = {}
        self._finished: list[int] = []
        self._timings: dict[int, CopyTiming] = {}
        self.bytes_submitted = 0

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The side stream the copies run on (None on the synchronous CPU fallback)."""
        return self._stream

    @property
    def is_async(self) -> bool:
        """True when copies run on a side CUDA stream (False: synchronous CPU fallback)."""
        return self._stream is not None

    def submit(self, pairs: Sequence[CopyPair], after: torch.cuda.Event | None = None) -> int:
        """Queue copies of host sources into device destinations; returns a new task id.

        pairs: (src, dst) with equal shapes and dtypes; src on the host (pinned for a truly
        asynchronous copy), dst on self.device. after: the copies start once this event has
        completed (record it after the destinations' last reader); None: once all work queued so
        far on the current stream has completed. Never blocks on CUDA.
        """
        checked = tuple(self._check_pair(src, dst) for src, dst in pairs)
        task_id = next(self._ids)
        nbytes = sum(src.numel() * src.element_size() for src, _ in checked)
        self.bytes_submitted += nbytes
        if self._stream is None:
            for src, dst in checked:
                dst.copy_(src)
            self._finished.append(task_id)
            return task_id
        if after is None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self._stream.wait_event(after)
        start = None
        with torch.cuda.stream(self._stream):
            if self._record_timing:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self._stream)
            for src, dst in checked:
                dst.copy_(src, non_blocking=True)
                dst.record_stream(self._stream)
            done = torch.cuda.Event(enable_timing=self._record_timing)
            done.record(self._stream)
        self._in_flight[task_id] = _Task(checked, done, nbytes, start)
        return task_id

    def poll(self) -> list[int]:
        """Ids of tasks finished since the last poll, oldest first; never blocks."""
        for task_id in list(self._in_flight):
            task = self._in_flight[task_id]
            if task.done_event is None or task.done_event.query():
                del self._in_flight[task_id]
                self._finished.append(task_id)
                if task.start_event is not None and task.done_event is not None:
                    self._timings[task_id] = CopyTiming(task.start_event, task.done_event,
                                                        task.nbytes)
        ready, self._finished = self._finished, []
        return ready

    def order_after(self, task_id: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: current) wait for an in-flight task on the device, without
        blocking the host, so a verify forward can be queued before the copy ends."""
        task = self._in_flight.get(task_id)
        if task is None or task.done_event is None:
            return
        (stream or torch.cuda.current_stream(self.device)).wait_event(task.done_event)

    def take_timing(self, task_id: int) -> CopyTiming | None:
        """The device interval of a finished task (record_timing only), returned once."""
        return self._timings.pop(task_id, None)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def check_integrity(self) -> None:
        """Every id is in at most one state; in-flight tasks have events exactly when async."""
        if set(self._in_flight) & set(self._finished):
            raise AssertionError("a task is both in flight and finished")
        if len(set(self._finished)) != len(self._finished):
            raise AssertionError("a finished task is queued twice")
        for task in self._in_flight.values():
            if (task.done_event is None) == self.is_async:
                raise AssertionError("in-flight task event disagrees with the mode")
            if (task.start_event is not None) != self._record_timing:
                raise AssertionError("in-flight task start event disagrees with record_timing")
        if set(self._timings) & set(self._in_flight):
            raise AssertionError("a task in flight already has a timing")

    def _check_pair(self, src: torch.Tensor, dst: torch.Tensor) -> CopyPair:
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError("source and destination must share shape and dtype")
        if dst.device != self.device and not (dst.device.type == self.device.type == "cuda"
                                              and self.device.index is None):
            raise ValueError(f"destination must be on {self.device}")
        if src.device.type != "cpu":
            raise ValueError("source must be a host tensor")
        return src, dst
