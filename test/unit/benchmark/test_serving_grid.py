"""The pure parts of benchmark/serving_grid.py (serving_grid_plan): grid, rounds, harness command,
output parsing, medians and ratios. No server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from benchmark import serving_grid_plan as plan

# One line of the harness's --output-file, recorded (sglang 0.5.23, random-ids, 4 prompts x 32
# tokens, concurrency 1, --output-details, 2 loaded CPU cores; its JSON as written, Infinity
# included): server_info emptied, itls dropped, floats rounded.
SAMPLE_LINE = (
    '{"tag": null, "backend": "sglang", "dataset_name": "random-ids", "request_rate": Infinity, "'
    'max_concurrency": 1, "sharegpt_output_len": null, "random_input_len": 1024, "random_output_l'
    'en": 32, "random_range_ratio": 1.0, "server_info": {}, "duration": 134.608, "completed": 4, '
    '"total_input_tokens": 4096, "total_input_text_tokens": 4096, "total_input_vision_tokens": 0,'
    ' "total_output_tokens": 128, "total_output_tokens_retokenized": 127, "request_throughput": 0'
    '.03, "input_throughput": 30.429, "output_throughput": 0.951, "total_throughput": 31.38, "mea'
    'n_e2e_latency_ms": 33636.5, "median_e2e_latency_ms": 34014.906, "std_e2e_latency_ms": 1318.5'
    '25, "p90_e2e_latency_ms": 34754.458, "p95_e2e_latency_ms": 34898.783, "p99_e2e_latency_ms": '
    '35014.244, "mean_ttft_ms": 23302.024, "median_ttft_ms": 22619.499, "std_ttft_ms": 2625.056, '
    '"p90_ttft_ms": 26089.861, "p95_ttft_ms": 26829.537, "p99_ttft_ms": 27421.277, "mean_tpot_ms"'
    ': 333.37, "median_tpot_ms": 343.181, "std_tpot_ms": 93.396, "p90_tpot_ms": 429.335, "p95_tpo'
    't_ms": 435.33, "p99_tpot_ms": 440.125, "mean_itl_ms": 333.369, "median_itl_ms": 176.718, "st'
    'd_itl_ms": 311.899, "p90_itl_ms": 784.998, "p95_itl_ms": 941.868, "p99_itl_ms": 1297.326, "c'
    'oncurrency": 1.0, "accept_length": null, "max_output_tokens_per_s": 9.0, "max_concurrent_req'
    'uests": 2, "input_lens": [1024, 1024, 1024, 1024], "output_lens": [32, 32, 32, 32], "ttfts":'
    ' [27.569, 20.4, 22.601, 22.638], "generated_texts": ["s\\n\\nWhat is the language of the text?'
    '\\n\\nThe text is in English. I need to translate it into the language of the target audience.'
    '", " eSpectraSpectraSpectraSpectraSpectraSpectraSpectraSpectraSpectraSpectraS", "e olde e e '
    'e e e e e e e e e e e e e e e e e e e e e e e e e e e", "asson Exadam 1111111111111111111111'
    '1111"], "errors": ["", "", "", ""]}'
)


def test_the_grid_groups_cells_by_budget_and_input_length() -> None:
    groups = plan.expand_grid(["ample", "tight"], [1024, 4096], ["random-ids", "custom"], [1, 8])
    assert len(groups) == 4 and all(len(g) == 4 for g in groups)
    assert {(c.budget, c.input_len) for c in groups[1]} == {("ample", 4096)}
    assert [c.key() for c in groups[0]][:2] == ["ample/random-ids/in1024/c1",
                                                "ample/random-ids/in1024/c8"]
    with pytest.raises(ValueError):
        plan.expand_grid(["ample"], [1024], ["sharegpt"], [1])


def test_rounds_rotate_the_server_order() -> None:
    servers = [plan.PLAIN, plan.OFFLOAD, plan.VERICACHE]
    assert plan.round_order(servers, 0) == servers
    assert plan.round_order(servers, 1) == [plan.OFFLOAD, plan.VERICACHE, plan.PLAIN]
    assert plan.round_order(servers, 3) == servers
    firsts = {plan.round_order(servers, r)[0] for r in range(3)}
    assert firsts == set(servers)


def test_budgets_hold_n_full_requests_as_the_other_budget_benchmarks() -> None:
    assert plan.budget_tokens(2, 1024, 128) == 2 * 1152 + 64
    assert plan.budget_n_full("ample", [1, 8, 16], 2) == 16
    assert plan.budget_n_full("tight", [1, 8, 16], 2) == 2
    with pytest.raises(ValueError):
        plan.budget_n_full("huge", [1], 2)


def test_the_harness_command_per_dataset(tmp_path: Path) -> None:
    common = {"num_prompts": 8, "output_len": 32, "seed": 3, "output_file": tmp_path / "o.jsonl"}
    cell = plan.Cell("ample", 1024, "random-ids", 4)
    cmd = plan.harness_command("py", cell, "http://h:1", "/m", custom_path=None, gsp=None, **common)
    assert cmd[:3] == ["py", "-m", "sglang.benchmark.serving"]
    assert cmd[cmd.index("--backend") + 1] == "sglang"
    for flag, value in (("--max-concurrency", "4"), ("--random-input-len", "1024"),
                        ("--temperature", "0"), ("--seed", "3"), ("--random-range-ratio", "1.0")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--output-details" in cmd and "--tokenize-prompt" in cmd and "--flush-cache" in cmd
    custom = plan.harness_command("py", plan.Cell("ample", 1024, "custom", 1), "u", "/m",
                                  custom_path=tmp_path / "c.jsonl", gsp=None, **common)
    assert custom[custom.index("--sharegpt-output-len") + 1] == "32"
    shape = plan.gsp_shape(1024, 32, 8, 3, 64)
    assert shape.system_len + 3 * 64 + 2 * 32 == 1024 and shape.groups * shape.per_group == 8
    gsp = plan.harness_command("py", plan.Cell("tight", 1024, "generated-shared-prefix", 8), "u",
                               "/m", custom_path=None, gsp=shape, **common)
    assert gsp[gsp.index("--backend") + 1] == "sglang-oai-chat"  # its multi-turn needs chat
    assert gsp[gsp.index("--gsp-num-turns") + 1] == "3"
    with pytest.raises(ValueError):
        plan.gsp_shape(256, 128, 4, 3, 64)


def test_custom_jsonl_is_the_harness_format() -> None:
    row = json.loads(plan.custom_jsonl_lines(["hello"])[0])
    assert row["conversations"][0]["content"] == "hello" and len(row["conversations"]) == 2


def test_parsing_a_recorded_harness_line(tmp_path: Path) -> None:
    metrics, texts = plan.parse_harness_line(SAMPLE_LINE)
    assert metrics["output_throughput"] == 0.951 and metrics["median_ttft_ms"] == 22619.499
    assert metrics["max_output_tokens_per_s"] == 9.0 and metrics["completed"] == 4
    assert metrics["median_tpot_ms"] == 343.181 and metrics["p90_tpot_ms"] == 429.335
    assert metrics["errors"] == 0 and len(texts) == 4 and texts[1].startswith(" eSpectra")
    path = tmp_path / "out.jsonl"
    path.write_text(SAMPLE_LINE.replace("0.951", "7.5") + "\n" + SAMPLE_LINE + "\n")
    assert plan.parse_harness_file(path)[0]["output_throughput"] == 0.951  # the last line
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError):
        plan.parse_harness_file(tmp_path / "empty.jsonl")


def _round(plain: float, offload: float, vc: float, ttft: tuple[float, float, float]) -> dict:
    vals = zip((plan.PLAIN, plan.OFFLOAD, plan.VERICACHE), (plain, offload, vc), ttft)
    return {"servers": {n: {"metrics": {"output_throughput": t, "median_ttft_ms": f}}
                        for n, t, f in vals},
            "identical": {plan.VERICACHE: {"same": 4, "total": 4}}}


def test_medians_and_ratios_against_the_better_baseline() -> None:
    rounds = [_round(100, 120, 150, (10, 20, 8)), _round(110, 100, 99, (12, 10, 20)),
              _round(90, 80, 135, (10, 10, 10))]
    s = plan.summarize_cell(rounds)
    assert s["servers"][plan.PLAIN]["output_throughput"] == 100
    assert s["servers"][plan.VERICACHE]["output_throughput"] == 135
    assert s["ratio_by_round"]["output_throughput"] == pytest.approx([1.25, 0.9, 1.5])
    assert s["ratio"]["output_throughput"] == pytest.approx(1.25)
    # latency: the better (lower) baseline over VeriCache's
    assert s["ratio_by_round"]["median_ttft_ms"] == pytest.approx([1.25, 0.5, 1.0])
    assert s["identical"][plan.VERICACHE] == {"same": 12, "total": 12}
    assert s["ratio"]["median_tpot_ms"] is None  # not measured: no ratio, no crash


def test_a_failed_server_leaves_no_ratio_and_identical_counts_positions() -> None:
    rnd = _round(100, 120, 150, (1, 1, 1))
    rnd["servers"][plan.VERICACHE] = {"error": "server start: boom"}
    assert plan.summarize_cell([rnd])["ratio"]["output_throughput"] is None
    assert plan.identical(["a", "b", "c"], ["a", "x", "c"]) == {"same": 2, "total": 3}
    assert plan.identical(["a", "b"], ["a"]) == {"same": 1, "total": 2}


def test_the_results_page_section_from_a_report_and_without_one(tmp_path: Path) -> None:
    from benchmark.results_page import Results
    from benchmark.results_page_serving import GRIDS, serving, serving_headline

    not_run = serving(Results(tmp_path))[0]
    assert serving_headline(Results(tmp_path)) == []
    assert not_run.startswith("Not yet run: `python benchmark/serving_grid.py`")
    cells = []
    for n, c, r in ((1024, 1, 1.1), (1024, 8, 1.3), (4096, 1, 0.9)):
        summary = plan.summarize_cell([_round(100, 120, 120 * r, (1, 1, 1))])
        cells.append({"budget": "tight", "dataset": "random-ids", "input_len": n,
                      "concurrency": c, "summary": summary})
    report = {"date": "2027-01-02", "command": "python benchmark/serving_grid.py --rounds 1",
              "cells": cells}
    (tmp_path / GRIDS[0]).write_text(json.dumps(report))
    lines = serving(Results(tmp_path))
    row = next(line for line in lines if line.startswith("| tight |"))
    assert "1024: c1 1.10, c8 1.30; 4096: c1 0.90" in row
    assert "100.0 / 120.0 / 108.0 (in 4096, c1)" in row and "| 12/12 |" in row
    assert "2027-01-02" in row and "`python benchmark/serving_grid.py --rounds 1`" in row
    more = plan.summarize_cell([_round(100, 120, 180, (1, 1, 1))])
    later = {"date": "2027-01-05", "command": "python benchmark/serving_grid.py --rounds 2",
             "cells": [{"budget": "tight", "dataset": "random-ids", "input_len": 1024,
                        "concurrency": 16, "summary": more}]}  # fmt: skip
    (tmp_path / GRIDS[1]).write_text(json.dumps(later))
    [row] = [line for line in serving(Results(tmp_path)) if line.startswith("| tight |")]
    assert "1024: c1 1.10, c8 1.30, c16 1.50; 4096: c1 0.90" in row and "| 16/16 |" in row
    assert "2027-01-05" in row and ("`python benchmark/serving_grid.py --rounds 1 && "
                                    "python benchmark/serving_grid.py --rounds 2`") in row
    (tmp_path / GRIDS[1]).unlink()
    [(question, answer, date, section)] = serving_headline(Results(tmp_path))
    assert "3 cells" in answer and "0 in paired rounds" in answer
    assert "**0.90-1.30x**, lowest at tight 4096 / c1 `random-ids`" in answer and "12/12" in answer
    assert date == "2027-01-02" and section == "Serving through SGLang's client"
    failed = _round(100, 120, 150, (1, 1, 1))
    failed["servers"][plan.VERICACHE] = {"error": "server start: boom"}
    cells.append({"budget": "ample", "dataset": "custom", "input_len": 7168, "concurrency": 8,
                  "summary": plan.summarize_cell([failed])})  # fmt: skip
    (tmp_path / GRIDS[0]).write_text(json.dumps({**report, "cells": cells}))
    [(_, answer, _, _)] = serving_headline(Results(tmp_path))
    assert "**0.90-1.30x**, lowest at tight 4096 / c1 `random-ids` (1 without a ratio" in answer
