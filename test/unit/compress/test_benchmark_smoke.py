"""The compressor benchmark runs end to end (tiny random Llama) and its drafting engine is exact:
the ``full`` compressor reproduces the full-KV greedy trajectory token for token."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmark import compressors
    finally:
        sys.path.remove(str(ROOT))
    return compressors


def test_quick_run_writes_all_outputs(bench, tmp_path: Path) -> None:
    doc = bench.main(["--quick", "--model", "tiny-random", "--out-dir", str(tmp_path)])
    for name in ("compressors.json", "compressors.md", "compressors_accept.png", "compressors_match.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    saved = json.loads((tmp_path / "compressors.json").read_text())
    assert saved["prompt_set"]["done"] == saved["prompt_set"]["n"] == 2
    for r in saved["results"]:
        assert r["measured_ratio"] > 3.0  # fitted to 4x measured bytes (tiny model: coarse steps)
        assert 1.0 <= r["accepted"]["8"]["mean_accepted_per_verify"] <= 9.0
    assert doc["check"]["best_dropper"]["family"] in bench.DROPPERS


def test_full_kv_draft_is_exact(bench, tmp_path: Path) -> None:
    horizon = 12
    doc = bench.main(["--model", "tiny-random", "--prompts", "1", "--min-tokens", "200",
                      "--max-tokens", "300", "--horizon", str(horizon), "--ratios", "4",
                      "--draft-lengths", "4", "--main-x", "4", "--families", "full,streaming,kivi",
                      "--out-dir", str(tmp_path)])
    full = next(r for r in doc["results"] if r["family"] == "full")
    assert full["matched_per_prompt"] == [horizon]
    assert full["accepted"]["4"]["mean_accepted_per_verify"] == 5.0
    assert full["measured_ratio"] == 1.0
