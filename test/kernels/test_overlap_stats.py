"""The overlap benchmark's interval arithmetic (kernels/overlap_stats.py), on made-up timelines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from overlap_stats import analyse_overlap, covered_ms, merge_intervals  # noqa: E402


def test_merge_and_cover() -> None:
    assert merge_intervals([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0)]) == [(0.0, 3.0), (5.0, 6.0)]
    assert covered_ms((1.0, 5.5), [(0.0, 3.0), (5.0, 6.0)]) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        merge_intervals([(2.0, 1.0)])


def test_serialized_copy_reports_no_overlap_and_no_slowdown() -> None:
    # The first H200 run's shape: all copies first, then the steps.
    copies = [(i * 19.4, (i + 1) * 19.4) for i in range(5)]
    steps = [(97.0 + i * 1.6, 97.0 + (i + 1) * 1.6) for i in range(40)]
    report = analyse_overlap(steps, copies, [1 << 30] * 5)
    assert report.overlap_fraction == pytest.approx(0.0)
    assert report.covered_steps_ms == ()
    assert report.slowdown_pct(1.6) is None
    assert report.copy_bytes_in_window == pytest.approx(0.0)


def test_full_overlap_slowdown_over_covered_steps_only() -> None:
    steps = [(i * 2.0, i * 2.0 + 2.0) for i in range(10)]  # 0 .. 20 ms, 2 ms steps
    copies = [(-1.0, 10.0), (10.0, 15.0)]  # busy from before the window up to 15 ms
    report = analyse_overlap(steps, copies, [11e6, 5e6])
    assert report.window_ms == pytest.approx(20.0)
    assert report.overlap_fraction == pytest.approx(0.75)
    assert report.step_coverage[:7] == pytest.approx((1.0,) * 7)
    assert report.step_coverage[7] == pytest.approx(0.5)
    assert len(report.covered_steps_ms) == 7
    assert report.slowdown_pct(1.0) == pytest.approx(100.0)
    # 10 of the first copy's 11 ms and all of the second lie inside the window
    assert report.copy_bytes_in_window == pytest.approx(10e6 + 5e6)
    assert report.h2d_GBps_in_window == pytest.approx(15e6 / 20e-3 / 1e9)
