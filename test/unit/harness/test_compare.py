"""Exactness harness logic: divergence detection, margins, argument stripping, prompt files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_vericache.exactness.__main__ import reference_args
from sglang_vericache.exactness.client import load_prompts
from sglang_vericache.exactness.compare import Generation, compare, first_divergence, summarize


@pytest.mark.parametrize(
    "ref, cand, expected",
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 9, 3], 1),
        ([1, 2, 3], [1, 2], 2),  # candidate stopped early
        ([1, 2], [1, 2, 3], 2),  # candidate went on past the reference's end
        ([], [], None),
        ([5], [6], 0),
    ],
)
def test_first_divergence(ref: list[int], cand: list[int], expected: int | None) -> None:
    assert first_divergence(ref, cand) == expected


def test_divergence_reports_tokens_and_reference_margin() -> None:
    top2 = (((-0.1, 1), (-2.0, 7)), ((-0.5, 2), (-0.6, 9)))
    ref = Generation((1, 2), top2)
    r = compare("p", ref, Generation((1, 9)))
    assert not r.identical and r.first_divergence == 1
    assert (r.reference_token, r.candidate_token) == (2, 9)
    assert r.reference_margin == pytest.approx(0.1)


def test_early_end_has_no_candidate_token() -> None:
    r = compare("p", Generation((1, 2, 3)), Generation((1,)))
    assert r.first_divergence == 1 and r.candidate_token is None and r.reference_margin is None


def test_summary_status_and_totals() -> None:
    same = compare("a", Generation((1,)), Generation((1,)))
    diff = compare("b", Generation((1,), (((-0.2, 1), (-0.3, 4)),)), Generation((4,)))
    s = summarize([same, diff], concurrency=1)
    assert s["status"] == "divergent" and s["total"] == 2 and s["divergent"] == 1
    assert s["min_divergence_margin"] == pytest.approx(0.1)
    assert summarize([same])["status"] == "identical"
    json.dumps(s)  # the summary is plain JSON


def test_reference_args_strip_every_vericache_flag_and_value() -> None:
    argv = [
        "--model-path", "m", "--vericache", "--vericache-compressor", "kivi:bits=4",
        "--vericache-tier=zmq://h:1", "--dtype", "float32", "--vericache-draft-len", "8",
    ]  # fmt: skip
    assert reference_args(argv) == ["--model-path", "m", "--dtype", "float32"]


def test_load_prompts_accepts_text_and_ids_and_rejects_bad_lines(tmp_path: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text('{"id": "a", "prompt": "hi"}\n\n{"input_ids": [1, 2], "max_new_tokens": 4}\n')
    prompts = load_prompts(good)
    assert [p.id for p in prompts] == ["a", "line3"]
    assert prompts[1].input_ids == (1, 2) and prompts[1].max_new_tokens == 4
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "input_ids": [1]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_prompts(bad)


def test_load_prompts_reads_one_grammar_per_prompt(tmp_path: Path) -> None:
    path = tmp_path / "g.jsonl"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    path.write_text("\n".join(json.dumps(row) for row in (
        {"prompt": "a", "regex": "(yes|no)"},
        {"prompt": "b", "json_schema": schema},
        {"prompt": "c", "json_schema": json.dumps(schema)},
        {"prompt": "d"},
    )) + "\n")  # fmt: skip
    a, b, c, d = load_prompts(path)
    assert a.grammar == ("regex", "(yes|no)")
    assert b.grammar == c.grammar == ("json_schema", json.dumps(schema))
    assert d.grammar is None
    path.write_text(json.dumps({"prompt": "x", "regex": "a", "ebnf": "root ::= \"a\""}) + "\n")
    with pytest.raises(ValueError, match="at most one of"):
        load_prompts(path)
