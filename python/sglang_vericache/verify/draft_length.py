"""One draft count per decode step: fixed, or chosen from measured costs (0: decode plainly).

SGLang's verify input has one width per batch, so a step drafts the same ``x`` for every drafted
row. ``--vericache-draft-len N`` always gives ``N``. ``auto`` (the default) asks the
``StepPlanner`` (``verify/step_plan.py``), which weighs each row's acceptance estimate against
what draft, verify and plain forwards cost on this machine, as timed by the worker: it drafts the
best ``x`` where that commits more tokens per second than plain decoding, and returns 0 (a plain
step) where it would not, e.g. short contexts, small batches, or a compressor whose drafts cost
what full attention costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import MutableMapping, Sequence

from sglang_vericache.verify.policy import AcceptanceConfig, AcceptanceEstimate
from sglang_vericache.verify.stats import Proposer
from sglang_vericache.verify.step_cost import ForwardKind, ForwardShape
from sglang_vericache.verify.step_plan import PlannedRow, StepDecision, StepPlanner

FIXED = "fixed --vericache-draft-len"
FORCED_LOOKUP = "--vericache-proposer lookup"
EWMA = 0.8  # weight of the previous estimate in ``ewma``


@dataclass(frozen=True, slots=True)
class StepRow:
    """A batch row as the worker sees it: request id, committed KV tokens, tokens in its
    compressed view, tokens it may still emit, whether it can draft from its compressed KV, and
    its prompt-lookup draft: ``lookup`` tokens (0: none this step) accepted at
    ``lookup_alpha`` (a row without compressed KV may carry one too)."""

    rid: str
    context: int
    compressed: int
    remaining: int
    drafts: bool
    lookup: int = 0
    lookup_alpha: float = 0.0


class DraftLengthController:
    """Chooses each step's draft count in {0} + [1, max_drafts]; bookkeeping only, no torch.

    fixed: the configured length (None = auto); proposer: ``--vericache-proposer`` ("auto":
    lookup drafts where the planner prices them faster; "compressed": never; "lookup": in every
    step where a row has one). The worker reports every forward it times through
    ``observe_forward`` and every verification of compressed-KV drafts through ``observe``.
    """

    def __init__(self, fixed: int | None, max_drafts: int,
                 estimates: MutableMapping[str, AcceptanceEstimate] | None = None,
                 proposer: str = "auto") -> None:  # fmt: skip
        """estimates: where each request's acceptance estimate is kept (the server's: its
        record's ``acceptance`` field, dropped when the request closes); a dict by default."""
        self.fixed = fixed
        self.proposer = proposer
        self.max_drafts = max_drafts
        self.planner = StepPlanner(min(2, max_drafts), max_drafts)
        self.estimates: MutableMapping[str, AcceptanceEstimate] = (
            {} if estimates is None else estimates)

    def plan(self, rows: Sequence[StepRow], joining: Sequence[int] = ()) -> StepDecision:
        """``joining``: contexts of waiting requests the drafted rows' compressed KV keeps out
        (``StepPlanner.plan``)."""
        compressed = any(r.drafts for r in rows)
        longest = max(r.lookup for r in rows) if self.proposer != "compressed" else 0
        if not (compressed or longest):
            return StepDecision(0, "no row can draft")
        if self.fixed is not None or (self.proposer == "lookup" and longest):
            drafts = min(self.fixed or self.max_drafts, self.max_drafts)
            if longest and (self.proposer == "lookup" or not compressed):
                # rows without compressed KV (dropped for admission) draft what they can
                reason = FORCED_LOOKUP if self.proposer == "lookup" else FIXED
                return StepDecision(min(drafts, longest), reason, proposer=Proposer.LOOKUP)
            return StepDecision(drafts, FIXED)
        return self.planner.plan([
            PlannedRow(r.context, r.compressed, self._estimate(r.rid).alpha, max(1, r.remaining),
                       r.drafts, r.lookup if longest else 0, r.lookup_alpha) for r in rows
        ], [PlannedRow(context, 0, 0.0, 1, False) for context in joining])  # fmt: skip

    def observe(self, rid: str, drafted: int, accepted: int) -> None:
        self._estimate(rid).update(drafted, accepted)

    def observe_forward(self, kind: ForwardKind, shape: ForwardShape, seconds: float) -> None:
        self.planner.observe(kind, shape, seconds)

    def _estimate(self, rid: str) -> AcceptanceEstimate:
        estimate = self.estimates.get(rid)
        if estimate is None:
            estimate = self.estimates[rid] = AcceptanceEstimate(AcceptanceConfig())
        return estimate


def ewma(previous: float, sample: float) -> float:
    """A moving average of measured times or rates; ``previous`` <= 0 means no sample yet."""
    return sample if previous <= 0.0 else EWMA * previous + (1 - EWMA) * sample
