"""Where a drafted request's full KV lives: in the device pool while it has room, on the host
when admission or decoding needs the room (pure bookkeeping, no torch).

On an accelerator, offloading right after prefill only adds work at an ample budget: every
verify then reads the KV back across the host link, and the freed slots sit unused. So under
``--vericache-placement pressure`` (what ``auto`` is there) a drafted request's full KV stays
RESIDENT until the pool is short, and is then offloaded, largest first (fewest moves for the
room), until the shortfall is covered (on the CPU backend ``auto`` offloads right after
prefill instead: its pool is host memory, and a row's own buffer is read in place while its
pool slots are gathered; ``config.Placement``)::

    shortfall = max(deficit, low_water - free slots, 0)
    deficit   = what the last admission attempt lacked for the request it could not fit
                (SGLang's own arithmetic: prompt + clipped output - remaining budget; 0 when
                nothing waits, or everything waiting fit)
    low_water = slots the running batch takes in one step (each row's verify width, twice)

Offloading a row frees its resident tokens and also shrinks what admission reserves for its
future (``srt/kv/admission.py``), so covering the deficit with resident tokens is enough; if
admission still fails, the next attempt reports the rest.

Once offloaded, a request stays offloaded (its tail follows: ``PoolOffloader.tail_tokens``): moving
KV back would cost a copy to gain nothing the scheduler asked for. A request finishing frees its
KV either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ResidentRow:
    """A drafted request whose full KV is in the pool: pool row and tokens it could move."""

    row: int
    movable_tokens: int


def shortfall(free_slots: int, deficit: int, low_water: int) -> int:
    """Pool slots to free now (0: no pressure). All arguments are slot counts >= 0."""
    if min(free_slots, deficit, low_water) < 0:
        raise ValueError(f"slot counts must be >= 0: {free_slots}, {deficit}, {low_water}")
    return max(deficit, low_water - free_slots, 0)


def rows_to_offload(resident: Sequence[ResidentRow], need: int) -> list[int]:
    """Rows to offload, largest first, until their tokens cover ``need`` (all if they cannot)."""
    chosen, freed = [], 0
    for r in sorted(resident, key=lambda r: (-r.movable_tokens, r.row)):
        if freed >= need:
            break
        if r.movable_tokens > 0:
            chosen.append(r.row)
            freed += r.movable_tokens
    return chosen


def low_water(verify_widths: Sequence[int]) -> int:
    """Slots the running batch needs for one more step, with a step's slack."""
    return 2 * sum(verify_widths)
