"""Per-request VeriCache counters and the server-wide aggregate.

Pure python: the SGLang glue copies :meth:`VeriCacheStats.to_meta_info` into
``meta_info["vericache"]`` and exports :class:`VeriCacheMetrics` to
Prometheus; nothing here imports prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

__all__ = [
    "ACCEPT_LEN_BUCKETS",
    "DecodeMode",
    "Proposer",
    "VerifyRecord",
    "VeriCacheStats",
]

# Upper bounds (inclusive, Prometheus "le") of the acceptance-length histogram.
# An acceptance length is the number of tokens one verification commits,
# including the correction/bonus token, so it is >= 1. Fine-grained below 8
# (CPU runs use x <= 8), then roughly geometric up to 64 (the paper runs
# x = 30-40); everything longer lands in +Inf. Fixed so that dashboards and
# runs stay comparable: change only together with the metric's name.
ACCEPT_LEN_BUCKETS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


class DecodeMode(str, Enum):
    """How a request is decoded (``srt/decode/eligibility.py`` decides; the value is what users see).

    GREEDY and SAMPLED rows are drafted from the compressed KV and verified against the full KV;
    they differ only in how a verify accepts: the verifier's argmax (token-identical to plain
    greedy decoding) or speculative sampling (identical in distribution to plain sampling).
    """

    GREEDY = "greedy"  # top_k == 1: drafts accepted while they equal the full-KV argmax
    SAMPLED = "sampled"  # temperature / top-p / top-k / min-p: accepted with prob. min(1, p/q)
    PLAIN = "plain"  # decoded exactly as without --vericache (penalties, grammar, ...)

    @property
    def drafted(self) -> bool:
        """Whether requests in this mode draft and verify."""
        return self is not DecodeMode.PLAIN


class Proposer(str, Enum):
    """Where a verify's drafts came from (the value is what ``/metrics`` and meta info show)."""

    COMPRESSED = "compressed"  # draft forwards of the model over the compressed KV
    LOOKUP = "lookup"  # the request's own context where it repeats (verify/prompt_lookup.py)
    AHEAD = "ahead"  # drafted while the prompt's prefix was fetched (srt/prefix/draft_ahead.py)


@dataclass(frozen=True, slots=True)
class VerifyRecord:
    """What one verification of one request did.

    drafted: drafts in the verify row (>= 0).
    committed: tokens committed, including the correction/bonus (in
        ``[1, drafted + 1]``).
    bytes_fetched: full-KV bytes brought to the device for it (>= 0).
    wait_full_s: seconds the finished draft waited for the full KV (>= 0).
    proposer: where the drafts came from.
    """

    drafted: int
    committed: int
    bytes_fetched: int
    wait_full_s: float
    proposer: Proposer = Proposer.COMPRESSED

    def __post_init__(self) -> None:
        if self.drafted < 0:
            raise ValueError(f"drafted must be >= 0, got {self.drafted}")
        if not 1 <= self.committed <= self.drafted + 1:
            raise ValueError(f"committed must be in [1, {self.drafted + 1}], got {self.committed}")
        if self.bytes_fetched < 0 or self.wait_full_s < 0:
            raise ValueError("bytes_fetched and wait_full_s must be >= 0")

    @property
    def accepted(self) -> int:
        """Drafts accepted (committed minus the correction/bonus token)."""
        return self.committed - 1


