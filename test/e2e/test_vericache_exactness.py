"""VeriCache servers against plain SGLang, token by token (fp32, CPU, greedy).

The reference is the session's plain server (same args minus --vericache*); each candidate is a
real --vericache server. A reduced prompt set keeps CI inside its budget; the full 24-prompt x
256-token set runs from benchmark/ (see benchmark/README.md).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from sglang_vericache.exactness.client import Prompt, generate_all
from sglang_vericache.exactness.compare import Generation, compare, summarize
from sglang_vericache.exactness.server import SGLangServer, http_json

# Real servers on 2 shared cores: generous per-test limits (fixtures start servers too).
pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
MAX_NEW_TOKENS = 32
BASE_ARGS = ["--max-total-tokens", "16384"]


@pytest.fixture(scope="module")
def prompts(default_model_path: Path) -> list[Prompt]:
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from benchmark.prompts import build_prompt_set

    tok = AutoTokenizer.from_pretrained(default_model_path)
    built = build_prompt_set(tok, n=4, min_tokens=300, max_tokens=600, seed=7)
    return [Prompt(id=p["id"], text=p["text"]) for p in built]


@pytest.fixture(scope="module")
def reference(plain_server, prompts: list[Prompt]) -> list[Generation]:
    return generate_all(
        plain_server.url, prompts, max_new_tokens=MAX_NEW_TOKENS, concurrency=2, with_top2=True
    )


def vericache_server(compressor: str, tmp_path: Path, draft_len: int | str = 4,
                     extra: tuple[str, ...] = ()) -> SGLangServer:  # fmt: skip
    args = BASE_ARGS + ["--vericache", "--vericache-compressor", compressor,
                        "--vericache-draft-len", str(draft_len), *extra]  # fmt: skip
    return SGLangServer(args, log_path=tmp_path / "vericache.log")


def assert_identical(prompts, reference, candidate, **context) -> None:
    results = [compare(p.id, r, c) for p, r, c in zip(prompts, reference, candidate)]
    summary = summarize(results, **context)
    assert summary["status"] == "identical", json.dumps(summary, indent=2)


def assert_drafted(url: str, prompt: Prompt) -> None:
    """The candidate really verified drafts (a silent plain fallback would also be exact)."""
    out = http_json(url + "/generate", {
        "text": prompt.text, "sampling_params": {"temperature": 0, "max_new_tokens": 8},
    })  # fmt: skip
    assert out["meta_info"].get("spec_verify_ct", 0) >= 1, out["meta_info"]


@pytest.mark.parametrize(
    "compressor, concurrency, draft_len, draft_dtype, proposer",
    [
        # aggressive dropping: many rejections, rollbacks; drafts on bf16 shadow weights
        ("streaming:sink=4,window=60", 1, 4, "bfloat16", "compressed"),
        # composition, low-bit, wider verify
        ("snapkv:ratio=0.5+kivi:bits=2", 4, 6, "model", "compressed"),
        # fp16 shadows, packed for fbgemm on x86 (what ``auto`` picks on an AVX2-only CPU); a
        # prompt-lookup draft in every step where a row's last tokens occurred before
        ("snapkv:ratio=0.25", 2, 3, "float16", "lookup"),
    ],
)
def test_vericache_is_token_identical(
    compressor: str, concurrency: int, draft_len, draft_dtype: str, proposer: str, prompts,
    reference, tmp_path: Path,
) -> None:  # fmt: skip
    extra = ("--vericache-draft-dtype", draft_dtype, "--vericache-proposer", proposer)
    with vericache_server(compressor, tmp_path, draft_len, extra) as server:
        candidate = generate_all(
            server.url, prompts, max_new_tokens=MAX_NEW_TOKENS, concurrency=concurrency
        )
        assert_drafted(server.url, prompts[0])
        # the proposers that drafted, as the request's meta info reports them
        used = http_json(server.url + "/generate", {
            "text": prompts[1].text, "sampling_params": {"temperature": 0, "max_new_tokens": 24},
        })["meta_info"]["vericache"]["proposers"]  # fmt: skip
        log = (tmp_path / "vericache.log").read_text(errors="replace")
    assert proposer in used, used
    if proposer == "compressed":
        assert "lookup" not in used, used
    logged = "draft weights in the model's dtype" if draft_dtype == "model" else (
        f"draft weights in {draft_dtype} (")  # fmt: skip
    assert logged in log, "the draft dtype the worker logged"
    assert "draft attention batched (CPU kernel)" in log, "drafts attend through the CPU kernel"
    assert_identical(prompts, reference, candidate, compressor=compressor, concurrency=concurrency)


def test_offload_only_baseline_is_identical_and_keeps_no_kv_on_the_device(
    prompts, reference, tmp_path: Path
) -> None:
    """``--vericache-draft-len 0``: the full KV leaves the pool and every token reads it back."""
    with vericache_server("kivi:bits=4", tmp_path, draft_len=0) as server:
        candidate = generate_all(server.url, prompts, max_new_tokens=MAX_NEW_TOKENS, concurrency=2)
        out = http_json(server.url + "/generate", {
            "text": "Restate this.\n" + prompts[1].text,
            "sampling_params": {"temperature": 0, "max_new_tokens": 40},
        })  # fmt: skip
    assert_identical(prompts, reference, candidate, compressor="offload only")
    stats = out["meta_info"]["vericache"]
    assert stats["mode"] == "plain" and "draft-len 0" in stats["plain_reason"], stats
    assert stats["host_kv_tokens"] >= out["meta_info"]["prompt_tokens"], stats  # + tail chunks
    assert stats["reserved_slots"] == 0 and stats["verify_steps"] == 0, stats


@pytest.fixture(scope="module")
def kivi_server(vericache_server) -> SGLangServer:
    """The session's shared ``--vericache`` server: the default compressor (kivi:bits=4), draft
    length 4, ``--enable-metrics``."""
    return vericache_server


def test_default_compressor_is_identical_and_accepts_long_drafts(
    kivi_server, prompts, reference
) -> None:
    candidate = generate_all(kivi_server.url, prompts, max_new_tokens=MAX_NEW_TOKENS, concurrency=2)
    assert_identical(prompts, reference, candidate, compressor="kivi:bits=4")
    out = http_json(kivi_server.url + "/generate", {
        "text": prompts[0].text, "sampling_params": {"temperature": 0, "max_new_tokens": 16},
    })  # fmt: skip
    # int4 drafts of a 135M model survive most verifies (measured ~0.95 per token).
    assert out["meta_info"]["spec_accept_length"] > 2.0, out["meta_info"]
    stats = out["meta_info"]["vericache"]
    assert stats["mode"] == "greedy" and stats["verify_steps"] >= 1
    assert stats["committed"] == stats["accepted"] + stats["verify_steps"]
    assert stats["mean_accept_len"] > 2.0


CHAT_QUESTIONS = ("What is the capital of France?", "What is 2 + 2?", "Name a primary color.",
                  "Say hello.", "What is the capital of Italy?", "Is water wet? Answer yes or no.")


def test_an_eos_before_a_stop_string_in_one_verify_ends_at_the_eos(kivi_server,
                                                                    plain_server) -> None:  # fmt: skip
    """A verify that commits ``[..., EOS, "\n"]`` must end at the EOS, as plain decoding does:
    SGLang's multi-token finish check matches stop strings first, and "\n" after the EOS ended
    the row there, the EOS and "\n" in its output (the long fuzz, seed 2, case 405)."""
    drafted = 0
    for question in CHAT_QUESTIONS:
        body = {"text": ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                         f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"),
                "sampling_params": {"temperature": 0, "max_new_tokens": 28, "stop": ["\n", ","]}}
        want = http_json(plain_server.url + "/generate", body)
        got = http_json(kivi_server.url + "/generate", body)
        assert got["output_ids"] == want["output_ids"], (question, want, got)
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], question
        drafted += got["meta_info"]["vericache"]["verify_steps"] > 0
    assert drafted >= len(CHAT_QUESTIONS) // 2  # the answers went through verifies


def test_auto_placement_on_cpu_moves_the_full_kv_to_its_host_buffer(kivi_server, prompts) -> None:
    """``--vericache-placement auto`` on the CPU backend: the pool is host memory, where reading
    a request's own contiguous buffer in place beats gathering its pool slots, so a drafted
    request's full KV moves there right after prefill (``config.Placement``)."""
    fresh = "Summarize the following.\n" + prompts[2].text  # no cached prefix: all of it is owned
    out = http_json(kivi_server.url + "/generate", {
        "text": fresh, "sampling_params": {"temperature": 0, "max_new_tokens": 8},
    })  # fmt: skip
    stats = out["meta_info"]["vericache"]
    assert stats["verify_steps"] >= 1, stats
    assert stats["host_kv_tokens"] >= out["meta_info"]["prompt_tokens"] - 32, stats
    # all of its compressed KV lives in the pool slots held for it: the full-precision columns,
    # and the KIVI body's packed codes and scales in pages (KIVI keeps no position index)
    assert stats["compressed_kv_bytes_in_pool"] == stats["compressed_kv_bytes"] > 0, stats


