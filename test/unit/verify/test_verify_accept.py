from __future__ import annotations

import random

import pytest
import torch
from sglang_vericache.verify.accept import greedy_accept, stop_at_first_stop_token, stop_at_last_draft


def _reference_accept(row: list[int], pred: list[int], n: int) -> int:
    """Accept length of one row, written the obvious way."""
    k = 0
    while k < n and row[k + 1] == pred[k]:
        k += 1
    return k + 1


def _random_batch(rng: random.Random, bs: int, width: int, vocab: int):
    """Drafts that agree with the verifier for a random number of tokens."""
    pred = [[rng.randrange(vocab) for _ in range(width)] for _ in range(bs)]
    rows, lens = [], []
    for i in range(bs):
        n = rng.randint(0, width - 1)
        agree = rng.randint(0, n)
        row = [rng.randrange(vocab)]
        for j in range(width - 1):
            if j < agree:
                row.append(pred[i][j])
            else:
                row.append(rng.randrange(vocab))
        rows.append(row)
        lens.append(n)
    return rows, pred, lens


@pytest.mark.parametrize("seed", range(40))
def test_accept_matches_reference_and_properties(seed: int) -> None:
    rng = random.Random(seed)
    bs, width, vocab = rng.randint(1, 9), rng.randint(1, 10), rng.choice([2, 3, 50])
    rows, pred, lens = _random_batch(rng, bs, width, vocab)
    res = greedy_accept(torch.tensor(rows), torch.tensor(pred),
                        torch.tensor(lens, dtype=torch.int32))
    assert res.accept_lens.dtype == torch.int32 and res.accept_lens.shape == (bs,)
    for i in range(bs):
        n_acc = int(res.accept_lens[i])
        assert 1 <= n_acc <= lens[i] + 1
        assert n_acc == _reference_accept(rows[i], pred[i], lens[i])
        # Committed tokens are exactly the verifier's predictions.
        assert res.row_tokens(i) == pred[i][:n_acc]
        # The accepted drafts equal the committed tokens before the last.
        assert rows[i][1:n_acc] == pred[i][: n_acc - 1]
        if n_acc <= lens[i]:  # first mismatch handled: the next draft was wrong
            assert rows[i][n_acc] != pred[i][n_acc - 1]
            assert not bool(res.bonus[i])
        else:
            assert bool(res.bonus[i])
        assert int(res.accepted_drafts[i]) == n_acc - 1
    mask = res.committed_mask()
    assert mask.sum(dim=1).tolist() == res.accept_lens.tolist()


@pytest.mark.parametrize("seed", range(10))
def test_draft_equal_to_predictions_is_fully_accepted_plus_bonus(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    bs, width = 4, 7
    pred = torch.randint(0, 1000, (bs, width), generator=gen)
    rows = torch.cat([torch.randint(0, 1000, (bs, 1), generator=gen), pred[:, :-1]], dim=1)
    res = greedy_accept(rows, pred)
    assert res.accept_lens.tolist() == [width] * bs
    assert res.bonus.all()
    assert torch.equal(res.committed, pred)


def test_padding_after_draft_lens_is_never_read() -> None:
    pred = torch.tensor([[5, 6, 7, 8]])
    lens = torch.tensor([1])
    a = greedy_accept(torch.tensor([[1, 5, 6, 7]]), pred, lens)
    b = greedy_accept(torch.tensor([[1, 5, 0, 0]]), pred, lens)
    assert a.accept_lens.tolist() == b.accept_lens.tolist() == [2]
    assert a.bonus.tolist() == [True]


def test_no_drafts_commits_one_token() -> None:
    res = greedy_accept(torch.tensor([[3], [4]]), torch.tensor([[9], [8]]))
    assert res.accept_lens.tolist() == [1, 1]
    assert res.row_tokens(1) == [8]
    res = greedy_accept(torch.tensor([[3, 9]]), torch.tensor([[9, 2]]), torch.tensor([0]))
    assert res.accept_lens.tolist() == [1] and res.bonus.tolist() == [True]


def test_first_token_rejected() -> None:
    res = greedy_accept(torch.tensor([[1, 2, 3]]), torch.tensor([[7, 3, 4]]))
    assert res.accept_lens.tolist() == [1]
    assert res.row_tokens(0) == [7]  # the correction
    assert res.bonus.tolist() == [False]


def test_mixed_integer_dtypes() -> None:
    rows = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    pred = torch.tensor([[2, 3, 4]], dtype=torch.int64)
    res = greedy_accept(rows, pred, torch.tensor([2], dtype=torch.int64))
    assert res.accept_lens.tolist() == [3]
    assert res.committed.dtype == torch.int64


def test_invalid_inputs_raise() -> None:
    with pytest.raises(ValueError):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError):
        greedy_accept(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError):
        greedy_accept(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError):
        greedy_accept(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long),
                      torch.tensor([3]))
    with pytest.raises(ValueError):
        greedy_accept(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long),
                      torch.tensor([0, 1]))


