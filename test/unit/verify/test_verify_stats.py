from __future__ import annotations

import json

import pytest
from sglang_vericache.verify.stats import (
    ACCEPT_LEN_BUCKETS,
    DecodeMode,
    Proposer,
    VeriCacheStats,
    VerifyRecord,
)


def test_buckets_are_fixed_and_sorted() -> None:
    assert ACCEPT_LEN_BUCKETS == (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
    assert list(ACCEPT_LEN_BUCKETS) == sorted(set(ACCEPT_LEN_BUCKETS))


def test_record_validation() -> None:
    for bad in (dict(drafted=-1, committed=1), dict(drafted=2, committed=0),
                dict(drafted=2, committed=4)):
        with pytest.raises(ValueError):
            VerifyRecord(bytes_fetched=0, wait_full_s=0.0, **bad)
    with pytest.raises(ValueError):
        VerifyRecord(drafted=1, committed=1, bytes_fetched=-1, wait_full_s=0.0)


def test_request_stats_and_meta_info() -> None:
    s = VeriCacheStats()
    s.check_integrity()
    s.record(VerifyRecord(drafted=4, committed=5, bytes_fetched=100, wait_full_s=0.25))
    s.check_integrity()
    s.record(VerifyRecord(drafted=4, committed=2, bytes_fetched=50, wait_full_s=0.0,
                          proposer=Proposer.LOOKUP))
    s.record_fetch_failure()
    s.check_integrity()
    meta = s.to_meta_info()
    assert json.loads(json.dumps(meta)) == meta
    assert meta == {"mode": "greedy", "plain_reason": "", "constrained": False, "drafted": 8,
                    "accepted": 5, "committed": 7, "verify_steps": 2, "mean_accept_len": 3.5, "accept_rate": 0.625,
                    "bytes_fetched": 150, "wait_full_s": 0.25, "fetch_failures": 1,
                    "proposers": {"compressed": {"verify_steps": 1, "drafted": 4, "accepted": 4},
                                  "lookup": {"verify_steps": 1, "drafted": 4, "accepted": 1}}}


def test_plain_request_says_why() -> None:
    s = VeriCacheStats.plain("temperature > 0: decoded without VeriCache")
    s.check_integrity()
    meta = s.to_meta_info()
    assert meta["mode"] == "plain" and meta["plain_reason"].startswith("temperature")
    assert meta["verify_steps"] == 0 and meta["mean_accept_len"] == 0.0
    with pytest.raises(RuntimeError):
        s.record(VerifyRecord(drafted=1, committed=1, bytes_fetched=0, wait_full_s=0.0))
    with pytest.raises(ValueError):
        VeriCacheStats.plain("")
    s.check_integrity()


def test_sampled_requests_record_verifications_and_report_their_mode() -> None:
    s = VeriCacheStats(mode=DecodeMode.SAMPLED)
    s.record(VerifyRecord(drafted=4, committed=2, bytes_fetched=0, wait_full_s=0.0))
    s.check_integrity()
    meta = s.to_meta_info()
    assert meta["mode"] == "sampled" and meta["accept_rate"] == 0.25 and meta["plain_reason"] == ""
    assert DecodeMode.SAMPLED.drafted and DecodeMode.GREEDY.drafted and not DecodeMode.PLAIN.drafted


def test_a_demoted_request_keeps_counting_its_lookup_drafts_only() -> None:
    """Its compressed KV dropped for admission, a request still verifies drafts of its own
    context (no compressed KV needed); drafts from compressed KV it can no longer have."""
    s = VeriCacheStats()
    s.record(VerifyRecord(drafted=4, committed=5, bytes_fetched=0, wait_full_s=0.0))
    s = s.demoted("compressed KV dropped to make room")
    s.record(VerifyRecord(drafted=6, committed=4, bytes_fetched=0, wait_full_s=0.0,
                          proposer=Proposer.LOOKUP))  # fmt: skip
    s.check_integrity()
    with pytest.raises(RuntimeError):
        s.record(VerifyRecord(drafted=2, committed=1, bytes_fetched=0, wait_full_s=0.0))
    meta = s.to_meta_info()
    assert meta["mode"] == "plain" and meta["committed"] == 9 and meta["verify_steps"] == 2
    assert meta["proposers"]["lookup"] == {"verify_steps": 1, "drafted": 6, "accepted": 3}
