"""capacity.py --rounds: a server run several times reports its median wall time, and every
round's outputs are compared with plain's."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmark.capacity import OFFLOAD_ONLY, markdown, summarize


def _run(wall: float, outputs: list[list[int]], peak: int = 2) -> dict:
    meta = [{"prompt_tokens": 100, "vericache": {"mean_accept_len": 2.0}} for _ in outputs]
    return {"outputs": outputs, "meta": meta, "peak_running": peak, "wall_s": wall}


def test_rounds_report_the_median_wall_and_check_every_round() -> None:
    args = argparse.Namespace(prompt_tokens=2048, max_new_tokens=2, draft_len=["auto"],
                              temperature=0.0)  # fmt: skip
    ref = [[1, 2], [3, 4]]
    runs = {"plain": [_run(10.0, ref)],
            OFFLOAD_ONLY: [_run(5.0, ref), _run(9.0, ref, peak=3), _run(6.0, ref)],
            "vericache": [_run(4.0, ref), _run(8.0, [[1, 2], [3, 5]])]}  # fmt: skip
    report = summarize(args, 1, 4096, 2, runs)
    rows = {r["server"]: r for r in report["rows"]}
    assert rows[OFFLOAD_ONLY]["wall_s"] == 6.0 and rows[OFFLOAD_ONLY]["peak_running"] == 3
    assert rows[OFFLOAD_ONLY]["throughput_vs_plain"] == round(10.0 / 6.0, 2)
    assert rows["vericache"]["wall_s"] == 6.0  # the median of an even count: the middle mean
    assert rows["vericache"]["identical_to_plain"] == 3  # one token differs in round 2
    text = markdown(report)
    assert "| 3/4 |" in text and "6.0 (median of [4.0, 8.0])" in text
    assert "| plain | 2 | 2.0 | 2/2 | 10.0 |" in text
