"""VeriCache's observability: ``meta_info["vericache"]`` per request, and Prometheus metrics
(``--enable-metrics``) next to SGLang's on ``/metrics``.

The exporter is created in the scheduler process after SGLang has set
``PROMETHEUS_MULTIPROC_DIR``, so the HTTP server's collector aggregates it like its own
``sglang:*`` series.
"""

from __future__ import annotations

from typing import Any

from sglang_vericache.verify.stats import (
    ACCEPT_LEN_BUCKETS,
    DecodeMode,
    VeriCacheStats,
    VerifyRecord,
)
from sglang_vericache.verify.step_profile import StepProfile


def request_meta_info(stats: VeriCacheStats | None, state: Any, span: Any, reserved: int,
                      ahead_used: tuple[int, int] | list[int]) -> dict[str, Any]:  # fmt: skip
    """``meta_info["vericache"]``: the request's counters plus where its KV lives now.

    stats: the request's counters (None while its prompt is still in prefill); ``mode`` says
        greedy / sampled / plain (then ``plain_reason`` says why), ``accept_rate`` and
        ``mean_accept_len`` its acceptance. state: its ``RequestDraftState`` or None; span: its
        offload ledger entry or None (``compressed_prefix_reused_tokens``: prompt positions
        whose compressed KV came from an earlier turn's, not compressed again); reserved: pool
        slots its draft row holds (``OffloadLedger.reserved``); ahead_used:
        drafts made while its prefix was fetched, and how many of them went to verify.
    """
    info = (stats or VeriCacheStats.plain("prompt still in prefill")).to_meta_info()
    info["compressed_kv_bytes"] = 0 if state is None else state.nbytes
    info["compressed_kv_bytes_in_pool"] = 0 if state is None else state.nbytes_in_pool
    info["compressed_prefix_reused_tokens"] = 0 if state is None else state.reused
    info["host_kv_tokens"] = 0 if span is None else span.host.length
    info["reserved_slots"] = reserved
    made, verified = ahead_used
    info["drafted_while_fetching"], info["drafted_while_fetching_verified"] = made, verified
    return info


