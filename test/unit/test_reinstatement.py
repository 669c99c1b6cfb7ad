"""reinstatement.py: which demoted rows get their compressed KV rebuilt, and when."""

from __future__ import annotations

from sglang_vericache.reinstatement import (
    COOLDOWN_TOKENS,
    ROOM_FACTOR,
    DemotedRow,
    rows_to_reinstate,
)


def _row(index: int, slots: int = 10, plain: int = COOLDOWN_TOKENS, left: int = 100,
         demotions: int = 1) -> DemotedRow:  # fmt: skip
    return DemotedRow(index, slots, plain, left, demotions)


def test_nothing_is_rebuilt_while_a_request_waits_for_memory() -> None:
    rows = [_row(0), _row(1)]
    assert rows_to_reinstate(rows, free_slots=10_000, waiting=True, low_water=0) == []
    assert rows_to_reinstate(rows, free_slots=10_000, waiting=False, low_water=0) == [0, 1]


def test_room_must_cover_twice_the_expected_slots_beyond_the_next_step() -> None:
    rows = [_row(0, slots=10, left=50), _row(1, slots=10, left=200)]
    need = ROOM_FACTOR * 10
    assert rows_to_reinstate(rows, free_slots=need + 8 - 1, waiting=False, low_water=8) == []
    # the row with more output left first; the second then finds the room short
    assert rows_to_reinstate(rows, free_slots=need + 8, waiting=False, low_water=8) == [1]
    assert rows_to_reinstate(rows, free_slots=need + 10 + 8, waiting=False, low_water=8) == [1, 0]


def test_a_row_cools_down_longer_after_each_demotion_and_must_have_output_left() -> None:
    free = 10_000
    assert rows_to_reinstate([_row(0, plain=COOLDOWN_TOKENS - 1)], free, False, 0) == []
    assert rows_to_reinstate([_row(0, plain=COOLDOWN_TOKENS, demotions=2)], free, False, 0) == []
    assert rows_to_reinstate([_row(0, plain=2 * COOLDOWN_TOKENS, demotions=2)], free, False,
                             0) == [0]  # fmt: skip
    assert rows_to_reinstate([_row(0, plain=4 * COOLDOWN_TOKENS, demotions=3)], free, False,
                             0) == [0]  # fmt: skip
    assert rows_to_reinstate([_row(0, left=COOLDOWN_TOKENS - 1)], free, False, 0) == []
