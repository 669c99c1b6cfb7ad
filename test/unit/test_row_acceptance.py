"""A mixed verify step's acceptance (``verify/row_acceptance.py``): greedy rows exactly as
``greedy_accept``, sampled rows by speculative sampling, merged into one batch result.

Synthetic logits, no model and no server: the per-position exactness of speculative sampling is
enumerated in ``test/unit/verify/test_spec_sampling.py``; here the wiring is checked (which rows,
which columns, which q, which randomness).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_vericache.verify.row_acceptance import SampledDrafts, accept_step, merge_accept, row_seeds
from sglang_vericache.verify import TOP_K_ALL, greedy_accept, process_logits
from sglang_vericache.verify.sampling_probs import RowSampling

V = 6


def sampling_info(temps: list[float], top_ps: list[float] | None = None) -> SimpleNamespace:
    """SGLang's ``SamplingBatchInfo`` fields that ``RowSampling.from_sampling_info`` reads; a
    temperature of 0 is a greedy row (SGLang stores it as temperature 1, top_k 1)."""
    greedy = [t == 0 for t in temps]
    top_ks = torch.tensor([1 if g else TOP_K_ALL for g in greedy], dtype=torch.int32)
    top_ps = torch.tensor(top_ps or [1.0] * len(temps))
    return SimpleNamespace(
        temperatures=torch.tensor([[1.0 if g else t] for g, t in zip(greedy, temps)]),
        top_ps=top_ps, top_ks=top_ks, min_ps=torch.zeros(len(temps)),
        is_all_greedy=all(greedy), need_top_k_sampling=any(greedy),
        need_top_p_sampling=bool((top_ps != 1.0).any()), need_min_p_sampling=False,
        max_top_k=None, sampling_seed=None,
    )  # fmt: skip


def reqs(seeds: list[int | None]) -> list[SimpleNamespace]:
    return [SimpleNamespace(sampling_params=SimpleNamespace(sampling_seed=s)) for s in seeds]


def test_merge_replaces_only_the_sampled_rows() -> None:
    tokens = torch.tensor([[1, 2, 3], [4, 5, 0], [1, 1, 1]])
    greedy = greedy_accept(tokens, torch.tensor([[2, 3, 4], [5, 9, 9], [7, 7, 7]]),
                           torch.tensor([2, 2, 0], dtype=torch.int32))  # fmt: skip
    spec = greedy_accept(tokens[1:2], torch.tensor([[5, 0, 8]]), torch.tensor([2], dtype=torch.int32))
    merged = merge_accept(greedy, spec, torch.tensor([1]))
    assert merged.accept_lens.tolist() == [3, 3, 1]
    assert merged.row_tokens(0) == [2, 3, 4] and merged.row_tokens(1) == [5, 0, 8]
    assert merged.row_tokens(2) == [7] and merged.bonus.tolist() == [True, True, True]
    assert greedy.committed[1].tolist() == [5, 9, 9], "inputs are not modified"


def test_without_sampled_rows_the_step_is_greedy_acceptance() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (4, 3), generator=g)
    logits = torch.randn(4 * 3, V, generator=g)
    lens = torch.tensor([2, 1, 0, 2], dtype=torch.int32)
    got = accept_step(tokens, logits, lens, None)
    want = greedy_accept(tokens, logits.argmax(-1).view(4, 3), lens)
    assert torch.equal(got.accept_lens, want.accept_lens)
    assert torch.equal(got.committed, want.committed)


def _step(info, requests, rows, width, draft_logits, verify_logits, seed=0):
    """Draft ``width - 1`` columns from ``draft_logits`` [W-1, bs, V], then accept."""
    bs = len(requests)
    positions = torch.arange(bs, dtype=torch.int64) + 10
    gen = torch.Generator().manual_seed(seed)
    sampled = SampledDrafts.start(info, requests, rows, positions, width, gen, torch.device("cpu"))
    tokens = torch.zeros(bs, width, dtype=torch.int64)
    for j in range(width - 1):
        tokens[:, j + 1] = draft_logits[j].argmax(-1)
        if sampled is not None:
            tokens[sampled.rows, j + 1] = sampled.draft(j, draft_logits[j])
    lens = torch.full((bs,), width - 1, dtype=torch.int32)
    return sampled, tokens, accept_step(tokens, verify_logits, lens, sampled)


def test_sampled_rows_keep_q_and_greedy_rows_stay_exact() -> None:
    g = torch.Generator().manual_seed(1)
    width, temps = 3, [0.0, 0.7, 0.0, 1.0]
    draft = torch.randn(width - 1, 4, V, generator=g)
    verify = torch.randn(4 * width, V, generator=g)
    info = sampling_info(temps, top_ps=[1.0, 0.9, 1.0, 1.0])
    sampled, tokens, got = _step(info, reqs([None] * 4), [1, 3], width, draft, verify)
    assert sampled is not None and sampled.q is not None
    want_sampling = RowSampling.from_sampling_info(info).select(torch.tensor([1, 3]))
    for j in range(width - 1):
        assert torch.allclose(sampled.q[:, j], process_logits(draft[j][[1, 3]], want_sampling))
        # a draft is never outside its q's support (top-p cut it away)
        assert (sampled.q[torch.arange(2), j, tokens[[1, 3], j + 1]] > 0).all()
    greedy = greedy_accept(tokens, verify.argmax(-1).view(4, width),
                           torch.full((4,), width - 1, dtype=torch.int32))  # fmt: skip
    for i in (0, 2):
        n = int(greedy.accept_lens[i])
        assert got.row_tokens(i) == greedy.row_tokens(i) and int(got.accept_lens[i]) == n
    assert ((got.accept_lens >= 1) & (got.accept_lens <= width)).all()


def test_sampled_rows_commit_tokens_distributed_as_p() -> None:
    """Many identical sampled rows in one batch: the first committed token's frequencies match
    p_0 = softmax(verify logits / T) (the rows' q differ from p, so drafts are often rejected)."""
    rows, width, temp = 20000, 3, 0.8
    g = torch.Generator().manual_seed(2)
    draft_row, verify_row = torch.randn(width - 1, 1, V, generator=g), torch.randn(width, V, generator=g)
    draft = draft_row.expand(width - 1, rows, V).contiguous()
    verify = verify_row.repeat(rows, 1)
    _, _, got = _step(sampling_info([temp] * rows), reqs([None] * rows), list(range(rows)), width,
                      draft, verify)  # fmt: skip
    first = torch.bincount(got.committed[:, 0], minlength=V).double() / rows
    p0 = torch.softmax(verify_row[0].double() / temp, -1)
    # 5 standard errors of a frequency (at most 0.5 / sqrt(rows) = 0.0035 each)
    assert torch.allclose(first, p0, atol=5 * 0.5 / rows**0.5), (first, p0)
    assert got.accept_lens.double().mean() > 1.0, "some drafts must be accepted"


def test_seeded_rows_repeat_whatever_the_generator() -> None:
    g = torch.Generator().manual_seed(3)
    width = 4
    draft = torch.randn(width - 1, 3, V, generator=g)
    verify = torch.randn(3 * width, V, generator=g)
    info, requests = sampling_info([1.0, 1.0, 1.0]), reqs([7, 7, None])
    runs = [_step(info, requests, [0, 1, 2], width, draft, verify, seed=s) for s in range(6)]
    for _, tokens, got in runs:
        # rows 0 and 1 share a seed but not a position: each repeats itself across runs
        assert torch.equal(tokens[:2], runs[0][1][:2])
        assert got.row_tokens(0) == runs[0][2].row_tokens(0)
        assert got.row_tokens(1) == runs[0][2].row_tokens(1)
    unseeded = {tuple(tokens[2].tolist()) for _, tokens, _ in runs}
    assert len(unseeded) > 1, "the unseeded row draws from the generator"


def test_row_seeds_only_when_some_row_is_seeded() -> None:
    positions = torch.tensor([3, 4])
    assert row_seeds(reqs([None, None]), positions) is None
    seeds = row_seeds(reqs([None, -5]), positions)
    assert seeds is not None and seeds.seeded.tolist() == [False, True]
    assert seeds.seeds.tolist() == [0, -5] and seeds.positions.tolist() == [3, 4]


def test_no_sampled_rows_means_no_sampled_state() -> None:
    info = sampling_info([0.0, 0.0])
    gen = torch.Generator()
    assert SampledDrafts.start(info, reqs([None, None]), [], torch.zeros(2), 3, gen,
                               torch.device("cpu")) is None  # fmt: skip


@pytest.mark.parametrize("width", [1, 2])
def test_narrow_verifies(width: int) -> None:
    """Width 1 (no drafts) commits one sample of p_0; width 2 one draft at most."""
    g = torch.Generator().manual_seed(4)
    draft = torch.randn(max(width - 1, 1), 2, V, generator=g)
    verify = torch.randn(2 * width, V, generator=g)
    _, _, got = _step(sampling_info([0.9, 0.9]), reqs([None, None]), [0, 1], width, draft, verify)
    assert ((got.accept_lens >= 1) & (got.accept_lens <= width)).all()
