"""Sampled grammar rows are exact in distribution (``verify/grammar_chain.py`` + speculative
sampling), with termination anywhere along the draft chain.

``_generate`` is the worker's step in miniature over a batch of SAMPLED, grammar-constrained
rows, through the same ``DraftChain`` calls as ``srt/decode/decode_step.py``: each draft column's
q logits are masked by the row's matcher and sampled (``draft``), the verify's p logits are
masked by the chain's column masks (``mask_verify``), rows are accepted by speculative sampling
(``accept``) and closed on an accepted terminating draft (``settle``); then each
matcher advances over the committed run as SGLang's ``_accept_grammar_tokens`` does (asserting
it drops nothing past termination). Each row runs until its grammar terminates.

The "model" gives p and q logits as functions of the output prefix (tables indexed by a hash of
it) and the grammar allows a random subset of tokens after each prefix, the end token ``EOS``
(which terminates it) from ``min_len`` on, and only EOS at ``max_len``. Plain sampling's
distribution over whole outputs is enumerated exactly; the drafted outputs must match it by a
chi-square test (and the first token's distribution by another) at p >= 0.001. Seeds are fixed,
so every outcome is deterministic; a chain cut before its terminating draft (the old rule)
fails by orders of magnitude.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from grammar_stubs import BoolMaskGrammar
from scipy import stats

from sglang_vericache.verify import TOP_K_ALL
from sglang_vericache.verify.draft_chain import DraftChain

TABLE = 4096  # prefix hash buckets of the toy model
PRIME = 2_147_483_647
ALPHA = 1e-3  # a correct sampler fails a test one time in a thousand seeds


def extend(codes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Prefix hashes after appending ``tokens`` (same shape, int64); the empty prefix is 0."""
    return (codes * 1_000_003 + tokens + 1) % PRIME


def extend_one(code: int, token: int) -> int:
    """``extend`` for one prefix, in python ints."""
    return (code * 1_000_003 + token + 1) % PRIME


class PrefixModel:
    """p, q logits and the grammar's allowed sets as functions of the output prefix.

    p, q: [TABLE, V] float32 logits. EOS = V - 1 ends an output. After a prefix of length L
    hashing to bucket b the grammar allows ``allowed[b]`` ([TABLE, V] bool, EOS False), plus
    EOS where ``L >= min_len`` and ``eos_ok[b]`` ([TABLE] bool); only EOS at ``L = max_len``.
    temperature: the rows' sampling temperature.
    """

    def __init__(self, p: torch.Tensor, q: torch.Tensor, allowed: torch.Tensor,
                 eos_ok: torch.Tensor, min_len: int, max_len: int,
                 temperature: float) -> None:  # fmt: skip
        self.vocab = p.shape[1]
        self.eos, self.min_len, self.max_len = self.vocab - 1, min_len, max_len
        self.p, self.q, self.temperature = p, q, temperature
        # [TABLE, V] masks before min_len / from min_len, and the only-EOS mask at max_len
        self.before_min = allowed.clone()
        self.before_min[:, self.eos] = False
        self.after_min = self.before_min.clone()
        self.after_min[:, self.eos] = eos_ok
        self.only_eos = torch.arange(self.vocab) == self.eos

    @classmethod
    def random(cls, vocab: int, seed: int, min_len: int, max_len: int, temperature: float = 1.0,
               scale: float = 1.5) -> PrefixModel:  # fmt: skip
        """Random logits; each bucket allows a random non-empty subset of non-EOS tokens and EOS
        in 70% of buckets."""
        gen = torch.Generator().manual_seed(seed)
        p = torch.randn(TABLE, vocab, generator=gen) * scale
        q = torch.randn(TABLE, vocab, generator=gen) * scale
        allowed = torch.rand(TABLE, vocab, generator=gen) < 0.6
        allowed[torch.arange(TABLE), torch.randint(0, vocab - 1, (TABLE,), generator=gen)] = True
        eos_ok = torch.rand(TABLE, generator=gen) < 0.7
        return cls(p, q, allowed, eos_ok, min_len, max_len, temperature)

    def mask(self, code: int, length: int) -> torch.Tensor:
        """[V] bool: tokens the grammar allows after a prefix of ``length`` tokens (a view)."""
        if length >= self.max_len:
            return self.only_eos
        return (self.after_min if length >= self.min_len else self.before_min)[code % TABLE]

    def plain_distribution(self) -> dict[tuple[int, ...], float]:
        """Exact probability of every output under plain masked sampling from p (to EOS)."""
        out: dict[tuple[int, ...], float] = {}

        def walk(prefix: tuple[int, ...], code: int, prob: float) -> None:
            logits = self.p[code % TABLE].double() / self.temperature
            logits[~self.mask(code, len(prefix))] = float("-inf")
            for token, pt in enumerate(torch.softmax(logits, -1).tolist()):
                if pt == 0.0:
                    continue
                seq = prefix + (token,)
                if token == self.eos:
                    out[seq] = prob * pt
                else:
                    walk(seq, extend_one(code, token), prob * pt)

        walk((), 0, 1.0)
        return out


