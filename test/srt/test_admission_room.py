"""Pool room for admission on SGLang's real CPU pools: a finished prefill's offload settled
before an attempt counts free slots, and drafted rows' compressed-KV reservations released for
the requests waiting behind them (``srt/kv/admission.py``, ``srt/decode/step_costs.py``), and a resident
drafted row's compressed KV counted in what it may still take."""

from __future__ import annotations

import pytest
import torch
from test_offload import LAYERS, _fill_row, _pools

pytestmark = pytest.mark.sglang


def _release(batch, drafted: list[int], off) -> list[int]:
    """What the worker does where drafting does not pay: the rows ``rows_to_release`` names
    drop their compressed KV and free its slots."""
    from sglang_vericache.srt.decode.step_costs import rows_to_release

    rows = rows_to_release(batch, drafted, off.ledger)
    for i in rows:
        off.release_reserved(int(batch.req_pool_indices[i]))
    return rows


def test_release_for_admission_frees_the_largest_reservations_until_the_deficit_is_covered() -> None:
    """A request waits for room the drafted rows' compressed KV holds: the planner hears of it
    only when those slots would cover its deficit. Where drafting does not pay, offloaded rows
    give their compressed-KV slots to admission: largest first, only as many rows as the
    deficit needs, and admission sees them freed."""
    from types import SimpleNamespace

    from sglang_vericache.srt.kv.offloader import PoolOffloader
    from sglang_vericache.srt.decode.step_costs import joining_contexts

    kv, rows, alloc = _pools(1)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    for row, reserve in ((0, 10), (1, 30), (2, 20)):
        _fill_row(rows, alloc, row, 60)
        off.offload(row, 0, 60, reserve * off.slot_bytes)
    _fill_row(rows, alloc, 3, 20)  # resident: nothing reserved, nothing to give
    batch = SimpleNamespace(req_pool_indices=torch.tensor([0, 1, 2, 3]))
    assert _release(batch, [0, 1, 2, 3], off) == []  # nobody waits for room
    assert joining_contexts(batch, [0, 1, 2, 3], off) == []
    off.ledger.admission_deficit, off.ledger.waiting_asks = 61, [("a", 500, 100)]
    assert joining_contexts(batch, [0, 1, 2, 3], off) == []  # 60 slots held: it would not fit
    off.ledger.admission_deficit = 25
    assert joining_contexts(batch, [0, 1, 2, 3], off) == [500]  # the planner weighs it in
    assert joining_contexts(batch, [0, 3], off) == []  # row 0's 10 slots are too few
    off.ledger.waiting_asks = [("a", 500, 100), ("b", 400, 30), ("c", 300, 10)]
    assert joining_contexts(batch, [0, 1, 2, 3], off) == [500, 400]  # 25 + 30 <= 60 < 65
    assert joining_contexts(batch, [1, 2], off) == [500]  # 50 held: "b" would not fit too
    off.ledger.waiting_asks = [("a", 500, 100)]
    free0, freed0 = alloc.available_size(), off.ledger.freed_slots
    assert _release(batch, [0, 1, 2, 3], off) == [1]  # 30 slots cover 25
    assert alloc.available_size() == free0 + 30 and off.ledger.freed_slots == freed0 + 30
    assert off.ledger.reserved(1) == 0 and off.ledger.span(1).host.length == 60
    off.ledger.admission_deficit = 25
    assert _release(batch, [0, 1, 2], off) == [2, 0]  # 20 + 10
    off.ledger.check_integrity(rows.req_to_token)


def test_release_for_admission_frees_room_for_every_request_that_joins() -> None:
    """Two waiting requests fit in what drafted rows hold: both join, and the release frees the
    first's deficit plus the second's whole ask, largest reservations first."""
    from types import SimpleNamespace

    from sglang_vericache.srt.kv.offloader import PoolOffloader
    from sglang_vericache.srt.decode.step_costs import joining_contexts

    kv, rows, alloc = _pools(1)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    for row, reserve in ((0, 10), (1, 30), (2, 20)):
        _fill_row(rows, alloc, row, 60)
        off.offload(row, 0, 60, reserve * off.slot_bytes)
    batch = SimpleNamespace(req_pool_indices=torch.tensor([0, 1, 2]))
    off.ledger.admission_deficit = 25
    off.ledger.waiting_asks = [("a", 500, 100), ("b", 400, 30)]
    assert joining_contexts(batch, [0, 1, 2], off) == [500, 400]
    assert _release(batch, [0, 1, 2], off) == [1, 2, 0]  # 30 + 20 < 55: row 0 too
    off.ledger.check_integrity(rows.req_to_token)


@pytest.mark.parametrize("waiting", [True, False])
def test_admission_counts_the_slots_a_finished_prefills_offload_gives_back(waiting: bool) -> None:
    """A prefill's offload waits for the worker's next forward, unless a request waits for room:
    then admission runs it first, and the attempt sees the freed slots (srt/kv/admission.py)."""
    from types import SimpleNamespace

    from sglang_vericache.srt.kv.admission import _new_prefill_around
    from sglang_vericache.srt.kv.offloader import PoolOffloader

    kv, rows, alloc = _pools(1)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    free0 = alloc.available_size()
    _fill_row(rows, alloc, 1, 150)  # a prompt just prefilled: its full KV in the pool
    settled = []

    def settle() -> None:  # what the worker queued: move the prompt to the host
        settled.append(off.offload(1, owned_from=0, committed=150, compressed_bytes=0).moved)

    off.ledger.settle_prefills = settle
    free_at_attempt = []
    scheduler = SimpleNamespace(tree_cache=SimpleNamespace(offloader=off),
                                waiting_queue=["a request"] if waiting else [])
    running = SimpleNamespace(batch_is_full=True)
    _new_prefill_around(lambda *_: free_at_attempt.append(alloc.available_size()),
                        scheduler, None, running)
    if waiting:
        assert settled == [150] and free_at_attempt == [free0]
        assert running.batch_is_full is False  # memory came back: admission tries again
    else:
        assert settled == [] and free_at_attempt == [free0 - 150]  # left for the forward
