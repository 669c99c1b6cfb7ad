"""placement.py: full KV stays in the pool until admission or decoding is short of room."""

from __future__ import annotations

import pytest

from sglang_vericache.placement import ResidentRow, low_water, rows_to_offload, shortfall
from sglang_vericache.srt.kv.admission import admission_deficit


def test_no_pressure_keeps_everything_resident() -> None:
    assert shortfall(free_slots=10_000, deficit=0, low_water=64) == 0
    assert rows_to_offload([ResidentRow(3, 5000)], need=0) == []


def test_admission_deficit_and_decode_low_water_both_count() -> None:
    assert shortfall(free_slots=10_000, deficit=700, low_water=64) == 700
    assert shortfall(free_slots=40, deficit=0, low_water=64) == 24
    assert shortfall(free_slots=40, deficit=30, low_water=64) == 30


def test_largest_rows_go_first_until_the_need_is_covered() -> None:
    rows = [ResidentRow(1, 300), ResidentRow(2, 5000), ResidentRow(3, 1200), ResidentRow(4, 0)]
    assert rows_to_offload(rows, need=4000) == [2]
    assert rows_to_offload(rows, need=5500) == [2, 3]
    assert rows_to_offload(rows, need=10**6) == [2, 3, 1]  # all that can move; row 4 cannot


def test_low_water_is_one_step_of_every_row_twice() -> None:
    assert low_water([5, 5, 1]) == 22


def test_deficit_is_what_sglang_asked_minus_what_was_left() -> None:
    assert admission_deficit(needed=4096 + 900, remaining=3000.5) == 1996
    assert admission_deficit(needed=10, remaining=50) == 1  # failed anyway: ask for something


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        shortfall(-1, 0, 0)
