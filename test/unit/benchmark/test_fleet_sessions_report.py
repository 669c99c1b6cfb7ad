"""benchmark/fleet_sessions_report.py: the figures the fleet benchmark reports, from replay rows."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmark"))

from fleet_sessions_report import (  # noqa: E402
    markdown,
    moved_turns,
    next_answers,
    skip_reason,
    summarize,
)


def row(sid: str, turn: int, start: float, e2e: float, *, prompt: int = 1000, cached: int = 0,
        sha: str = "a", **extra: object) -> dict:  # fmt: skip
    return {"session_id": sid, "turn": turn, "start_s": start, "e2e_s": e2e, "ttft_s": e2e / 2,
            "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": 8,
            "output_sha256": sha, **extra}  # fmt: skip


def run(rows: list[dict], wall: float = 10.0, **extra: object) -> dict:
    return {"turns": rows, "meta": {"wall_s": wall}, **extra}


ARGS = argparse.Namespace(sessions=2, turns=2, max_tokens=8, think_s=1.0, replicas=2,
                          system_tokens=1000, holds_tight=2, bandwidth_mbps=100.0,
                          compressor="snapkv:ratio=0.25", gsp_prompts=8, gsp_turns=3,
                          gsp_input_len=1536)  # fmt: skip


def test_next_answer_is_the_whole_turn_that_ends_after_the_kill() -> None:
    rows = [row("s0", 0, 0.0, 2.0), row("s0", 1, 3.0, 4.0),   # in flight at kill 5: 4 s
            row("s1", 0, 0.0, 1.0), row("s1", 1, 6.0, 1.5),   # starts after it: 1.5 s
            row("s2", 0, 4.0, 0.5), {"session_id": "s2", "turn": 1, "start_s": 5.5,
                                     "error": "HTTP 503"}]  # fmt: skip
    assert next_answers(rows, 5.0) == [4.0, 1.5, None]


def test_a_moved_turn_found_its_prefix_when_most_of_the_previous_prompt_was_cached() -> None:
    rows = [row("s0", 0, 0, 1, prompt=2000, worker="A"),
            row("s0", 1, 2, 1, prompt=2500, cached=1900, worker="B"),   # moved, found (>= 1800)
            row("s0", 2, 4, 1, prompt=3000, cached=1000, worker="A"),   # moved, recomputed
            row("s0", 3, 6, 1, prompt=3500, cached=3000, worker="A"),   # stayed
            row("s1", 0, 0, 1, worker="A"), row("s1", 1, 2, 1, cached=990, worker=None)]
    assert moved_turns(rows) == {"moved": 2, "found_prefix": 1}  # no worker named: not counted


def test_summary_compares_answers_and_speedups_with_plain_at_the_first_phase() -> None:
    plain = run([row("s0", 0, 0, 4.0), row("s0", 1, 5, 6.0), row("s1", 0, 0, 5.0)])
    vc = run([row("s0", 0, 0, 2.0, cached=900), row("s0", 1, 3, 3.0, sha="b"),
              row("s1", 0, 0, 2.5, attempts=2)],
             counters=[{"vericache:tier_link_events": {"hits_tokens": 640.0}}],
             tier={"bytes_out": 123})  # fmt: skip
    killed = run([row("s0", 0, 0, 2.0), row("s0", 1, 3, 5.0, cached=500)], kill_s=4.0)
    report = summarize({"tight": {"plain": plain, "vericache-zmq": vc,
                                  "hicache": {"skipped": "did not run here: no CUDA"}},
                        "tight, replica killed": {"vericache-zmq": killed}},
                       {"plain": "(a)", "vericache-zmq": "(c)", "hicache": "(b)"},
                       {"tight": 2560}, ARGS)  # fmt: skip
    tight = report["phases"]["tight"]
    assert tight["plain"]["e2e_speedup_vs_plain"] == 1.0
    assert tight["vericache-zmq"]["e2e_s"]["median"] == 2.5
    assert tight["vericache-zmq"]["e2e_speedup_vs_plain"] == 2.0   # 5.0 / 2.5
    assert (tight["vericache-zmq"]["identical"], tight["vericache-zmq"]["compared"]) == (2, 3)
    assert tight["vericache-zmq"]["recomputed_tokens"] == 3000 - 900
    assert tight["vericache-zmq"]["tier_hit_tokens"] == 640
    assert tight["vericache-zmq"]["retried_turns"] == 1
    assert tight["hicache"] == {"skipped": "did not run here: no CUDA",
                                "e2e_speedup_vs_plain": None}  # fmt: skip
    kill = report["phases"]["tight, replica killed"]["vericache-zmq"]["kill"]
    assert kill["next_answer_s"]["median"] == 5.0 and kill["recomputed_after"] == 500
    text = markdown(report)
    assert "**2.00x**" in text and "not run: did not run here: no CUDA" in text
    assert "first turn answered after the kill" in text and "2/3" in text


def test_a_skipped_configuration_is_named_by_its_error_line() -> None:
    tail = ("server exited with status -9 during start-up (args: ...); log tail:\n"
            "  File \"torch/cuda/__init__.py\", line 591, in _lazy_init\n"
            "RuntimeError: Found no NVIDIA driver on your system.\n[...] kill_process_tree\n")
    assert skip_reason(tail) == "RuntimeError: Found no NVIDIA driver on your system."
    assert skip_reason("lmcache is not importable here") == "lmcache is not importable here"


def test_sglang_client_runs_are_compared_with_plains_texts_and_tabled() -> None:
    metrics = {"output_throughput": 12.5, "median_ttft_ms": 900.0, "median_tpot_ms": 210.0}
    plain = run([row("s0", 0, 0, 4.0)], gsp={"metrics": metrics, "texts": ["a", "b", "c"]})
    vc = run([row("s0", 0, 0, 2.0)], gsp={"metrics": {**metrics, "output_throughput": 20.0},
                                          "texts": ["a", "x", "c"]})  # fmt: skip
    broken = run([row("s0", 0, 0, 2.0)], gsp={"error": "exit status 1; log tail: boom"})
    report = summarize({"tight": {"plain": plain, "vericache-zmq": vc,
                                  "vericache-lmcache": broken}},
                       {"plain": "(a)", "vericache-zmq": "(c)", "vericache-lmcache": "(d)"},
                       {"tight": 2560}, ARGS)  # fmt: skip
    tight = report["phases"]["tight"]
    assert tight["plain"]["gsp"]["identical"] == 3
    assert (tight["vericache-zmq"]["gsp"]["identical"], tight["vericache-zmq"]["gsp"]["texts"]) \
        == (2, 3)
    assert tight["vericache-lmcache"]["gsp"] == {"error": "exit status 1; log tail: boom"}
    table = markdown(report)
    assert "| SGLang client (generated-shared-prefix): output tok/s | 12.5 | 20.0 | failed |" \
        in table
    assert "| SGLang client: texts identical to (a) | 3/3 | 2/3 | - |" in table
