"""Interval arithmetic for the overlap benchmark: how much of a drafting window a copy covered.

All times are milliseconds from one reference point (CUDA event timestamps on one device are
comparable across streams; on CPU smoke runs, wall-clock). Pure Python, unit-tested on CPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Interval = tuple[float, float]  # (start_ms, end_ms), start <= end

FULLY_COVERED = 0.99  # a step counts as "under a copy" when a copy was busy for >= 99% of it


def merge_intervals(intervals: Sequence[Interval]) -> list[Interval]:
    """Union of intervals as sorted, disjoint intervals."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"interval ends before it starts: {(start, end)}")
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered_ms(span: Interval, busy: Sequence[Interval]) -> float:
    """Length of `span` that lies inside the union `busy` (disjoint, as merge_intervals gives)."""
    start, end = span
    return sum(max(0.0, min(end, b_end) - max(start, b_start)) for b_start, b_end in busy)


@dataclass(frozen=True, slots=True)
class OverlapReport:
    """What the copies covered of a drafting window of consecutive steps.

    window_ms: first step start to last step end. overlap_fraction: share of the window during
    which at least one copy was running on the device. step_coverage: per step, the same share.
    covered_steps_ms: durations of the steps fully under a copy (coverage >= FULLY_COVERED).
    copy_bytes_in_window: bytes of every copy, each weighted by the share of its interval inside
    the window (copies are assumed to move bytes evenly over their interval).
    """

    window_ms: float
    overlap_fraction: float
    step_coverage: tuple[float, ...]
    covered_steps_ms: tuple[float, ...]
    copy_busy_ms: float
    copy_bytes_in_window: float

    @property
    def h2d_GBps_in_window(self) -> float:
        return self.copy_bytes_in_window / max(self.window_ms * 1e-3, 1e-12) / 1e9

    def slowdown_pct(self, alone_ms: float) -> float | None:
        """Median step time under a copy vs `alone_ms`, in percent; None if no step was fully
        under a copy (then there is no overlapped measurement to report)."""
        if not self.covered_steps_ms:
            return None
        return 100.0 * (statistics.median(self.covered_steps_ms) / alone_ms - 1.0)


def analyse_overlap(steps: Sequence[Interval], copies: Sequence[Interval],
                    copy_bytes: Sequence[float]) -> OverlapReport:
    """steps: the drafting steps in order; copies: every copy task's device interval, with its
    bytes in copy_bytes (same order)."""
    if not steps:
        raise ValueError("no steps")
    if len(copies) != len(copy_bytes):
        raise ValueError("copies and copy_bytes differ in length")
    busy = merge_intervals(copies)
    window = (steps[0][0], steps[-1][1])
    window_ms = max(window[1] - window[0], 0.0)
    coverage = tuple(covered_ms(s, busy) / (s[1] - s[0]) if s[1] > s[0] else 0.0 for s in steps)
    covered = tuple(s[1] - s[0] for s, c in zip(steps, coverage) if c >= FULLY_COVERED)
    in_window = 0.0
    for (start, end), nbytes in zip(copies, copy_bytes):
        if end > start:
            in_window += nbytes * covered_ms((start, end), [window]) / (end - start)
    return OverlapReport(
        window_ms=window_ms,
        overlap_fraction=covered_ms(window, busy) / window_ms if window_ms > 0 else 0.0,
        step_coverage=coverage,
        covered_steps_ms=covered,
        copy_busy_ms=sum(e - s for s, e in busy),
        copy_bytes_in_window=in_window,
    )
