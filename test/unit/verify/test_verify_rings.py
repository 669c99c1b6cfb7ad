from __future__ import annotations

import dataclasses
import random

import pytest

from sglang_vericache.verify.rings import RingConfig, StepRing, TransferDemand, VerifyRings


def _free_map(rings: VerifyRings) -> tuple[list[int], list[int]]:
    steps = range(rings.now, rings.now + rings.config.horizon_steps)
    return [rings.link.free_at(s) for s in steps], [rings.buffer.free_at(s) for s in steps]


def test_step_ring_reserve_release_advance() -> None:
    ring = StepRing("t", horizon=4, capacity=10)
    assert ring.can_reserve({0: 4, 3: 10})
    assert not ring.can_reserve({4: 1})  # outside the window
    assert not ring.can_reserve({0: 11})
    ring.reserve("a", {0: 4, 3: 10})
    ring.check_integrity()
    with pytest.raises(KeyError):
        ring.reserve("a", {1: 1})
    with pytest.raises(ValueError):
        ring.reserve("b", {3: 1})
    ring.advance(1)  # step 0 consumed
    ring.check_integrity()
    assert ring.reserved("a") == {3: 10}
    assert ring.free_at(4) == 10  # step 4 entered the window empty
    assert ring.release("a") == 10
    ring.check_integrity()
    assert [ring.free_at(s) for s in range(1, 5)] == [10] * 4
    ring.advance(100)
    ring.check_integrity()
    with pytest.raises(ValueError):
        ring.advance(99)
    with pytest.raises(KeyError):
        ring.release("a")


def test_transfer_is_packed_latest_first_before_verify() -> None:
    rings = VerifyRings(RingConfig(horizon_steps=8, link_bytes_per_step=100, buffer_bytes=1000))
    res = rings.admit("a", TransferDemand(link_bytes=250, buffer_bytes=300), earliest=0,
                      verify_step=5)
    rings.check_integrity()
    assert res.transfer == ((2, 50), (3, 100), (4, 100))
    assert res.fetch_step == 2 and res.link_bytes == 250
    assert (res.hold_first, res.hold_last) == (2, 5)
    link, buf = _free_map(rings)
    assert link == [100, 100, 50, 0, 0, 100, 100, 100]
    assert buf == [1000, 1000, 700, 700, 700, 700, 1000, 1000]
    # A second transfer for the same verify step must go earlier.
    res_b = rings.admit("b", TransferDemand(150, 300), earliest=0, verify_step=5)
    assert res_b.transfer == ((1, 100), (2, 50))
    rings.check_integrity()


def test_zero_byte_demand_holds_only_the_verify_step() -> None:
    rings = VerifyRings(RingConfig(horizon_steps=4, link_bytes_per_step=1, buffer_bytes=10,
                                   hold_after_steps=1))
    res = rings.admit("a", TransferDemand(0, 4), earliest=0, verify_step=1)
    assert res.transfer == () and res.fetch_step == 1 and (res.hold_first, res.hold_last) == (1, 2)
    rings.check_integrity()
    assert not rings.can_admit("b", TransferDemand(0, 7), 0, 2)
    assert not rings.can_admit("b", TransferDemand(0, 7), 0, 0)  # holds 0..1, 1 overlaps
    assert rings.can_admit("b", TransferDemand(0, 6), 0, 0)
    assert not rings.can_admit("b", TransferDemand(0, 1), 0, 3)  # hold would leave the window
    assert not rings.can_admit("a", TransferDemand(0, 1), 0, 0)  # already holds one


def test_admission_limits() -> None:
    cfg = RingConfig(horizon_steps=5, link_bytes_per_step=10, buffer_bytes=50)
    rings = VerifyRings(cfg)
    assert rings.fits_empty(TransferDemand(40, 50))
    assert not rings.fits_empty(TransferDemand(41, 10))
    assert not rings.fits_empty(TransferDemand(1, 51))
    assert rings.plan("a", TransferDemand(10, 1), earliest=0, verify_step=5) is None  # hold out
    assert rings.plan("a", TransferDemand(10, 1), earliest=3, verify_step=3) is None  # no room
    with pytest.raises(ValueError):
        rings.admit("a", TransferDemand(41, 1), 0, 4)
    rings.check_integrity()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.buffer_bytes = 3  # type: ignore[misc]
    for bad in (dict(horizon_steps=1), dict(link_bytes_per_step=0), dict(hold_after_steps=4)):
        with pytest.raises(ValueError):
            dataclasses.replace(cfg, **bad)
    with pytest.raises(ValueError):
        TransferDemand(-1, 0)


def test_release_frees_exactly_what_admit_took() -> None:
    rings = VerifyRings(RingConfig(horizon_steps=10, link_bytes_per_step=64, buffer_bytes=256))
    rings.admit("x", TransferDemand(100, 100), 0, 6)
    before = _free_map(rings)
    rings.admit("y", TransferDemand(150, 120), 1, 8)
    rings.check_integrity()
    rings.release("y")
    rings.check_integrity()
    assert _free_map(rings) == before


@pytest.mark.parametrize("seed", range(30))
def test_random_operations_never_over_reserve(seed: int) -> None:
    rng = random.Random(seed)
    cfg = RingConfig(horizon_steps=rng.randint(3, 12), link_bytes_per_step=rng.randint(1, 100),
                     buffer_bytes=rng.randint(1, 300), hold_after_steps=rng.randint(0, 1))
    rings = VerifyRings(cfg)
    now = 0
    admitted = 0
    for _ in range(300):
        op = rng.random()
        rid = f"r{rng.randrange(8)}"
        if op < 0.55:
            demand = TransferDemand(rng.randint(0, 3 * cfg.link_bytes_per_step),
                                    rng.randint(0, cfg.buffer_bytes))
            verify = now + rng.randint(0, cfg.horizon_steps)
            earliest = now + rng.randint(-1, 2)
            can = rings.can_admit(rid, demand, earliest, verify)
            link_before, buf_before = _free_map(rings)
            if can:
                res = rings.admit(rid, demand, earliest, verify)
                admitted += 1
                assert res.link_bytes == demand.link_bytes
                assert all(max(earliest, now) <= s < verify for s, _ in res.transfer)
                link_after, buf_after = _free_map(rings)
                assert sum(link_before) - sum(link_after) == demand.link_bytes
                held = res.hold_last - res.hold_first + 1
                assert sum(buf_before) - sum(buf_after) == held * demand.buffer_bytes
            else:
                with pytest.raises((KeyError, ValueError)):
                    rings.admit(rid, demand, earliest, verify)
                assert _free_map(rings) == (link_before, buf_before)
        elif op < 0.85:
            if rid in rings:
                link_before, buf_before = _free_map(rings)
                remaining_link = sum(rings.link.reserved(rid).values())
                remaining_buf = sum(rings.buffer.reserved(rid).values())
                rings.release(rid)
                link_after, buf_after = _free_map(rings)
                assert sum(link_after) - sum(link_before) == remaining_link
                assert sum(buf_after) - sum(buf_before) == remaining_buf
            else:
                with pytest.raises(KeyError):
                    rings.release(rid)
        else:
            now += rng.randint(1, 3)
            rings.advance(now)
        rings.check_integrity()  # includes 0 <= used <= capacity at every step
    assert admitted > 0
