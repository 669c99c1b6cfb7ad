"""Requests that used to kill SGLang's scheduler get HTTP 400, and the server keeps serving.

Each case below took a plain SGLang 0.5.23 CPU server down (the scheduler raised in its first
forward pass, or queued work for hours) before ``sglang_vericache.srt.hooks.validation``; each must
now be a 400 whose message names the offending field, on the plain and the ``--vericache``
server alike, and a greedy request afterwards must still be answered.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from sglang_vericache.requests_check import MAX_PARALLEL_SAMPLES

pytestmark = [pytest.mark.sglang, pytest.mark.model]

VOCAB = 49152  # SmolLM2-135M-Instruct
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (name, path, body, what the message must contain)
BAD_REQUESTS = [
    ("empty text", "/generate", {"text": ""}, ["text", "empty"]),
    ("id past vocab", "/generate", {"input_ids": [1, 2, 999999]},
     ["input_ids", "999999", f"[0, {VOCAB})"]),
    ("id == vocab size", "/generate", {"input_ids": [1, 2, VOCAB]}, ["input_ids", str(VOCAB)]),
    ("negative id", "/generate", {"input_ids": [1, -3, 2]}, ["input_ids", "-3"]),
    ("empty text in a batch", "/generate", {"text": ["hello", ""]}, ["text[1]", "empty"]),
    ("empty ids in a batch", "/generate", {"input_ids": [[1, 2], []]}, ["input_ids[1]", "empty"]),
    ("bad id in a batch", "/generate", {"input_ids": [[1, 2], [3, 999999]]},
     ["input_ids[1]", "999999"]),
    ("top_logprobs_num past vocab", "/generate",
     {"text": "hi", "return_logprob": True, "top_logprobs_num": 10**6}, ["top_logprobs_num"]),
    ("huge n", "/generate", {"text": "hi", "sampling_params": {"n": 10**6}},
     ["n:", str(MAX_PARALLEL_SAMPLES)]),
    ("completions: empty prompt in a batch", "/v1/completions",
     {"model": "default", "prompt": [[1, 2], []], "max_tokens": 2}, ["input_ids[1]", "empty"]),
    ("completions: id past vocab", "/v1/completions",
     {"model": "default", "prompt": [1, 999999], "max_tokens": 2}, ["input_ids", "999999"]),
    ("completions: logprobs past vocab", "/v1/completions",
     {"model": "default", "prompt": "hi", "max_tokens": 2, "logprobs": 10**6},
     ["top_logprobs"]),
    ("chat: top_logprobs past vocab", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 10**6}, ["top_logprobs"]),
    ("chat: huge n", "/v1/chat/completions", {**CHAT, "n": 10**6}, ["n:"]),
    ("stop id past vocab", "/generate",
     {"text": "a", "sampling_params": {"max_new_tokens": 4, "stop_token_ids": [VOCAB + 1000]}},
     ["stop_token_ids", str(VOCAB + 1000), f"[0, {VOCAB})"]),
    ("chat: stop id past vocab", "/v1/chat/completions", {**CHAT, "stop_token_ids": [-1]},
     ["stop_token_ids", "-1"]),
    ("regex with min_new_tokens", "/generate",
     {"text": "1, 2, 3,", "sampling_params": {"max_new_tokens": 20, "min_new_tokens": 10,
                                              "regex": "(yes|no)"}},
     ["min_new_tokens", "regex"]),
    ("chat: json_schema with min_tokens", "/v1/chat/completions",
     {**CHAT, "min_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}}},
     ["min_new_tokens", "json_schema"]),
]  # fmt: skip


def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def _assert_serves(url: str) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4,
                                                                     "temperature": 0}}  # fmt: skip
    status, out = _post(url + "/generate", body)
    assert status == 200 and out["meta_info"]["completion_tokens"] == 4, out


@pytest.fixture(params=["plain_server", "vericache_server"])
def server(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("name,path,body,needles", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_a_400_naming_the_field(server: Any, name: str, path: str, body: dict,
                                               needles: list[str]) -> None:  # fmt: skip
    status, out = _post(server.url + path, body)
    message = json.dumps(out)
    assert status == 400, f"{name}: {status} {message[:500]}"
    for needle in needles:
        assert needle in message, f"{name}: {needle!r} not in {message[:500]}"
    _assert_serves(server.url)


def test_streamed_empty_prompt_gets_an_error_event(server: Any) -> None:
    """A streamed request has sent its 200 header before validation; SGLang reports the 400
    as the stream's one event (``code: 400``), and the scheduler never sees the request."""
    req = urllib.request.Request(
        server.url + "/generate",
        data=json.dumps({"text": "", "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = [
            line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")
        ]
    error = json.loads(events[0])["error"]
    assert error["code"] == 400 and error["message"].startswith("text: "), error
    _assert_serves(server.url)


def test_answers_sglang_already_gave_are_kept(plain_server: Any) -> None:
    """Where SGLang already answered 400 its message stands (the hooks run after its checks)."""
    status, out = _post(plain_server.url + "/generate",
                        {"text": "hi", "sampling_params": {"max_new_tokens": -5}})  # fmt: skip
    assert status == 400 and "max_new_tokens must be at least 0" in json.dumps(out)
    status, out = _post(plain_server.url + "/generate", {"input_ids": []})
    assert status == 400 and "input_ids cannot be empty" in json.dumps(out)
    status, out = _post(plain_server.url + "/v1/completions", {"model": "default", "prompt": ""})
    assert status == 400 and "Prompt cannot be empty" in json.dumps(out)


def test_valid_edge_requests_still_pass(plain_server: Any) -> None:
    """The checks reject nothing that served before: the last vocabulary id, n at the limit's
    small end, top_logprobs_num equal to small values, a batch of good prompts."""
    ok = [
        {"input_ids": [1, 2, VOCAB - 1], "sampling_params": {"max_new_tokens": 1}},
        {"text": ["hello", "world"], "sampling_params": {"max_new_tokens": 1}},
        {"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": 2}},
        {"text": "hi", "return_logprob": True, "top_logprobs_num": 5,
         "sampling_params": {"max_new_tokens": 1}},
    ]  # fmt: skip
    for body in ok:
        status, out = _post(plain_server.url + "/generate", body)
        assert status == 200, (body, out)


# Batches whose last item (only) is bad, each with SGLang's or our message. The items before it
# would decode 64 tokens: were they dispatched before the bad item was found, the server would
# have to abort them (what SGLang 0.5.23 does: it sends items one by one, then aborts the sent
# ones when a later item fails its checks).
FIRST = {"max_new_tokens": 64, "temperature": 0}
LATE_BAD_BATCHES = [
    ("top_p", {"text": ["a b c", "d e f", "g h"],
               "sampling_params": [FIRST, FIRST, {"max_new_tokens": 4, "top_p": 5}]},
     ["top_p must be in (0, 1]"]),
    ("max_new_tokens -5", {"text": ["a b c", "d e f"],
                           "sampling_params": [FIRST, {"max_new_tokens": -5}]},
     ["max_new_tokens must be at least 0"]),
    ("top_k past int32", {"text": ["a b c", "d e f"],
                          "sampling_params": [FIRST, {"max_new_tokens": 4, "top_k": 2**40}]},
     ["sampling_params[1]", "top_k"]),
    ("stop id past vocab", {"input_ids": [[1, 2, 3], [4, 5]],
                            "sampling_params": [FIRST, {"stop_token_ids": [VOCAB + 5]}]},
     ["sampling_params[1]", "stop_token_ids", str(VOCAB + 5)]),
    ("min_new_tokens with a regex", {"text": ["a b c", "d e f"], "sampling_params": [
        FIRST, {"max_new_tokens": 20, "min_new_tokens": 5, "regex": "(yes|no)"}]},
     ["sampling_params[1]", "min_new_tokens", "regex"]),
    ("top_logprobs_num past vocab", {"text": ["a b c", "d e f"], "return_logprob": [False, True],
                                     "top_logprobs_num": [0, 10**6], "sampling_params": FIRST},
     ["top_logprobs_num[1]"]),
    ("id past vocab", {"input_ids": [[1, 2, 3], [4, 5], [6, VOCAB + 7]], "sampling_params": FIRST},
     ["input_ids[2]", str(VOCAB + 7)]),
    ("id prompt past the context", {"input_ids": [[1, 2, 3], [5] * 9000], "sampling_params": FIRST},
     ["longer than the model's context length"]),
]  # fmt: skip


def _metric_sum(url: str, name: str) -> float:
    """The sum of ``name``'s samples on ``/metrics`` (0 where it has none yet)."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def _idle(url: str, timeout: float = 60.0) -> tuple[float, float]:
    """(running requests, requests the VeriCache worker tracks) once both are 0, or at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        now = (_metric_sum(url, "sglang:num_running_reqs"),
               _metric_sum(url, "vericache:tracked_requests"))  # fmt: skip
        if now == (0.0, 0.0) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


@pytest.mark.parametrize("name,body,needles", LATE_BAD_BATCHES,
                         ids=[c[0] for c in LATE_BAD_BATCHES])  # fmt: skip
def test_a_bad_later_batch_item_is_refused_before_any_item_starts(
    plain_server: Any, vericache_server: Any, name: str, body: dict, needles: list[str]
) -> None:
    """Plain and ``--vericache`` answer the same 400, naming the problem; every item was checked
    before any was dispatched (the ``--vericache`` server, the one with metrics, aborted
    nothing), and the server is idle and serving afterwards."""
    aborted = _metric_sum(vericache_server.url, "sglang:num_aborted_requests_total")
    answers = [_post(server.url + "/generate", body) for server in (plain_server, vericache_server)]
    assert answers[0] == answers[1], (name, answers)
    status, out = answers[1]
    message = json.dumps(out)
    assert status == 400, f"{name}: {status} {message[:500]}"
    for needle in needles:
        assert needle in message, f"{name}: {needle!r} not in {message[:500]}"
    assert _metric_sum(vericache_server.url, "sglang:num_aborted_requests_total") == aborted, (
        f"{name}: items before the bad one were dispatched, then aborted")
    assert _idle(vericache_server.url) == (0.0, 0.0)
    _assert_serves(vericache_server.url)


def test_a_batch_item_sglang_refuses_after_tokenizing_leaves_no_state(
    plain_server: Any, vericache_server: Any
) -> None:
    """A text too long for the context is found only once SGLang tokenized it, after the items
    before it were sent: SGLang aborts those. Both servers answer the same 400, and the
    ``--vericache`` worker is left holding nothing for the aborted items."""
    body = {"text": ["a b c", "word " * 9000], "sampling_params": FIRST}
    answers = [_post(server.url + "/generate", body) for server in (plain_server, vericache_server)]
    assert answers[0] == answers[1] and answers[1][0] == 400, answers
    assert "longer than the model's context length" in json.dumps(answers[1][1])
    assert _idle(vericache_server.url) == (0.0, 0.0)
    _assert_serves(vericache_server.url)
    _assert_serves(plain_server.url)