@dataclass(slots=True)
class VeriCacheStats:
    """Counters of one request, cumulative over its life.

    ``accepted <= drafted`` and ``committed == accepted + verify_steps`` hold
    at all times (every verification commits exactly one non-draft token).
    A PLAIN request names its reason and records no verification of compressed-KV drafts; its
    counters stay at zero, or at what it drafted before it was demoted to plain decoding
    (``demoted``) plus the prompt-lookup drafts it verified since (a draft of its own context
    needs no compressed KV). For a SAMPLED request ``accepted`` counts drafts that passed their
    min(1, p/q) coin.
    """

    mode: DecodeMode = DecodeMode.GREEDY
    plain_reason: str = ""
    constrained: bool = False  # a grammar masks its drafts and verifies (grammar_chain.py)
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    verify_steps: int = 0
    bytes_fetched: int = 0
    wait_full_s: float = 0.0
    fetch_failures: int = 0
    # proposer -> [verifies, drafted, accepted] of the verifications it drafted
    by_proposer: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def plain(cls, reason: str) -> VeriCacheStats:
        """Stats of a request decoded without VeriCache (reason is shown to users)."""
        if not reason:
            raise ValueError("a plain-decoded request must say why")
        return cls(mode=DecodeMode.PLAIN, plain_reason=reason)

    def demoted(self, reason: str) -> VeriCacheStats:
        """These counters, PLAIN from now on for ``reason`` (a drafted request that stops
        drafting keeps what it drafted, accepted and committed so far)."""
        if not reason:
            raise ValueError("a plain-decoded request must say why")
        return replace(self, mode=DecodeMode.PLAIN, plain_reason=reason)

    def record(self, rec: VerifyRecord) -> None:
        """Add one verification. Raises on a PLAIN request's, but for prompt-lookup drafts."""
        if not (self.mode.drafted or rec.proposer is Proposer.LOOKUP):
            raise RuntimeError("a plain-decoded request verifies no compressed-KV drafts")
        self.drafted += rec.drafted
        self.accepted += rec.accepted
        self.committed += rec.committed
        self.verify_steps += 1
        self.bytes_fetched += rec.bytes_fetched
        self.wait_full_s += rec.wait_full_s
        mine = self.by_proposer.setdefault(rec.proposer.value, [0, 0, 0])
        mine[0] += 1
        mine[1] += rec.drafted
        mine[2] += rec.accepted

    def record_fetch_failure(self) -> None:
        """Count a failed full-KV transfer (the worker recomputed instead)."""
        self.fetch_failures += 1

    @property
    def mean_accept_len(self) -> float:
        """Mean tokens committed per verification (incl. bonus); 0.0 before any."""
        return self.committed / self.verify_steps if self.verify_steps else 0.0

    @property
    def accept_rate(self) -> float:
        """Fraction of drafted tokens accepted; 0.0 before any draft."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_meta_info(self) -> dict[str, object]:
        """The ``meta_info["vericache"]`` dict: JSON-serialisable, stable keys."""
        return {
            "mode": self.mode.value,
            "plain_reason": self.plain_reason,
            "constrained": self.constrained,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "committed": self.committed,
            "verify_steps": self.verify_steps,
            "mean_accept_len": round(self.mean_accept_len, 4),
            "accept_rate": round(self.accept_rate, 4),
            "bytes_fetched": self.bytes_fetched,
            "wait_full_s": round(self.wait_full_s, 6),
            "fetch_failures": self.fetch_failures,
            "proposers": {name: {"verify_steps": v, "drafted": d, "accepted": a}
                          for name, (v, d, a) in sorted(self.by_proposer.items())},
        }

    def check_integrity(self) -> None:
        """Raise AssertionError if the counters are inconsistent."""
        counters = (self.drafted, self.accepted, self.committed, self.verify_steps,
                    self.bytes_fetched, self.fetch_failures)
        assert all(c >= 0 for c in counters), counters
        assert self.wait_full_s >= 0.0
        assert self.accepted <= self.drafted, (self.accepted, self.drafted)
        assert self.committed == self.accepted + self.verify_steps
        assert sum(v for v, _, _ in self.by_proposer.values()) == self.verify_steps
        assert sum(d for _, d, _ in self.by_proposer.values()) == self.drafted
        if self.mode is DecodeMode.PLAIN:
            assert self.plain_reason, "plain mode needs a reason"
        else:
            assert not self.plain_reason
