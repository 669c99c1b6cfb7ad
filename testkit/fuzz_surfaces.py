"""The request fuzzer's less travelled surfaces (see ``fuzz.py``).

- ``hidden``: ``return_hidden_states`` (``true``: every position, ``"last"``: the last one),
  alone, in batches, and in batches where only some items ask; the servers must be started
  with ``--return-hidden-states-mode full`` to serve them (otherwise both answer 400).
- ``batch_invalid``: a batch whose later item is invalid (sampling parameters, ids, grammar):
  the whole batch is refused before any item runs, on both servers alike.
- ``n_constrained``: ``n > 1`` with a grammar and log-probs.
- ``distribution``: one sampled prompt, ``n`` completions on each server; the token at one
  decode position must be distributed alike (a two-sample chi-square test, ``fuzz_stats.py``).
- ``embeds``: ``input_embeds`` prompts (served only with ``--disable-radix-cache``; both sides
  refuse them otherwise).
- ``weights``: ``/update_weights_from_disk`` with the weights already served, in the middle of
  the traffic (outputs after it must not change; runs alone).
- ``storm``: a burst of streams dropped after their first event and of requests aborted through
  ``/abort_request`` while they run; the server must answer afterwards and leak nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from testkit.fuzz import (
    GENERATE,
    STATUS,
    TOKENS,
    FuzzCase,
    VocabInfo,
    case,
    constraint,
    greedy,
    logprob_fields,
    random_ids,
    sampled,
)  # fmt: skip
from testkit.fuzz_prompts import short_prompt

DISTRIBUTION = "distribution"  # check: sampled completions compared as distributions
STORM = "storm"  # pseudo-endpoint: the runner sends a burst (``fuzz_run.run_storm``)
UPDATE_WEIGHTS = "/update_weights_from_disk"
DIST_SAMPLES = 48  # completions per server for one distribution test


def k_hidden(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    mode: Any = rng.choice([True, "last"])
    if rng.random() < 0.5:
        body = {"text": short_prompt(rng), "sampling_params": greedy(rng, max_new_tokens=
                rng.randint(1, 8)), "return_hidden_states": mode}  # fmt: skip
        return case("hidden", GENERATE, body, TOKENS, "hidden")
    texts = [short_prompt(rng) for _ in range(rng.randint(2, 3))]
    asks: Any = mode
    if rng.random() < 0.4:  # only some items ask
        asks = [rng.choice([mode, False]) for _ in texts]
        asks[rng.randrange(len(asks))] = mode
    body = {"text": texts, "sampling_params": greedy(rng, max_new_tokens=rng.randint(1, 8)),
            "return_hidden_states": asks}  # fmt: skip
    return case("hidden", GENERATE, body, TOKENS, "hidden")


def _bad_item(rng: random.Random, vocab: VocabInfo) -> tuple[str, dict[str, Any]]:
    """(tag, sampling params) that SGLang refuses for one item."""
    oov = vocab.vocab_size + rng.randint(0, 100)
    return rng.choice([
        ("bad_sampling", {"temperature": -1.0}),
        ("bad_sampling", {"top_p": 1.5}),
        ("bad_sampling", {"max_new_tokens": -3}),
        ("bad_sampling", {"min_new_tokens": 9, "max_new_tokens": 2}),
        ("oov_ids", {"stop_token_ids": [oov]}),
        ("bad_grammar", {"regex": "(("}),
    ])  # fmt: skip


def k_batch_invalid(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    size = rng.randint(2, 4)
    params = [greedy(rng, max_new_tokens=rng.randint(2, 12)) for _ in range(size)]
    bad = rng.randint(1, size - 1)  # never the first item: the earlier ones look fine
    if rng.random() < 0.75:
        tag, extra = _bad_item(rng, vocab)
        params[bad] = {**params[bad], **extra}
        body = {"text": [short_prompt(rng) for _ in range(size)], "sampling_params": params}
    else:
        tag = "oov_ids"
        ids = [random_ids(rng, vocab, rng.randint(2, 12)) for _ in range(size)]
        ids[bad] = [*ids[bad], vocab.vocab_size + rng.randint(0, 100)]
        body = {"input_ids": ids, "sampling_params": params}
    return case("batch_invalid", GENERATE, body, TOKENS, tag)


def k_n_constrained(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    n = rng.randint(2, 4)
    is_greedy = rng.random() < 0.5
    grammar = constraint(rng)
    params = (greedy(rng, n=n, max_new_tokens=rng.randint(4, 24), **grammar) if is_greedy
              else sampled(rng, n=n, max_new_tokens=rng.randint(4, 24), **grammar))  # fmt: skip
    body = {"text": short_prompt(rng), "sampling_params": params}
    if rng.random() < 0.7:
        body.update(logprob_fields(rng, vocab))
    return case("n_constrained", GENERATE, body, TOKENS if is_greedy else STATUS)


def k_distribution(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    """``n`` samples of a short continuation; the comparator tests the token at one decode
    position (named by the case's ``posK`` tag: past the prefill's token, so drafted and
    verified). Half of them are grammar-constrained, where a grammar may end the output."""
    params: dict[str, Any] = {"temperature": rng.choice([0.7, 1.0, 1.3]), "n": DIST_SAMPLES,
                              "max_new_tokens": 6}  # fmt: skip
    if rng.random() < 0.3:
        params["top_p"] = rng.choice([0.8, 0.95])
    if rng.random() < 0.5:
        params.update(constraint(rng))
    else:
        params["ignore_eos"] = True
    position = rng.randint(1, 4)
    body = {"text": short_prompt(rng), "sampling_params": params}
    return case("distribution", GENERATE, body, DISTRIBUTION, f"pos{position}")


def k_embeds(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    width = vocab.hidden_size or 8
    rows = rng.randint(2, 12)
    embeds = [[round(rng.gauss(0.0, 0.05), 4) for _ in range(width)] for _ in range(rows)]
    body = {"input_embeds": embeds, "sampling_params": greedy(rng, max_new_tokens=
            rng.randint(1, 12))}  # fmt: skip
    return case("embeds", GENERATE, body, TOKENS, "embeds")


def k_weights(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    """The served weights loaded again; without a model path (no server asked) a greedy case."""
    if not vocab.model_path:
        return case("weights", GENERATE, {"text": short_prompt(rng), "sampling_params":
                    greedy(rng)}, TOKENS, "weights")  # fmt: skip
    return case("weights", UPDATE_WEIGHTS, {"model_path": vocab.model_path}, STATUS, "weights")


def k_storm(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    body = {"streams": rng.randint(4, 12), "aborts": rng.randint(2, 6),
            "texts": [short_prompt(rng) for _ in range(4)],
            "max_new_tokens": rng.randint(32, 96)}  # fmt: skip
    return case("storm", STORM, body, STATUS, "storm", "disconnect")


KINDS: tuple[tuple[str, float, Callable[[random.Random, VocabInfo], FuzzCase]], ...] = (
    ("hidden", 4, k_hidden),
    ("batch_invalid", 3, k_batch_invalid),
    ("n_constrained", 3, k_n_constrained),
    ("distribution", 2, k_distribution),
    ("embeds", 2, k_embeds),
    ("weights", 0.5, k_weights),
    ("storm", 1, k_storm),
)
