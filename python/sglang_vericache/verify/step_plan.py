"""Draft this step or decode it plainly, and how far to draft: whichever commits more per second.

A drafted step of x drafts costs x draft forwards (over the compressed views) and one verify of
width x + 1 (over the full KV); it commits E(alpha_i, x) tokens per drafted row and one per
other row. A plain step costs one decode forward and commits one token per row. With the fitted
costs of ``step_cost.StepCostModel``, for the batch at hand::

    plain rate  = rows / T_plain(rows, sum L_i + 1)
    draft rate  = (sum_drafted E(alpha_i, x) + rows not drafted)
                  / (sum_{j<x} T_draft(rows, sum C_i + j + 1) + T_verify(rows * W, sum L_i + W))

and the step drafts the best x only when its rate beats plain by ``margin``. Rows whose context
repeats also carry a prompt-lookup draft of ``l_i`` tokens (``verify/prompt_lookup.py``) with its
own acceptance ``beta_i``; a lookup step costs no draft forward::

    lookup rate = (sum_i E(beta_i, min(x, l_i)) + rows without a lookup draft)
                  / T_verify(rows * W, sum L_i + W)

and it is chosen where it beats both (and plain by ``margin``) (hysteresis: a tie
is not worth the compressed KV's upkeep). Rows that dropped their compressed KV for admission
(below) still carry lookup drafts: where none is left to draft from, the step weighs lookup
against plain decoding alone, measured and explored the same way.

Drafting pays where attention over the full KV dominates a step (long contexts, large batches, high
acceptance) and loses where the fixed and per-token cost of x + 1 forwards dominates: the same code
finds both, on any device, from what it measured. Until every kind of forward has been timed a few
times the planner measures (plain first, then drafting with short chains: 2, 4, 2 drafts, enough to
tell a verify's per-query cost from its fixed cost, where the first chains of a fresh server would
otherwise cost the most). Afterwards it now and then runs the mode it would not have chosen, so a
fit never goes stale while the other mode is winning: first after ``explore_every`` decisions, then
twice as long after each exploration that confirmed the choice (up to ``explore_max``), and back to
``explore_every`` when one changed it. An exploration into drafting drafts the shortest chain:
it is a probe, and where drafting loses every extra draft is lost time. A batch that outgrew
what a fit has seen (``StepCostModel.covers``: the warm-up request measured one short row) is
measured again before it is predicted.

Under a short budget the compressed KV is not free: its pool slots keep waiting requests out.
When admission lacks no more than the drafted rows' compressed KV holds, the worker names the
request that would get in (``joining``), and plain decoding is weighed over the batch with it:
dropping the compressed KV (the rows decode offload-only from then on) wins unless drafting
this batch commits more per second than plain decoding a larger one::

    plain rate = (rows + joining) / T_plain(rows + joining, sum over both of (L + 1))

Where plain decoding won that comparison, requests whose prefills settle while others still wait
build no compressed KV until room returns (``srt/kv/reinstate.py``, ``starts_demoted``): it
would only be dropped again for the next arrival. Where there is no verdict yet (a fit does not
cover the batch), admission comes first too (``ADMISSION_FIRST``): measuring drafting would hold
the slots a waiting request needs for several steps of a batch that is about to grow, and the
offload-only baseline admits at once (16 x 1k prompts on a budget of 2 requests' full KV: 5
measuring steps of 4 rows stood between two prefills).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sglang_vericache.verify.policy import expected_committed
from sglang_vericache.verify.stats import Proposer
from sglang_vericache.verify.step_cost import ForwardKind, ForwardShape, StepCostModel

PLAIN_FASTER = "plain decoding is faster"  # the reason of a measured no-draft decision
DRAFTING_PAYS = "drafting pays"  # a measured decision to draft from the compressed KV
LOOKUP_PAYS = "lookup drafts pay"  # drafts from the requests' own context, no draft forward
# a plain step that admits waiting requests before the fits can weigh drafting against them
ADMISSION_FIRST = "admission first, drafting not measured"
ADMITTING = (PLAIN_FASTER, ADMISSION_FIRST)  # decisions that drop compressed KV for admission


@dataclass(frozen=True, slots=True)
class PlannedRow:
    """One batch row: ``context`` committed KV tokens, ``compressed`` tokens in its compressed
    view (0 when not drafted), acceptance estimate ``alpha``, ``remaining`` tokens it may emit,
    whether it can draft at all, and its prompt-lookup draft: ``lookup`` tokens (0: none, or the
    step cannot take lookup drafts) accepted at ``lookup_alpha``."""

    context: int
    compressed: int
    alpha: float
    remaining: int
    drafts: bool
    lookup: int = 0
    lookup_alpha: float = 0.0


@dataclass(frozen=True, slots=True)
class StepDecision:
    """drafts: draft tokens this step (0: a plain decode step), made by ``proposer``. Rates in
    committed tokens per second as predicted (None while a fit is not ready)."""

    drafts: int
    reason: str
    plain_rate: float | None = None
    draft_rate: float | None = None
    proposer: Proposer = Proposer.COMPRESSED


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    # drafting must beat plain by this fraction: the fits predict a step within ~15% (budget
    # sweep, benchmark/README.md), so a smaller predicted win is about as likely a loss, and
    # flipping between the modes costs the compressed KV's catch-up
    margin: float = 0.10
    # decisions before the first exploration (and after a changed mind): one step in the mode
    # not chosen, a few percent of steps once the intervals double; at 64, a fit misled by one
    # slow sample went unchallenged for a whole 42-step decode (benchmark/README.md)
    explore_every: int = 16
    explore_max: int = 1024  # longest interval between explorations

    def __post_init__(self) -> None:
        if self.margin < 0 or not 2 <= self.explore_every <= self.explore_max:
            raise ValueError(f"need margin >= 0 and 2 <= explore_every <= explore_max: {self}")


class StepPlanner:
    """Chooses each decode step's draft count from measured costs; no torch, no clock.

    ``costs`` is owned here; the worker feeds it through ``observe`` after each forward.
    """

    def __init__(self, min_drafts: int, max_drafts: int,
                 config: PlannerConfig = PlannerConfig()) -> None:  # fmt: skip
        if not 1 <= min_drafts <= max_drafts:
            raise ValueError(f"need 1 <= min_drafts <= max_drafts: {min_drafts}, {max_drafts}")
        self.min_drafts, self.max_drafts, self.config = min_drafts, max_drafts, config
        self.costs = StepCostModel()
        self.decisions = 0
        self.explore_interval = config.explore_every
        self.next_exploration = config.explore_every  # the decision that explores next
        self._explored_against: bool | None = None  # the choice the last exploration overrode

    def observe(self, kind: ForwardKind, shape: ForwardShape, seconds: float) -> None:
        self.costs.observe(kind, shape, seconds)

    def plan(self, rows: Sequence[PlannedRow],
             joining: Sequence[PlannedRow] = ()) -> StepDecision:  # fmt: skip
        """This step's draft count for ``rows``; ``joining``: rows that would be admitted if the
        drafted rows dropped their compressed KV (module doc), decoded plainly if they join."""
        compressed = any(r.drafts for r in rows)
        if not (compressed or any(r.lookup for r in rows)):
            return StepDecision(0, "no row can draft")
        self.decisions += 1
        # the drafts weighed against plain decoding: the compressed KV's, or where no row has any
        # left (all dropped it for admission), the rows' lookup drafts alone
        proposer = Proposer.COMPRESSED if compressed else Proposer.LOOKUP
        if compressed:
            probe = self._cap(rows, self.min_drafts)
            drafting_measured = (
                self.costs.covers(ForwardKind.DRAFT, draft_shape(rows, 0))
                and self.costs.covers(ForwardKind.VERIFY, verify_shape(rows, probe + 1)))
        else:
            longest = max(1, self._lookup_cap(rows))
            probe = min(longest, self.min_drafts)
            drafting_measured = self.costs.covers(
                ForwardKind.VERIFY, verify_shape(rows, probe + 1, proposer))
        plain_measured = self.costs.covers(ForwardKind.PLAIN, plain_shape(rows))
        if joining and not (plain_measured and drafting_measured):
            return StepDecision(0, ADMISSION_FIRST)
        if not plain_measured:
            return StepDecision(0, "measuring plain decode")
        if not drafting_measured:
            if not compressed:
                return StepDecision(longest, "measuring drafting", proposer=proposer)
            odd = self.costs.fits[ForwardKind.VERIFY].samples % 2  # chains of 2, 4, 2 drafts
            return StepDecision(self._cap(rows, self.min_drafts * (1 + odd)), "measuring drafting")
        plain_rate = self.plain_rate([*rows, *joining])
        x, draft_rate = self.best_draft(rows) if compressed else self.best_lookup(rows)
        drafting = draft_rate > plain_rate * (1.0 + self.config.margin)
        self._review_exploration(drafting)
        if self.decisions < self.next_exploration:
            if compressed:
                lx, lookup_rate = self.best_lookup(rows)
                if lookup_rate > max(draft_rate, plain_rate * (1.0 + self.config.margin)):
                    return StepDecision(lx, LOOKUP_PAYS, plain_rate, lookup_rate,
                                        Proposer.LOOKUP)  # fmt: skip
            pays = DRAFTING_PAYS if compressed else LOOKUP_PAYS
            return StepDecision(x if drafting else 0, pays if drafting else PLAIN_FASTER,
                                plain_rate, draft_rate, proposer)  # fmt: skip
        self._explored_against = drafting  # keep the losing mode's fit fresh, as cheaply as can be
        return StepDecision(0 if drafting else probe, "exploring", plain_rate, draft_rate,
                            proposer)  # fmt: skip

    def _review_exploration(self, drafting: bool) -> None:
        """The first decision after an exploration, on fits that include it, sets the next one:
        later when the exploration confirmed the choice it overrode, soon when it changed it."""
        if self._explored_against is None:
            return
        if drafting == self._explored_against:
            self.explore_interval = min(2 * self.explore_interval, self.config.explore_max)
        else:
            self.explore_interval = self.config.explore_every
        self._explored_against = None
        self.next_exploration = self.decisions + self.explore_interval

    def _cap(self, rows: Sequence[PlannedRow], x: int) -> int:
        """Drafting past every row's ``remaining - 1`` cannot pay (the verify adds a token)."""
        most = max(r.remaining - 1 for r in rows if r.drafts)
        return max(self.min_drafts, min(x, most))

    def _lookup_cap(self, rows: Sequence[PlannedRow]) -> int:
        """The longest lookup draft that can pay: ``_cap`` over the rows that carry one."""
        most = max((min(r.lookup, r.remaining - 1) for r in rows if r.lookup), default=0)
        return max(0, min(most, self.max_drafts))

    def plain_rate(self, rows: Sequence[PlannedRow]) -> float:
        seconds = self.costs.predict(ForwardKind.PLAIN, plain_shape(rows))
        return len(rows) / max(seconds or 0.0, 1e-9)

    def best_draft(self, rows: Sequence[PlannedRow]) -> tuple[int, float]:
        """The draft count in [min_drafts, cap] of the highest predicted rate (the longer on a
        tie), and that rate. One pass over the chain: x drafts cost the first x draft forwards,
        summed as x grows, and a verify of width x + 1 (a plan runs every decode step)."""
        best_x, best_rate, drafting = self.min_drafts, -1.0, 0.0
        for x in range(1, self._cap(rows, self.max_drafts) + 1):
            drafting += self.costs.predict(ForwardKind.DRAFT, draft_shape(rows, x - 1)) or 0.0
            if x < self.min_drafts:
                continue
            seconds = drafting + (self.costs.predict(ForwardKind.VERIFY,
                                                     verify_shape(rows, x + 1)) or 0.0)
            committed = sum(expected_committed(r.alpha, min(x, max(0, r.remaining - 1)))
                            if r.drafts else 1.0 for r in rows)  # fmt: skip
            rate = committed / max(seconds, 1e-9)
            if rate >= best_rate:
                best_x, best_rate = x, rate
        return best_x, best_rate

    def best_lookup(self, rows: Sequence[PlannedRow]) -> tuple[int, float]:
        """The lookup draft count of the highest predicted rate (module doc), and that rate;
        (0, 0.0) when no row has a lookup draft. Every row commits at least its verify's token.
        """
        longest = self._lookup_cap(rows)
        best_x, best_rate = 0, 0.0
        for x in range(1, longest + 1):
            shape = verify_shape(rows, x + 1, Proposer.LOOKUP)
            seconds = self.costs.predict(ForwardKind.VERIFY, shape) or 0.0
            committed = sum(expected_committed(r.lookup_alpha,
                                               min(x, r.lookup, max(0, r.remaining - 1)))
                            for r in rows)  # fmt: skip
            rate = committed / max(seconds, 1e-9)
            if rate > best_rate:
                best_x, best_rate = x, rate
        return best_x, best_rate


def plain_shape(rows: Sequence[PlannedRow]) -> ForwardShape:
    return ForwardShape.plain([r.context for r in rows])


def draft_shape(rows: Sequence[PlannedRow], step: int) -> ForwardShape:
    return ForwardShape.draft([r.compressed if r.drafts else 0 for r in rows], step)


def verify_shape(rows: Sequence[PlannedRow], width: int,
                 proposer: Proposer = Proposer.COMPRESSED) -> ForwardShape:  # fmt: skip
    """The shape of a verify of ``width`` over ``rows`` (what the worker observes): a row's
    queries past its drafts pad the width and do not attend. Compressed drafts fill the width
    of every row that drafts; a lookup draft is as long as the row's (``PlannedRow.lookup``)."""
    if proposer is Proposer.LOOKUP:
        live = [1 + min(width - 1, r.lookup) for r in rows]
    else:
        live = [width if r.drafts else 1 for r in rows]
    return ForwardShape.verify([r.context for r in rows], width, live)
