"""Draft-length policies: fixed ``x``, or adaptive per request.

Cost model (paper §4, notes/cpu-draft-cost.md §3): with per-token acceptance
``a`` a window of ``x`` drafts commits in expectation

    E(x) = 1 + a + a^2 + ... + a^x  = (1 - a^(x+1)) / (1 - a)

tokens (accepted drafts + correction/bonus). The window costs ``x`` draft
steps, then the verify; the verify cannot start before the full KV is
resident, whose transfer started with the window (it overlaps drafting):

    T(x) = max(x * t_draft, t_fetch) + t_verify_base + (x + 1) * t_verify_token

:class:`AdaptiveDraftLength` picks the ``x`` in ``[min_len, max_len]`` that
maximises ``E(x) / T(x)`` (the largest one on ties). ``log E`` has increasing
differences in ``(x, a)`` and ``-log T`` in ``(x, t_fetch)``, so the choice
never shrinks when acceptance or the fetch time grows (tests check both).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

__all__ = [
    "DraftCosts",
    "DraftQuery",
    "DraftLengthPolicy",
    "FixedDraftLength",
    "AdaptiveDraftLength",
    "AcceptanceConfig",
    "AcceptanceEstimate",
    "expected_committed",
    "policy_for",
]


def expected_committed(alpha: float, x: int) -> float:
    """E(x) = sum_{i=0..x} alpha^i, summed directly (stable at alpha -> 1)."""
    total, term = 0.0, 1.0
    for _ in range(x + 1):
        total += term
        term *= alpha
    return total


@dataclass(frozen=True, slots=True)
class DraftCosts:
    """Measured or estimated times, seconds, all >= 0.

    draft_step_s: one draft step of this request (> 0).
    fetch_eta_s: from the window's start until the full KV for its
        verification is resident (0 when already resident).
    verify_base_s: fixed cost of a verify forward.
    verify_per_token_s: extra verify cost per verified position.
    """

    draft_step_s: float
    fetch_eta_s: float = 0.0
    verify_base_s: float = 0.0
    verify_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.draft_step_s > 0:
            raise ValueError(f"draft_step_s must be > 0, got {self.draft_step_s}")
        for name in ("fetch_eta_s", "verify_base_s", "verify_per_token_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")

    def window_time(self, x: int) -> float:
        """T(x): wall time of a window of x drafts plus its verification."""
        drafting = max(x * self.draft_step_s, self.fetch_eta_s)
        return drafting + self.verify_base_s + (x + 1) * self.verify_per_token_s


@dataclass(frozen=True, slots=True)
class DraftQuery:
    """Inputs of one draft-length decision.

    alpha: per-token acceptance estimate in [0, 1] (AcceptanceEstimate.alpha).
    costs: the request's timing.
    remaining_tokens: tokens the request may still emit (>= 1), or None;
        drafting more than ``remaining_tokens - 1`` cannot pay off because a
        verification always adds the bonus token.
    """

    alpha: float
    costs: DraftCosts
    remaining_tokens: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.remaining_tokens is not None and self.remaining_tokens < 1:
            raise ValueError("remaining_tokens must be >= 1")


class DraftLengthPolicy(ABC):
    """Chooses how many tokens a request drafts in its next window.

    Contract: ``choose`` is a pure function of the query (no mutation, no
    clock, safe to share across requests and threads). It returns ``x`` in
    ``[min_len, max_len]``, except that a ``remaining_tokens`` budget lowers
    it to ``min(x, remaining_tokens - 1)`` (possibly 0: a verify of just the
    last committed token, i.e. one plain decode step).
    """

    min_len: int
    max_len: int

    @abstractmethod
    def _choose_unbounded(self, query: DraftQuery) -> int:
        """x in [min_len, max_len] ignoring the remaining-token budget."""

    def choose(self, query: DraftQuery) -> int:
        x = self._choose_unbounded(query)
        if query.remaining_tokens is not None:
            x = min(x, query.remaining_tokens - 1)
        return x


def _check_bounds(min_len: int, max_len: int) -> None:
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")


@dataclass(frozen=True, slots=True)
class FixedDraftLength(DraftLengthPolicy):
    """``--vericache-draft-len N``: always N drafts."""

    length: int

    def __post_init__(self) -> None:
        _check_bounds(self.length, self.length)

    @property
    def min_len(self) -> int:  # type: ignore[override]
        return self.length

    @property
    def max_len(self) -> int:  # type: ignore[override]
        return self.length

    def _choose_unbounded(self, query: DraftQuery) -> int:
        return self.length


@dataclass(frozen=True, slots=True)
class AdaptiveDraftLength(DraftLengthPolicy):
    """``--vericache-draft-len auto``: argmax of E(x)/T(x) over [min_len, max_len]."""

    min_len: int = 2
    max_len: int = 32

    def __post_init__(self) -> None:
        _check_bounds(self.min_len, self.max_len)

    def _choose_unbounded(self, query: DraftQuery) -> int:
        # Incremental E(x); compare rates by cross-multiplication of positive
        # numbers; ">=" keeps the largest maximiser on ties.
        alpha, costs = query.alpha, query.costs
        expected = expected_committed(alpha, self.min_len)
        term = alpha ** (self.min_len + 1)
        best_x = self.min_len
        best_e, best_t = expected, costs.window_time(self.min_len)
        for x in range(self.min_len + 1, self.max_len + 1):
            expected += term
            term *= alpha
            t = costs.window_time(x)
            if expected * best_t >= best_e * t:
                best_x, best_e, best_t = x, expected, t
        return best_x


def policy_for(draft_len: int | None, min_len: int = 2, max_len: int = 32) -> DraftLengthPolicy:
    """The policy for ``VeriCacheConfig.draft_len``: an int -> fixed, None
    ("auto") -> adaptive over ``[min_len, max_len]``."""
    if draft_len is None:
        return AdaptiveDraftLength(min_len=min_len, max_len=max_len)
    return FixedDraftLength(draft_len)


@dataclass(frozen=True, slots=True)
class AcceptanceConfig:
    """Discounted Beta estimate of the per-token acceptance alpha.

    decay: weight of the history kept per verification, in [0, 1).
    prior_alpha: alpha assumed before any evidence, in [0, 1].
    prior_weight: pseudo-trials the prior is worth (> 0).
    """

    decay: float = 0.8
    prior_alpha: float = 0.8
    prior_weight: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if not 0.0 <= self.prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must be in [0, 1], got {self.prior_alpha}")
        if not self.prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")


class AcceptanceEstimate:
    """Per-request estimate of alpha from its verification history.

    Under the chain model each draft is accepted with probability alpha until
    the first rejection, so a verify with ``accepted < drafted`` is
    ``accepted`` successes and one failure, and a fully accepted one is
    ``accepted`` successes (censored). Successes and trials decay by
    ``decay`` per verification (an EWMA), shrunk toward the prior.
    """

    __slots__ = ("config", "_successes", "_trials", "observations")

    def __init__(self, config: AcceptanceConfig) -> None:
        self.config = config
        self._successes = 0.0
        self._trials = 0.0
        self.observations = 0

    def update(self, drafted: int, accepted: int) -> None:
        """Add one verification: ``0 <= accepted <= drafted``."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted}, {drafted}")
        if drafted == 0:
            return  # a verify without drafts says nothing about acceptance
        trials = accepted + (1 if accepted < drafted else 0)
        self._successes = self.config.decay * self._successes + accepted
        self._trials = self.config.decay * self._trials + trials
        self.observations += 1

    @property
    def alpha(self) -> float:
        """Current estimate in [0, 1]."""
        cfg = self.config
        est = (self._successes + cfg.prior_alpha * cfg.prior_weight) / (
            self._trials + cfg.prior_weight)
        return min(1.0, max(0.0, est))

    def check_integrity(self) -> None:
        assert 0.0 <= self._successes <= self._trials + 1e-9, (self._successes, self._trials)
        assert self.observations >= 0
        assert 0.0 <= self.alpha <= 1.0
