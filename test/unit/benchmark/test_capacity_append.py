"""capacity.py --append: an earlier sweep's other budgets are kept only if comparable."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmark.capacity import OFFLOAD_ONLY, kept_reports

SERVERS = ["plain", OFFLOAD_ONLY, "vericache snapkv:ratio=0.25"]


def _args(**over) -> argparse.Namespace:
    base = {"prompt_tokens": 2048, "max_new_tokens": 64, "draft_len": ["6"], "temperature": 0.0,
            "no_offload_baseline": False, "compressors": ["snapkv:ratio=0.25"],
            "n_full": [3, 6]}  # fmt: skip
    return argparse.Namespace(**(base | over))


def _report(n_full: int) -> dict:
    return {"n_full": n_full, "prompt_tokens": 2048, "max_new_tokens": 64, "draft_len": ["6"],
            "rows": [{"server": s, "requests": 8} for s in SERVERS]}  # fmt: skip


def test_keeps_the_budgets_this_run_does_not_measure(tmp_path: Path) -> None:
    path = tmp_path / "sweep.json"
    assert kept_reports(path, _args(), 8) == []  # nothing there yet
    path.write_text(json.dumps({"sweep": [_report(2), _report(6)]}))
    assert [r["n_full"] for r in kept_reports(path, _args(), 8)] == [2]
    path.write_text(json.dumps(_report(12)))  # a single-budget run has no "sweep" list
    assert [r["n_full"] for r in kept_reports(path, _args(), 8)] == [12]


@pytest.mark.parametrize("change", [{"max_new_tokens": 128}, {"draft_len": ["4"]},
                                    {"compressors": ["kivi:bits=4"]}, {"no_offload_baseline": True},
                                    {"temperature": 0.7}])
def test_refuses_a_sweep_measured_otherwise(tmp_path: Path, change: dict) -> None:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"sweep": [_report(2)]}))
    with pytest.raises(ValueError, match="--append"):
        kept_reports(path, _args(**change), 8)
    with pytest.raises(ValueError, match="requests"):
        kept_reports(path, _args(), 12)
