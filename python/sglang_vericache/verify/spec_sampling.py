"""Speculative sampling: chain acceptance that is exact in distribution (pure torch, no sglang).

The sampled counterpart of ``verify/accept.py``'s greedy acceptance. A verify row is
``[last committed token, d_1 .. d_n, padding]`` of width ``W``. Draft ``d_{j+1}`` was sampled
from the draft (compressed-KV) distribution ``q_j`` at column ``j``; the verify forward gives the
target (full-KV) distribution ``p_j`` at every column ``j = 0 .. W-1`` (both after the request's
temperature / top-k / top-p / min-p processing, ``verify/sampling_probs.py``). Column by column:

    accept d_{j+1} with probability  a = min(1, p_j(d_{j+1}) / q_j(d_{j+1}))
    at the first rejection (column k) commit a token from  normalize(max(0, p_k - q_k))
    if every real draft was accepted, commit a bonus token from  p_n

Each committed token is then distributed exactly as a sample from ``p`` given the committed
prefix (Leviathan et al. 2023; Chen et al. 2023), so the committed sequence is distributed as
plain sampling from p, whatever q is. Edge cases (where exact arithmetic and floats part ways):

- ``q(d) = 0`` never happens for a ``d`` sampled from ``q`` (an underflow or a caller passing a
  different q can cause it). We take the limit of ``min(1, p/q)`` as ``q -> 0+``: accept iff
  ``p(d) > 0``. The event has probability zero, so any rule is exact; this one never commits a
  token that p forbids (grammar-masked, outside top-k/top-p).
- ``p(d) = 0``: always rejected (``a = 0``), and the residual puts no mass on d.
- ``max(0, p - q)`` all zero: p == q in floats, where rejection has probability zero; we sample
  from p instead (so a rejection forced by rounding still commits a token p allows).
  The residual's support is always inside p's support (``p - q > 0`` needs ``p > 0``).

:func:`acceptance_probability` and :func:`residual_distribution` carry all of the math; the
batched :func:`speculative_accept` and the unit tests' exact enumeration both use them.

One verify step in the worker (``sampling = RowSampling.from_sampling_info(info)``, with the
logits already through SGLang's ``_preprocess_logits``; ``rnd = Randomness(gen, RowSeeds(...))``
with each row's ``sampling_seed`` and the position of its last committed token)::

    for j in range(W - 1):                        # drafting on the compressed KV
        q[:, j] = process_logits(draft_logits, sampling)
        rows[:, j + 1] = sample_drafts(q[:, j], rnd, j)
    p = process_logits(verify_logits, sampling.repeat(W)).view(bs, W, V)
    res = speculative_accept(rows, q, p, draft_lens, draw_accept_uniforms(rnd, bs, W, device))

Seeded rows are reproducible for the same draft lengths: a different draft length changes which
draws decide a position (an adaptive draft-length policy driven by timings is not reproducible).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_vericache.verify.accept import AcceptResult
from sglang_vericache.verify.rng import Draw, Randomness

__all__ = [
    "AcceptDraws",
    "acceptance_probability",
    "draw_accept_uniforms",
    "residual_distribution",
    "sample_drafts",
    "sample_from",
    "speculative_accept",
]


def acceptance_probability(p_at_draft: torch.Tensor, q_at_draft: torch.Tensor) -> torch.Tensor:
    """Probability of accepting a draft token ``d``: ``min(1, p(d) / q(d))``.

    p_at_draft, q_at_draft: same shape, any float dtype: p(d) and q(d) for each draft.
    Returns that shape in float64: 0 where ``p(d) = 0``; 1 where ``p(d) >= q(d)`` (including
    ``q(d) = 0 < p(d)``, the limit as q -> 0+); ``p(d) / q(d)`` otherwise.
    """
    p, q = p_at_draft.double(), q_at_draft.double()
    # Where p < q, q > p >= 0 so the division is safe; elsewhere the quotient is discarded.
    ratio = p / torch.where(p < q, q, torch.ones_like(q))
    return torch.where(p <= 0, torch.zeros_like(p), torch.where(p >= q, torch.ones_like(p), ratio))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a rejected draft's replacement is sampled from: ``normalize(max(0, p - q))``.

    p, q: [..., V] float probability vectors (same shape).
    Returns [..., V] float64 summing to 1 along V; rows whose residual mass is exactly 0
    (p == q in floats) get ``normalize(p)`` instead.
    """
    p64, q64 = p.double(), q.double()
    res = (p64 - q64).clamp_min(0.0)
    mass = res.sum(dim=-1, keepdim=True)
    fallback = p64 / p64.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, res / torch.where(mass > 0, mass, torch.ones_like(mass)), fallback)


