"""The tier link's bounds and event counts (``srt/prefix/remote_prefix.py``), as plain data: the flags
``--vericache-tier-lookup-deadline`` / ``--vericache-tier-inflight-mb`` set the bounds, and
``/metrics`` publishes both (``vericache:tier_*``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LinkBounds:
    """How long admission may wait on the tier.

    lookup_deadline_s: a lookup still unanswered after this is cancelled and the request
        recomputes (a hung KV server answers nothing; the client's own timeout is 30 s, and a
        waiting request holds SGLang's admission loop while it waits).
    retry_down_after_s: after a failed or overdue task the tier counts as down: probes report
        0 without contacting it until this long has passed, then one probe tries again.
    forget_unprobed_after_s: a waiting request the scheduler has not probed for this long is
        forgotten with its fetched KV (SGLang tells the prefix cache nothing when a request is
        aborted in the queue); one that was only waiting long starts its lookup again.
    fetch_overdue_factor / assumed_fetch_bytes_per_s: a fetch still in flight after
        ``lookup_deadline_s`` plus this factor times its expected transfer time (its bytes at
        the link's measured bandwidth; at ``assumed_fetch_bytes_per_s`` before one is
        measured) is abandoned: its requests recompute and the tier counts as down. A tier
        that hangs mid-fetch would otherwise hold them until its client notices (LMCache's:
        its 30 s request timeout).
    max_put_bytes / max_fetch_bytes: host bytes held by write-throughs / fetches in flight. A
        write-through past the cap is skipped (that prefix is written by a later turn), a
        fetch past it is not started (the request recomputes): memory stays bounded when the
        link is slower than the traffic.
    """

    lookup_deadline_s: float = 1.0
    retry_down_after_s: float = 5.0
    forget_unprobed_after_s: float = 60.0
    fetch_overdue_factor: float = 4.0
    assumed_fetch_bytes_per_s: float = 8e6
    max_put_bytes: int = 512 << 20
    max_fetch_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if min(self.lookup_deadline_s, self.forget_unprobed_after_s) <= 0:
            raise ValueError("lookup_deadline_s and forget_unprobed_after_s must be > 0")
        if min(self.max_put_bytes, self.max_fetch_bytes) <= 0:
            raise ValueError("max_put_bytes and max_fetch_bytes must be > 0")
        if min(self.fetch_overdue_factor, self.assumed_fetch_bytes_per_s) <= 0:
            raise ValueError("fetch_overdue_factor and assumed_fetch_bytes_per_s must be > 0")
        if self.retry_down_after_s < 0:
            raise ValueError("retry_down_after_s must be >= 0")


    def fetch_deadline_s(self, nbytes: int, measured_bytes_per_s: float) -> float:
        """Seconds a fetch of ``nbytes`` may stream before it is abandoned (0 bytes/s: none
        measured yet, ``assumed_fetch_bytes_per_s`` stands in)."""
        rate = measured_bytes_per_s or self.assumed_fetch_bytes_per_s
        return self.lookup_deadline_s + self.fetch_overdue_factor * nbytes / rate


def fetch_pays(nbytes: int, tokens: int, fetch_bytes_per_s: float,
               prefill_tokens_per_s: float) -> bool:  # fmt: skip
    """Whether fetching ``nbytes`` (the KV of ``tokens``) is predicted no slower than
    recomputing them: a fast GPU on a slow link recomputes, a CPU on a fast link fetches.
    Nothing to fetch, or either rate unmeasured (0): it fetches (measuring the link)."""
    if not nbytes or fetch_bytes_per_s <= 0 or prefill_tokens_per_s <= 0:
        return True
    return nbytes / fetch_bytes_per_s <= tokens / prefill_tokens_per_s


@dataclass(slots=True)
class RemoteCounters:
    lookups: int = 0
    hits_tokens: int = 0
    fetch_failures: int = 0
    overdue_lookups: int = 0
    overdue_fetches: int = 0  # abandoned past their deadline (LinkBounds.fetch_overdue_factor)
    probes_skipped_down: int = 0
    puts_skipped_full: int = 0  # write-throughs past max_put_bytes
    fetches_skipped_full: int = 0  # fetches past max_fetch_bytes (recomputed)
    fetches_skipped_slower: int = 0  # recomputing was predicted faster than fetching
    puts: int = 0
    put_failures: int = 0
    chunks_already_writing: int = 0  # chunks a concurrent write-through was storing already

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}
