"""The soak's server-free parts (benchmark/soak_traffic.py): the traffic mix, trends, metrics
parsing and process sampling."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmark"))

from soak_traffic import (  # noqa: E402
    ABORT, TrafficMix, metric_values, slope, traffic, tree_usage, trends,
)
from testkit.fuzz import VocabInfo  # noqa: E402

VOCAB = VocabInfo(49152, 8192, (260, 198), hidden_size=576, model_path="/m")


def test_traffic_is_seeded_numbered_and_mixes_disconnects_and_aborts() -> None:
    a = list(itertools.islice(traffic(3, VOCAB, TrafficMix()), 1200))
    b = list(itertools.islice(traffic(3, VOCAB, TrafficMix()), 1200))
    assert [c.to_json() for c in a] == [c.to_json() for c in b]
    assert [c.index for c in a] == list(range(1200))
    disconnects = sum(c.disconnect_after is not None for c in a) / len(a)
    aborts = [c for c in a if c.kind == ABORT]
    assert 0.09 <= disconnects <= 0.2  # 10% injected, plus the fuzzer's own
    assert 0.015 <= len(aborts) / len(a) <= 0.05
    assert len({c.body["rid"] for c in aborts}) == len(aborts)  # each abort names its own rid
    assert {"hidden", "greedy", "grammar"} <= {c.kind for c in a}


def test_traffic_leaves_out_what_it_is_told_to() -> None:
    cases = list(itertools.islice(traffic(1, VOCAB, TrafficMix(), exclude=("hidden",)), 600))
    assert not any(c.kind == "hidden" for c in cases)
    with pytest.raises(ValueError, match="shares"):
        TrafficMix(disconnect=0.8, abort=0.3)


def test_trends_fit_a_slope_per_hour_after_the_warm_up_sample() -> None:
    samples = [{"minute": 0, "rss_bytes": 10, "fds": 5}]  # warm-up: skipped
    samples += [{"minute": m, "rss_bytes": 1000 + 2 * m, "fds": 40} for m in range(1, 11)]
    t = trends(samples)
    assert t["rss_bytes"]["slope_per_hour"] == pytest.approx(120.0)
    assert t["rss_bytes"]["first"] == 1002 and t["rss_bytes"]["last"] == 1020
    assert t["fds"]["slope_per_hour"] == 0.0
    assert slope([1.0], [3.0]) == 0.0 and slope([2.0, 2.0], [1.0, 5.0]) == 0.0


def test_metric_values_reads_labelled_samples_of_one_metric() -> None:
    text = "\n".join([
        "# HELP vericache:tier_bytes_in_flight Host bytes.",
        'vericache:tier_bytes_in_flight{kind="put",model_name="default"} 0.0',
        'vericache:tier_bytes_in_flight{kind="fetch",model_name="default"} 4096.0',
        'vericache:tier_bytes_in_flight_other{kind="put"} 7.0',
        "vericache:tier_up 1.0",
    ])  # fmt: skip
    values = metric_values(text, "vericache:tier_bytes_in_flight")
    assert sorted(values.values()) == [0.0, 4096.0]
    assert metric_values(text, "vericache:tier_up") == {"": 1.0}


def test_tree_usage_counts_this_process() -> None:
    usage = tree_usage(os.getpid())
    assert usage["processes"] >= 1 and usage["rss_bytes"] > 10 * 2**20 and usage["fds"] >= 3
    assert usage["memory_bytes"] == usage["anon_bytes"] + usage["swap_bytes"]
    assert 0 < usage["anon_bytes"] <= usage["rss_bytes"] and usage["file_bytes"] > 0


def test_tree_usage_sees_memory_a_process_writes() -> None:
    """A fresh child writes 64 MiB between two readings of its own tree. A child, not this
    process: the test run's tree holds every server a fixture started, and a long-lived
    process's allocator may hand back pages it already touched."""
    code = ("import sys; sys.stdin.readline(); held = bytearray(b'x') * (64 * 2**20); "
            "print('written', flush=True); sys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        before = tree_usage(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "written"
        deadline = time.monotonic() + 15.0  # a kernel may account pages a little late
        after = tree_usage(child.pid)
        while after["memory_bytes"] - before["memory_bytes"] < 48 * 2**20:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
            after = tree_usage(child.pid)
        assert before["processes"] == after["processes"] == 1
        assert after["memory_bytes"] - before["memory_bytes"] >= 48 * 2**20, (before, after)
        assert after["anon_bytes"] + after["swap_bytes"] >= 64 * 2**20
    finally:
        child.kill()
        child.wait()


def test_only_token_differences_count_as_greedy_mismatches() -> None:
    from soak import SoakTarget, compare_greedy
    from testkit.fuzz import GENERATE, TOKENS, FuzzCase
    from testkit.fuzz_outputs import Reply

    case = FuzzCase(0, "greedy", GENERATE, {"text": "x"}, TOKENS)
    case2 = FuzzCase(1, "greedy", GENERATE, {"text": "y"}, TOKENS)
    ref = {0: Reply(200, {"output_ids": [1, 2], "meta_info": {"hidden_states": [[0.0]]}}),
           1: Reply(200, {"output_ids": [1, 2], "meta_info": {}})}
    cand = {0: Reply(200, {"output_ids": [1, 2], "meta_info": {"hidden_states": [[0.5]]}}),
            1: Reply(200, {"output_ids": [1, 3], "meta_info": {}})}
    a = SoakTarget("a", "", 0, lambda: True, replies=ref)
    b = SoakTarget("b", "", 0, lambda: True, replies=cand)
    out = compare_greedy({0: case, 1: case2}, a, b)
    assert out["compared"] == 2 and out["mismatch_count"] == 1 and out["other_count"] == 1
    assert out["mismatches"][0]["index"] == 1 and out["other_differences"][0]["index"] == 0
