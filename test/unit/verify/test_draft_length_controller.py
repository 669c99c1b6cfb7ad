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


def demoted(context: int, tokens: list[int], alpha: float = 0.9) -> list[StepRow]:
    """8 rows that dropped their compressed KV for admission; row i has a lookup draft of
    ``tokens[i]`` tokens (cycled)."""
    return [StepRow(f"r{i}", context, 0, 200, False, tokens[i % len(tokens)], alpha)
            for i in range(8)]


def test_rows_without_compressed_kv_verify_their_lookup_drafts_where_they_pay() -> None:
    """A demoted row has no compressed KV but its own context: its lookup drafts are weighed
    against plain decoding alone, and a batch with none left to draft is plain as before."""
    ctl = DraftLengthController(fixed=None, max_drafts=8)
    time_forwards(ctl)
    plan = ctl.plan(demoted(6000, [6], alpha=0.95))
    assert (plan.proposer, plan.drafts) == (Proposer.LOOKUP, 6), plan
    assert plan.draft_rate > plan.plain_rate
    rare = ctl.plan(demoted(6000, [0, 0, 0, 0, 0, 0, 0, 1], alpha=0.1))
    assert rare.drafts == 0 and rare.reason == "plain decoding is faster", rare
    assert ctl.plan(demoted(6000, [0])).reason == "no row can draft"
    # a fixed length drafts what the rows can: their lookup drafts, cut to the fixed length
    fixed = DraftLengthController(fixed=4, max_drafts=8).plan(demoted(100, [0, 6]))
    assert (fixed.drafts, fixed.proposer) == (4, Proposer.LOOKUP)
    none = DraftLengthController(fixed=None, max_drafts=8, proposer="compressed")
    assert none.plan(demoted(6000, [6])).drafts == 0


def test_lookup_only_rows_are_measured_before_they_are_predicted() -> None:
    """A fresh planner times a plain step, then a lookup verify, before weighing them."""
    ctl = DraftLengthController(fixed=None, max_drafts=8)
    first = ctl.plan(demoted(3000, [5]))
    assert (first.drafts, first.reason) == (0, "measuring plain decode")
    for _ in range(3):
        ctl.observe_forward(ForwardKind.PLAIN, ForwardShape.plain([3000] * 8), 0.2)
    second = ctl.plan(demoted(3000, [5]))
    assert (second.drafts, second.reason, second.proposer) == (
        5, "measuring drafting", Proposer.LOOKUP)
    for _ in range(3):
        ctl.observe_forward(ForwardKind.VERIFY, ForwardShape.verify([3000] * 8, 6), 0.25)
    third = ctl.plan(demoted(3000, [5], alpha=0.95))
    assert third.reason == "lookup drafts pay" and third.drafts == 5, third
