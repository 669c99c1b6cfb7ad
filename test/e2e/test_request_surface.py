"""SGLang's request surface under ``--vericache``, compared with plain SGLang request by request.

Every test sends the same request to the shared plain server and the shared ``--vericache``
server (``test/conftest.py``) and compares what comes back: greedy tokens exactly, logprobs
within ``LOGPROB_TOL`` (verify and decode forwards may differ in the last float bits). The
``--vericache`` side must also really draft where it can (a silent plain fallback would pass any
exactness check), and hold no per-request state once idle.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from sglang_vericache.exactness.server import http_json

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(1800)]

LOGPROB_TOL = 1e-3
PROMPT = "Explain how a hash map handles collisions, step by step.\n"
GREEDY = {"temperature": 0, "max_new_tokens": 24}


def generate(server, text: str, sampling: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return http_json(server.url + "/generate", {"text": text, "sampling_params": sampling, **extra})


def both(plain_server, vericache_server, text: str, sampling: dict[str, Any], **extra: Any):
    return (generate(plain_server, text, sampling, **extra),
            generate(vericache_server, text, sampling, **extra))  # fmt: skip


def max_logprob_diff(ref: list, got: list) -> float:
    """Max |a - b| over (logprob, token id, ...) rows whose token ids agree (asserted)."""
    assert len(ref) == len(got), (len(ref), len(got))
    worst = 0.0
    for a, b in zip(ref, got):
        assert a[1] == b[1], (a, b)
        if a[0] is not None:
            worst = max(worst, abs(a[0] - b[0]))
    return worst


def test_logprobs_are_served_from_the_verify_pass(plain_server, vericache_server) -> None:
    """The request that used to kill the scheduler: same tokens, same logprobs, drafted."""
    extra = {"return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [11, 198],
             "logprob_start_len": 4}  # fmt: skip
    ref, got = both(plain_server, vericache_server, PROMPT, GREEDY, **extra)
    assert got["output_ids"] == ref["output_ids"]
    r, g = ref["meta_info"], got["meta_info"]
    diffs = [max_logprob_diff(r["output_token_logprobs"], g["output_token_logprobs"]),
             max_logprob_diff(r["input_token_logprobs"], g["input_token_logprobs"])]  # fmt: skip
    for ref_top, got_top in zip(r["output_top_logprobs"], g["output_top_logprobs"]):
        diffs.append(max_logprob_diff(ref_top, got_top))
    for ref_ids, got_ids in zip(r["output_token_ids_logprobs"], g["output_token_ids_logprobs"]):
        diffs.append(max_logprob_diff(ref_ids, got_ids))
    print(f"logprob max abs diff: {max(diffs):.2e}")
    assert max(diffs) <= LOGPROB_TOL, max(diffs)
    assert g["vericache"]["mode"] == "greedy" and g["vericache"]["verify_steps"] >= 1, g


def test_openai_chat_logprobs_match(plain_server, vericache_server) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "Name three rivers."}],
            "temperature": 0, "max_tokens": 20, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    ref = http_json(plain_server.url + "/v1/chat/completions", body)["choices"][0]
    got = http_json(vericache_server.url + "/v1/chat/completions", body)["choices"][0]
    assert got["message"]["content"] == ref["message"]["content"]
    pairs = zip(ref["logprobs"]["content"], got["logprobs"]["content"])
    worst = max(abs(a["logprob"] - b["logprob"]) for a, b in pairs)
    assert worst <= LOGPROB_TOL, worst


def test_prompt_longer_than_a_prefill_chunk(plain_server, vericache_server,
                                            chunked_prefill_size: int) -> None:
    items = " ".join(f"Item {i} is filed under shelf {i % 7}." for i in range(120))
    text = "Chapter notes. " + items
    ref, got = both(plain_server, vericache_server, text + "\nThe last item is", GREEDY)
    assert ref["meta_info"]["prompt_tokens"] > 2 * chunked_prefill_size
    assert got["output_ids"] == ref["output_ids"]
    assert got["meta_info"]["vericache"]["verify_steps"] >= 1


def test_one_token_requests_leave_no_state(plain_server, vericache_server) -> None:
    for text in ("Once upon a time", "def main():", PROMPT):
        one = {"temperature": 0, "max_new_tokens": 1}
        ref, got = both(plain_server, vericache_server, text, one)
        assert got["output_ids"] == ref["output_ids"] and len(got["output_ids"]) == 1
    assert tracked_when_idle(vericache_server) == 0


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.2}, {"repetition_penalty": 0.5},
                                     {"frequency_penalty": 0.8}, {"presence_penalty": 0.8}])
def test_penalties_at_temperature_zero_match(plain_server, vericache_server, penalty) -> None:
    """Penalized greedy requests draft: every verify column is penalized as plain decoding
    would penalize that position (srt/decode/penalized_rows.py)."""
    for text in ("List the planets of the solar system:", "The quick brown fox " * 3):
        sampling = {**GREEDY, "max_new_tokens": 32, **penalty}
        ref, got = both(plain_server, vericache_server, text, sampling)
        assert got["output_ids"] == ref["output_ids"], (penalty, text)
        stats = got["meta_info"]["vericache"]
        assert stats["mode"] == "greedy" and stats["drafted"] > 0, stats


def test_min_new_tokens_and_ignore_eos_match(plain_server, vericache_server) -> None:
    for sampling in ({"min_new_tokens": 20, "max_new_tokens": 24},
                     {"ignore_eos": True, "max_new_tokens": 40}):  # fmt: skip
        text = "Reply with one word: yes or no?"
        ref, got = both(plain_server, vericache_server, text, {"temperature": 0, **sampling})
        assert got["output_ids"] == ref["output_ids"], sampling


def test_stops_inside_a_multi_token_commit_match(plain_server, vericache_server) -> None:
    """Stop strings and ids land mid-verify: SGLang must trim the commit where plain stops."""
    for stop in ({"stop": [" the"]}, {"stop": ["\n"]}, {"stop_token_ids": [13, 30]}):
        sampling = {**GREEDY, "max_new_tokens": 48, **stop}
        ref, got = both(plain_server, vericache_server, PROMPT, sampling)
        assert got["text"] == ref["text"] and got["output_ids"] == ref["output_ids"], stop
        assert got["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"], stop


def test_mixed_batch_keeps_drafting_greedy_rows(plain_server, vericache_server) -> None:
    """Half greedy, half sampled, at once: greedy rows stay exact and drafted."""
    texts = [f"Write step {i} of a recipe for bread:" for i in range(4)]
    greedy = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    sampled = {"temperature": 0.8, "max_new_tokens": 32, "ignore_eos": True}
    ref = [generate(plain_server, t, greedy) for t in texts[:2]]
    jobs = [(t, greedy) for t in texts[:2]] + [(t, sampled) for t in texts[2:]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: generate(vericache_server, *job), jobs))
    for r, g in zip(ref, got[:2]):
        assert g["output_ids"] == r["output_ids"]
        stats = g["meta_info"]["vericache"]
        assert stats["mode"] == "greedy" and stats["mean_accept_len"] > 1.0, stats
    for g in got[2:]:
        # sampled rows draft too (speculative sampling, test/e2e/test_sampled_drafting.py)
        assert len(g["output_ids"]) == 32 and g["meta_info"]["vericache"]["mode"] == "sampled"


def test_grammar_constrained_greedy_matches(plain_server, vericache_server) -> None:
    regex = {**GREEDY, "regex": r"(yes|no), because [a-z ]{5,30}\."}
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    schema = {**GREEDY, "max_new_tokens": 48, "json_schema": json.dumps(city)}
    for sampling in (regex, schema):
        ref, got = both(plain_server, vericache_server, "Is Paris in France? Answer:", sampling)
        assert got["output_ids"] == ref["output_ids"]
        info = got["meta_info"]["vericache"]  # drafted under the grammar's masks, not plain
        assert info["mode"] == "greedy" and info["constrained"], info
        assert info["accepted"] > 0 and info["committed"] > info["verify_steps"], info


def test_grammar_termination_under_ignore_eos_finishes_like_plain(
    plain_server, vericache_server
) -> None:
    """A grammar that ends on an EOS that ``ignore_eos`` does not stop at: plain SGLang sees the
    termination a step late and emits one more token; so must ``--vericache``
    (``srt/hooks/grammar_finish.py``)."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    for extra in ({"regex": r"(yes|no)\."}, {"json_schema": json.dumps(city)}):
        sampling = {**GREEDY, "max_new_tokens": 40, "ignore_eos": True, **extra}
        ref, got = both(plain_server, vericache_server, "Is Paris in France? Answer:", sampling)
        assert len(ref["output_ids"]) < 40, "the grammar must end the request, not the length"
        assert got["output_ids"] == ref["output_ids"]
        assert got["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]


def test_torch_profiler_traces_steps_and_the_server_keeps_serving(
    plain_server, vericache_server, tmp_path
) -> None:
    """``POST /start_profile`` (SGLang's torch profiler) used to kill the scheduler on the CPU
    platform (``srt/platform.py``): it traces a few steps, writes its trace, and serves on."""
    for name, server in (("plain", plain_server), ("vericache", vericache_server)):
        out = tmp_path / name
        ask = {"output_dir": str(out), "num_steps": 2, "activities": ["CPU"]}
        req = urllib.request.Request(server.url + "/start_profile", json.dumps(ask).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.status == 200
        generate(server, PROMPT, GREEDY)  # the profiled steps; it stops itself after two
        deadline = time.monotonic() + 120
        while not list(out.rglob("*.json*")) and time.monotonic() < deadline:
            time.sleep(1.0)
        assert list(out.rglob("*.json*")), f"{name}: no trace written under {out}"
    ref, got = both(plain_server, vericache_server, PROMPT, GREEDY)
    assert got["output_ids"] == ref["output_ids"]


@pytest.mark.parametrize("path, body, names", [
    ("/start_expert_distribution_record", None, "--expert-distribution-recorder-mode"),
    ("/stop_expert_distribution_record", None, "--expert-distribution-recorder-mode"),
    ("/dump_expert_distribution_record", None, "--expert-distribution-recorder-mode"),
    ("/release_memory_occupation", {}, "needs a GPU"),
    ("/resume_memory_occupation", {}, "needs a GPU"),
])  # fmt: skip
def test_admin_requests_that_killed_the_scheduler_are_refused(
    plain_server, vericache_server, path, body, names
) -> None:
    """Expert-distribution recording on a server without a recorder, and releasing memory
    occupation on a host without a GPU, killed SGLang's scheduler: now a 400 naming the problem
    (``srt/hooks/validation.py``), on both servers, and both keep serving."""
    data = b"" if body is None else json.dumps(body).encode()
    for server in (plain_server, vericache_server):
        req = urllib.request.Request(server.url + path, data, method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=60)
        assert refused.value.code == 400
        assert names in refused.value.read().decode()
    ref, got = both(plain_server, vericache_server, PROMPT, GREEDY)
    assert got["output_ids"] == ref["output_ids"]


def tracked_when_idle(server, timeout: float = 60.0) -> float:
    """``vericache:tracked_requests`` plus every ``vericache:request_entries`` sample once the
    server has no running request."""
    deadline = time.monotonic() + timeout
    value = -1.0
    while time.monotonic() < deadline:
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
            lines = resp.read().decode().splitlines()
        running = sum(float(line.rsplit(" ", 1)[1]) for line in lines
                      if line.startswith("sglang:num_running_reqs"))  # fmt: skip
        value = sum(float(line.rsplit(" ", 1)[1]) for line in lines  # and each holder's
                    if line.startswith(("vericache:tracked_requests",  # entries (requests/)
                                        "vericache:request_entries")))  # fmt: skip
        if running == 0 and value == 0:
            return value
        time.sleep(1.0)
    return value
