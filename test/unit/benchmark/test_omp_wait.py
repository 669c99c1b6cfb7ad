"""omp_wait.py: each configuration sets only its own OpenMP variable, and a real (tiny) run of
its workload reports positive seconds for every process started together."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmark.omp_wait import configs, markdown, run_together


def test_configurations_set_one_variable_each() -> None:
    table = configs([300, 1000])
    assert table["default spin"] == {}
    assert table["passive"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert table["spin 1000"] == {"GOMP_SPINCOUNT": "1000"}


def test_processes_started_together_each_report_their_time() -> None:
    seconds = run_together("pairs", {"GOMP_SPINCOUNT": "1000"}, 2)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)


def test_markdown_has_a_row_per_configuration() -> None:
    row = {"1": [1.5], "2": [3.0, 3.2], "3": [4.0, 4.5, 5.0], "draft": [0.06]}
    text = markdown({"rounds": 1, "results": {"passive": row, "spin 1000": row}})
    assert "| passive | 1.50-1.50 | 3.00-3.20 | 4.00-5.00 | 60-60 |" in text
    assert "| spin 1000 |" in text
