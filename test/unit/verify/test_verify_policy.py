from __future__ import annotations

import dataclasses
import random

import pytest

from sglang_vericache.verify.policy import (
    AcceptanceConfig,
    AcceptanceEstimate,
    AdaptiveDraftLength,
    DraftCosts,
    DraftQuery,
    FixedDraftLength,
    expected_committed,
)


def _random_costs(rng: random.Random) -> DraftCosts:
    return DraftCosts(draft_step_s=rng.uniform(0.001, 0.2), fetch_eta_s=rng.uniform(0.0, 3.0),
                      verify_base_s=rng.uniform(0.0, 0.5), verify_per_token_s=rng.uniform(0, 0.02))


def _brute_force(policy: AdaptiveDraftLength, q: DraftQuery) -> int:
    def rate(x: int) -> float:
        a = q.alpha
        e = x + 1 if a == 1.0 else (1 - a ** (x + 1)) / (1 - a)
        return e / q.costs.window_time(x)
    rates = {x: rate(x) for x in range(policy.min_len, policy.max_len + 1)}
    best = max(rates.values())
    return max(x for x, r in rates.items() if r >= best * (1 - 1e-9))


def test_expected_committed_closed_form() -> None:
    for a in (0.0, 0.3, 0.9, 0.999):
        for x in range(0, 20):
            assert expected_committed(a, x) == pytest.approx((1 - a ** (x + 1)) / (1 - a))
    assert expected_committed(1.0, 7) == 8.0


def test_fixed_policy_and_remaining_budget() -> None:
    p = FixedDraftLength(6)
    costs = DraftCosts(draft_step_s=0.01)
    assert p.choose(DraftQuery(0.1, costs)) == 6
    assert p.choose(DraftQuery(0.9, costs, remaining_tokens=4)) == 3
    assert p.choose(DraftQuery(0.9, costs, remaining_tokens=1)) == 0
    assert (p.min_len, p.max_len) == (6, 6)
    with pytest.raises(ValueError):
        FixedDraftLength(0)


@pytest.mark.parametrize("seed", range(25))
def test_adaptive_respects_bounds_and_is_the_argmax(seed: int) -> None:
    rng = random.Random(seed)
    lo = rng.randint(1, 8)
    policy = AdaptiveDraftLength(min_len=lo, max_len=lo + rng.randint(0, 40))
    for _ in range(20):
        q = DraftQuery(alpha=rng.random(), costs=_random_costs(rng))
        x = policy.choose(q)
        assert policy.min_len <= x <= policy.max_len
        assert x == _brute_force(policy, q)


@pytest.mark.parametrize("seed", range(25))
def test_adaptive_monotone_in_alpha(seed: int) -> None:
    rng = random.Random(1000 + seed)
    policy = AdaptiveDraftLength(min_len=1, max_len=rng.choice([8, 32, 64]))
    costs = _random_costs(rng)
    xs = [policy.choose(DraftQuery(alpha=i / 200, costs=costs)) for i in range(201)]
    assert xs == sorted(xs), xs


@pytest.mark.parametrize("seed", range(25))
def test_adaptive_monotone_in_fetch_eta(seed: int) -> None:
    rng = random.Random(2000 + seed)
    policy = AdaptiveDraftLength(min_len=2, max_len=40)
    base = _random_costs(rng)
    alpha = rng.random()
    xs = [policy.choose(DraftQuery(alpha, dataclasses.replace(base, fetch_eta_s=f / 20)))
          for f in range(0, 200)]
    assert xs == sorted(xs), xs


def test_adaptive_grows_with_slow_fetch_and_high_acceptance() -> None:
    policy = AdaptiveDraftLength(min_len=2, max_len=40)
    fast = DraftQuery(0.5, DraftCosts(draft_step_s=0.01, fetch_eta_s=0.0, verify_base_s=0.01))
    slow = DraftQuery(0.5, DraftCosts(draft_step_s=0.01, fetch_eta_s=0.3, verify_base_s=0.01))
    assert policy.choose(slow) > policy.choose(fast)
    # A transfer longer than any window: draft as long as allowed.
    assert policy.choose(DraftQuery(0.9, DraftCosts(0.01, fetch_eta_s=10.0))) == 40
    assert policy.choose(DraftQuery(1.0, DraftCosts(0.01, verify_base_s=1.0))) == 40


def test_configs_are_frozen_and_validated() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        AdaptiveDraftLength().max_len = 3  # type: ignore[misc]
    with pytest.raises(ValueError):
        AdaptiveDraftLength(min_len=5, max_len=4)
    with pytest.raises(ValueError):
        DraftCosts(draft_step_s=0.0)
    with pytest.raises(ValueError):
        DraftCosts(draft_step_s=1.0, fetch_eta_s=-1.0)
    with pytest.raises(ValueError):
        DraftQuery(alpha=1.5, costs=DraftCosts(1.0))
    with pytest.raises(ValueError):
        DraftQuery(alpha=0.5, costs=DraftCosts(1.0), remaining_tokens=0)
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
