"""Monte Carlo check of the batched sampler in a worker-like loop, and the seeded draws.

``_generate`` is the worker's step in miniature: draft n tokens with ``sample_drafts``, verify
with ``speculative_accept``, advance each row by its ``accept_lens``, repeat until every row has
m tokens. p_t and q_t depend only on the absolute position t, so the first m committed tokens
must be distributed as the product of the p_t. Fixed seeds make every outcome deterministic;
the chi-square bound (p ~ 1e-6) is loose, and a wrong sampler exceeds it by orders of magnitude.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import pytest
import torch

from sglang_vericache.verify.accept import AcceptResult
from sglang_vericache.verify.rng import Draw, Randomness, RowSeeds, seeded_uniforms
from sglang_vericache.verify.spec_sampling import (
    AcceptDraws,
    draw_accept_uniforms,
    sample_drafts,
    sample_from,
    speculative_accept,
)

V = 5
N = 200_000
# Positions 0..4: a p/q pair of each kind (zeros on either side, one-hot p or q, p == q).
P = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0],
                  [0.3, 0.1, 0.2, 0.25, 0.15], [0.2, 0.2, 0.2, 0.2, 0.2]])  # fmt: skip
Q = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2], [0.1, 0.2, 0.3, 0.2, 0.2],
                  [0.3, 0.1, 0.2, 0.25, 0.15], [1.0, 0.0, 0.0, 0.0, 0.0]])  # fmt: skip
Accept = Callable[..., AcceptResult]


def _accept_every_draft(tokens, q_probs, p_probs, lens, draws: AcceptDraws) -> AcceptResult:
    """A deliberately wrong verifier: keeps every draft, then a bonus from p."""
    rows = tokens.shape[0]
    ar = torch.arange(rows)
    committed = tokens[:, 1:].clone()
    committed = torch.cat([committed, torch.zeros(rows, 1, dtype=committed.dtype)], dim=1)
    u = draws.resample.gather(1, lens.long().view(-1, 1)).squeeze(1)
    committed[ar, lens.long()] = sample_from(p_probs[ar, lens.long()], u)
    return AcceptResult((lens + 1).int(), committed, torch.ones(rows, dtype=torch.bool))


def _generate(n: int, m: int, randomness: Callable[[torch.Tensor, torch.Tensor], Randomness],
              accept: Accept = speculative_accept) -> torch.Tensor:  # fmt: skip
    """[N, m] int64: each row's first m committed tokens, n drafts per verify step."""
    out = torch.full((N, m), -1, dtype=torch.int64)
    pos = torch.zeros(N, dtype=torch.int64)  # tokens committed so far = position of column 0
    width = n + 1
    while True:
        rows = (pos < m).nonzero().squeeze(1)
        if rows.numel() == 0:
            return out
        base = pos[rows]
        cols = (base.unsqueeze(1) + torch.arange(width)).clamp_max(P.shape[0] - 1)
        p_probs, q_probs = P[cols], Q[cols[:, :n]]
        rnd = randomness(rows, base)
        tokens = torch.zeros(rows.numel(), width, dtype=torch.int64)
        for j in range(n):
            tokens[:, j + 1] = sample_drafts(q_probs[:, j], rnd, j)
        lens = torch.full((rows.numel(),), n, dtype=torch.int32)
        res = accept(
            tokens, q_probs, p_probs, lens, draw_accept_uniforms(rnd, rows.numel(), width, "cpu")
        )
        for j in range(width):
            keep = (j < res.accept_lens) & (base + j < m)
            out[rows[keep], base[keep] + j] = res.committed[keep, j]
        pos[rows] = base + res.accept_lens.long()


def _chi_square(samples: torch.Tensor) -> tuple[float, float, int]:
    """Joint of the columns against prod_t P[t]: (statistic over the cells p allows, bound at
    p ~ 1e-6, number of samples in cells p forbids)."""
    m = samples.shape[1]
    flat = (samples * (V ** torch.arange(m - 1, -1, -1))).sum(1)
    counts = torch.bincount(flat, minlength=V**m).double()
    expect = torch.ones(1, dtype=torch.float64)
    for t in range(m):
        expect = (expect.view(-1, 1) * P[t].double().view(1, -1)).view(-1)
    expect *= samples.shape[0]
    live = expect > 0
    stat = float(((counts[live] - expect[live]) ** 2 / expect[live]).sum())
    df = int(live.sum()) - 1
    z = 4.75  # one-sided normal quantile for 1e-6; Wilson-Hilferty approximation of chi2
    return (
        stat,
        df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3,
        int(counts[~live].sum()),
    )


def _shared(seed: int) -> Callable[[torch.Tensor, torch.Tensor], Randomness]:
    gen = torch.Generator().manual_seed(seed)
    return lambda rows, base: Randomness(gen)


def _half_seeded(seed: int) -> Callable[[torch.Tensor, torch.Tensor], Randomness]:
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.arange(N, dtype=torch.int64) * 7919 - 2**40  # negative seeds included
    seeded = torch.arange(N) % 2 == 0
    return lambda rows, base: Randomness(gen, RowSeeds(seeds[rows], base, seeded[rows]))


