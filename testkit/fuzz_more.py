"""The request fuzzer's OpenAI, malformed and context-edge kinds (see ``fuzz.py``).

Malformed bodies are compared on the HTTP status only where they are rejected; a body one server
accepts and the other rejects, a 5xx or a dead server is what they are here to find (empty text
and out-of-vocabulary ids crashed both servers once). Context-edge requests sit exactly at, and
one token past, the model's context length.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from testkit.fuzz import (
    CHAT,
    COMPLETIONS,
    COUNT,
    GENERATE,
    JSON_SCHEMAS,
    REGEXES,
    STATUS,
    STOP_STRINGS,
    TOKENS,
    FuzzCase,
    VocabInfo,
    case,
    greedy,
    max_new,
    random_ids,
)  # fmt: skip
from testkit.fuzz_prompts import QUESTIONS, SHORT, long_prompt, short_prompt

MODEL = "default"
# Regexes whose every match is a few tokens long: decoding ends however large max_new_tokens is.
BOUNDED_REGEXES = (r"(yes|no|maybe)", r"[0-9]{1,3}(\.[0-9]{1,2})?", r"(red|green|blue), (cat|dog)")


def _oai_common(rng: random.Random, body: dict[str, Any]) -> str:
    """Fields both OpenAI endpoints share; returns the check the sampling mode allows."""
    check = TOKENS
    if rng.random() < 0.15:
        body.update(temperature=0.8, seed=rng.randint(0, 2**31 - 1))
        # SGLang reads a chat limit of 0 as none (``max_completion_tokens or max_tokens``): with
        # ignore_eos such a row would decode to the context's end (minutes on a CPU)
        body["ignore_eos"] = all(body.get(k) != 0 for k in ("max_tokens", "max_completion_tokens"))
        check = COUNT
    else:
        body["temperature"] = 0
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.25 and check == TOKENS:  # a sampled stop would make counts differ
        body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    if rng.random() < 0.25:
        body["stream"] = True
    if rng.random() < 0.5:
        body["return_token_ids"] = True
    return check


def k_oai_completion(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    r = rng.random()
    prompt: Any = (short_prompt(rng) if r < 0.65 else long_prompt(rng) if r < 0.7
                   else [short_prompt(rng), short_prompt(rng)] if r < 0.85
                   else random_ids(rng, vocab, rng.randint(2, 24)))  # fmt: skip
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_new(rng)}
    check = _oai_common(rng, body)
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.3:
            body["echo"] = True
    if rng.random() < 0.1:
        body["regex"] = rng.choice(REGEXES)
    return case("oai_completion", COMPLETIONS, body, check)


def _messages(rng: random.Random) -> list[dict[str, str]]:
    msgs = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    if rng.random() < 0.3:
        msgs.insert(0, {"role": "system", "content": "Answer briefly."})
    if rng.random() < 0.2:
        msgs += [{"role": "assistant", "content": rng.choice(SHORT)},
                 {"role": "user", "content": rng.choice(QUESTIONS)}]  # fmt: skip
    return msgs


def _response_format(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.3:
        return {"type": "json_object"}
    schema = rng.choice(JSON_SCHEMAS)
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def k_oai_chat(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    limit_key = "max_tokens" if rng.random() < 0.7 else "max_completion_tokens"
    body: dict[str, Any] = {"model": MODEL, "messages": _messages(rng), limit_key: max_new(rng)}
    check = _oai_common(rng, body)
    if rng.random() < 0.3:
        body["logprobs"] = True
        if rng.random() < 0.7:
            body["top_logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.15:
        body["response_format"] = _response_format(rng)
        body[limit_key] = rng.randint(8, 32)
    return case("oai_chat", CHAT, body, check)


def k_oai_disconnect(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    body = {"model": MODEL, "messages": _messages(rng), "max_tokens": rng.randint(24, 64),
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    return case("oai_disconnect", CHAT, body, STATUS, disconnect_after=rng.randint(1, 2))


# -- malformed ------------------------------------------------------------------------------


def _gen(prompt: dict[str, Any], **params: Any) -> dict[str, Any]:
    return {**prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 4, **params}}


def _malformed_generate(rng: random.Random, v: VocabInfo) -> list[tuple[str, Any]]:
    """(tag, body) for every malformed /generate body; the caller picks one."""
    text = {"text": short_prompt(rng)}
    oov = rng.choice([v.vocab_size, v.vocab_size + 1000, -1, 2**31])
    return [
        ("empty_text", _gen({"text": ""})),
        ("empty_text", _gen({"text": ["", short_prompt(rng)]})),
        ("empty_ids", _gen({"input_ids": []})),
        ("oov_ids", _gen({"input_ids": [1, 2, oov]})),
        ("oov_ids", _gen(text, stop_token_ids=[oov])),
        ("oov_ids", {**_gen(text), "return_logprob": True, "token_ids_logprob": [oov]}),
        ("negative_max_new", _gen(text, max_new_tokens=-1)),
        ("wrong_type", _gen({"text": 123})),
        ("wrong_type", {**text, "sampling_params": "greedy"}),
        ("wrong_type", _gen(text, max_new_tokens="8")),
        ("wrong_type", _gen(text, temperature="hot")),
        ("wrong_type", _gen(text, stop_token_ids="x")),
        ("wrong_type", _gen({"input_ids": ["a", "b"]})),
        ("unknown_param", _gen(text, bogus=1)),
        ("no_prompt", _gen({})),
        ("both_prompts", _gen({**text, "input_ids": [1, 2, 3]})),
        ("bad_sampling", _gen(text, temperature=-1)),
        ("bad_sampling", _gen(text, top_p=rng.choice([0.0, 1.5]))),
        ("bad_sampling", _gen(text, top_k=0)),
        ("bad_sampling", _gen(text, n=0)),
        ("bad_sampling", _gen(text, min_new_tokens=8, max_new_tokens=2)),
        ("bad_sampling", _gen(text, frequency_penalty=5.0)),
        ("bad_sampling", _gen(text, repetition_penalty=0.0)),
        ("bad_logprob", {**_gen(text), "return_logprob": True, "top_logprobs_num": -1}),
        ("bad_logprob", {**_gen(text), "return_logprob": True, "logprob_start_len": 10**6}),
        ("bad_grammar", _gen(text, regex="(")),
        ("bad_grammar", _gen(text, json_schema="{")),
        ("bad_grammar", _gen(text, ebnf="root ::=")),
        ("bad_grammar", _gen(text, regex="[0-9]+", json_schema=json.dumps(JSON_SCHEMAS[2]))),
        ("bad_json", '{"text": "unterminated'),
    ]


def _malformed_openai(rng: random.Random, v: VocabInfo) -> list[tuple[str, str, Any]]:
    msg = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    chat = {"model": MODEL, "messages": msg, "max_tokens": 4, "temperature": 0}
    comp = {"model": MODEL, "prompt": short_prompt(rng), "max_tokens": 4, "temperature": 0}
    return [
        ("oai_empty", CHAT, {**chat, "messages": []}),
        ("oai_missing", CHAT, {"model": MODEL, "max_tokens": 4}),
        ("oai_empty", COMPLETIONS, {**comp, "prompt": ""}),
        ("negative_max_new", COMPLETIONS, {**comp, "max_tokens": -1}),
        ("bad_logprob", CHAT, {**chat, "logprobs": True, "top_logprobs": 50}),
        ("bad_logprob", COMPLETIONS, {**comp, "logprobs": -2}),
        ("bad_sampling", CHAT, {**chat, "n": 0}),
        ("bad_grammar", CHAT, {**chat, "response_format": {"type": "json_schema"}}),
        ("oov_ids", COMPLETIONS, {**comp, "prompt": [1, v.vocab_size + 5]}),
        ("wrong_type", CHAT, {**chat, "messages": "hello"}),
    ]


def k_malformed(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    """Deliberately invalid requests; a greedy base, so a body both accept is still compared."""
    if rng.random() < 0.7:
        tag, body = rng.choice(_malformed_generate(rng, vocab))
        return case("malformed", GENERATE, body, TOKENS, tag)
    tag, endpoint, body = rng.choice(_malformed_openai(rng, vocab))
    return case("malformed", endpoint, body, TOKENS, tag)


def k_context_edge(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    """Requests at the context limit: prompt + max_new_tokens exactly the context length (or one
    past it: rejected), or a short prompt whose max_new_tokens fills the context but whose regex
    ends decoding after a few tokens, or an absurd max_new_tokens."""
    mode = rng.choice(("fits", "over", "regex", "regex", "huge"))
    ctx = vocab.context_len
    if mode in ("fits", "over"):
        k = rng.randint(1, 4)
        ids = random_ids(rng, vocab, ctx - k)
        body = {"input_ids": ids, "sampling_params": greedy(rng, max_new_tokens=k + (mode == "over"))}
        return case("context_edge", GENERATE, body, TOKENS, mode)
    if mode == "regex":
        ids = random_ids(rng, vocab, rng.randint(4, 24))
        limit = ctx - len(ids) + rng.choice([0, 1])
        params = {"temperature": 0, "max_new_tokens": limit, "regex": rng.choice(BOUNDED_REGEXES)}
        return case("context_edge", GENERATE, {"input_ids": ids, "sampling_params": params}, TOKENS,
                    mode)  # fmt: skip
    params = greedy(rng, max_new_tokens=rng.choice([ctx, 10**6, 2**31]))
    return case("context_edge", GENERATE, {"text": short_prompt(rng), "sampling_params": params},
                TOKENS, mode)  # fmt: skip


KINDS: tuple[tuple[str, float, Callable[[random.Random, VocabInfo], FuzzCase]], ...] = (
    ("oai_completion", 7, k_oai_completion),
    ("oai_chat", 7, k_oai_chat),
    ("oai_disconnect", 1, k_oai_disconnect),
    ("malformed", 8, k_malformed),
    ("context_edge", 1, k_context_edge),
)
