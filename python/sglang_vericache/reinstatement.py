"""When a demoted row drafts again (pure bookkeeping, no torch).

A drafted row is *demoted* where drafting does not pay and admission is short: its compressed KV
is dropped so that its pool slots admit a waiting request (``srt/decode/decode_step.py``,
``_demote_for_room``), and it decodes plainly from its full KV. The room was needed then, not
for good: once nothing waits for memory and the pool's free slots hold the row's compressed KV
again, the compressed KV is rebuilt from the full KV (exact, as every token's KV is) and the row
drafts again wherever the planner finds that drafting pays (``srt/kv/reinstate.py``).

A rebuild compresses the whole context (SmolLM2, KIVI int4, one CPU thread: 47 ms at 1k tokens,
0.3 s at 4k; StreamingLLM 12 ms), so a row is rebuilt only

- while no request waits for memory (an admission deficit, or asks queued behind it): the room
  is theirs first;
- where the free slots cover ``ROOM_FACTOR`` times its expected compressed KV beyond the batch's
  next step (``placement.low_water``), so the next arrival does not find the room gone at once;
- after it decoded ``COOLDOWN_TOKENS`` tokens plainly since its last demotion, twice as many for
  each earlier demotion (a row demoted again and again is rebuilt ever more rarely);
- where at least ``COOLDOWN_TOKENS`` of its output remain (a row about to finish would not
  repay the compression).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

COOLDOWN_TOKENS = 16
ROOM_FACTOR = 2


@dataclass(frozen=True, slots=True)
class DemotedRow:
    """A demoted row of the decode batch, as the reinstatement policy sees it.

    index: its batch index; expected_slots: pool slots its rebuilt compressed KV is expected to
    take (its compressed bytes per token at demotion times its length now); plain_tokens: tokens
    it decoded since its last demotion; tokens_left: output it may still emit; demotions: times
    it was demoted (>= 1).
    """

    index: int
    expected_slots: int
    plain_tokens: int
    tokens_left: int
    demotions: int


def cooled_down(row: DemotedRow) -> bool:
    """It decoded plainly long enough since its last demotion, and has enough output left."""
    wait = COOLDOWN_TOKENS << max(row.demotions - 1, 0)
    return row.plain_tokens >= wait and row.tokens_left >= COOLDOWN_TOKENS


def rows_to_reinstate(rows: Sequence[DemotedRow], free_slots: int, waiting: bool,
                      low_water: int) -> list[int]:  # fmt: skip
    """Batch indices of ``rows`` to rebuild now, most output left first, while the free slots
    beyond ``low_water`` cover ``ROOM_FACTOR`` times each one's expected slots (see module doc).
    None while a request waits for memory (``waiting``)."""
    if waiting:
        return []
    room, chosen = free_slots - low_water, []
    for row in sorted(rows, key=lambda r: (-r.tokens_left, r.index)):
        if cooled_down(row) and ROOM_FACTOR * row.expected_slots <= room:
            chosen.append(row.index)
            room -= row.expected_slots
    return chosen
