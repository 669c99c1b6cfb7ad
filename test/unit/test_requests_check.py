"""The pure request checks (no SGLang, no server): what they reject, what they let through."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_vericache.requests_check import (
    check_expert_recording,
    check_input_embeds,
    check_memory_occupation,
    INT32_MAX,
    MAX_PARALLEL_SAMPLES,
    RequestError,
    batch_prompts,
    check_batch,
    check_batch_items,
    check_parallel_samples,
    check_prompt_ids,
    check_sampling_params,
    check_top_logprobs_num,
)

VOCAB = 100


def _error(fn, *args, **kw) -> RequestError:
    with pytest.raises(RequestError) as info:
        fn(*args, **kw)
    return info.value


def test_request_error_is_a_value_error_naming_the_field() -> None:
    # SGLang's HTTP layer turns ValueError into a 400 with the message; the field leads it.
    err = _error(check_prompt_ids, [], VOCAB, field="input_ids")
    assert isinstance(err, ValueError)
    assert err.field == "input_ids" and str(err).startswith("input_ids: ")


@pytest.mark.parametrize("ids", [[0], [1, 2, 3], [VOCAB - 1], list(range(VOCAB)), (5, 6)])
def test_valid_prompts_pass(ids) -> None:
    check_prompt_ids(ids, VOCAB, field="input_ids")


def test_numpy_integers_pass_and_none_is_not_checked() -> None:
    import torch

    check_prompt_ids([np.int64(3), np.int32(4)], VOCAB, field="input_ids")
    check_prompt_ids(list(torch.tensor([3, 4])), VOCAB, field="input_ids")
    with pytest.raises(RequestError, match="integers .* at position 0"):
        check_prompt_ids(list(torch.tensor([3.0, 4.5])), VOCAB, field="input_ids")
    with pytest.raises(RequestError, match="position 0 is outside"):
        check_prompt_ids(list(torch.tensor([VOCAB, 4])), VOCAB, field="input_ids")
    check_prompt_ids(None, VOCAB, field="input_ids")


def test_empty_prompt_names_the_field_and_the_fix() -> None:
    err = _error(check_prompt_ids, [], VOCAB, field="text")
    assert (
        str(err).startswith("text: ") and "empty" in str(err) and "at least one token" in str(err)
    )
    err = _error(check_prompt_ids, [], VOCAB, field="input_ids[2]")
    assert str(err).startswith("input_ids[2]: ") and f"[0, {VOCAB})" in str(err)


@pytest.mark.parametrize("bad,pos", [([1, 2, VOCAB], 2), ([VOCAB + 5], 0), ([3, -1, 4], 1),
                                     ([0, 999999, -7], 1)])  # fmt: skip
def test_out_of_vocabulary_ids_name_the_id_its_position_and_the_range(bad, pos) -> None:
    err = _error(check_prompt_ids, bad, VOCAB, field="input_ids")
    msg = str(err)
    assert f"token id {bad[pos]} at position {pos}" in msg and f"[0, {VOCAB})" in msg


@pytest.mark.parametrize("bad", [[1, 2.0], [1, "2"], [True, 2], [1, None], [[1, 2]]])
def test_non_integer_ids_are_rejected(bad) -> None:
    err = _error(check_prompt_ids, bad, VOCAB, field="input_ids")
    assert "integers" in str(err) and "position" in str(err)


def test_top_logprobs_num_is_bounded_by_the_vocabulary() -> None:
    for ok in (None, 0, -1, 1, VOCAB, [1, VOCAB]):
        check_top_logprobs_num(ok, VOCAB)
    err = _error(check_top_logprobs_num, VOCAB + 1, VOCAB)
    assert err.field == "top_logprobs_num" and f"at most {VOCAB}" in str(err)
    assert _error(check_top_logprobs_num, [1, 10**6], VOCAB).field == "top_logprobs_num"


def test_top_k_must_fit_the_samplers_int32() -> None:
    for ok in (None, {}, {"top_k": -1}, {"top_k": 0}, {"top_k": INT32_MAX}, {"top_k": 2.5}):
        check_sampling_params(ok, VOCAB)  # 0 and floats are SGLang's to reject, its own message
    err = _error(check_sampling_params, {"top_k": INT32_MAX + 1}, VOCAB)
    assert err.field == "top_k" and "-1" in str(err) and str(INT32_MAX) in str(err)


def test_stop_token_ids_must_be_in_the_vocabulary() -> None:
    """The fuzzer's crash: an out-of-vocabulary stop id beside a min_new_tokens request."""
    for ok in ({"stop_token_ids": []}, {"stop_token_ids": [0, VOCAB - 1]}, [{}, {"top_k": 1}]):
        check_sampling_params(ok, VOCAB)
    for bad in ({"stop_token_ids": [VOCAB + 1000]}, {"stop_token_ids": [2, -1]},
                [{}, {"stop_token_ids": [VOCAB]}]):  # fmt: skip
        err = _error(check_sampling_params, bad, VOCAB)
        assert err.field == "stop_token_ids" and f"[0, {VOCAB})" in str(err)


