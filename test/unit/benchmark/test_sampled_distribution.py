"""The distribution test of ``benchmark/sampled_distribution.py``: calibrated under the null,
rejects a real difference, and its power bound inverts (pure python + scipy, < 1 s)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmark.sampled_distribution import chi_square_homogeneity, power_at, required_n  # noqa: E402

OUTCOMES = ["a"] * 40 + ["b"] * 30 + ["c"] * 20 + [f"rare{i}" for i in range(10)]


def test_null_rejection_rate_is_about_alpha() -> None:
    rng = random.Random(0)
    rejections = 0
    for _ in range(400):
        a = [rng.choice(OUTCOMES) for _ in range(300)]
        b = [rng.choice(OUTCOMES) for _ in range(300)]
        rejections += chi_square_homogeneity(a, b).p_value < 0.05
    assert rejections / 400 <= 0.09, rejections  # 0.05 nominal; lumping makes it conservative


def test_rejects_a_shift_of_total_variation_0_1() -> None:
    rng = random.Random(1)
    shifted = ["a"] * 30 + ["b"] * 40 + ["c"] * 20 + [f"rare{i}" for i in range(10)]
    a = [rng.choice(OUTCOMES) for _ in range(2000)]
    b = [rng.choice(shifted) for _ in range(2000)]
    result = chi_square_homogeneity(a, b)
    assert result.p_value < 1e-6 and result.tv == pytest.approx(0.1, abs=0.03)


def test_rare_outcomes_are_lumped_and_identical_samples_pass() -> None:
    rng = random.Random(2)
    a = [rng.choice(OUTCOMES) for _ in range(200)]
    result = chi_square_homogeneity(a, list(a))
    assert result.p_value == pytest.approx(1.0) and result.tv == 0.0
    # a, b, c (and perhaps a rare outcome drawn often) kept; the other rare ones form one cell
    assert 3 <= result.cells < 13 and result.df == result.cells
    assert chi_square_homogeneity(["x"] * 5, ["x"] * 7).p_value == 1.0


def test_power_bound_and_required_n_agree() -> None:
    n = required_n(df=5, tv=0.05, alpha=0.01, power=0.9)
    assert power_at(n, 5, 0.05, 0.01) >= 0.9 > power_at(n - 1, 5, 0.05, 0.01)
    assert required_n(df=1, tv=0.05, alpha=0.05) == pytest.approx(2100, rel=0.02)  # z-test size
