from __future__ import annotations

import dataclasses
import random

import pytest

from sglang_vericache.verify.policy import (
    AcceptanceConfig,
    AcceptanceEstimate,
    expected_committed,
)


def test_expected_committed_closed_form() -> None:
    for a in (0.0, 0.3, 0.9, 0.999):
        for x in range(0, 20):
            assert expected_committed(a, x) == pytest.approx((1 - a ** (x + 1)) / (1 - a))
    assert expected_committed(1.0, 7) == 8.0


def test_configs_are_frozen_and_validated() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        AcceptanceConfig().decay = 0.5  # type: ignore[misc]
    with pytest.raises(ValueError):
        AcceptanceConfig(decay=1.0)
    with pytest.raises(ValueError):
        AcceptanceConfig(prior_weight=0.0)


def test_acceptance_estimate_tracks_history() -> None:
    est = AcceptanceEstimate(AcceptanceConfig(decay=0.8, prior_alpha=0.5, prior_weight=2.0))
    est.check_integrity()
    assert est.alpha == pytest.approx(0.5)
    for _ in range(30):
        est.update(drafted=8, accepted=8)
        est.check_integrity()
    high = est.alpha
    assert high > 0.95
    for _ in range(30):
        est.update(drafted=8, accepted=0)
        est.check_integrity()
    assert est.alpha < 0.2 < high  # the prior keeps it off 0 (weight 2 vs 5 trials)
    est.update(drafted=0, accepted=0)  # no information
    assert est.observations == 60
    with pytest.raises(ValueError):
        est.update(drafted=2, accepted=3)
    est.check_integrity()


@pytest.mark.parametrize("true_alpha", [0.3, 0.7, 0.95])
def test_acceptance_estimate_recovers_geometric_alpha(true_alpha: float) -> None:
    rng = random.Random(7)
    est = AcceptanceEstimate(AcceptanceConfig(decay=0.98, prior_alpha=0.5, prior_weight=1.0))
    for _ in range(400):
        k = 0
        while k < 8 and rng.random() < true_alpha:
            k += 1
        est.update(8, k)
    est.check_integrity()
    assert est.alpha == pytest.approx(true_alpha, abs=0.08)
