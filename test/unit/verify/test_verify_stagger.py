from __future__ import annotations

import random
from collections import defaultdict

import pytest

from sglang_vericache.verify.rings import RingConfig, TransferDemand
from sglang_vericache.verify.stagger import StaggerConfig, StaggerScheduler, _search_order

GENEROUS = RingConfig(horizon_steps=40, link_bytes_per_step=10**9, buffer_bytes=10**12)


def _simulate(sched: StaggerScheduler, n: int, x: int, steps: int, demand: TransferDemand,
              fetch_extra_steps: int = 0):
    """Drive the scheduler like the worker does: verify when due and the
    transfer (plus an extra delay) is done, then start the next window."""
    windows: dict[str, tuple[int, int]] = {}  # rid -> (start, planned verify step)
    fetch_began: dict[str, int] = {}
    verified_at: dict[str, list[int]] = defaultdict(list)
    per_step: list[int] = []
    all_plans = []
    for i in range(n):
        sched.submit(f"r{i}", 0, x, demand)
        sched.check_integrity()
    for t in range(steps):
        plan = sched.step(t, n)
        sched.check_integrity()
        for wp in plan.planned:
            all_plans.append(wp)
            windows[wp.rid] = (wp.start_step, wp.verify_step)
            assert wp.draft_len == min(wp.verify_step - wp.start_step, sched.config.max_len)
        for rid in plan.start_fetch:
            assert rid not in fetch_began
            fetch_began[rid] = t
        assert [windows[r][1] for r in plan.verify] == sorted(windows[r][1] for r in plan.verify)
        done = 0
        for rid in plan.verify:
            res = sched.reservation(rid)
            assert res is not None and res.verify_step <= t
            transfer_end = res.transfer[-1][0] + 1 if res.transfer else res.verify_step
            if t < transfer_end + fetch_extra_steps:
                continue  # full KV not resident yet: the request waits (AWAIT_FULL)
            sched.complete(rid)
            sched.check_integrity()
            del fetch_began[rid]
            verified_at[rid].append(t)
            sched.submit(rid, t + 1, x, demand)
            sched.check_integrity()
            done += 1
        per_step.append(done)
    return all_plans, verified_at, per_step


def test_search_order() -> None:
    assert _search_order(4, 1, 8) == [4, 3, 5, 2, 6, 1, 7, 8]
    assert _search_order(1, 1, 3) == [1, 2, 3]
    assert _search_order(9, 2, 5) == [5, 4, 3, 2]


@pytest.mark.parametrize("n,x", [(8, 4), (16, 7), (5, 1), (30, 10)])
def test_steady_state_counts_windows_and_no_starvation(n: int, x: int) -> None:
    cfg = StaggerConfig(min_len=1, max_len=2 * x + 2, rings=GENEROUS)
    sched = StaggerScheduler(cfg)
    steps = 40 * (x + 1)
    plans, verified_at, per_step = _simulate(sched, n, x, steps, TransferDemand(1000, 1000))
    for wp in plans:  # every window is planned inside [start + min_len, start + max_len]
        assert cfg.min_len <= wp.verify_step - wp.start_step <= cfg.max_len
    cap = sched.cap(n, x)
    assert max(per_step) <= cap
    warm = per_step[2 * (x + 1):]
    mean = sum(warm) / len(warm)
    assert mean == pytest.approx(n / (x + 1), rel=0.15)
    for rid, times in verified_at.items():
        gaps = [b - a for a, b in zip([0] + times, times)]
        assert max(gaps) <= cfg.max_len + 1, (rid, gaps)  # verifies within its window
    assert len(verified_at) == n


def test_arrivals_together_are_spread_over_the_cycle() -> None:
    sched = StaggerScheduler(StaggerConfig(min_len=1, max_len=8, rings=GENEROUS))
    for i in range(8):
        sched.submit(f"r{i}", 0, 4, TransferDemand(0, 0))
    plan = sched.step(0, 8)
    sched.check_integrity()
    steps = [wp.verify_step for wp in plan.planned]
    assert [wp.rid for wp in plan.planned] == [f"r{i}" for i in range(8)]  # FIFO
    assert len(set(steps)) == 4 and max(steps.count(s) for s in steps) == sched.cap(8, 4) == 2
    assert all(1 <= s <= 8 for s in steps)


def test_bandwidth_bound_queues_fifo_without_starvation() -> None:
    rings = RingConfig(horizon_steps=20, link_bytes_per_step=100, buffer_bytes=10**6)
    sched = StaggerScheduler(StaggerConfig(min_len=1, max_len=8, rings=rings))
    steps = 400
    _, verified_at, per_step = _simulate(sched, 6, 4, steps, TransferDemand(250, 10))
    total = sum(per_step)
    assert total <= steps * 100 / 250 + 1  # the link is never oversubscribed
    assert total >= steps * 100 / 250 * 0.8  # and is kept busy
    counts = [len(v) for v in verified_at.values()]
    assert len(counts) == 6 and max(counts) - min(counts) <= 2  # fair
    for times in verified_at.values():
        gaps = [b - a for a, b in zip([0] + times, times)]
        assert max(gaps) <= 6 * 3 + 8


