"""Speculative sampling is exact in distribution: exact enumeration, then Monte Carlo.

The enumeration walks every branch of the procedure (draft outcome x accept/reject x residual or
bonus token) with the same ``acceptance_probability`` / ``residual_distribution`` the batched
sampler uses, across verify steps, and compares the probability of every committed sequence with
the product of the target distributions (p_t does not depend on the prefix here, so the joint of
the first m committed tokens must be the product). A deliberately wrong variant must fail it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

from sglang_vericache.verify.sampling_probs import TOP_K_ALL, RowSampling, process_logits
from sglang_vericache.verify.spec_sampling import (
    AcceptDraws,
    acceptance_probability,
    residual_distribution,
    speculative_accept,
)

V = 5
Dist = torch.Tensor  # [V] float64


def _d(*xs: float) -> Dist:
    t = torch.tensor(xs, dtype=torch.float64)
    return t / t.sum()


def _truncated(logits: list[float], *, top_k: int = TOP_K_ALL, top_p: float = 1.0,
               min_p: float = 0.0, temperature: float = 1.0) -> Dist:  # fmt: skip
    s = RowSampling.of(torch.tensor([temperature]), torch.tensor([top_p]),
                       torch.tensor([top_k], dtype=torch.int32), torch.tensor([min_p]))  # fmt: skip
    probs = process_logits(torch.tensor([logits]), s)[0].double()
    return probs / probs.sum()  # exact to float64 (the sampler normalises what it draws from)


def _onehot(i: int) -> Dist:
    return torch.nn.functional.one_hot(torch.tensor(i), V).double()


# (p, q) at position 0; later positions roll them so every p_t differs.
CASES: dict[str, tuple[Dist, Dist]] = {
    "q0_where_p_pos": (_d(0.1, 0.2, 0.3, 0.4, 0.0), _d(0.0, 0.5, 0.5, 0.0, 0.0)),
    "p0_where_q_pos": (_d(0.5, 0.5, 0.0, 0.0, 0.0), _d(1, 1, 1, 1, 1)),
    "disjoint_support": (_d(0, 0, 0.3, 0.7, 0), _d(0.6, 0.4, 0, 0, 0)),
    "topk_p_topp_q": (
        _truncated([2.0, 1.0, 0.5, 0.1, -1.0], top_k=3),
        _truncated([1.0, 2.0, 0.2, 0.4, 0.0], top_p=0.6, temperature=0.7),
    ),
    "minp_p_topk1_q": (
        _truncated([0.0, 1.5, 1.4, -2.0, 0.3], min_p=0.3),
        _truncated([0.0, 1.5, 1.4, -2.0, 0.3], top_k=1),
    ),
    "onehot_p": (_onehot(2), _d(0.1, 0.2, 0.3, 0.2, 0.2)),
    "onehot_q": (_d(0.3, 0.1, 0.2, 0.25, 0.15), _onehot(0)),
    "onehot_both_differ": (_onehot(1), _onehot(3)),
    "p_equals_q": (_d(0.3, 0.1, 0.2, 0.25, 0.15), _d(0.3, 0.1, 0.2, 0.25, 0.15)),
}


def _positions(case: str, n: int) -> tuple[list[Dist], list[Dist]]:
    p, q = CASES[case]
    return [p.roll(t) for t in range(n)], [q.roll(2 * t) for t in range(n)]


def _mixed(n: int) -> tuple[list[Dist], list[Dist]]:
    """Position t takes the t-th case: the checked p/q pair changes kind along the chain."""
    pairs = list(CASES.values())
    return [pairs[t % len(pairs)][0] for t in range(n)], [
        pairs[t % len(pairs)][1] for t in range(n)
    ]


AcceptFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ResidualFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _one_step(p, q, start, n, need, accept: AcceptFn, residual: ResidualFn) -> dict:
    """Committed tokens of one verify step at ``start`` with ``n`` drafts, cut at ``need``.

    Returns {token tuple: probability}; a tuple shorter than ``need`` ended the step.
    """
    out: dict[tuple, float] = defaultdict(float)
    alive = {(): 1.0}  # every draft so far accepted
    for j in range(n):
        if j == need:  # enough tokens: the continuations sum to 1
            for prefix, w in alive.items():
                out[prefix] += w
            return out
        t = start + j
        a, r = accept(p[t], q[t]), residual(p[t], q[t])
        grown: dict[tuple, float] = defaultdict(float)
        for prefix, w in alive.items():
            for d in range(V):
                wq = w * float(q[t][d])
                if wq == 0.0:
                    continue  # d is never drafted
                grown[prefix + (d,)] += wq * float(a[d])
                for x in range(V):
                    out[prefix + (x,)] += wq * (1.0 - float(a[d])) * float(r[x])
        alive = grown
    for prefix, w in alive.items():  # all n drafts accepted
        if n == need:
            out[prefix] += w
        else:
            for x in range(V):
                out[prefix + (x,)] += w * float(p[start + n][x])
    return out


def enumerate_committed(p, q, n, m, accept: AcceptFn = acceptance_probability,
                        residual: ResidualFn = residual_distribution) -> dict:  # fmt: skip
    """Exact distribution of the first ``m`` committed tokens, ``n`` drafts per verify step."""
    done: dict[tuple, float] = defaultdict(float)
    frontier = {(): 1.0}
    while frontier:
        nxt: dict[tuple, float] = defaultdict(float)
        for prefix, w in frontier.items():
            for seq, pr in _one_step(
                p, q, len(prefix), n, m - len(prefix), accept, residual
            ).items():
                if pr == 0.0:
                    continue
                full = prefix + seq
                (done if len(full) >= m else nxt)[full[:m]] += w * pr
        frontier = nxt
    return done


def _max_error(p, dist: dict, m: int) -> float:
    """Largest |P(committed sequence) - prod_t p_t(x_t)| over all V**m sequences."""
    err = 0.0
    grid = (
        torch.cartesian_prod(*[torch.arange(V)] * m).view(-1, m)
        if m > 1
        else torch.arange(V).view(-1, 1)
    )
    for seq in grid.tolist():
        expect = 1.0
        for t, x in enumerate(seq):
            expect *= float(p[t][x])
        err = max(err, abs(dist.get(tuple(seq), 0.0) - expect))
    return err


@pytest.mark.parametrize("case", [*CASES, "mixed"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_enumerated_committed_distribution_is_p(case: str, n: int) -> None:
    for m in sorted({1, 2, n + 1}):
        p, q = _mixed(m) if case == "mixed" else _positions(case, m)
        dist = enumerate_committed(p, q, n, m)
        assert sum(dist.values()) == pytest.approx(1.0, abs=1e-12)
        assert _max_error(p, dist, m) < 1e-12, (case, n, m)


@pytest.mark.parametrize("n", [1, 3])
def test_wrong_variants_fail_the_exact_check(n: int) -> None:
    """The check can fail: accepting every draft, or resampling from p instead of the residual."""
    p, q = _mixed(n + 1)
    always = enumerate_committed(p, q, n, n + 1, accept=lambda pp, qq: torch.ones_like(pp))
    assert _max_error(p, always, n + 1) > 1e-2
    from_p = enumerate_committed(p, q, n, n + 1, residual=lambda pp, qq: pp)
    assert _max_error(p, from_p, n + 1) > 1e-3


def test_acceptance_probability_edges() -> None:
    p = torch.tensor([0.2, 0.0, 0.0, 0.5, 0.1])
    q = torch.tensor([0.0, 0.3, 0.0, 0.5, 0.4])
    a = acceptance_probability(p, q)
    assert a.dtype == torch.float64
    # q=0<p: limit of min(1, p/q) -> 1; p=0: never; p=q=0: never; p=q: 1; p<q: p/q.
    assert a.tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0, 0.25])


def test_residual_falls_back_to_p_when_p_equals_q() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5, 0.0], [0.4, 0.1, 0.5]], dtype=torch.float64)
    r = residual_distribution(p, q)
    assert torch.equal(r[0], p[0])
    assert r[1].tolist() == pytest.approx([0.0, 1.0, 0.0])
    assert torch.isfinite(r).all()


def _draws(accept: list[list[float]], resample: list[list[float]]) -> AcceptDraws:
    return AcceptDraws(torch.tensor(accept, dtype=torch.float64),
                       torch.tensor(resample, dtype=torch.float64))  # fmt: skip


def test_batched_branches_with_fixed_uniforms() -> None:
    """Rows of draft length 0..3 in one batch, each branch forced by its uniforms."""
    p_col = _d(0.1, 0.2, 0.3, 0.4, 0.0).float()
    q_col = _d(0.4, 0.3, 0.2, 0.1, 0.0).float()
    p = p_col.expand(4, 4, V).clone()
    q = q_col.expand(4, 3, V).clone()
    tokens = torch.tensor([[7, 99, 99, 99],   # no drafts (padding is out of vocabulary)
                           [7, 0, 3, 99],     # d=0: a=0.25, u=0.3 -> reject at column 0
                           [7, 2, 3, 1],      # all accepted (u below a): bonus from p
                           [7, 3, 0, 2]])  # fmt: skip  # d=3 (a=1) then d=0 rejected
    lens = torch.tensor([0, 2, 3, 3])
    draws = _draws([[0.5] * 3, [0.3, 0.0, 0.0], [0.0, 0.0, 0.0], [0.99, 0.9, 0.0]],
                   [[0.05] * 4, [0.0, 0, 0, 0], [0.0, 0, 0, 0.99], [0, 0.0, 0, 0]])  # fmt: skip
    res = speculative_accept(tokens, q, p, lens, draws)
    assert res.accept_lens.tolist() == [1, 1, 4, 2]
    assert res.bonus.tolist() == [True, False, True, False]
    # u=0.05 of p (cdf .1): token 0. Residual max(0,p-q) = [0,0,.1,.3,0]: u=0 -> 2.
    # u=0.99 of p: token 3 (never 4, which has p=0).
    assert [res.row_tokens(i) for i in range(4)] == [[0], [2], [2, 3, 1, 3], [3, 2]]
    assert res.committed.dtype == torch.int64 and res.committed[0, 1:].tolist() == [0, 0, 0]


def test_zero_width_of_drafts_and_shape_checks() -> None:
    p = _d(1, 2, 3, 4, 0).float().view(1, 1, V)
    res = speculative_accept(torch.tensor([[3]]), torch.empty(1, 0, V), p, torch.tensor([0]),
                             _draws([[]], [[0.95]]))  # fmt: skip
    assert res.row_tokens(0) == [3] and res.bonus.tolist() == [True]
    with pytest.raises(ValueError):
        speculative_accept(torch.tensor([[3, 1]]), torch.empty(1, 1, V), p, torch.tensor([1]),
                           _draws([[0.5]], [[0.5, 0.5]]))  # fmt: skip
    with pytest.raises(ValueError):
        speculative_accept(torch.tensor([[3, 1]]), torch.ones(1, 1, V) / V, p.expand(1, 2, V),
                           torch.tensor([2]), _draws([[0.5]], [[0.5, 0.5]]))  # fmt: skip


def test_never_commits_a_token_p_forbids() -> None:
    """q puts all its mass where p is 0 (and q(d) = 0 passed for a draft): only p's support."""
    p = _d(0, 0, 1, 1, 0).float().expand(64, 3, V).clone()
    q = _d(1, 1, 0, 0, 1).float().expand(64, 2, V).clone()
    tokens = torch.tensor([[0, 4, 2]] * 64)  # d=2 has q(d)=0 < p(d): accepted if reached
    gen = torch.Generator().manual_seed(1)
    draws = AcceptDraws(torch.rand(64, 2, generator=gen, dtype=torch.float64),
                        torch.rand(64, 3, generator=gen, dtype=torch.float64))  # fmt: skip
    res = speculative_accept(tokens, q, p, torch.full((64,), 2), draws)
    assert res.accept_lens.tolist() == [1] * 64  # d=4 has p=0: always rejected
    assert set(res.committed[:, 0].tolist()) == {2, 3}
