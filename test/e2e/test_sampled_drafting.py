"""Sampled requests under ``--vericache`` draft (speculative sampling) and keep plain SGLang's
output distribution (issue 16, item 1).

For each prompt and setting, ``N_CI`` continuations of 3 tokens come from the shared plain server
and from the shared ``--vericache`` server (``test/conftest.py``); a chi-square test of
homogeneity (``benchmark/sampled_distribution.py``) compares the first token and the first three
tokens. The first token is sampled at prefill by SGLang itself; tokens 2-3 are decided by a
verify with speculative sampling, so the three-token test is the one that checks drafting.

Power, documented honestly: for two samples of N per side at total-variation distance d, the
test's noncentrality is at least 2 N d^2 over any alternative (``power_at``). Power 0.9 against
*every* alternative at TV 0.05 needs N = 3000-7000 per side (alpha 0.01, df 1-20): that is the
long run, ``benchmark/sampled_distribution.py`` (results in ``benchmark/results/``). On 2 CI
cores this test uses N_CI = 512 per side and a Bonferroni level of ALPHA / 4 per test: it detects
any TV >= 0.135 (df 1), 0.165 (df 5), 0.18 (df 10) with power >= 0.9, TV 0.05 with power of only
a few percent (each test prints its bound).
Two guards keep it meaningful: the same test must reject a real wrong distribution (plain
sampling at another temperature), and the ``--vericache`` samples must really have been drafted
(a silent plain fallback would pass any distribution test).

What it does not reach: the shared server's ``kivi:bits=4`` keeps the newest 32 tokens in full
precision, so on these short prompts q == p and every draft is accepted; this checks the wiring
(drafted rows, the merge with SGLang's batch, q and p rebuilt as SGLang's sampler would), while
rejection and residual resampling are checked by ``test/unit/verify/test_spec_sampling.py``
(exact enumeration), ``test/unit/test_row_acceptance.py`` and the long run's lossy compressor.

Grammar rows (issue 40): sampled requests under a regex that may end after each answer compare
their output lengths, plain vs ``--vericache``, by the same chi-square test. The bias it guards
against (drafting stopped before a terminating draft) shows even with q == p, so the exact
short-prompt KV does not hide it; ``test/unit/verify/test_grammar_sampling.py`` checks the
property exactly over random p, q and grammars.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from sglang_vericache.exactness.server import http_json

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.sampled_distribution import (  # noqa: E402
    chi_square_homogeneity,
    compare,
    drafting_summary,
    power_at,
    sample,
)

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(3600)]

N_CI = 512
ALPHA = 0.01  # family-wise: every same-distribution test below runs at ALPHA / TESTS
PROMPTS = ("The capital of France is", "Here is a list of fruits: apple, banana,")
# One setting per prompt (both temperature / top_p settings covered, half the samples of every
# prompt x setting pair: this fixture was the suite's slowest, 4 min on 2 cores).
SETTINGS = [(PROMPTS[0], 0.7, 1.0), (PROMPTS[1], 1.0, 0.9)]
TESTS = 2 * len(SETTINGS)  # first token and first three tokens per setting
WRONG_TEMPERATURE = 1.0  # plain at T=0.7 vs plain at this: a real, different distribution
# A grammar that may end after every answer: EOS competes with " and" (issue 40). At temperature
# 2 several of the model's choices to end or go on are far from certain, where a bias shows most
# (a chain cut before its terminating draft ended with probability ~x^2 instead of x). Measured
# at N_GRAMMAR = 384: plain 156 outputs of length 2 and 73 of length 3, the old rule 174 and 20
# (p = 1e-6), the fix 168 and 69 (p = 0.35). No newline after "assistant": with one, the model
# ends after its first answer ~3/4 of the time and the old rule's bias is smaller.
GRAMMAR_PROMPT = ("<|im_start|>user\nIs the sky blue? Answer yes or no.<|im_end|>\n"
                  "<|im_start|>assistant")  # fmt: skip
GRAMMAR_REGEX = r"(yes|no)( and (yes|no)){0,4}"
GRAMMAR_TEMPERATURE = 2.0
N_GRAMMAR = 384


def _params(temperature: float, top_p: float) -> dict:
    return {"temperature": temperature, "top_p": top_p, "max_new_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def samples(plain_server, vericache_server) -> dict:
    """(side, prompt, T, top_p) -> (output ids [N_CI], meta_info["vericache"] [N_CI])."""
    out = {}
    for side, server in (("plain", plain_server), ("vericache", vericache_server)):
        for p, t, tp in SETTINGS:
            out[side, p, t, tp] = sample(server.url, p, _params(t, tp), N_CI, batch=128)
    out["wrong"] = sample(plain_server.url, PROMPTS[0], _params(WRONG_TEMPERATURE, 1.0), N_CI,
                          batch=128)  # fmt: skip
    return out


def test_sampled_rows_really_draft(samples) -> None:
    """Every sampled row ran in mode "sampled" and verifies committed more than one token."""
    for p, t, tp in SETTINGS:
        summary = drafting_summary(samples["vericache", p, t, tp][1])
        print(f"{p!r} T={t} top_p={tp}: {summary}")
        assert summary["modes"] == ["sampled"], summary
        assert summary["verify_steps"] >= N_CI and summary["committed_per_verify"] > 1.0, summary


@pytest.mark.parametrize("setting", SETTINGS, ids=[f"{p[:12]}-T{t}-p{tp}" for p, t, tp in SETTINGS])
def test_same_distribution_as_plain(samples, setting) -> None:
    ref, got = samples[("plain", *setting)][0], samples[("vericache", *setting)][0]
    assert len(ref) == len(got) == N_CI and all(len(o) == 3 for o in ref + got)
    for name, result in compare(ref, got).items():
        print(f"{setting} {name}: p={result.p_value:.4f} df={result.df} TV={result.tv:.3f} "
              f"power(TV 0.05)>={power_at(N_CI, max(result.df, 1), 0.05, ALPHA / TESTS):.3f}")
        assert result.p_value >= ALPHA / TESTS, (setting, name, result)


def test_the_test_rejects_a_wrong_distribution(samples) -> None:
    """The same test on plain T=0.7 vs plain T=1.0 samples must reject: it can fail."""
    ref = samples["plain", PROMPTS[0], 0.7, 1.0][0]
    results = compare(ref, samples["wrong"][0])
    print({k: (round(v.p_value, 6), round(v.tv, 3)) for k, v in results.items()})
    assert results["first_three"].p_value < ALPHA / TESTS, results


def test_seeded_rows_repeat_their_verified_tokens(vericache_server) -> None:
    """With ``sampling_seed`` and a fixed draft length, the tokens the verifies decide repeat
    run to run (the first token is SGLang's prefill sample: seeded only with
    ``--enable-deterministic-inference``, so runs are compared given the same first token)."""
    if "--vericache-draft-len" not in vericache_server.args:
        pytest.skip("auto draft length: seeded output is reproducible only for fixed lengths")
    body = {"text": PROMPTS[0], "sampling_params": {**_params(1.0, 1.0), "max_new_tokens": 10,
                                                    "sampling_seed": 1234}}  # fmt: skip
    runs = [tuple(http_json(vericache_server.url + "/generate", body)["output_ids"])
            for _ in range(4)]  # fmt: skip
    by_first = Counter(r[0] for r in runs)
    first, count = by_first.most_common(1)[0]
    if count < 2:
        pytest.skip(f"no two runs share a first token: {runs}")
    assert len({r for r in runs if r[0] == first}) == 1, runs


@pytest.fixture(scope="module")
def grammar_samples(plain_server, vericache_server) -> dict:
    """side -> (output ids [N_GRAMMAR], meta_info["vericache"] [N_GRAMMAR]) under the regex."""
    params = {"temperature": GRAMMAR_TEMPERATURE, "max_new_tokens": 16, "regex": GRAMMAR_REGEX}
    return {side: sample(server.url, GRAMMAR_PROMPT, params, N_GRAMMAR, batch=128)
            for side, server in (("plain", plain_server), ("vericache", vericache_server))}


def test_sampled_grammar_rows_end_as_plain_sampling_does(grammar_samples) -> None:
    """Sampled rows under a regex that can end after each answer: where the output ends (its
    length; 16 = max_new_tokens) is distributed as plain SGLang's, and the rows really drafted
    under their grammar (a plain fallback would pass any distribution test)."""
    (ref, _), (got, stats) = grammar_samples["plain"], grammar_samples["vericache"]
    summary = drafting_summary(stats)
    print(f"regex rows: {summary}")
    assert summary["modes"] == ["sampled"] and all(s.get("constrained") for s in stats), summary
    assert summary["verify_steps"] >= N_GRAMMAR and sum(s["drafted"] for s in stats) > 0, summary
    lengths = chi_square_homogeneity([len(o) for o in ref], [len(o) for o in got])
    print(f"output lengths: plain {sorted(Counter(len(o) for o in ref).items())}, vericache "
          f"{sorted(Counter(len(o) for o in got).items())}: {lengths}")  # fmt: skip
    assert lengths.p_value >= 1e-3, lengths