def test_min_new_tokens_beside_a_grammar_is_refused() -> None:
    """The fuzzer's crash: the finished grammar allows only EOS, min_new_tokens masks it, and a
    sampled neighbour makes the sampler draw from NaN probabilities."""
    for ok in ({"regex": "(a|b)"}, {"regex": "(a|b)", "min_new_tokens": 0},
               {"min_new_tokens": 5}, {"json_schema": None, "min_new_tokens": 5}):  # fmt: skip
        check_sampling_params(ok, VOCAB)
    for grammar in ("regex", "json_schema", "ebnf", "structural_tag"):
        err = _error(check_sampling_params, [{}, {grammar: "x", "min_new_tokens": 3}], VOCAB)
        assert err.field == "min_new_tokens" and grammar in str(err) and "drop" in str(err)


def test_parallel_samples_are_bounded() -> None:
    for ok in (None, 0, 1, MAX_PARALLEL_SAMPLES):
        check_parallel_samples(ok)
    err = _error(check_parallel_samples, MAX_PARALLEL_SAMPLES + 1)
    assert err.field == "n" and f"at most {MAX_PARALLEL_SAMPLES}" in str(err)
    assert _error(check_parallel_samples, 5, limit=4).field == "n"


def test_batch_prompts_name_each_item() -> None:
    assert batch_prompts(["a", ""], None) == [("text[0]", None), ("text[1]", [])]
    assert batch_prompts("", None, empty_text_ids=[1]) == [("text", [1])]
    assert batch_prompts(None, [[1], []]) == [("input_ids[0]", [1]), ("input_ids[1]", [])]
    assert batch_prompts(None, [4, 5]) == [("input_ids", [4, 5])]
    assert batch_prompts("hello", None) == []


def test_check_batch_reports_the_first_bad_item_by_index() -> None:
    check_batch(["a", "b"], None, VOCAB)
    check_batch(None, [[1, 2], [3]], VOCAB)
    assert _error(check_batch, ["a", ""], None, VOCAB).field == "text[1]"
    assert _error(check_batch, None, [[1, 2], [3, VOCAB]], VOCAB).field == "input_ids[1]"
    assert _error(check_batch, None, [[1], []], VOCAB).field == "input_ids[1]"
    # a tokenizer that turns "" into a BOS token can serve an empty text
    check_batch(["a", ""], None, VOCAB, empty_text_ids=[0])


def test_check_batch_items_names_the_first_bad_item_by_index() -> None:
    """Every item's sampling parameters and top_logprobs_num are checked before any item is
    sent; a bad one in the last item is reported with its index."""
    good = {"max_new_tokens": 4, "top_k": 5, "stop_token_ids": [1]}
    check_batch_items([good, good], [None, 3], VOCAB)
    err = _error(check_batch_items, [good, good, {"top_k": INT32_MAX + 1}], [None] * 3, VOCAB)
    assert err.field == "sampling_params[2]" and str(err).startswith("sampling_params[2]: top_k:")
    err = _error(check_batch_items, [good, {"stop_token_ids": [VOCAB]}], [None, None], VOCAB)
    assert err.field == "sampling_params[1]" and str(VOCAB) in str(err)
    err = _error(check_batch_items, [good, {"regex": "a", "min_new_tokens": 2}], [None] * 2, VOCAB)
    assert err.field == "sampling_params[1]" and "regex" in str(err)
    err = _error(check_batch_items, [good, good], [None, VOCAB + 1], VOCAB)
    assert err.field == "top_logprobs_num[1]"


def test_a_long_prompt_is_checked_fast() -> None:
    """~10 ms for 100k tokens on an idle core (the per-token isinstance path took ~350 ms);
    the best of three runs, so a busy machine does not fail it."""
    import time

    ids = list(range(VOCAB)) * 1000  # 100k tokens
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        check_prompt_ids(ids, VOCAB, field="input_ids")
        best = min(best, time.perf_counter() - t)
    assert best < 0.1


def test_expert_recording_needs_a_recorder_mode() -> None:
    """Without ``--expert-distribution-recorder-mode`` SGLang's scheduler raises and exits on
    ``/start_expert_distribution_record``: refused, naming the flag."""
    with pytest.raises(RequestError, match="--expert-distribution-recorder-mode"):
        check_expert_recording(None)
    check_expert_recording("stat")  # a server started with a recorder records


def test_memory_occupation_release_needs_an_accelerator() -> None:
    with pytest.raises(RequestError, match="needs a GPU"):
        check_memory_occupation(False)
    check_memory_occupation(True)


def test_input_embeds_need_a_bfloat16_model() -> None:
    """SGLang 0.5.23 casts input_embeds to bfloat16: a float32 model's scheduler would crash."""
    import torch

    check_input_embeds(torch.bfloat16)
    check_input_embeds("bfloat16")
    for dtype in (torch.float32, torch.float16, "float32"):
        with pytest.raises(RequestError, match=r"input_embeds: .*--dtype bfloat16"):
            check_input_embeds(dtype)
