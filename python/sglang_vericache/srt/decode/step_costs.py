"""What the worker tells the planner and the placement policy about a batch (glue, no policy).

- ``step_rows``: each row's context, compressed-view size and remaining budget, for the
  draft-or-plain decision (``verify/draft_length.py`` -> ``verify/step_plan.py``);
- ``plain_shape`` / ``verify_shape``: the shape of the full-KV forwards the worker times, for
  the cost fit (``verify/step_cost.py``; draft forwards: ``ForwardShape.draft``);
- ``relieve_pressure``: offload resident drafted rows while admission or the next step is short
  of pool slots (``placement.py``);
- ``joining_contexts`` / ``rows_to_release``: the requests waiting for the slots that drafted
  rows' compressed KV holds, and, where drafting does not pay (with those requests in a plain
  batch), the rows whose slots to free for them (the rows then decode plainly).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from sglang_vericache.placement import ResidentRow, low_water, rows_to_offload, shortfall
from sglang_vericache.verify.draft_length import StepRow
from sglang_vericache.srt.decode.eligibility import tokens_left
from sglang_vericache.verify.step_cost import ForwardShape


def step_rows(batch: Any, states: Mapping[str, Any], drafted: Sequence[int],
              lookup: Mapping[int, tuple[int, float]] | None = None) -> list[StepRow]:
    """The batch's rows for ``DraftLengthController.plan`` (``drafted``: rows that can draft;
    ``lookup``: row -> (its prompt-lookup draft's tokens, their acceptance estimate))."""
    can, lookup = set(drafted), lookup or {}
    lens = batch.seq_lens_cpu.tolist()
    rows = []
    for i, req in enumerate(batch.reqs):
        state = states.get(req.rid) if i in can else None
        tokens, alpha = lookup.get(i, (0, 0.0))
        rows.append(StepRow(req.rid, int(lens[i]), 0 if state is None else state.view_tokens,
                            max(1, tokens_left(req)), state is not None, tokens, alpha))
    return rows


def plain_shape(batch: Any) -> ForwardShape:
    """The batch's one-token decode over the full KV."""
    return ForwardShape.plain(batch.seq_lens_cpu.tolist())


def verify_shape(batch: Any, width: int, live: Sequence[int]) -> ForwardShape:
    """The batch's width-W verify over the full KV, row i's first ``live[i]`` queries attending
    (1 + its drafts)."""
    return ForwardShape.verify(batch.seq_lens_cpu.tolist(), width, live)


def relieve_pressure(batch: Any, states: Mapping[str, Any], offloader: Any, width: int) -> int:
    """Offload resident drafted rows, largest first, until the pool covers admission's deficit
    and one more step of every row (``placement.shortfall``). Returns tokens moved to the host.
    """
    ledger = offloader.ledger
    free = offloader.free_slots()  # cached prefixes count: allocation evicts them, no offload
    need = shortfall(free, ledger.admission_deficit, low_water([width] * len(batch.reqs)))
    if need == 0:
        return 0
    pool_rows = batch.req_pool_indices.tolist()
    lens = batch.seq_lens_cpu.tolist()
    resident, owner = [], {}
    for i, req in enumerate(batch.reqs):
        if req.rid not in states or ledger.span(pool_rows[i]) is not None:
            continue  # not drafted (nothing to draft from once offloaded), or already offloaded
        # the whole row moves: the tree keeps its slots as cached nodes, no longer pinned
        resident.append(ResidentRow(pool_rows[i], int(lens[i])))
        owner[pool_rows[i]] = (req, int(lens[i]), states[req.rid])
    moved = 0
    for row in rows_to_offload(resident, need):
        req, committed, state = owner[row]
        moved += offloader.offload(row, int(req.kv.cache_protected_len), committed,
                                   min_tokens=1, req=req, state=state).moved  # fmt: skip
    return moved


def joining_contexts(batch: Any, drafted: Sequence[int], offloader: Any) -> list[int]:
    """The contexts of the waiting requests that the drafted rows' compressed-KV slots would
    make room for, in queue order: the one admission could not fit (``admission_deficit``
    slots short), then each behind it while the slots still cover their asks; none when they
    do not cover the first. The planner weighs plain decoding with these requests in the batch
    (``verify/step_plan.py``); ``rows_to_release`` names the rows whose slots they need."""
    ledger = offloader.ledger
    if ledger.admission_deficit <= 0 or not ledger.waiting_asks:
        return []
    held = sum(slots for slots, _ in _reservations(batch, drafted, ledger))
    return [context for _, context, _ in _joining(ledger, held)]


def rows_to_release(batch: Any, drafted: Sequence[int], ledger: Any) -> list[int]:
    """Rows (of ``drafted``) whose compressed-KV slots admission needs: the largest draft rows
    first, until they cover what the joining requests lack (at least the deficit admission
    reported). Call only where drafting does not pay; the caller drops those rows' compressed
    KV, then frees their slots (``PoolOffloader.release_reserved``)."""
    if ledger.admission_deficit <= 0:
        return []
    held = _reservations(batch, drafted, ledger)
    joining = _joining(ledger, sum(slots for slots, _ in held))
    target = ledger.admission_deficit + sum(ask for _, _, ask in joining[1:])
    released, freed = [], 0
    for slots, i in sorted(held, reverse=True):
        if freed >= target:
            break
        freed += slots
        released.append(i)
    return released


def _joining(ledger: Any, held: int) -> list[tuple[str, int, int]]:
    """The waiting asks (queue order) that ``held`` freed slots admit: the first needs the
    deficit, each later one its whole ask."""
    joining, need = [], 0
    for k, ask in enumerate(ledger.waiting_asks):
        need += ledger.admission_deficit if k == 0 else ask[2]
        if need > held:
            break
        joining.append(ask)
    return joining


def _reservations(batch: Any, drafted: Sequence[int], ledger: Any) -> list[tuple[int, int]]:
    """(reserved compressed-KV slots, batch index) of the ``drafted`` rows that hold some."""
    pool_rows = batch.req_pool_indices.tolist()
    held = []
    for i in drafted:
        reserved = ledger.reserved(pool_rows[i])
        if reserved:
            held.append((reserved, i))
    return held
