"""The fuzzer's new surfaces on fabricated replies: hidden states, sampled distributions, invalid
later batch items, weight updates; and the chi-square test behind the distribution check."""

from __future__ import annotations

import random

import pytest

from testkit import fuzz_compare as fc
from testkit.fuzz import GENERATE, TOKENS, FuzzCase, VocabInfo, generate_cases
from testkit.fuzz_outputs import Reply
from testkit.fuzz_report import summarize
from testkit.fuzz_run import runs_alone
from testkit.fuzz_stats import chi_square_homogeneity
from testkit.fuzz_surfaces import DISTRIBUTION, UPDATE_WEIGHTS

VOCAB = VocabInfo(49152, 8192, (260, 198, 30, 28), hidden_size=576, model_path="/models/m")


def test_homogeneity_tells_a_biased_sample_from_a_fair_one() -> None:
    rng = random.Random(0)
    fair = [rng.random() < 0.5 for _ in range(2000)]
    fair2 = [rng.random() < 0.5 for _ in range(2000)]
    biased = [rng.random() < 0.25 for _ in range(2000)]  # F1's x^2 stop bias at x = 0.5
    assert chi_square_homogeneity(fair, fair2).p_value > 0.001
    assert chi_square_homogeneity(fair, biased).p_value < 1e-20
    assert chi_square_homogeneity(["a"] * 9, ["a"] * 9).p_value == 1.0


def _reply(outs: list[dict]) -> Reply:
    return Reply(200, outs if len(outs) > 1 else outs[0])


def _gen(ids: list[int], hidden=None) -> dict:
    meta = {} if hidden is None else {"hidden_states": hidden}
    return {"output_ids": ids, "text": "", "meta_info": meta}


def test_hidden_states_must_match_in_shape_and_value() -> None:
    case = FuzzCase(0, "hidden", GENERATE, {"text": "x", "return_hidden_states": True}, TOKENS)
    ref = _reply([_gen([1, 2], [[[0.5, 1.0]], [0.25, 0.5]])])
    same = _reply([_gen([1, 2], [[[0.5, 1.0 + 1e-5]], [0.25, 0.5]])])
    short = _reply([_gen([1, 2], [[[0.5, 1.0]]])])  # one decode step's entry missing (F5)
    off = _reply([_gen([1, 2], [[[0.5, 1.2]], [0.25, 0.5]])])
    assert fc.compare_case(case, ref, same).ok
    for bad in (short, off):
        result = fc.compare_case(case, ref, bad)
        assert [p.kind for p in result.problems] == [fc.HIDDEN_MISMATCH]


def test_prompt_hidden_states_compared_over_the_positions_both_computed() -> None:
    """A prompt served partly from one server's prefix cache has fewer prompt rows there (the
    hour soak: 1 against 13): the rows both computed must agree, the decode entries all."""
    case = FuzzCase(0, "hidden", GENERATE, {"text": "x", "return_hidden_states": True}, TOKENS)
    full = _reply([_gen([1], [[[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], [0.7, 0.8]])])
    cached = _reply([_gen([1], [[[0.5, 0.6]], [0.7, 0.8]])])
    wrong_tail = _reply([_gen([1], [[[0.5, 0.9]], [0.7, 0.8]])])
    assert fc.compare_case(case, full, cached).ok and fc.compare_case(case, cached, full).ok
    result = fc.compare_case(case, full, wrong_tail)
    assert [p.kind for p in result.problems] == [fc.HIDDEN_MISMATCH]


def _dist_case(pos: int) -> FuzzCase:
    body = {"text": "x", "sampling_params": {"n": 200, "temperature": 1.0}}
    return FuzzCase(0, "distribution", GENERATE, body, DISTRIBUTION, (f"pos{pos}",))


def test_distribution_check_catches_a_stop_bias_and_passes_a_fair_sample() -> None:
    """Position 1 ends (EOS) half the time on the reference; a candidate that ends there a
    quarter of the time (F1's x^2) fails, one drawn from the same coin passes."""
    rng = random.Random(1)

    def side(p_end: float) -> Reply:
        return Reply(200, [_gen([5] if rng.random() < p_end else [5, 7, 9]) for _ in range(400)])

    ref, fair, biased = side(0.5), side(0.5), side(0.25)
    summary_ok = fc.compare_case(_dist_case(1), ref, fair)
    assert summary_ok.ok and summary_ok.p_value > 0.001
    bad = fc.compare_case(_dist_case(1), ref, biased)
    assert [p.kind for p in bad.problems] == [fc.DISTRIBUTION_MISMATCH]
    s = summarize([_dist_case(1)], [bad], seed=0, tolerance=1e-3)
    assert s["distribution_tests"] == 1 and s["distribution_min_p"] < 1e-3
    assert len(s["distribution_mismatches"]) == 1 and not s["ok"]


def test_invalid_batch_items_are_never_the_first_and_weights_run_alone() -> None:
    cases = generate_cases(3, 3000, VOCAB, kinds=["batch_invalid", "weights"])
    invalid = [c for c in cases if c.kind == "batch_invalid"]
    weights = [c for c in cases if c.kind == "weights"]
    assert invalid and weights
    for c in invalid:
        params = c.body["sampling_params"]
        first_ok = params[0].get("temperature", 0) >= 0 and "regex" not in params[0]
        assert first_ok and "stop_token_ids" not in params[0]
        assert len(params) >= 2
    for c in weights:
        assert c.endpoint == UPDATE_WEIGHTS and c.body == {"model_path": "/models/m"}
        assert runs_alone(c)


def test_embeds_and_hidden_cases_have_the_served_width() -> None:
    cases = generate_cases(4, 2000, VOCAB, kinds=["embeds", "hidden"])
    embeds = [c for c in cases if c.kind == "embeds"]
    assert embeds and all(len(row) == 576 for c in embeds for row in c.body["input_embeds"])
    hidden = [c for c in cases if c.kind == "hidden"]
    assert any(isinstance(c.body["return_hidden_states"], list) for c in hidden)
    assert {"last", True} <= {v for c in hidden for v in (
        c.body["return_hidden_states"] if isinstance(c.body["return_hidden_states"], list)
        else [c.body["return_hidden_states"]])}  # fmt: skip
