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
    assert full["kl_nats_per_token_mean"] == pytest.approx(0.0, abs=1e-5)  # same distributions
    for r in doc["results"]:
        assert len(r["kl_per_prompt"]) == 1 and r["kl_nats_per_token_mean"] >= -1e-6


def test_kl_divergence_ignores_tokens_the_reference_never_emits() -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    try:
        from benchmark.compressors_chains import kl_divergence
    finally:
        sys.path.remove(str(ROOT))
    banned = torch.tensor([0.0, 1.0, float("-inf")])  # the benchmark bans EOS with -inf
    p = banned.log_softmax(-1)
    q = torch.tensor([1.0, 0.0, float("-inf")]).log_softmax(-1)
    expected = float((p.exp()[:2] * (p[:2] - q[:2])).sum())
    assert kl_divergence(p, p) == 0.0
    assert kl_divergence(p, q) == pytest.approx(expected) and expected > 0