class VeriCacheExporter:
    """Counters, the accepted-length histogram and KV-placement gauges (labels: model_name).

    Verification series also carry ``mode`` (``greedy`` or ``sampled``, ``DecodeMode``): the two
    accept differently (argmax match vs. the min(1, p/q) coin), so their acceptance is compared
    per mode; summing over ``mode`` gives the server totals.
    """

    def __init__(self, model_name: str) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        labels = {"model_name": model_name}
        names = list(labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(f"vericache:{name}", doc, labelnames=names + list(extra))

        def gauge(name: str, doc: str, multiprocess_mode: str = "mostrecent") -> Any:
            return Gauge(f"vericache:{name}", doc, labelnames=names,
                         multiprocess_mode=multiprocess_mode)  # fmt: skip

        mode = ("mode",)
        self._drafted = counter("drafted_tokens", "Tokens drafted (any proposer).", mode)
        self._accepted = counter(
            "accepted_tokens", "Drafted tokens the full-KV verify accepted.", mode
        )  # fmt: skip
        self._committed = counter("committed_tokens", "Tokens committed by verifications.", mode)
        self._verifies = counter("verify_steps", "Full-KV verifications (one per request).", mode)
        proposer = ("proposer",)
        self._by_proposer = {  # where drafts came from (verify/stats.py Proposer)
            "verify_steps": counter("proposer_verify_steps", "Verifications by where their "
                                    "drafts came from (compressed, lookup, ahead).", proposer),
            "drafted": counter("proposer_drafted_tokens", "Drafted tokens by proposer.",
                               proposer),
            "accepted": counter("proposer_accepted_tokens", "Accepted drafts by proposer.",
                                proposer),
        }  # fmt: skip
        self._bytes = counter("full_kv_bytes_fetched", "Full-KV bytes brought to the device.")
        self._wait = counter("full_kv_wait_seconds", "Time drafts waited for the full KV.")
        self._failures = counter("fetch_failures", "Failed full-KV transfers (recomputed).")
        self._requests = counter("requests", "Requests by decode mode.", ("mode",))
        self._steps = counter("decode_steps", "Decode steps by the draft-or-plain decision "
                              "(verify/draft_length.py).", ("decision",))  # fmt: skip
        self._moved = counter("pressure_offloaded_tokens",
                              "Full-KV tokens moved to host memory because the pool was short.")
        self._accept_len = Histogram(
            "vericache:accept_length", "Tokens committed per verification, by decode mode.",
            labelnames=names + list(mode), buckets=[float(b) for b in ACCEPT_LEN_BUCKETS],
        )  # fmt: skip
        self._host_tokens = gauge("host_kv_tokens",
                                  "Running requests' full-KV tokens in host memory.")
        self._reserved = gauge("compressed_kv_slots", "Pool slots held for compressed KV.")
        self._evicted = gauge("resident_draft_slots_evicted", "Pool slots of resident draft "
                              "rows (compressed KV of requests whose full KV is in the pool) "
                              "that allocations took back since start.")  # fmt: skip
        self._tracked = gauge("tracked_requests", "Live requests in the scheduler's VeriCache "
                              "request table (0 when idle: nothing leaked).")  # fmt: skip
        self._entries = Gauge("vericache:request_entries", "Live request records, the records "
                              "holding each state field (draft, plain, lookup, ahead_job, ...) "
                              "and the entries of shared structures (requests/table.py "
                              "entry_counts; all 0 when idle).",
                              labelnames=names + ["table"], multiprocess_mode="mostrecent")
        self._phase_s = counter("step_phase_seconds", "Decode-step seconds by phase (prepare, "
                                "draft, verify, plain, commit, offload, other).", ("phase",))
        self._phase_steps = counter("step_phase_steps", "Decode steps in which each phase ran.",
                                    ("phase",))  # fmt: skip
        self._profiled = counter("profiled_steps", "Decode steps profiled (step_phase_seconds).")
        self._prefill_s = counter("prefill_phase_seconds", "Prefill-step seconds by phase "
                                  "(prefill, compress, offload, other): what a drafted "
                                  "request's first token waits for.", ("phase",))  # fmt: skip
        self._draft_fwd = counter("draft_forwards", "Draft forwards over the compressed views.")
        self._transient = gauge("step_transient_bytes_peak", "Largest tensor set a decode "
                                "step built outside the KV pool (a quantized view with its draft "
                                "chain, a row's gathered verify KV), peak since start.", "max")
        self._transient_peak = 0
        self._labels = labels

    def observe_profile(self, profile: StepProfile) -> None:
        """One decode step's profile (``verify/step_profile.py``)."""
        lb = self._labels
        for phase, seconds in profile.seconds.items():
            self._phase_s.labels(phase=phase.value, **lb).inc(seconds)
            self._phase_steps.labels(phase=phase.value, **lb).inc()
        self._phase_s.labels(phase="other", **lb).inc(profile.other)
        self._profiled.labels(**lb).inc()
        if profile.draft_forwards:
            self._draft_fwd.labels(**lb).inc(profile.draft_forwards)
        if profile.transient_bytes > self._transient_peak:
            self._transient_peak = profile.transient_bytes
            self._transient.labels(**lb).set(self._transient_peak)

    def observe_prefill_profile(self, profile: StepProfile) -> None:
        """One prefill step's profile (phases prefill, compress, offload)."""
        lb = self._labels
        for phase, seconds in profile.seconds.items():
            self._prefill_s.labels(phase=phase.value, **lb).inc(seconds)
        self._prefill_s.labels(phase="other", **lb).inc(profile.other)

    def observe_verify(self, rec: VerifyRecord, mode: DecodeMode) -> None:
        """One verification of a drafted (greedy or sampled) request."""
        lb, by_mode = self._labels, {**self._labels, "mode": mode.value}
        self._drafted.labels(**by_mode).inc(rec.drafted)
        self._accepted.labels(**by_mode).inc(rec.accepted)
        self._committed.labels(**by_mode).inc(rec.committed)
        self._verifies.labels(**by_mode).inc()
        self._bytes.labels(**lb).inc(rec.bytes_fetched)
        self._wait.labels(**lb).inc(rec.wait_full_s)
        self._accept_len.labels(**by_mode).observe(rec.committed)
        by_proposer = {**lb, "proposer": rec.proposer.value}
        self._by_proposer["verify_steps"].labels(**by_proposer).inc()
        self._by_proposer["drafted"].labels(**by_proposer).inc(rec.drafted)
        self._by_proposer["accepted"].labels(**by_proposer).inc(rec.accepted)

    def observe_fetch_failure(self) -> None:
        self._failures.labels(**self._labels).inc()

    def observe_request(self, mode: DecodeMode) -> None:
        self._requests.labels(mode=mode.value, **self._labels).inc()

    def observe_step(self, decision: str) -> None:
        """One decode step and why it drafted or not (``StepDecision.reason``)."""
        self._steps.labels(decision=decision, **self._labels).inc()

    def observe_pressure_offload(self, tokens: int) -> None:
        if tokens:
            self._moved.labels(**self._labels).inc(tokens)

    def set_placement(self, ledger: Any, tracked: int,
                      entries: dict[str, int] | None = None) -> None:  # fmt: skip
        """Gauges at the end of a scheduler step: ``ledger`` is the offload ledger
        (``srt/kv/offload.py``), ``tracked`` the live requests of the request table, ``entries``
        its ``entry_counts()`` (per holder of per-request state)."""
        for table, count in (entries or {}).items():
            self._entries.labels(table=table, **self._labels).set(count)
        host_kv_tokens = sum(entry.host.length for entry in ledger.rows.values())
        self._host_tokens.labels(**self._labels).set(host_kv_tokens)
        self._reserved.labels(**self._labels).set(ledger.reserved_slots())
        self._evicted.labels(**self._labels).set(ledger.evicted_resident_slots)
        self._tracked.labels(**self._labels).set(tracked)


class TierLinkExporter:
    """The remote tier link (``srt/prefix/remote_prefix.py``): host bytes of writes and fetches in
    flight beside their bounds (``--vericache-tier-inflight-mb``), whether the tier counts as
    up, the link's event counts (lookups, hits, overdue lookups, skipped writes...) and the
    DEMOTED prefixes kept for it (``tier/demoted.py``: entries, pool slots charged, bytes,
    entries refused)."""

    def __init__(self, model_name: str, link: Any) -> None:
        from prometheus_client import Gauge

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Gauge(f"vericache:{name}", doc, labelnames=["model_name", *extra],
                         multiprocess_mode="mostrecent")  # fmt: skip

        self._labels = {"model_name": model_name}
        self._bytes = gauge("tier_bytes_in_flight", "Host bytes of tier transfers in flight.",
                            ("kind",))  # fmt: skip
        self._up = gauge("tier_up", "1 while the remote tier answers; 0 while it counts as down.")
        self._events = gauge("tier_link_events", "Tier link event counts since start.", ("event",))
        self._demoted = gauge("demoted_prefixes", "Compressed KV kept for prefixes whose full "
                              "KV is in the tier.", ("what",))  # fmt: skip
        bound = gauge("tier_bytes_bound", "Bound on host bytes in flight, by kind.", ("kind",))
        bound.labels(kind="put", **self._labels).set(link.bounds.max_put_bytes)
        bound.labels(kind="fetch", **self._labels).set(link.bounds.max_fetch_bytes)

    def observe(self, link: Any, demoted: Any = None) -> None:
        """Publish ``link``'s current state and ``demoted``'s (a ``DemotedPrefixes``; cheap:
        call after each tier operation)."""
        lb = self._labels
        self._bytes.labels(kind="put", **lb).set(link.put_bytes_in_flight())
        self._bytes.labels(kind="fetch", **lb).set(link.fetch_bytes_in_flight())
        self._up.labels(**lb).set(1 if link.tier_up else 0)
        for event, count in link.counters.as_dict().items():
            self._events.labels(event=event, **lb).set(count)
        if demoted is not None:
            for what, value in (("entries", len(demoted.entries)), ("bytes", demoted.nbytes),
                                ("slots", demoted.charged_slots), ("refused", demoted.refused)):
                self._demoted.labels(what=what, **lb).set(value)