def test_transient_memory_bound_limits_concurrent_holds() -> None:
    rings = RingConfig(horizon_steps=20, link_bytes_per_step=100, buffer_bytes=100)
    sched = StaggerScheduler(StaggerConfig(min_len=1, max_len=8, rings=rings))
    _, verified_at, per_step = _simulate(sched, 6, 4, 200, TransferDemand(150, 60))
    # Only one 60-byte buffer fits at a time; each hold lasts >= 3 steps.
    assert sum(per_step) <= 200 / 3 + 1
    assert len(verified_at) == 6


def test_late_fetch_keeps_request_due_until_complete() -> None:
    sched = StaggerScheduler(StaggerConfig(min_len=1, max_len=8, rings=GENEROUS))
    _, verified_at, per_step = _simulate(sched, 4, 3, 120, TransferDemand(10, 10),
                                         fetch_extra_steps=2)
    assert len(verified_at) == 4
    assert all(len(v) >= 120 // (3 + 1 + 2 + 1) - 1 for v in verified_at.values())


def test_start_fetch_reported_once_and_late_window() -> None:
    rings = RingConfig(horizon_steps=12, link_bytes_per_step=10, buffer_bytes=100)
    sched = StaggerScheduler(StaggerConfig(min_len=2, max_len=4, rings=rings))
    sched.submit("a", 0, 3, TransferDemand(20, 10))
    plan = sched.step(0, 1)
    (wp,) = plan.planned
    assert (wp.start_step, wp.verify_step, wp.draft_len) == (0, 3, 3)
    assert wp.reservation.transfer == ((1, 10), (2, 10))
    assert plan.start_fetch == () and plan.verify == ()
    assert sched.step(1, 1).start_fetch == ("a",)
    assert sched.step(2, 1).start_fetch == ()
    assert sched.step(3, 1).verify == ("a",)
    assert sched.step(4, 1).verify == ("a",)  # overdue until completed
    sched.complete("a")
    sched.check_integrity()
    # A window whose whole range has passed verifies at the first step that fits.
    sched.submit("a", 0, 3, TransferDemand(0, 10))
    plan = sched.step(10, 1)
    (wp,) = plan.planned
    assert wp.verify_step == 11 and wp.draft_len == 4
    sched.check_integrity()


def test_errors() -> None:
    rings = RingConfig(horizon_steps=6, link_bytes_per_step=10, buffer_bytes=100)
    sched = StaggerScheduler(StaggerConfig(min_len=1, max_len=4, rings=rings))
    sched.submit("a", 0, 2, TransferDemand(0, 0))
    with pytest.raises(KeyError):
        sched.submit("a", 0, 2, TransferDemand(0, 0))
    with pytest.raises(ValueError):
        sched.submit("b", 0, 2, TransferDemand(51, 0))  # needs 6 transfer steps
    with pytest.raises(ValueError):
        sched.submit("b", 0, -1, TransferDemand(0, 0))
    with pytest.raises(KeyError):
        sched.complete("zz")
    sched.complete("a")  # a queued window can be dropped too
    assert not sched.is_tracked("a")
    sched.step(3, 1)
    with pytest.raises(ValueError):
        sched.step(2, 1)
    with pytest.raises(ValueError):
        StaggerConfig(min_len=1, max_len=6, rings=rings)  # horizon too short
    with pytest.raises(ValueError):
        StaggerConfig(min_len=0, max_len=2, rings=rings)
    sched.check_integrity()


@pytest.mark.parametrize("seed", range(20))
def test_random_workload_invariants(seed: int) -> None:
    rng = random.Random(seed)
    rings = RingConfig(horizon_steps=rng.randint(10, 24), link_bytes_per_step=rng.randint(5, 50),
                       buffer_bytes=rng.randint(50, 200), hold_after_steps=rng.randint(0, 1))
    max_len = rng.randint(2, 8)
    sched = StaggerScheduler(StaggerConfig(min_len=1, max_len=max_len, rings=rings))
    active: set[str] = set()
    next_id = 0
    last_verify: dict[str, int] = {}
    for t in range(300):
        if rng.random() < 0.2 and len(active) < 12:
            rid = f"r{next_id}"
            next_id += 1
            demand = TransferDemand(rng.randint(0, 3 * rings.link_bytes_per_step),
                                    rng.randint(0, 50))
            sched.submit(rid, t, rng.randint(0, 10), demand)
            active.add(rid)
            last_verify[rid] = t
        plan = sched.step(t, max(len(active), 1))
        sched.check_integrity()
        for rid in plan.verify:
            if rng.random() < 0.8:  # sometimes the fetch is late
                sched.complete(rid)
                last_verify[rid] = t
                if rng.random() < 0.1:
                    active.discard(rid)  # finished
                else:
                    demand = TransferDemand(rng.randint(0, 3 * rings.link_bytes_per_step),
                                            rng.randint(0, 50))
                    sched.submit(rid, t + 1, rng.randint(0, 10), demand)
                sched.check_integrity()
        if active and rng.random() < 0.03:  # abort at any phase
            rid = rng.choice(sorted(active))
            sched.complete(rid)
            active.discard(rid)
            sched.check_integrity()
        # Nobody waits forever: the queue drains FIFO as the rings free up.
        for rid in active:
            assert t - last_verify[rid] <= 150, (rid, t, last_verify[rid])
