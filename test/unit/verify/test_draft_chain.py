"""verify/draft_chain.py: a step's rows and draft lengths from start to settle (greedy rows,
proposals, stop tokens, ride-along rows). Sampled and grammar rows through the chain are
test_grammar_sampling.py's (exact in distribution)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_vericache.verify.draft_chain import DraftChain

V = 16
INFO = SimpleNamespace(vocab_size=V)


def greedy_chain(bs: int, width: int, drafted: list[int]) -> DraftChain:
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(sampling_seed=None))] * bs
    return DraftChain.start(torch.arange(bs, dtype=torch.int64), width, drafted, reqs=reqs,
                            sampling_info=INFO, sampled_rows=[], grammar_rows=[],
                            positions=torch.zeros(bs, dtype=torch.int64),
                            generator=torch.Generator())  # fmt: skip


def one_hot(tokens: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(tokens), V)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_start_puts_last_tokens_first_and_drafts_only_the_drafted_rows() -> None:
    chain = greedy_chain(3, 4, drafted=[0, 2])
    assert chain.rows[:, 0].tolist() == [0, 1, 2] and chain.width == 4
    assert chain.draft_lens.tolist() == [3, 0, 3] and chain.draft_lens.dtype == torch.int32
    assert chain.sampled is None and chain.grammar is None
    chain.check_integrity()


def test_greedy_drafts_verify_accept_and_a_stop_token_cuts() -> None:
    chain = greedy_chain(2, 3, drafted=[0, 1])
    chain.draft(0, one_hot([5, 7]))
    chain.draft(1, one_hot([6, 8]))
    chain.end_drafts()
    assert chain.rows.tolist() == [[0, 5, 6], [1, 7, 8]]
    # verify: row 0 agrees on both drafts (bonus 9); row 1 rejects its first (correction 4)
    verify = one_hot([5, 6, 9, 4, 0, 0])
    chain.mask_verify(verify)
    accepted = chain.accept(verify)
    assert accepted.accept_lens.tolist() == [3, 1]
    assert accepted.row_tokens(0) == [5, 6, 9] and accepted.row_tokens(1) == [4]
    settled = chain.settle(accepted, [frozenset({6}), frozenset()])
    assert settled.row_tokens(0) == [5, 6] and settled.row_tokens(1) == [4]


def test_a_ride_along_row_commits_its_first_column_only() -> None:
    chain = greedy_chain(2, 3, drafted=[0])
    chain.propose(torch.tensor([[5, 6], [7, 8]]))
    accepted = chain.accept(one_hot([5, 6, 9, 7, 8, 3]))
    assert accepted.accept_lens.tolist() == [3, 1]  # row 1's drafts are never verified


def test_proposals_are_refused_where_rows_need_q_or_a_mask() -> None:
    chain = greedy_chain(1, 2, drafted=[0])
    chain.sampled = SimpleNamespace(width=2)  # a sampled row: its q must come from drafting
    with pytest.raises(ValueError, match="all-greedy"):
        chain.propose(torch.tensor([[3]]))


def test_short_or_absent_lookup_drafts_verify_only_as_far_as_they_go() -> None:
    """A lookup step: row 0's draft is 1 token (padding after it is never accepted, though the
    verify agrees with it), row 1 has none (its verify token only), row 2 has the full width."""
    chain = greedy_chain(3, 3, drafted=[0, 1, 2])
    chain.propose(torch.tensor([[5, 0], [1, 1], [7, 8]]),
                  torch.tensor([1, 0, 2], dtype=torch.int32))  # fmt: skip
    assert chain.draft_lens.tolist() == [1, 0, 2]
    chain.check_integrity()
    verify = one_hot([5, 0, 9, 4, 1, 1, 7, 8, 3])
    accepted = chain.accept(verify)
    assert accepted.accept_lens.tolist() == [2, 1, 3]
    assert accepted.row_tokens(0) == [5, 0] and accepted.row_tokens(1) == [4]
    assert accepted.row_tokens(2) == [7, 8, 3]