class PrefixGrammar(BoolMaskGrammar):
    """A grammar object over ``PrefixModel``'s allowed sets (``BaseGrammarObject``'s interface
    as ``GrammarChain`` uses it; a bool mask, True = allowed; rollback like xgrammar's)."""

    def __init__(self, model: PrefixModel) -> None:
        self.model, self.accepted, self.codes = model, [], [0]

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == self.model.eos

    def accept_token(self, token: int) -> None:
        if self.is_terminated():
            return  # SGLang's backends ignore tokens after termination
        if not self.model.mask(self.codes[-1], len(self.accepted))[token]:
            raise ValueError(f"token {token} not allowed after {self.accepted}")
        self.accepted.append(token)
        self.codes.append(extend_one(self.codes[-1], token))

    def rollback(self, k: int) -> None:
        del self.accepted[len(self.accepted) - k:]
        del self.codes[len(self.codes) - k:]

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        vocab_mask[idx] = self.model.mask(self.codes[-1], len(self.accepted))



def sampling_info(rows: int, temperature: float, vocab: int) -> SimpleNamespace:
    """The ``SamplingBatchInfo`` fields ``RowSampling.from_sampling_info`` reads: plain
    temperature sampling for every row."""
    return SimpleNamespace(
        temperatures=torch.full((rows, 1), temperature), top_ps=torch.ones(rows),
        top_ks=torch.full((rows,), TOP_K_ALL, dtype=torch.int32), min_ps=torch.zeros(rows),
        is_all_greedy=False, need_top_k_sampling=False, need_top_p_sampling=False,
        need_min_p_sampling=False, max_top_k=None, sampling_seed=None, vocab_size=vocab,
    )  # fmt: skip


def _step(model: PrefixModel, grammars: list[PrefixGrammar], drafts: int,
          gen: torch.Generator) -> list[list[int]]:  # fmt: skip
    """One drafted step over these rows; returns each row's committed run."""
    n, width = len(grammars), drafts + 1
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(sampling_seed=None), grammar=g)
            for g in grammars]  # fmt: skip
    info = sampling_info(n, model.temperature, model.vocab)
    every = list(range(n))
    chain = DraftChain.start(torch.zeros(n, dtype=torch.int64), width, every, reqs=reqs,
                             sampling_info=info, sampled_rows=every, grammar_rows=every,
                             positions=torch.zeros(n, dtype=torch.int64), generator=gen)  # fmt: skip
    codes = [torch.tensor([g.codes[-1] for g in grammars])]  # prefix before verify column j
    try:
        for j in range(drafts):
            chain.draft(j, model.q[codes[j] % TABLE].clone())
            codes.append(extend(codes[j], chain.rows[:, j + 1]))
        chain.end_drafts()
        chain.check_integrity()
    finally:
        chain.grammar.rollback()
    verify = torch.stack([model.p[c % TABLE] for c in codes], dim=1).view(n * width, -1)
    chain.mask_verify(verify)
    result = chain.settle(chain.accept(verify), [frozenset()] * n)
    return [result.row_tokens(k) for k in range(n)]


