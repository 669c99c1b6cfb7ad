"""Seeded request fuzz: the shared plain server against the shared ``--vericache`` server.

A CI-sized run of ``testkit.fuzz`` (80 requests over /generate and the
OpenAI endpoints, malformed ones included; about 2 s each on 2 cores; seed 21's 80 cases draw
every one of the generator's 23 kinds: hidden states, invalid later batch items, sampled
distributions, a weight reload and an abort storm among them): the same HTTP status for every
request,
identical greedy tokens, log-probs within tolerance, both servers alive and healthy at the end,
and no KV left in use once idle. The long run (several seeds) is ``benchmark/fuzz.py``.

(Named ``test_fuzz_servers.py``: a second ``test_fuzz.py`` next to ``test/unit/test_fuzz.py``
would break collection, as test directories are not packages.)

Knobs for local runs: ``VERICACHE_FUZZ_SEED``, ``VERICACHE_FUZZ_REQUESTS``,
``VERICACHE_FUZZ_EXCLUDE`` (comma-separated kinds or tags, e.g. ``logprob,oov_ids``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from testkit import fuzz_compare as fc
from testkit.fuzz import GENERATE, FuzzCase
from testkit.fuzz_outputs import Reply
from testkit.fuzz_report import brief, summarize
from testkit.fuzz_run import Target, fuzz

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(1800)]

SEED = int(os.environ.get("VERICACHE_FUZZ_SEED", "21"))
REQUESTS = int(os.environ.get("VERICACHE_FUZZ_REQUESTS", "80"))
EXCLUDE = [k for k in os.environ.get("VERICACHE_FUZZ_EXCLUDE", "").split(",") if k]
TOLERANCE = fc.DEFAULT_TOLERANCE


def target(name: str, server) -> Target:
    return Target(name, server.url, alive=lambda: server.proc.poll() is None)


def assert_clean(summary: dict) -> None:
    """Every check the fuzz run makes, each with the summary as its message."""
    msg = brief(summary)
    assert not summary["no_response"], msg  # connection errors, timeouts, a dead server
    assert not summary["status_mismatches"], msg
    assert not summary["server_errors"], msg  # a 5xx, even on both sides
    assert not summary["greedy_mismatches"], msg
    assert not summary["count_mismatches"] and not summary["output_count_mismatches"], msg
    assert not summary["unparsable"], msg
    assert not summary["logprob_violations"], msg
    assert not summary["hidden_state_mismatches"], msg
    assert not summary["distribution_mismatches"], msg
    assert summary["logprob_max_abs_diff"] <= summary["tolerance"], msg
    assert not summary["server_deaths"], msg
    assert not summary["leaks"], msg
    assert summary["ok"], msg


def test_vericache_answers_every_fuzzed_request_like_plain(
    plain_server, vericache_server, tmp_path: Path
) -> None:
    summary = fuzz(target("plain", plain_server), target("vericache", vericache_server),
                   seed=SEED, requests=REQUESTS, exclude=EXCLUDE, tolerance=TOLERANCE,
                   concurrency=4, timeout=300.0, progress_every=40)  # fmt: skip
    out = tmp_path / "fuzz.json"
    out.write_text(json.dumps(summary, indent=1, default=str))
    print(f"fuzz summary: {out} ({summary['requests']} requests, {summary['wall_s']} s)")
    assert summary["requests"] >= min(REQUESTS, 50) or EXCLUDE
    assert summary["logprob_values_compared"] > 0 or "logprob" in EXCLUDE
    assert summary["distribution_tests"] > 0 or "distribution" in EXCLUDE
    assert_clean(summary)


def test_the_checks_fail_on_a_wrong_candidate() -> None:
    """No servers: fabricated replies through the same comparison and assertion, so a broken
    comparator cannot turn the test above into one that always passes."""
    case = FuzzCase(0, "greedy", GENERATE, {"text": "x", "sampling_params": {"temperature": 0}})
    ref = Reply(200, {"output_ids": [1, 2, 3], "meta_info": {}})
    wrong = Reply(200, {"output_ids": [1, 2, 4], "meta_info": {}})
    healthy = {"alive": True, "healthy": True, "leak": None}
    summary = summarize([case], [fc.compare_case(case, ref, wrong)], seed=0, tolerance=TOLERANCE,
                        health={"plain": healthy, "vericache": healthy})  # fmt: skip
    with pytest.raises(AssertionError, match="greedy_mismatches"):
        assert_clean(summary)
