from __future__ import annotations

import random

import pytest

from sglang_vericache.verify.window import FetchState, IllegalTransition, Phase, VerifyWindow


def _snapshot(w: VerifyWindow) -> tuple:
    return (w.phase, w.target_len, w.drafts, w.fetch, w.fetch_bytes, w.stats.to_meta_info(),
            w.last_record)


def test_full_accept_goes_through_commit() -> None:
    w = VerifyWindow("r", target_len=3)
    w.check_integrity()
    w.start_fetch(1000)
    w.check_integrity()
    w.add_drafts([5, 6])
    w.add_drafts([7])
    assert w.draft_room == 0
    w.check_integrity()
    w.fetch_done(now=1.0)  # before the draft closed: no waiting
    w.end_draft(now=2.0)
    assert w.ready_to_verify()
    w.begin_verify()
    w.check_integrity()
    rec = w.resolve([5, 6, 7, 8])
    assert w.phase is Phase.COMMIT and w.rolled_back == 0
    assert (rec.drafted, rec.committed, rec.accepted, rec.bytes_fetched) == (3, 4, 3, 1000)
    assert rec.wait_full_s == 0.0
    w.check_integrity()
    w.settle(next_target_len=5)
    w.check_integrity()
    assert w.phase is Phase.DRAFT and w.drafts == () and w.fetch is FetchState.NONE
    meta = w.stats.to_meta_info()
    assert meta["drafted"] == 3 and meta["accepted"] == 3 and meta["verify_steps"] == 1
    assert meta["bytes_fetched"] == 1000 and meta["mean_accept_len"] == 4.0


def test_partial_accept_goes_through_rollback_and_counts_wait() -> None:
    w = VerifyWindow("r", target_len=4)
    w.add_drafts([1, 2, 3, 4])
    w.end_draft(now=10.0)
    w.start_fetch(64)
    w.check_integrity()
    w.fetch_done(now=10.5)
    w.begin_verify()
    rec = w.resolve([1, 9])
    assert w.phase is Phase.ROLLBACK and w.rolled_back == 3
    assert rec.wait_full_s == pytest.approx(0.5)
    w.check_integrity()
    w.settle(2)
    assert w.stats.wait_full_s == pytest.approx(0.5)
    w.check_integrity()


def test_fetch_failure_counts_and_refetch_keeps_wait() -> None:
    w = VerifyWindow("r", target_len=1)
    w.add_drafts([3])
    w.end_draft(now=0.0)
    w.start_fetch(10)
    w.fetch_failed(now=1.0)
    w.check_integrity()
    assert w.fetch is FetchState.NONE and w.stats.fetch_failures == 1
    with pytest.raises(IllegalTransition):
        w.begin_verify()
    w.start_fetch(0)  # e.g. recompute locally
    w.fetch_done(now=3.0)
    w.begin_verify()
    rec = w.resolve([3, 4])
    assert rec.wait_full_s == pytest.approx(3.0)
    w.check_integrity()


def test_resolve_rejects_committed_that_contradicts_drafts() -> None:
    w = VerifyWindow("r", target_len=2)
    w.add_drafts([1, 2])
    w.start_fetch(0)
    w.fetch_done(0.0)
    w.end_draft(0.0)
    w.begin_verify()
    before = _snapshot(w)
    for bad in ([], [7, 2], [1, 2, 3, 4]):
        with pytest.raises(ValueError):
            w.resolve(bad)
        assert _snapshot(w) == before
    w.check_integrity()


def test_finish_reports_fetch_in_flight() -> None:
    w = VerifyWindow("r", target_len=2)
    w.start_fetch(5)
    assert w.finish() is FetchState.IN_FLIGHT
    w.check_integrity()
    with pytest.raises(IllegalTransition):
        w.add_drafts([1])
    v = VerifyWindow("s", target_len=2)
    assert v.finish() is FetchState.NONE
    u = VerifyWindow("u", target_len=0)
    u.start_fetch(1)
    u.fetch_done(0.0)
    u.end_draft(0.0)
    assert u.finish() is FetchState.RESIDENT
    u.check_integrity()


def test_illegal_basics() -> None:
    w = VerifyWindow("r", target_len=1)
    with pytest.raises(IllegalTransition):
        w.add_drafts([1, 2])
    with pytest.raises(IllegalTransition):
        w.begin_verify()
    with pytest.raises(IllegalTransition):
        w.resolve([1])
    with pytest.raises(IllegalTransition):
        w.settle(1)
    with pytest.raises(IllegalTransition):
        w.fetch_done(0.0)
    w.add_drafts([1])
    with pytest.raises(IllegalTransition):
        w.retarget(0)
    with pytest.raises(ValueError):
        VerifyWindow("x", target_len=-1)
    w.check_integrity()


