"""verify/draft_length.py: one draft count per step, fixed or from measured costs (0 = plain)."""

from __future__ import annotations

from sglang_vericache.verify.draft_length import (
    FIXED,
    FORCED_LOOKUP,
    DraftLengthController,
    StepRow,
)
from sglang_vericache.verify.stats import Proposer
from sglang_vericache.verify.step_cost import ForwardKind, ForwardShape


def rows(context: int, n: int = 8, remaining: int = 200, drafts: bool = True) -> list[StepRow]:
    return [StepRow(f"r{i}", context, context // 4, remaining, drafts) for i in range(n)]


def time_forwards(ctl: DraftLengthController, fixed: float = 0.058, per_query: float = 0.009,
                  per_kv: float = 11e-6) -> None:  # fmt: skip
    """Feed the CPU cost fit of benchmark/model.py as if measured, for every forward kind."""
    for batch in (1, 4, 8, 16):
        for width in (1, 3, 5):
            for context in (500, 3000, 8000):
                shape = ForwardShape(batch, batch * width, batch * (context + width))
                seconds = fixed + per_query * shape.queries + per_kv * shape.kv_read
                for kind in ForwardKind:
                    ctl.observe_forward(kind, shape, seconds)


def test_fixed_length_is_used_as_is() -> None:
    ctl = DraftLengthController(fixed=6, max_drafts=8)
    plan = ctl.plan(rows(100))
    assert (plan.drafts, plan.reason) == (6, FIXED)
    assert DraftLengthController(fixed=12, max_drafts=8).plan(rows(100)).drafts == 8


def timed_controller(drafted: int, accepted: int, verifies: int) -> DraftLengthController:
    """An auto controller with the CPU cost fit and every row's history of ``verifies``."""
    ctl = DraftLengthController(fixed=None, max_drafts=8)
    time_forwards(ctl)
    for _ in range(verifies):
        for i in range(8):
            ctl.observe(f"r{i}", drafted=drafted, accepted=accepted)
    return ctl


def test_auto_drafts_long_contexts_and_decodes_short_ones_plainly() -> None:
    ctl = timed_controller(drafted=4, accepted=4, verifies=10)
    assert ctl.plan(rows(6300)).drafts >= 2
    assert ctl.plan(rows(300)).drafts == 0


def test_acceptance_drives_the_choice() -> None:
    ctl = timed_controller(drafted=8, accepted=0, verifies=20)
    assert ctl.plan(rows(6300)).drafts == 0  # drafts that are never accepted never pay
    assert ctl.estimates["r0"].alpha < 0.2 and len(ctl.estimates) == 8  # one per row


def test_rows_that_cannot_draft_get_a_plain_step() -> None:
    ctl = DraftLengthController(fixed=4, max_drafts=8)
    assert ctl.plan(rows(6300, drafts=False)).drafts == 0


def looked_up(context: int, tokens: list[int], alpha: float = 0.9) -> list[StepRow]:
    """8 rows; row i has a lookup draft of ``tokens[i]`` tokens (the list is cycled)."""
    return [StepRow(f"r{i}", context, context // 4, 200, True, tokens[i % len(tokens)], alpha)
            for i in range(8)]


def test_proposer_lookup_takes_lookup_drafts_wherever_a_row_has_one() -> None:
    fixed = DraftLengthController(fixed=4, max_drafts=8, proposer="lookup")
    plan = fixed.plan(looked_up(100, [0, 6]))
    assert (plan.drafts, plan.reason, plan.proposer) == (4, FORCED_LOOKUP, Proposer.LOOKUP)
    assert fixed.plan(looked_up(100, [0, 2])).drafts == 2  # no more than the longest
    assert fixed.plan(looked_up(100, [0])).proposer is Proposer.COMPRESSED  # none: as before
    auto = DraftLengthController(fixed=None, max_drafts=8, proposer="lookup")
    assert auto.plan(looked_up(100, [3])).drafts == 3


def test_proposer_compressed_never_prices_lookup_drafts() -> None:
    for proposer, expected in (("compressed", Proposer.COMPRESSED), ("auto", Proposer.LOOKUP)):
        ctl = DraftLengthController(fixed=None, max_drafts=8, proposer=proposer)
        time_forwards(ctl)
        for _ in range(10):
            for i in range(8):
                ctl.observe(f"r{i}", drafted=4, accepted=3)
        assert ctl.plan(looked_up(6000, [6], alpha=0.95)).proposer is expected
    fixed = DraftLengthController(fixed=4, max_drafts=8)  # auto with a fixed length: as before
    assert fixed.plan(looked_up(100, [6])).proposer is Proposer.COMPRESSED