def metric_values(url: str, name: str) -> dict[str, float]:
    """``name``'s samples on ``/metrics``: {label text: value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as resp:
        lines = resp.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line.startswith(name)}  # fmt: skip


def test_auto_under_memory_pressure_is_exact_offloads_and_measures_both_modes(
    prompts, reference, tmp_path: Path
) -> None:
    """A budget that holds about two of the four prompts' full KV, ``--vericache-draft-len
    auto``, ``--vericache-placement pressure``: a request alone has room, so its full KV stays
    in the pool, its compressed KV in free slots beside it; then the request admission cannot fit makes the worker move running requests'
    full KV to host memory (``placement.py``), so all four run at once; the planner times plain
    and drafted steps before it chooses (``verify/step_plan.py``); every token is plain
    SGLang's."""
    extra = ("--max-total-tokens", "1400", "--chunked-prefill-size", "512", "--enable-metrics",
             "--vericache-placement", "pressure")  # fmt: skip
    with vericache_server("snapkv:ratio=0.25", tmp_path, "auto", extra=extra) as server:
        alone = http_json(server.url + "/generate", {
            "text": "Summarize the following.\n" + prompts[0].text,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        })["meta_info"]["vericache"]  # fmt: skip
        assert alone["host_kv_tokens"] == 0, alone  # room: nothing moved
        # its compressed KV in free pool slots, where the allocator counts it (a resident row)
        assert alone["compressed_kv_bytes_in_pool"] > 0 and alone["reserved_slots"] > 0, alone

        def one(prompt: Prompt) -> dict:
            return http_json(server.url + "/generate", {"text": prompt.text, "sampling_params": {
                "temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}})  # fmt: skip

        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(one, prompts))
        steps = metric_values(server.url, "vericache:decode_steps_total")
        moved = metric_values(server.url, "vericache:pressure_offloaded_tokens_total")
    for ref, out in zip(reference, outs):
        assert tuple(out["output_ids"]) == ref.output_ids
    assert sum(moved.values()) > 0, moved
    decisions = {k.split('decision="')[1].split('"')[0] for k, v in steps.items() if v > 0}
    assert {"measuring plain decode", "measuring drafting"} <= decisions, steps


def test_rows_demoted_for_admission_still_verify_their_lookup_drafts(
    prompts, reference, tmp_path: Path
) -> None:
    """A budget of about two of the four prompts' full KV: requests that wait for memory make
    running rows drop their compressed KV (``_demote_for_room``) or never build it
    (``starts_demoted``). Such a row has nothing to draft from but its own context: its
    prompt-lookup drafts still go through the full-KV verify (``StepRows.lookup_only``), and
    every token is plain SGLang's."""
    extra = ("--max-total-tokens", "900", "--chunked-prefill-size", "512",
             "--vericache-proposer", "lookup")  # fmt: skip
    with vericache_server("kivi:bits=4", tmp_path, "auto", extra=extra) as server:

        def one(prompt: Prompt) -> dict:
            return http_json(server.url + "/generate", {"text": prompt.text, "sampling_params": {
                "temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}})  # fmt: skip

        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(one, prompts))
        log = (tmp_path / "vericache.log").read_text(errors="replace")
    for ref, out in zip(reference, outs):
        assert tuple(out["output_ids"]) == ref.output_ids
    assert "for admission" in log or "while requests wait for memory" in log
    stats = [out["meta_info"]["vericache"] for out in outs]
    demoted = [s for s in stats if "dropped to make room" in s["plain_reason"]]
    assert any(s["proposers"].get("lookup", {}).get("verify_steps", 0) for s in demoted), stats


def test_prometheus_metrics_count_verifications(kivi_server, prompts) -> None:
    http_json(kivi_server.url + "/generate", {
        "text": prompts[1].text, "sampling_params": {"temperature": 0, "max_new_tokens": 8},
    })  # fmt: skip
    with urllib.request.urlopen(kivi_server.url + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("vericache:") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    assert values.get("vericache:verify_steps_total", 0) >= 1, sorted(values)
    assert values["vericache:committed_tokens_total"] == (
        values["vericache:accepted_tokens_total"] + values["vericache:verify_steps_total"])
    assert values.get("vericache:accept_length_count", 0) == values["vericache:verify_steps_total"]
    assert values.get("vericache:requests_total", 0) >= 1
    # the step profile: every decode step is profiled, drafting steps count their forwards
    decode_steps = values["vericache:decode_steps_total"]
    assert values.get("vericache:profiled_steps_total", 0) == decode_steps, sorted(values)
    assert values["vericache:step_phase_seconds_total"] > 0
    assert values.get("vericache:draft_forwards_total", 0) > 0
    # the batched CPU kernel reads a KIVI row where it lies (packed body, then its draft row's
    # pool slots and the chain's): a draft copies nothing; SDPA, where it did not build, copies
    from sglang_vericache.ops.cpu_draft_decode import load_cpu_draft_decode

    copies = values.get("vericache:step_transient_bytes_peak", 0)
    assert copies == 0 if load_cpu_draft_decode() is not None else copies > 0, copies


def test_meta_info_is_current_at_the_end_of_long_and_streamed_outputs(kivi_server, prompts) -> None:
    """A verify commits several tokens per step; the counters must still reach the final
    response (SGLang sends per-token info in pieces) and every streamed chunk."""
    sampling = {"temperature": 0, "max_new_tokens": 96, "ignore_eos": True}
    out = http_json(kivi_server.url + "/generate", {"text": prompts[3].text, "sampling_params": sampling})
    stats = out["meta_info"]["vericache"]
    assert stats["verify_steps"] == out["meta_info"]["spec_verify_ct"], stats
    assert stats["committed"] + 1 >= 96, stats  # the first token comes from the prefill
    body = {"text": prompts[3].text, "sampling_params": sampling, "stream": True}
    chunks = [event["meta_info"] for event in _sse(kivi_server.url + "/generate", body)]
    assert len(chunks) > 2 and all("vericache" in c for c in chunks), len(chunks)
    committed = [c["vericache"]["committed"] for c in chunks]
    assert committed == sorted(committed) and committed[-1] + 1 >= 96, committed


def _sse(url: str, body: dict) -> Iterator[dict]:
    """POST ``body`` and yield each server-sent event's JSON until [DONE]."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                yield json.loads(line[5:])


def _stream_chat(url: str, content: str) -> str:
    body = {"model": "default", "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 40, "stream": True}  # fmt: skip
    events = _sse(url + "/v1/chat/completions", body)
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events)


def test_streamed_chat_matches_plain(kivi_server, plain_server) -> None:
    question = "List three uses of a hash map, one line each."
    assert _stream_chat(kivi_server.url, question) == _stream_chat(plain_server.url, question)


def test_sampled_request_drafts_and_penalized_request_is_plain(kivi_server) -> None:
    """Sampling alone drafts (speculative sampling); penalties keep a row plain."""
    sampled = {"temperature": 0.8, "max_new_tokens": 12, "ignore_eos": True}
    out = http_json(kivi_server.url + "/generate", {"text": "Once upon a time",
                                                    "sampling_params": sampled})  # fmt: skip
    assert out["meta_info"]["completion_tokens"] == 12
    stats = out["meta_info"]["vericache"]
    assert stats["mode"] == "sampled" and stats["verify_steps"] >= 1 and stats["drafted"] > 0
    assert 0.0 <= stats["accept_rate"] <= 1.0 and stats["plain_reason"] == ""
    penalized = {**sampled, "frequency_penalty": 0.5}
    out = http_json(kivi_server.url + "/generate", {"text": "Once upon a time",
                                                    "sampling_params": penalized})  # fmt: skip
    stats = out["meta_info"]["vericache"]  # plain decoding, never a lossy token
    assert stats["mode"] == "plain" and "penalties" in stats["plain_reason"]
    assert stats["drafted"] == 0 and stats["verify_steps"] == 0


def _frontend_program(url: str) -> dict[str, str]:
    """An SGLang frontend-language program: a shared prefix, fork, several gen calls."""
    import sglang as sgl

    @sgl.function
    def plan_trip(s, city):
        s += f"You are planning a day in {city}.\n"
        s += "Morning: " + sgl.gen("morning", max_tokens=16, temperature=0, stop="\n")
        forks = s.fork(2)
        for f, part in zip(forks, ("Lunch", "Evening")):
            f += f"\n{part}: " + sgl.gen("idea", max_tokens=16, temperature=0, stop="\n")
        s += "\nIdeas: " + forks[0]["idea"] + " | " + forks[1]["idea"]
        s += "\nSummary: " + sgl.gen("summary", max_tokens=20, temperature=0)

    state = plan_trip.run(city="Lisbon", backend=sgl.RuntimeEndpoint(url))
    return {"morning": state["morning"], "summary": state["summary"], "text": state.text()}


def test_frontend_program_with_fork_matches_plain(kivi_server, plain_server) -> None:
    got = _frontend_program(kivi_server.url)
    assert got == _frontend_program(plain_server.url)
    assert all(got.values())  # every gen produced text


def test_a_decoding_requests_prompt_is_a_hit_for_requests_that_share_it(
    kivi_server, plain_server, prompts
) -> None:
    """An agent fleet's system prompt: while the first request decodes (its full KV moved to its
    host buffer after prefill), a second request sharing the prompt reuses the prompt's device
    KV instead of recomputing it, and answers as plain SGLang does."""
    import threading
    import time

    shared = "Briefing shared by every agent of the fleet.\n\n" + prompts[1].text
    first = {"text": shared, "stream": True,
             "sampling_params": {"temperature": 0, "max_new_tokens": 96, "ignore_eos": True}}
    stamps: list[tuple[float, dict]] = []
    started = threading.Event()

    def consume() -> None:
        for event in _sse(kivi_server.url + "/generate", first):
            stamps.append((time.monotonic(), event))
            started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(600), "the first request never streamed a token"
    second = {"text": shared + "\n\nName the topic in three words.",
              "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    got = http_json(kivi_server.url + "/generate", second)
    answered = time.monotonic()
    reader.join(600)
    assert stamps[-1][0] > answered, "the first request finished first: nothing was shared live"
    shared_tokens = stamps[-1][1]["meta_info"]["prompt_tokens"]
    assert got["meta_info"]["cached_tokens"] >= shared_tokens - 1, (got["meta_info"], shared_tokens)
    assert got["output_ids"] == http_json(plain_server.url + "/generate", second)["output_ids"]


def test_a_conversations_next_turn_extends_its_cached_turn_and_matches_plain(
    kivi_server, plain_server, prompts
) -> None:
    """Turn 2 of a conversation is turn 1's prompt and answer (whose KV came from verifies and
    host buffers) plus a question: a radix hit whose prefill attends only the new tokens'
    queries (``srt/attention/backend.py``). Both turns answer as plain SGLang does."""
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    turn = {"text": prompts[2].text, "sampling_params": params}
    for n in range(2):
        got = http_json(kivi_server.url + "/generate", turn)
        want = http_json(plain_server.url + "/generate", turn)
        assert got["output_ids"] == want["output_ids"], f"turn {n + 1}"
        if n:
            assert got["meta_info"]["cached_tokens"] >= want["meta_info"]["prompt_tokens"] // 2
        turn = {"text": turn["text"] + got["text"] + "\n\nAnd in one sentence?",
                "sampling_params": params}  # fmt: skip