# --------------------------------------------------------------- random walks
ACTIONS = ("retarget", "add", "end_draft", "start_fetch", "fetch_done", "fetch_failed",
           "begin_verify", "resolve", "settle", "finish")


def _legal(w: VerifyWindow, action: str, arg: int) -> bool:
    """Independent statement of the transition table."""
    p, f = w.phase, w.fetch
    if action == "retarget":
        return p is Phase.DRAFT and arg >= w.num_drafted
    if action == "add":
        return p is Phase.DRAFT and w.num_drafted + arg <= w.target_len
    if action == "end_draft":
        return p is Phase.DRAFT
    if action == "start_fetch":
        return p in (Phase.DRAFT, Phase.AWAIT_FULL) and f is FetchState.NONE
    if action in ("fetch_done", "fetch_failed"):
        return p in (Phase.DRAFT, Phase.AWAIT_FULL) and f is FetchState.IN_FLIGHT
    if action == "begin_verify":
        return p is Phase.AWAIT_FULL and f is FetchState.RESIDENT
    if action == "resolve":
        return p is Phase.VERIFY
    if action == "settle":
        return p in (Phase.COMMIT, Phase.ROLLBACK)
    if action == "finish":
        return p not in (Phase.VERIFY, Phase.FINISHED)
    raise AssertionError(action)


def _apply(w: VerifyWindow, action: str, arg: int, rng: random.Random, now: float) -> None:
    if action == "retarget":
        w.retarget(arg)
    elif action == "add":
        w.add_drafts([rng.randrange(5) for _ in range(arg)])
    elif action == "end_draft":
        w.end_draft(now)
    elif action == "start_fetch":
        w.start_fetch(arg * 100)
    elif action == "fetch_done":
        w.fetch_done(now)
    elif action == "fetch_failed":
        w.fetch_failed(now)
    elif action == "begin_verify":
        w.begin_verify()
    elif action == "resolve":
        k = rng.randint(0, w.num_drafted)
        tail = rng.randrange(5)
        w.resolve(list(w.drafts[:k]) + [tail])
    elif action == "settle":
        w.settle(arg)
    elif action == "finish":
        w.finish()


@pytest.mark.parametrize("seed", range(30))
def test_random_sequences_keep_invariants_and_illegal_raise(seed: int) -> None:
    rng = random.Random(seed)
    w = VerifyWindow(f"r{seed}", target_len=rng.randint(0, 4))
    now = 0.0
    legal_done = 0
    for _ in range(400):
        now += rng.random()
        action = rng.choice(ACTIONS)
        arg = rng.randint(0, 4)
        expected = _legal(w, action, arg)
        before = _snapshot(w)
        try:
            _apply(w, action, arg, rng, now)
        except IllegalTransition:
            assert not expected, (action, arg, before)
            assert _snapshot(w) == before
        else:
            assert expected, (action, arg, before)
            legal_done += 1
        w.check_integrity()
        if w.phase is Phase.FINISHED:
            w = VerifyWindow(f"r{seed}", target_len=rng.randint(0, 4))
            w.check_integrity()
    assert legal_done > 50


@pytest.mark.parametrize("seed", range(10))
def test_random_legal_cycles_accumulate_stats(seed: int) -> None:
    rng = random.Random(seed)
    w = VerifyWindow("r", target_len=rng.randint(0, 6))
    drafted = accepted = 0
    for cycle in range(50):
        w.start_fetch(rng.randint(0, 9))
        w.check_integrity()
        w.add_drafts([rng.randrange(3) for _ in range(w.target_len)])
        w.end_draft(float(cycle))
        w.fetch_done(float(cycle) + rng.random())
        w.begin_verify()
        k = rng.randint(0, w.num_drafted)
        rec = w.resolve(list(w.drafts[:k]) + [rng.randrange(3)])
        drafted += rec.drafted
        accepted += rec.accepted
        w.check_integrity()
        w.settle(rng.randint(0, 6))
        w.check_integrity()
    assert w.stats.drafted == drafted and w.stats.accepted == accepted
    assert w.stats.verify_steps == 50 and w.stats.committed == accepted + 50