def test_stop_at_last_draft_drops_only_a_bonus_after_an_accepted_stop() -> None:
    tokens = torch.tensor([[0, 5, 6], [0, 5, 6], [0, 5, 6], [0, 9, 9]])
    predict = torch.tensor([[5, 6, 7], [5, 8, 7], [5, 6, 7], [4, 4, 4]])
    res = greedy_accept(tokens, predict, torch.tensor([2, 2, 2, 0], dtype=torch.int32))
    stops = torch.tensor([True, True, False, True])
    got = stop_at_last_draft(res, stops)
    # row 0 ends on its accepted stop 6; row 1's stop was rejected (correction 8); row 2 does not
    # stop; row 3 has no draft to stop at (its one token stays)
    assert got.accept_lens.tolist() == [2, 2, 3, 1]
    assert [got.row_tokens(i) for i in range(4)] == [[5, 6], [5, 8], [5, 6, 7], [4]]
    assert got.bonus.tolist() == [False, False, True, True]
    assert res.accept_lens.tolist() == [3, 2, 3, 1], "inputs are not modified"
    with pytest.raises(ValueError, match="stops"):
        stop_at_last_draft(res, stops[:2])


def test_a_committed_stop_token_ends_its_row() -> None:
    """The fuzzer's case (seed 2, 405): a verify committed [30, EOS 2, 198]; plain decoding ends
    at the EOS, so nothing after it is committed (198 completed the stop string "\\n", which
    SGLang's multi-token finish check matched first, keeping the EOS and 198)."""
    eos = frozenset({2})
    rows = torch.tensor([[7, 30, 2, 198], [7, 30, 2, 198], [7, 2, 5, 6], [7, 8, 9, 10]])
    predict = torch.tensor([[30, 2, 198, 11], [30, 2, 198, 11], [2, 5, 6, 12], [8, 9, 10, 13]])
    result = greedy_accept(rows, predict)
    assert result.accept_lens.tolist() == [4, 4, 4, 4] and result.bonus.all()
    cut = stop_at_first_stop_token(result, [eos, frozenset(), eos, eos])
    assert cut.accept_lens.tolist() == [2, 4, 1, 4]  # the EOS kept; ignore_eos: all; none: all
    assert cut.bonus.tolist() == [False, True, False, True]
    assert cut.row_tokens(0) == [30, 2] and cut.row_tokens(2) == [2]
    assert stop_at_first_stop_token(result, [frozenset()] * 4) is result


def test_a_stop_token_after_the_rejection_is_not_read() -> None:
    rows = torch.tensor([[7, 30, 99, 2]])
    predict = torch.tensor([[30, 4, 2, 2]])  # draft 99 rejected: commits [30, 4]
    result = greedy_accept(rows, predict)
    cut = stop_at_first_stop_token(result, [frozenset({2})])
    assert cut.accept_lens.tolist() == [2] and cut.row_tokens(0) == [30, 4]
