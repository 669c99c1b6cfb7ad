"""The step-profile benchmark's window, profile arithmetic and report (benchmark/step_profile.py);
no server: synthetic streams and metric scrapes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmark"))

from benchmark.step_profile import OFFLOAD_ONLY, Window, profile, summarize, tokens_at  # noqa: E402


def test_window_opens_at_the_last_first_token_and_closes_at_the_first_finish() -> None:
    scrapes = []
    window = Window(2, on_open=lambda: scrapes.append("open") or 1,
                    on_close=lambda: scrapes.append("close") or 2)  # fmt: skip
    window.first_token(1.0)
    window.first_token(2.0)
    window.finished(5.0)
    window.finished(6.0)
    assert (window.opened, window.closed, scrapes) == (2.0, 5.0, ["open", "close"])
    assert window.snapshots == {"open": 1, "close": 2} and window.valid
    early = Window(2)
    early.first_token(1.0)
    early.finished(2.0)  # finished before the other request started: no such span
    early.first_token(3.0)
    early.finished(4.0)
    assert not early.valid
    assert tokens_at([(1.0, 1), (2.0, 4), (3.0, 9)], 2.5) == 4 and tokens_at([(1.0, 1)], 0.0) == 0


def _scrape(steps: float, draft_s: float, verify_s: float, forwards: float) -> dict:
    return {
        "vericache:profiled_steps": {"": steps},
        "vericache:step_phase_seconds": {"draft": draft_s, "verify": verify_s, "other": 0.01},
        "vericache:step_phase_steps": {"draft": steps, "verify": steps},
        "vericache:draft_forwards": {"": forwards},
        "vericache:verify_steps": {"greedy": 2 * steps},
        "vericache:drafted_tokens": {"greedy": 8 * steps},
        "vericache:committed_tokens": {"greedy": 6 * steps},
        "vericache:decode_steps": {"drafting pays": steps},
        "vericache:step_transient_bytes_peak": {"": 1000.0},
    }


def _run(outputs: list[list[int]], tok_s: float, with_metrics: bool) -> dict:
    snaps = {"open": _scrape(10, 1.0, 2.0, 40), "close": _scrape(30, 5.0, 6.0, 120)}
    return {"outputs": outputs, "decode_tok_s": tok_s, "e2e_tok_s": tok_s / 2,
            "decode_window_s": 10.0, "wall_s": 20.0, "prompt_tokens": [1000, 1200],
            "generated_mid": 50.0, "compressed_kv_bytes": [10**6, 10**6],
            "metrics": snaps if with_metrics else {}}  # fmt: skip


def test_profile_diffs_the_scrapes_and_predicts_the_same_batch() -> None:
    p = profile(_run([[1]], 10.0, True), batch=2)
    assert p["steps"] == 20 and p["drafts_per_verify"] == 4.0 and p["committed_per_verify"] == 3.0
    assert p["ms_when_run"]["draft"] == pytest.approx(200.0)  # 4 s over the 20 drafting steps
    assert p["draft_ms_per_forward"] == pytest.approx(50.0)  # 4 s over 80 forwards
    assert p["context"] == 1150  # mean prompt + tokens generated at mid-window
    model = p["model_ms"]
    assert model["verify"] > model["plain"] > model["draft_forward"] > 0  # L > view


def test_summary_compares_every_system_with_plain_and_offload_only(tmp_path: Path) -> None:
    from step_profile_report import markdown, plot

    runs = {"plain": _run([[1, 2], [3, 4]], 10.0, False),
            OFFLOAD_ONLY: _run([[1, 2], [3, 4]], 12.0, True),
            "vericache": _run([[1, 2], [3, 5]], 18.0, True)}  # fmt: skip
    out = summarize(2, runs)
    vc = out["systems"]["vericache"]
    assert (vc["decode_vs_plain"], vc["decode_vs_offload"], vc["identical"]) == (1.8, 1.5, "1/2")
    report = {"settings": {"prompt_tokens": 1000, "seed": 1, "max_new_tokens": 8,
                           "compressor": "snapkv:ratio=0.25", "draft_len": "auto"},
              "runs": [out]}  # fmt: skip
    text = markdown(report)
    assert "| vericache | 18.0 | 1.8x | 1.5x |" in text and "1/2" in text
    # the command line repeats what differs from the defaults, so the table can be rerun
    assert ("`python benchmark/step_profile.py --concurrency 2 --seed 1 --max-new-tokens 8 "
            "--prompt-tokens 1000`") in text  # fmt: skip
    plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_alternating_rounds_are_tabled_with_their_median() -> None:
    """``--rounds``: each round's decode rates and plain-step times, whether all three systems
    gave the same tokens, and the median ratio of the paired rounds (1, 2: both servers up)
    beside that of all; a single round adds nothing to the report."""
    from step_profile_report import markdown

    from benchmark.step_profile import round_row

    plain = _run([[1, 2], [3, 4]], 10.0, False)
    off, same, wrong = (_run([[1, 2], [3, 4]], 12.0, True), _run([[1, 2], [3, 4]], 18.0, True),
                        _run([[1, 2], [3, 5]], 6.0, True))  # fmt: skip
    rounds = [round_row(0, off, same, plain, 2), round_row(1, off, wrong, plain, 2),
              round_row(2, off, same, plain, 2)]  # fmt: skip
    assert [r["ratio"] for r in rounds] == [1.5, 0.5, 1.5]
    assert [r["identical"] for r in rounds] == [True, False, True]
    out = summarize(2, {"plain": plain, OFFLOAD_ONLY: off, "vericache": same})
    report = {"settings": {"prompt_tokens": 1000, "seed": 1, "max_new_tokens": 8,
                           "compressor": "snapkv:ratio=0.25", "draft_len": "auto"},
              "runs": [out | {"rounds": rounds}]}  # fmt: skip
    text = markdown(report)
    assert "| 1 | 12.0 |" in text and "| 0.5x | NO |" in text
    assert ("Median VeriCache / offload-only: 1.00x over the 2 paired rounds, 1.50x over all 3."
            in text)  # fmt: skip
    assert "take turns" not in markdown({**report, "runs": [out | {"rounds": rounds[:1]}]})
