"""The agent-capacity benchmark's budget, summary and report (benchmark/agent_capacity.py); no
server: synthetic session files and replay results."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmark"))

from benchmark.agent_capacity import PLAIN, budget_tokens, markdown, summarize  # noqa: E402


def test_budget_holds_the_largest_final_prefix_times_holds(tmp_path: Path) -> None:
    sessions = tmp_path / "s.jsonl"
    rows = [{"turns": [{"tokens": 200}, {"tokens": 100}]}, {"turns": [{"tokens": 50}]}]
    sessions.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # largest: 1000 system + (200 + 64) + (100 + 64) = 1428; x3 = 4284 -> pages of 64: 4288
    assert budget_tokens(sessions, holds=3, answer_tokens=64, system_tokens=1000) == 4288
    assert budget_tokens(sessions, holds=1, answer_tokens=0, system_tokens=0) == 320


def _run(sha: list[str], e2e: float, cached: int, hits: int = 0, out: int = 0) -> dict:
    turns = [{"session_id": f"s{i}", "turn": 0, "output_sha256": h, "prompt_tokens": 100,
              "cached_tokens": cached} for i, h in enumerate(sha)]  # fmt: skip
    stat = {"median": e2e, "p90": 2 * e2e, "n": len(sha), "mean": e2e, "max": 2 * e2e}
    run = {"turns": turns + [{"session_id": "s9", "turn": 0, "error": "timeout"}],
           "meta": {"wall_s": 10.0},
           "summary": {"by_turn": {"0": {"ttft_s": stat, "e2e_s": stat, "reuse": {"n": 0}}},
                       "all": {"ttft_s": stat, "e2e_s": stat}, "errors": 1}}  # fmt: skip
    if hits:
        run["counters"] = {"vericache:tier_link_events": {"hits_tokens": float(hits)}}
        run["tier"] = {"bytes_out": out}
    return run


def test_summary_compares_answers_with_plain_and_counts_recompute_and_fetches() -> None:
    runs = {PLAIN: _run(["a", "b"], 4.0, cached=10),
            "VeriCache": _run(["a", "x"], 2.0, cached=90, hits=80, out=5_000_000)}  # fmt: skip
    args = argparse.Namespace(sessions=2, turns=1, max_tokens=8, holds=1, think_s=0.0,
                              bandwidth_mbps=100.0, compressor="snapkv:ratio=0.25")  # fmt: skip
    report = summarize(runs, 4096, args)
    plain, vc = report["configs"][PLAIN], report["configs"]["VeriCache"]
    assert (plain["identical"], vc["identical"], vc["answers"]) == (2, 1, 2)
    assert (plain["recomputed_tokens"], vc["recomputed_tokens"]) == (180, 20)
    assert (vc["tier_hit_tokens"], vc["tier_bytes_out"], plain["tier_hit_tokens"]) == (80, 5e6, 0)
    assert vc["errors"] == 1 and vc["all"]["e2e_s"] == {"median": 2.0, "p90": 4.0}
    text = markdown(report)
    assert "**2.00x**" in text and "1/2" in text and "`--max-total-tokens 4096`" in text
    assert "| 0 | 4.00 / 8.00 | 2.00 / 4.00 |" in text  # TTFT cells of turn 0