@pytest.mark.parametrize(
    ("n", "m", "source"), [(3, 2, _shared), (2, 3, _half_seeded), (4, 4, _shared)]
)
def test_monte_carlo_committed_distribution_is_p(n: int, m: int, source) -> None:
    stat, bound, forbidden = _chi_square(_generate(n, m, source(0)))
    assert forbidden == 0 and stat < bound, (stat, bound, forbidden)


def test_monte_carlo_rejects_accepting_every_draft() -> None:
    """The same check fails a wrong verifier, on the statistic alone (m = 1: q's support lies
    inside p's) and on committing tokens p forbids (m = 2)."""
    stat, bound, forbidden = _chi_square(_generate(3, 1, _shared(0), accept=_accept_every_draft))
    assert forbidden == 0 and stat > 100 * bound, (stat, bound)
    _, _, forbidden = _chi_square(_generate(3, 2, _shared(0), accept=_accept_every_draft))
    assert forbidden > 0


def _murmur3_32(data: bytes) -> int:
    """Reference MurmurHash3_x86_32 (seed 0) in plain python."""
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF
    h = 0
    for (k,) in struct.iter_unpack("<I", data):
        k = rotl((k * 0xCC9E2D51) & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= len(data)
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_seeded_uniforms_are_murmur3_of_seed_counter_draw() -> None:
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789012345])
    counters = torch.tensor([[0, 1, 2**31, 2**32 - 1]] * seeds.numel())
    for draw in Draw:
        got = seeded_uniforms(seeds, counters, draw)
        for i, s in enumerate(seeds.tolist()):
            for j, c in enumerate(counters[i].tolist()):
                key = struct.pack("<IIII", s & 0xFFFFFFFF, (s >> 32) & 0xFFFFFFFF, c, int(draw))
                assert float(got[i, j]) == (_murmur3_32(key) + 0.5) / 2**32


def test_seeded_uniforms_look_uniform_and_streams_differ() -> None:
    seeds = torch.arange(1000, dtype=torch.int64)
    counters = torch.arange(1000, dtype=torch.int64).expand(1000, -1)
    u = {d: seeded_uniforms(seeds, counters, d).flatten() for d in Draw}
    for x in u.values():
        assert 0 < float(x.min()) and float(x.max()) < 1
        assert abs(float(x.mean()) - 0.5) < 2e-3 and abs(float(x.var()) - 1 / 12) < 2e-3
        hist = torch.histc(x.float(), bins=20, min=0, max=1)
        assert float((hist / x.numel() - 0.05).abs().max()) < 2e-3
    corr = torch.corrcoef(torch.stack([u[Draw.DRAFT], u[Draw.ACCEPT], u[Draw.RESAMPLE]]))
    assert float((corr - torch.eye(3)).abs().max()) < 5e-3


def _one_verify(rnd: Randomness, rows: int, n: int = 3) -> AcceptResult:
    p, q = P[:4].expand(rows, 4, V), Q[:3].expand(rows, 3, V)
    tokens = torch.zeros(rows, n + 1, dtype=torch.int64)
    for j in range(n):
        tokens[:, j + 1] = sample_drafts(q[:, j], rnd, j)
    return speculative_accept(
        tokens, q, p, torch.full((rows,), n), draw_accept_uniforms(rnd, rows, n + 1, "cpu")
    )


def test_seeded_rows_reproduce_alone_or_in_any_batch() -> None:
    """A seeded row's result depends on (seed, position) only: not on the batch or generator."""
    seeds = torch.tensor([11, 22, 33, 44, 55, 66])
    positions = torch.tensor([100, 7, 7, 0, 5000, 42])
    everyone = RowSeeds(seeds, positions, torch.ones(6, dtype=torch.bool))
    full = _one_verify(Randomness(torch.Generator().manual_seed(1), everyone), 6)
    again = _one_verify(Randomness(torch.Generator().manual_seed(999), everyone), 6)
    assert torch.equal(full.committed, again.committed) and torch.equal(
        full.accept_lens, again.accept_lens
    )
    for i in (0, 3, 5):
        alone = RowSeeds(seeds[i : i + 1], positions[i : i + 1], torch.ones(1, dtype=torch.bool))
        one = _one_verify(Randomness(torch.Generator().manual_seed(i), alone), 1)
        assert one.row_tokens(0) == full.row_tokens(i)
    # Unseeded rows follow the generator: same generator seed, same output.
    mixed = RowSeeds(seeds, positions, torch.tensor([True, False] * 3))
    a = _one_verify(Randomness(torch.Generator().manual_seed(5), mixed), 6)
    b = _one_verify(Randomness(torch.Generator().manual_seed(5), mixed), 6)
    assert torch.equal(a.committed, b.committed)
    assert [a.row_tokens(i) for i in (0, 2, 4)] == [full.row_tokens(i) for i in (0, 2, 4)]


def test_row_seeds_validate_shapes() -> None:
    with pytest.raises(ValueError):
        RowSeeds(torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                 torch.ones(3, dtype=torch.bool))  # fmt: skip
    with pytest.raises(TypeError):
        RowSeeds(
            torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), torch.ones(3)
        )
    with pytest.raises(ValueError):
        Randomness(torch.Generator(), RowSeeds(torch.zeros(2, dtype=torch.int64),
                   torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.bool))).uniforms(
            Draw.DRAFT, 3, 0, 1, "cpu")  # fmt: skip
