"""A verify's inputs over SGLang's batch (``srt/decode/batch_inputs.py``): full width, and
ragged where rows draft less than the width (only their 1 + drafts columns go in)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_vericache.srt.decode.batch_inputs import (
    live_index,
    set_verify_inputs,
    spread_rows,
)


def _batch_and_table():
    table = torch.arange(3 * 50, dtype=torch.int32).view(3, 50) + 1000  # slot = 1000 + 50r + p
    return SimpleNamespace(req_pool_indices=torch.tensor([2, 0])), table


def test_a_full_width_verify_takes_every_column() -> None:
    batch, table = _batch_and_table()
    rows = torch.tensor([[7, 8, 9], [4, 5, 6]])
    assert live_index([3, 3], 3, "cpu") is None
    set_verify_inputs(batch, table, rows, torch.tensor([10, 20]))
    assert batch.input_ids.tolist() == [7, 8, 9, 4, 5, 6]
    assert batch.spec_info.positions.tolist() == [10, 11, 12, 20, 21, 22]
    assert batch.out_cache_loc.tolist() == [1110, 1111, 1112, 1020, 1021, 1022]
    assert batch.spec_info.draft_token_num == 3 and batch.seq_lens_cpu.tolist() == [10, 20]


def test_a_ragged_verify_takes_each_rows_live_columns_and_spreads_back() -> None:
    batch, table = _batch_and_table()
    rows = torch.tensor([[7, 8, 9], [4, 4, 4]])  # row 1 has no drafts: padded with its token
    kept = live_index([3, 1], 3, "cpu")
    assert kept.tolist() == [0, 1, 2, 3]
    set_verify_inputs(batch, table, rows, torch.tensor([10, 20]), kept)
    assert batch.input_ids.tolist() == [7, 8, 9, 4]
    assert batch.spec_info.positions.tolist() == [10, 11, 12, 20]
    assert batch.out_cache_loc.tolist() == [1110, 1111, 1112, 1020]
    assert batch.spec_info.draft_token_num == 3  # the width every reader's layout keeps
    logits = torch.arange(4 * 2, dtype=torch.float32).view(4, 2) + 1
    spread = spread_rows(logits, live_index([1, 3], 3, "cpu"), 6)
    assert spread.tolist() == [[1, 2], [0, 0], [0, 0], [3, 4], [5, 6], [7, 8]]
