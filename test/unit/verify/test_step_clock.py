"""The decode-step clock: laps add up per phase, the rest is ``other``, misuse is refused."""

from __future__ import annotations

import pytest

from sglang_vericache.verify.step_profile import Phase, StepClock


def test_laps_accumulate_per_phase_and_the_rest_is_other() -> None:
    clock = StepClock()
    clock.start(10.0)
    clock.lap(Phase.PREPARE, 10.5)
    clock.lap(Phase.DRAFT, 12.0)
    clock.count_draft_forward()
    clock.count_draft_forward()
    clock.lap(Phase.VERIFY, 13.0)
    clock.lap(Phase.COMMIT, 13.25)
    clock.lap(Phase.OFFLOAD, 13.5)
    clock.lap(Phase.COMMIT, 13.75)  # commit and offload alternate per row: laps add up
    clock.note_transient(100)
    clock.note_transient(40)
    profile = clock.finish(14.5)
    assert profile.seconds == {Phase.PREPARE: 0.5, Phase.DRAFT: 1.5, Phase.VERIFY: 1.0,
                               Phase.COMMIT: 0.5, Phase.OFFLOAD: 0.25}  # fmt: skip
    assert profile.other == pytest.approx(0.75)
    assert profile.total == pytest.approx(4.5)
    assert profile.draft_forwards == 2 and profile.transient_bytes == 100
    assert not clock.running


def test_a_new_step_starts_from_zero() -> None:
    clock = StepClock()
    clock.start(0.0)
    clock.lap(Phase.PLAIN, 1.0)
    clock.note_transient(7)
    clock.finish(1.0)
    clock.start(5.0)
    profile = clock.finish(6.0)
    assert profile.seconds == {} and profile.other == 1.0 and profile.transient_bytes == 0


def test_laps_outside_a_step_are_refused() -> None:
    clock = StepClock()
    with pytest.raises(RuntimeError, match="start"):
        clock.lap(Phase.DRAFT, 1.0)
    with pytest.raises(RuntimeError, match="start"):
        clock.finish(1.0)