def sample_from(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row from non-negative (unnormalised) weights.

    weights: [rows, V] float, each row with positive total. uniforms: [rows] float in [0, 1).
    Returns [rows] int64: the first index whose cumulative weight exceeds ``u * total``; a
    zero-weight index is never returned (its cumulative weight equals its predecessor's).
    """
    cdf = weights.double().cumsum(dim=-1)
    target = uniforms.double().to(weights.device).unsqueeze(1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_max(weights.shape[-1] - 1)  # u * total rounds up to total: last index


def sample_drafts(q_probs: torch.Tensor, randomness: Randomness, column: int) -> torch.Tensor:
    """Sample the draft token that follows verify column ``column``, one per row.

    q_probs: [rows, V] float, the draft distribution at that column (``process_logits`` of the
        compressed-KV logits). Keep it: ``speculative_accept`` needs the same vector.
    column: 0 for the first draft (it follows the last committed token), 1 for the next, ...
    Returns [rows] int64. Seeded rows draw ``Draw.DRAFT`` at counter ``position + column``.
    """
    u = randomness.uniforms(Draw.DRAFT, q_probs.shape[0], column, 1, q_probs.device)
    return sample_from(q_probs, u[:, 0])


@dataclass(frozen=True)
class AcceptDraws:
    """The uniforms one :func:`speculative_accept` call consumes.

    accept: [rows, W-1] float64 in [0, 1): coin for the draft after column j is ``accept[:, j]``.
    resample: [rows, W] float64 in [0, 1): the correction/bonus token at column k uses
        ``resample[:, k]``.
    """

    accept: torch.Tensor
    resample: torch.Tensor


def draw_accept_uniforms(randomness: Randomness, rows: int, width: int,
                         device: torch.device | str) -> AcceptDraws:  # fmt: skip
    """Fresh :class:`AcceptDraws` for a verify of ``rows`` rows of width ``width``."""
    return AcceptDraws(
        accept=randomness.uniforms(Draw.ACCEPT, rows, 0, width - 1, device),
        resample=randomness.uniforms(Draw.RESAMPLE, rows, 0, width, device),
    )


def _check(verify_tokens, q_probs, p_probs, draft_lens, draws) -> tuple[int, int]:
    """Shapes and ranges of :func:`speculative_accept`'s inputs; returns (rows, W)."""
    if verify_tokens.dim() != 2 or verify_tokens.dtype.is_floating_point:
        raise ValueError(
            f"verify_tokens must be [rows, W] integer, got {tuple(verify_tokens.shape)}"
        )
    rows, width = verify_tokens.shape
    if width < 1:
        raise ValueError("verify width W must be >= 1 (the last committed token)")
    if p_probs.dim() != 3 or p_probs.shape[:2] != (rows, width):
        raise ValueError(f"p_probs must be [{rows}, {width}, V], got {tuple(p_probs.shape)}")
    vocab = p_probs.shape[2]
    if q_probs.shape != (rows, width - 1, vocab):
        raise ValueError(
            f"q_probs must be [{rows}, {width - 1}, {vocab}], got {tuple(q_probs.shape)}"
        )
    if draft_lens.shape != (rows,) or draft_lens.dtype.is_floating_point:
        raise ValueError(f"draft_lens must be [{rows}] integer, got {tuple(draft_lens.shape)}")
    if rows and (int(draft_lens.min()) < 0 or int(draft_lens.max()) > width - 1):
        raise ValueError(f"draft_lens must lie in [0, {width - 1}]")
    if draws.accept.shape != (rows, width - 1) or draws.resample.shape != (rows, width):
        raise ValueError(f"draws must be [{rows}, {width - 1}] and [{rows}, {width}]")
    return rows, width


def speculative_accept(
    verify_tokens: torch.Tensor,
    q_probs: torch.Tensor,
    p_probs: torch.Tensor,
    draft_lens: torch.Tensor,
    draws: AcceptDraws,
) -> AcceptResult:
    """Accept each row's drafts with probability min(1, p/q) and commit one more token.

    verify_tokens: [rows, W] integer: column 0 the last committed token, columns
        ``1 .. draft_lens[i]`` the drafts (``d_{j+1}`` sampled from ``q_probs[i, j]``); later
        columns are never read as drafts.
    q_probs: [rows, W-1, V] float, draft distributions; only ``j < draft_lens[i]`` is read.
    p_probs: [rows, W, V] float, target distributions; only ``j <= draft_lens[i]`` is read.
    draft_lens: [rows] integer in [0, W-1]; 0: no drafts, the row commits one sample of p_0.
    draws: the uniforms (:func:`draw_accept_uniforms`, or fixed ones in tests).

    Returns an :class:`AcceptResult` (the structure ``greedy_accept`` returns): ``accept_lens``
    [rows] int32 in [1, draft_lens + 1]; ``committed`` [rows, W] int64 whose first
    ``accept_lens[i]`` entries are the accepted drafts then the correction/bonus token (entries
    after them are rejected drafts, or 0 past the row's drafts: never emit them); ``bonus``
    [rows] bool, every real draft was accepted.
    """
    rows, width = _check(verify_tokens, q_probs, p_probs, draft_lens, draws)
    device = p_probs.device
    lens = draft_lens.to(device=device, dtype=torch.int64)
    drafts = verify_tokens[:, 1:].to(device=device, dtype=torch.int64)  # [rows, W-1]
    real = torch.arange(width - 1, device=device).unsqueeze(0) < lens.unsqueeze(1)
    # Padding may hold any value (even out of vocabulary): read p, q at a safe index there.
    safe = torch.where(real, drafts, torch.zeros_like(drafts)).unsqueeze(-1)
    p_d = p_probs[:, : width - 1].gather(2, safe).squeeze(-1)
    q_d = q_probs.gather(2, safe).squeeze(-1)
    accepted = (draws.accept.to(device) < acceptance_probability(p_d, q_d)) & real
    k = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # leading accepted drafts, [rows]

    # One more token at column k: residual on rejection, p_k itself when all drafts passed.
    ar = torch.arange(rows, device=device)
    p_k = p_probs[ar, k].double()  # [rows, V]
    rejected = k < lens
    if width > 1:
        # A row that was not rejected may have k = W-1 (no q there): any valid column will do,
        # its residual is discarded by the where.
        q_k = q_probs[ar, k.clamp_max(width - 2)]
        target = torch.where(rejected.unsqueeze(1), residual_distribution(p_k, q_k), p_k)
    else:
        target = p_k
    u = draws.resample.to(device).gather(1, k.unsqueeze(1)).squeeze(1)
    extra = sample_from(target, u)

    committed = torch.zeros(rows, width, dtype=torch.int64, device=device)
    committed[:, : width - 1] = torch.where(real, drafts, torch.zeros_like(drafts))
    committed[ar, k] = extra
    return AcceptResult(accept_lens=(k + 1).to(torch.int32), committed=committed, bonus=~rejected)
