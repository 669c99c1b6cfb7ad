"""VeriCache's Prometheus metrics (``--enable-metrics``), next to SGLang's on ``/metrics``.

Created in the scheduler process after SGLang has set ``PROMETHEUS_MULTIPROC_DIR``, so the
HTTP server's collector aggregates them like its own ``sglang:*`` series.
"""

from __future__ import annotations

from typing import Any

from sglang_vericache.verify.stats import ACCEPT_LEN_BUCKETS, DecodeMode, VerifyRecord


class VeriCacheExporter:
    """Counters, the accepted-length histogram and KV-placement gauges (labels: model_name)."""

    def __init__(self, model_name: str) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        labels = {"model_name": model_name}
        names = list(labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(f"vericache:{name}", doc, labelnames=names + list(extra))

        self._drafted = counter("drafted_tokens", "Tokens drafted from the compressed KV.")
        self._accepted = counter("accepted_tokens", "Drafted tokens the full-KV verify accepted.")
        self._committed = counter("committed_tokens", "Tokens committed by verifications.")
        self._verifies = counter("verify_steps", "Full-KV verifications (one per request).")
        self._bytes = counter("full_kv_bytes_fetched", "Full-KV bytes brought to the device.")
        self._wait = counter("full_kv_wait_seconds", "Time drafts waited for the full KV.")
        self._failures = counter("fetch_failures", "Failed full-KV transfers (recomputed).")
        self._requests = counter("requests", "Requests by decode mode.", ("mode",))
        self._accept_len = Histogram(
            "vericache:accept_length", "Tokens committed per verification.",
            labelnames=names, buckets=[float(b) for b in ACCEPT_LEN_BUCKETS],
        )  # fmt: skip
        self._host_tokens = Gauge(
            "vericache:host_kv_tokens", "Running requests' full-KV tokens in host memory.",
            labelnames=names, multiprocess_mode="mostrecent",
        )  # fmt: skip
        self._reserved = Gauge(
            "vericache:compressed_kv_slots", "Pool slots held for compressed KV.",
            labelnames=names, multiprocess_mode="mostrecent",
        )  # fmt: skip
        self._tracked = Gauge(
            "vericache:tracked_requests",
            "Requests whose VeriCache state the worker holds (0 when idle: nothing leaked).",
            labelnames=names, multiprocess_mode="mostrecent",
        )  # fmt: skip
        self._labels = labels

    def observe_verify(self, rec: VerifyRecord) -> None:
        lb = self._labels
        self._drafted.labels(**lb).inc(rec.drafted)
        self._accepted.labels(**lb).inc(rec.accepted)
        self._committed.labels(**lb).inc(rec.committed)
        self._verifies.labels(**lb).inc()
        self._bytes.labels(**lb).inc(rec.bytes_fetched)
        self._wait.labels(**lb).inc(rec.wait_full_s)
        self._accept_len.labels(**lb).observe(rec.committed)

    def observe_fetch_failure(self) -> None:
        self._failures.labels(**self._labels).inc()

    def observe_request(self, mode: DecodeMode) -> None:
        self._requests.labels(mode=mode.value, **self._labels).inc()

    def set_placement(self, ledger: Any, tracked: int) -> None:
        """Gauges at the end of a scheduler step: ``ledger`` is the offload ledger
        (``srt/offload.py``), ``tracked`` the requests whose state the worker holds."""
        host_kv_tokens = sum(entry.host.length for entry in ledger.rows.values())
        self._host_tokens.labels(**self._labels).set(host_kv_tokens)
        self._reserved.labels(**self._labels).set(ledger.reserved_slots())
        self._tracked.labels(**self._labels).set(tracked)
