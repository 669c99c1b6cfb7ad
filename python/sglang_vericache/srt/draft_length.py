"""``--vericache-draft-len auto``: one verify width per decode step, from each request's history.

SGLang's verify input has one width per batch, so the step drafts ``x = max_i x_i`` tokens,
where ``x_i`` is what ``AdaptiveDraftLength`` (``verify/policy.py``) picks for request i from its
acceptance estimate and the measured cost of a draft step and of a verify. A request that would
have stopped earlier only verifies a few more positions (cheap: one O(x * L) pass). A fixed
``--vericache-draft-len N`` always gives ``N``.
"""

from __future__ import annotations

from sglang_vericache.verify.policy import (
    AcceptanceConfig,
    AcceptanceEstimate,
    DraftCosts,
    DraftQuery,
    policy_for,
)

EWMA = 0.8  # weight of the previous timing estimate


class DraftLengthController:
    """Chooses each step's draft count in [1, max_drafts]; bookkeeping only, no torch.

    fixed: the configured length (None = adaptive). Timings are wall seconds measured by the
    worker around its forwards.
    """

    def __init__(self, fixed: int | None, max_drafts: int) -> None:
        self.fixed = fixed
        self.max_drafts = max_drafts
        self.policy = policy_for(fixed, min_len=min(2, max_drafts), max_len=max_drafts)
        self.estimates: dict[str, AcceptanceEstimate] = {}
        self.draft_step_s = 0.0
        self.verify_s = 0.0

    def drafts_for(self, rids: list[str], remaining: list[int]) -> int:
        """Drafts this step for a batch of requests (``remaining``: tokens each may still emit)."""
        if self.fixed is not None:
            return min(self.fixed, self.max_drafts)
        if self.draft_step_s <= 0.0:
            return self.max_drafts // 2 or 1  # no timings yet
        costs = DraftCosts(draft_step_s=self.draft_step_s, verify_base_s=self.verify_s)
        best = 1
        for rid, left in zip(rids, remaining):
            est = self.estimates.setdefault(rid, AcceptanceEstimate(AcceptanceConfig()))
            query = DraftQuery(alpha=est.alpha, costs=costs, remaining_tokens=max(1, left))
            best = max(best, self.policy.choose(query))
        return min(best, self.max_drafts)

    def observe(self, rid: str, drafted: int, accepted: int) -> None:
        self.estimates.setdefault(rid, AcceptanceEstimate(AcceptanceConfig())).update(
            drafted, accepted
        )

    def time_draft_step(self, seconds: float) -> None:
        self.draft_step_s = ewma(self.draft_step_s, seconds)

    def time_verify(self, seconds: float) -> None:
        self.verify_s = ewma(self.verify_s, seconds)

    def forget(self, rid: str) -> None:
        self.estimates.pop(rid, None)


def ewma(previous: float, sample: float) -> float:
    """A moving average of measured times or rates; ``previous`` <= 0 means no sample yet."""
    return sample if previous <= 0.0 else EWMA * previous + (1 - EWMA) * sample
