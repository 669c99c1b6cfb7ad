"""The request fuzzer's generator, output reading and comparator, on fabricated replies.

The comparator is what makes the e2e fuzz test able to fail, so it is checked here against
deliberately wrong candidates: a different status, a different token, a log-prob off by more
than the tolerance, a missing answer, a 5xx.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from testkit import fuzz_compare as fc
from testkit.fuzz import (
    CHAT,
    COMPLETIONS,
    COUNT,
    GENERATE,
    STATUS,
    TOKENS,
    FuzzCase,
    VocabInfo,
    all_kinds,
    generate_cases,
    tags_of,
)  # fmt: skip
from testkit.fuzz_outputs import Reply, outputs
from testkit.fuzz_report import abbreviate, brief, markdown, merge, summarize
from testkit.fuzz_surfaces import DISTRIBUTION, STORM, UPDATE_WEIGHTS

VOCAB = VocabInfo(vocab_size=49152, context_len=8192, frequent_ids=(260, 198, 30, 28))


@pytest.fixture(scope="module")
def cases() -> list[FuzzCase]:
    return generate_cases(0, 1500, VOCAB)


# -- generator -----------------------------------------------------------------------------


def test_same_seed_same_cases_other_seed_other_cases() -> None:
    a = [c.to_json() for c in generate_cases(5, 200, VOCAB)]
    assert a == [c.to_json() for c in generate_cases(5, 200, VOCAB)]
    assert a != [c.to_json() for c in generate_cases(6, 200, VOCAB)]


def test_every_kind_drawn_and_bodies_are_json(cases: list[FuzzCase]) -> None:
    assert set(all_kinds()) <= {c.kind for c in cases}
    assert [c.index for c in cases] == list(range(len(cases)))
    for c in cases:
        if not isinstance(c.body, str):
            assert json.loads(json.dumps(c.body)) == c.body
        assert c.endpoint in (GENERATE, COMPLETIONS, CHAT, STORM, UPDATE_WEIGHTS)
        assert c.check in (TOKENS, COUNT, STATUS, DISTRIBUTION)


def test_greedy_dominates_and_decoding_stays_short(cases: list[FuzzCase]) -> None:
    """CI time: most requests are greedy, and max_new_tokens above 64 only at the context edge
    (where a regex or the context itself ends decoding after a few tokens)."""
    checks = Counter(c.check for c in cases)
    assert checks[TOKENS] > 0.75 * len(cases)
    for c in cases:
        sp = c.body.get("sampling_params") if isinstance(c.body, dict) else None
        limit = sp.get("max_new_tokens") if isinstance(sp, dict) else None
        if isinstance(limit, int) and limit > 64:
            assert c.kind in ("context_edge", "malformed"), c


def test_no_openai_row_without_a_limit_ignores_eos() -> None:
    """An OpenAI limit of 0 is no limit in SGLang (``max_completion_tokens or max_tokens``):
    with ignore_eos (sampled rows set it) the row would decode to the end of the context."""
    sampled_unlimited = 0
    for c in generate_cases(1, 700, VOCAB) + generate_cases(5, 700, VOCAB):
        if c.endpoint in (COMPLETIONS, CHAT) and isinstance(c.body, dict):
            if 0 in (c.body.get("max_tokens"), c.body.get("max_completion_tokens")):
                sampled_unlimited += c.body.get("temperature") == 0.8
                assert not c.body.get("ignore_eos"), c
    assert sampled_unlimited > 0  # the draws cover the case


def test_edge_values_are_drawn(cases: list[FuzzCase]) -> None:
    ids = {t for c in cases if isinstance(c.body, dict) and c.kind == "input_ids"
           for t in c.body["input_ids"]}  # fmt: skip
    assert {0, VOCAB.vocab_size - 1} <= ids and max(ids) < VOCAB.vocab_size
    limits = Counter(c.body["sampling_params"]["max_new_tokens"] for c in cases
                     if c.kind in ("greedy", "input_ids"))  # fmt: skip
    assert limits[0] and limits[1] and limits[32]
    tags = Counter(t for c in cases for t in c.tags)
    for tag in ("logprob", "stream", "stop", "penalty", "grammar", "n", "batch", "long",
                "disconnect", "sampled", "empty_text", "oov_ids", "wrong_type", "bad_json",
                "negative_max_new", "fits", "over"):  # fmt: skip
        assert tags[tag], tag


def test_stop_token_ids_are_frequent_tokens(cases: list[FuzzCase]) -> None:
    stop_ids = [t for c in cases if c.kind == "stop"
                for t in c.body["sampling_params"].get("stop_token_ids", [])]  # fmt: skip
    assert stop_ids and set(stop_ids) <= set(VOCAB.frequent_ids)


def test_long_prompts_cross_the_chunked_prefill_size(cases: list[FuzzCase]) -> None:
    longs = [c.body["text"] for c in cases if c.kind == "long"]
    assert longs and min(map(len, longs)) > 2600  # ~4 chars a token: > 600 tokens
    assert max(map(len, longs)) < 6400 + 200


def test_context_edge_sits_at_the_limit(cases: list[FuzzCase]) -> None:
    for c in cases:
        if c.kind == "context_edge" and {"fits", "over"} & set(c.tags):
            total = len(c.body["input_ids"]) + c.body["sampling_params"]["max_new_tokens"]
            assert total == VOCAB.context_len + ("over" in c.tags)


def test_disconnects_stream_and_only_check_status(cases: list[FuzzCase]) -> None:
    dis = [c for c in cases if c.disconnect_after is not None]
    assert dis and all(c.stream and c.check == STATUS and "disconnect" in c.tags for c in dis)


def test_filters_keep_indices_stable() -> None:
    every = generate_cases(3, 300, VOCAB)
    no_logprob = generate_cases(3, 300, VOCAB, exclude=["logprob", "malformed"])
    assert no_logprob and all(not {"logprob", "malformed"} & c.labels() for c in no_logprob)
    by_index = {c.index: c.to_json() for c in every}
    assert all(by_index[c.index] == c.to_json() for c in no_logprob)
    only = generate_cases(3, 300, VOCAB, kinds=["oai_chat"])
    assert only and {c.kind for c in only} == {"oai_chat"}


def test_tags_read_off_the_body() -> None:
    body = {"text": ["a", "b"], "stream": True, "return_logprob": True,
            "sampling_params": {"temperature": 0.7, "n": 2, "stop": "x", "regex": "a"}}  # fmt: skip
    assert set(tags_of(GENERATE, body)) == {"batch", "stream", "logprob", "sampled", "n", "stop",
                                            "grammar"}  # fmt: skip
    assert tags_of(GENERATE, "{bad") == ("raw",)
    with pytest.raises(ValueError):
        VocabInfo(vocab_size=1, context_len=8192)


# -- reading outputs -----------------------------------------------------------------------


def gen_item(ids, lps=None, index=None) -> dict:
    meta = {"output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]} if lps else {}
    item = {"text": "".join(map(str, ids)), "output_ids": list(ids), "meta_info": meta}
    return item if index is None else {**item, "index": index}


def test_generate_stream_folds_to_the_last_event_per_index() -> None:
    c = FuzzCase(0, "stream", GENERATE, {"text": ["a", "b"], "stream": True})
    events = [gen_item([1], index=0), gen_item([7], index=1), gen_item([1, 2], index=0),
              gen_item([7, 8, 9], index=1)]  # fmt: skip
    outs = outputs(c, Reply(200, events))
    assert [o.ids for o in outs] == [(1, 2), (7, 8, 9)]


def test_openai_chat_stream_folds_deltas_and_logprobs() -> None:
    c = FuzzCase(0, "oai_chat", CHAT, {"messages": [], "stream": True, "logprobs": True})
    chunk = lambda text, lp: {"choices": [{"index": 0, "delta": {"content": text}, "logprobs": {
        "content": [{"token": text, "logprob": lp, "top_logprobs": []}]}}]}  # fmt: skip
    out = outputs(c, Reply(200, [chunk("Hel", -0.5), chunk("lo", -0.25), {"choices": []}]))[0]
    assert out.text == "Hello" and out.n_tokens == 2
    assert out.logprobs["token"] == [{"Hel": -0.5}, {"lo": -0.25}]


def test_openai_completion_token_ids_and_top_logprobs() -> None:
    c = FuzzCase(0, "oai_completion", COMPLETIONS, {"prompt": "x"})
    body = {"choices": [{"index": 1, "text": "b", "token_ids": [5]}, {
        "index": 0, "text": "a", "token_ids": [4],
        "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [{"a": -1.0}]}}]}
    outs = outputs(c, Reply(200, body))
    assert [o.ids for o in outs] == [(4,), (5,)]
    assert outs[0].logprobs == {"token": [{"a": -1.0}], "top": [{"a": -1.0}]}


# -- comparator: it must catch a wrong candidate ---------------------------------------------


GREEDY = FuzzCase(0, "greedy", GENERATE, {"text": "x", "sampling_params": {"temperature": 0}})


def problems(case: FuzzCase, ref: Reply, cand: Reply) -> list[str]:
    return [p.kind for p in fc.compare_case(case, ref, cand).problems]


def test_identical_replies_pass() -> None:
    r = Reply(200, gen_item([1, 2, 3], [-0.1, -0.2, -0.3]))
    result = fc.compare_case(GREEDY, r, r)
    assert result.ok and result.logprobs_compared == 3 and result.max_logprob_diff == 0.0


def test_status_mismatch_caught() -> None:
    assert problems(GREEDY, Reply(400, {"error": "bad"}), Reply(200, gen_item([1]))) == [
        fc.STATUS_MISMATCH]  # fmt: skip
    stream = FuzzCase(0, "stream", GENERATE, {"text": "x", "stream": True})
    ok, broken = Reply(200, [gen_item([1])]), Reply(200, [{"error": "boom"}], stream_error=True)
    assert problems(stream, ok, broken) == [fc.STATUS_MISMATCH]


def test_greedy_token_mismatch_caught_with_first_divergence() -> None:
    result = fc.compare_case(GREEDY, Reply(200, gen_item([1, 2, 3, 4])),
                             Reply(200, gen_item([1, 2, 9, 4])))  # fmt: skip
    (p,) = result.problems
    assert p.kind == fc.TOKEN_MISMATCH and p.detail["first_divergence"] == 2
    early = problems(GREEDY, Reply(200, gen_item([1, 2, 3])), Reply(200, gen_item([1, 2])))
    assert early == [fc.TOKEN_MISMATCH]


def test_logprob_beyond_tolerance_caught_within_passes() -> None:
    ref = Reply(200, gen_item([1, 2], [-0.5, -1.0]))
    close = fc.compare_case(GREEDY, ref, Reply(200, gen_item([1, 2], [-0.5004, -1.0])))
    assert close.ok and close.max_logprob_diff == pytest.approx(4e-4)
    far = fc.compare_case(GREEDY, ref, Reply(200, gen_item([1, 2], [-0.5, -1.01])))
    assert [p.kind for p in far.problems] == [fc.LOGPROB_MISMATCH]
    assert far.max_logprob_diff == pytest.approx(0.01)
    missing = problems(GREEDY, ref, Reply(200, gen_item([1, 2])))
    assert missing == [fc.LOGPROB_MISMATCH]


def test_top_k_boundary_tie_tolerated_other_swaps_not() -> None:
    assert fc._compare_position({1: -0.1, 2: -2.0}, {1: -0.1, 3: -2.0}, 1e-3)[2] == ""
    assert fc._compare_position({1: -0.1, 2: -2.0}, {1: -0.1, 3: -1.5}, 1e-3)[2]


def test_no_answer_and_server_error_caught() -> None:
    ok = Reply(200, gen_item([1]))
    assert problems(GREEDY, ok, Reply(None, error="ConnectionRefusedError")) == [fc.NO_RESPONSE]
    assert problems(GREEDY, Reply(500, "x"), Reply(500, "x")) == [fc.SERVER_ERROR]


def test_count_and_status_checks() -> None:
    sampled = FuzzCase(0, "sampled", GENERATE, {"text": "x"}, COUNT)
    assert problems(sampled, Reply(200, gen_item([1, 2])), Reply(200, gen_item([3, 4]))) == []
    assert problems(sampled, Reply(200, gen_item([1, 2])), Reply(200, gen_item([3]))) == [
        fc.COUNT_MISMATCH]  # fmt: skip
    for tag in ("grammar", "stop"):  # a sample may end wherever a token completes them
        ends = FuzzCase(0, "sampled", GENERATE, {"text": "x"}, COUNT, (tag,))
        assert problems(ends, Reply(200, gen_item([1, 2])), Reply(200, gen_item([3]))) == []
    dis = FuzzCase(0, "disconnect", GENERATE, {"stream": True}, STATUS, disconnect_after=1)
    assert problems(dis, Reply(200, [gen_item([1])]), Reply(200, [gen_item([5])])) == []
    n = problems(GREEDY, Reply(200, [gen_item([1]), gen_item([1])]), Reply(200, [gen_item([1])]))
    assert n == [fc.OUTPUT_COUNT]
    assert problems(GREEDY, Reply(200, {"weird": 1}), Reply(200, {"weird": 1})) == [fc.UNPARSABLE]


# -- summary ---------------------------------------------------------------------------------


def test_summary_lists_failures_with_bodies_deaths_and_leaks() -> None:
    cs = [GREEDY, FuzzCase(1, "malformed", GENERATE, {"text": ""}, TOKENS, ("empty_text",))]
    results = [fc.compare_case(cs[0], Reply(200, gen_item([1, 2])), Reply(200, gen_item([1, 3]))),
               fc.compare_case(cs[1], Reply(400, {}), Reply(None, error="reset"))]  # fmt: skip
    health = {"plain": {"alive": True, "healthy": True, "leak": None},
              "vericache": {"alive": False, "healthy": False, "leak": None}}  # fmt: skip
    s = summarize(cs, results, seed=1, tolerance=1e-3, health=health, wall_s=1.0)
    assert not s["ok"] and s["failed_cases"] == 2 and s["server_deaths"] == ["vericache"]
    assert s["greedy_mismatches"][0]["body"] == GREEDY.body
    assert s["greedy_mismatches"][0]["first_divergence"] == 1
    assert s["no_response"][0]["tags"] == ["empty_text"]
    assert s["by_kind"]["malformed"]["failed"] == 1
    assert json.loads(json.dumps(s)) == s
    total = merge([s, s])
    assert total["requests"] == 4 and total["failing_kinds"] == {"greedy": 2, "malformed": 2}
    assert "FAIL" in markdown([s], total) and "greedy_mismatches" in brief(s)


def test_clean_summary_is_ok() -> None:
    r = Reply(200, gen_item([1]))
    healthy = {"alive": True, "healthy": True, "leak": None}
    s = summarize([GREEDY], [fc.compare_case(GREEDY, r, r)], seed=0, tolerance=1e-3,
                  health={"plain": healthy, "vericache": healthy})  # fmt: skip
    assert s["ok"] and s["server_deaths"] == [] and s["leaks"] == []


def test_abbreviate_shortens_long_prompts() -> None:
    short = abbreviate({"text": "x" * 5000, "input_ids": list(range(1000))})
    assert len(short["text"]) < 300 and len(short["input_ids"]) == 13
