"""srt/draft_length.py: one draft count per step from per-request acceptance and timings."""

from __future__ import annotations

from sglang_vericache.srt.draft_length import DraftLengthController


def test_fixed_length_is_used_as_is() -> None:
    ctl = DraftLengthController(fixed=6, max_drafts=8)
    ctl.time_draft_step(0.01)
    assert ctl.drafts_for(["a", "b"], [100, 100]) == 6
    assert DraftLengthController(fixed=12, max_drafts=8).drafts_for(["a"], [100]) == 8


def test_adaptive_length_follows_acceptance_and_the_step_budget() -> None:
    ctl = DraftLengthController(fixed=None, max_drafts=16)
    assert 1 <= ctl.drafts_for(["a"], [100]) <= 16  # before any timing: a middle value
    ctl.time_draft_step(0.01)
    ctl.time_verify(0.05)  # verify 5x a draft step: long windows pay off when drafts survive
    for _ in range(20):
        ctl.observe("good", drafted=8, accepted=8)
        ctl.observe("bad", drafted=8, accepted=0)
    good = ctl.drafts_for(["good"], [100])
    bad = ctl.drafts_for(["bad"], [100])
    assert good > bad >= 1
    assert ctl.drafts_for(["good", "bad"], [100, 100]) == good  # the batch takes the longest
    assert ctl.drafts_for(["good"], [3]) <= 2  # never drafts past the request's last token
    ctl.forget("good")
    assert "good" not in ctl.estimates