def _generate(model: PrefixModel, samples: int, drafts: int, seed: int) -> list[tuple[int, ...]]:
    """``samples`` outputs, each drafted ``drafts`` tokens a step until its grammar ends."""
    gen = torch.Generator().manual_seed(seed)
    grammars = [PrefixGrammar(model) for _ in range(samples)]
    live = list(grammars)
    while live:
        for grammar, run in zip(live, _step(model, live, drafts, gen)):
            retained = []
            for token in run:  # SchedulerBatchResultProcessor._accept_grammar_tokens
                grammar.accept_token(token)
                retained.append(token)
                if grammar.is_terminated():
                    break
            assert retained == run, "a token past termination was committed"
        live = [g for g in live if not g.is_terminated()]
    return [tuple(g.accepted) for g in grammars]


def chi_square_p(observed: Counter, expected: dict, samples: int) -> float:
    """p-value of ``observed`` counts against ``expected`` probabilities; categories expected
    fewer than 5 times are pooled (one category)."""
    obs, exp, rare_obs, rare_exp = [], [], 0, 0.0
    for key, prob in expected.items():
        if prob * samples >= 5:
            obs.append(observed[key])
            exp.append(prob * samples)
        else:
            rare_obs, rare_exp = rare_obs + observed[key], rare_exp + prob * samples
    assert sum(observed.values()) == samples and set(observed) <= set(expected), "impossible output"
    if rare_exp > 0:
        obs.append(rare_obs)
        exp.append(rare_exp)
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, [e * sum(obs) / sum(exp) for e in exp]).pvalue)


def test_two_tokens_equal_p_and_q_end_half_the_time() -> None:
    """The issue's reproduction: {continue, EOS}, p = q = [0.5, 0.5], one draft a step."""
    even = torch.zeros(TABLE, 2)
    model = PrefixModel(even, even, torch.ones(TABLE, 2, dtype=torch.bool),
                        torch.ones(TABLE, dtype=torch.bool), 0, 50, 1.0)  # fmt: skip
    samples = 20_000
    outputs = _generate(model, samples, drafts=1, seed=1)
    ended_at_once = sum(out[0] == model.eos for out in outputs)
    assert stats.binomtest(ended_at_once, samples, 0.5).pvalue >= ALPHA, ended_at_once / samples


# (vocab, model seed, min_len, max_len, temperature): EOS possible at the first token or later,
# vocabularies of 2-5 tokens, outputs of up to 5 tokens
MODELS = [(2, 11, 0, 4, 1.0), (3, 12, 0, 4, 1.0), (4, 13, 1, 4, 0.7), (5, 14, 0, 3, 1.3)]


@pytest.mark.parametrize("drafts", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("spec", MODELS, ids=lambda s: f"V{s[0]}")
def test_sampled_grammar_outputs_are_distributed_as_plain_sampling(spec, drafts: int) -> None:
    vocab, seed, min_len, max_len, temperature = spec
    model = PrefixModel.random(vocab, seed, min_len, max_len, temperature)
    want = model.plain_distribution()
    assert abs(sum(want.values()) - 1.0) < 1e-9
    samples = 4000
    outputs = _generate(model, samples, drafts, seed=100 * seed + drafts)
    got = Counter(outputs)
    assert chi_square_p(got, want, samples) >= ALPHA, (got.most_common(5), want)
    first_want: Counter = Counter()
    for seq, prob in want.items():
        first_want[seq[:1]] += prob
    first = Counter(out[:1] for out in outputs)
    assert chi_square_p(first, dict(first_want), samples) >= ALPHA, (first, first_want)
