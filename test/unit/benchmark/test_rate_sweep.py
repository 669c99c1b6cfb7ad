"""The request-rate sweep's arrival schedule and summary (benchmark/rate_sweep.py); no server."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
import itertools

from benchmark.rate_sweep import arrivals, markdown, pct, summarize


def test_arrivals_are_poisson_at_the_rate_and_reproducible() -> None:
    offsets = arrivals(4000, rate=0.5, seed=3)
    assert offsets[0] == 0.0
    assert offsets == sorted(offsets) and offsets == arrivals(4000, rate=0.5, seed=3)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.mean(gaps) == pytest.approx(2.0, rel=0.08)  # 1 / rate
    assert statistics.pstdev(gaps) == pytest.approx(2.0, rel=0.1)  # exponential: sd = mean
    assert arrivals(10, rate=0.5, seed=4) != arrivals(10, rate=0.5, seed=3)


def _req(arrive: float, ttft: float, e2e: float, ids: list[int]) -> dict:
    return {"arrive_s": arrive, "finish_s": arrive + e2e, "ttft_s": ttft, "e2e_s": e2e,
            "tpot_s": (e2e - ttft) / max(len(ids) - 1, 1), "output_ids": ids}  # fmt: skip


def test_summary_counts_identical_outputs_and_uses_the_whole_span() -> None:
    plain = [_req(0.0, 1.0, 5.0, [1, 2, 3]), _req(2.0, 2.0, 6.0, [4, 5, 6])]
    other = [_req(0.0, 0.5, 3.0, [1, 2, 3]), _req(2.0, 0.5, 3.0, [4, 5, 7])]
    runs = {"plain": {0.5: {"requests": plain}}, "vc": {0.5: {"requests": other}}}
    rows = summarize(runs, [0.5])
    by = {r["server"]: r for r in rows}
    assert by["plain"]["identical_to_plain"] == 2 and by["vc"]["identical_to_plain"] == 1
    assert by["plain"]["output_tokens_per_s"] == pytest.approx(6 / 8.0, abs=0.01)  # 0 .. 8 s
    assert by["vc"]["e2e_median_s"] == 3.0 and by["plain"]["ttft_median_s"] == 1.5
    table = markdown({"budget_tokens": 100, "n_full": 2, "prompt_tokens": 40, "seed": 5,
                      "max_new_tokens": 3, "requests": 2, "rows": rows})  # fmt: skip
    assert table.count("\n| 0.5 |") == 2 and "1/2" in table


def test_percentile_picks_an_observed_value() -> None:
    assert pct([3.0, 1.0, 2.0, 10.0], 0.9) == 10.0
    assert pct([1.0], 0.9) == 1.0


def test_a_failed_request_fails_the_run_with_its_reason() -> None:
    from benchmark.rate_sweep import run_rate

    with pytest.raises(RuntimeError, match=r"2 request\(s\) failed.*request 0"):
        run_rate("http://127.0.0.1:9", [{"text": "a"}, {"text": "b"}], [0.0, 0.0], 4, "dead")
