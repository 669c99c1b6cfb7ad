"""Demoted rows of a decode batch draft again once room returns (glue; the policy is
``sglang_vericache.reinstatement``).

``_demote_for_room`` (``srt/decode/decode_step.py``) drops a drafted row's compressed KV where
drafting does not pay and a waiting request needs its pool slots; ``RequestBook`` keeps the row
plain (``DEMOTED``). Each decode step, before it sorts its rows, the worker asks ``still_demoted``:
the demoted rows whose room has returned get their compressed KV rebuilt from their full KV
(``RequestDraftState.build`` over the row's exact KV, in the pool or offloaded), lodged in pool
slots at once (``PoolOffloader.hold``), and back in the book's ``states``; from then on they are
drafted rows like any other (drafted where the planner finds it pays, offloaded under pressure).
The rest stay plain this step. Greedy output is unchanged: drafts only propose, the verify over
the full KV decides every token.

A compressor that scores tokens by the prompt's queries (SnapKV, H2O...) cannot rebuild a
running row's compressed KV (the queries are gone): such a row stays demoted, tried once.

A request whose prefill settles while another waits for memory, after the planner last found
plain decoding with the waiting requests faster than drafting without them, or put them first
while it could not weigh the two yet (``RequestBook.admission_first``, ``verify/step_plan.py``
``ADMITTING``), starts demoted (``starts_demoted``): its compressed KV would take the pool
slots the waiting request needs, and the planner would drop it for that request again, after a
compression for nothing and decode steps of a small batch in place of a prefill (16 x 1k prompts
on a budget of 2 requests' full KV: 14 compressed KV dropped within seconds of their build,
0.86x and 0.90x offload-only in two paired rounds,
``benchmark/results/serving_grid_1k_tight_c16_before.json``; with this rule 0.95x and 0.92x,
``serving_grid_1k_tight_c16_settle.json``; 8 x 1k: 0.96x in both rounds,
``serving_grid_1k_tight_c8_settle.json``). It is built like a demoted row's once room
returns. Only a compressor that needs no prompt queries (KIVI, StreamingLLM) can build it then
(``builds_without_queries``); with any other the request compresses at once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang_vericache.compress.base import Observation
from sglang_vericache.placement import low_water
from sglang_vericache.reinstatement import DemotedRow, rows_to_reinstate
from sglang_vericache.srt.kv.draft_state import RequestDraftState
from sglang_vericache.srt.decode.eligibility import decode_mode, tokens_left

logger = logging.getLogger(__name__)


def still_demoted(batch: Any, book: Any, offloader: Any, compressor: Any, num_layers: int,
                  width: int) -> set[int]:  # fmt: skip
    """Indices of ``batch.reqs`` that stay demoted this step; the others the book held demoted
    are reinstated (module doc). book: ``RequestBook``; offloader: ``PoolOffloader``; width: a
    row's verify width (slots a step takes per row, for the room the batch keeps)."""
    demoted = book.demoted_rows(batch.reqs)
    if not demoted:
        return demoted
    waiting = admission_waits(offloader.ledger)
    lens = batch.seq_lens_cpu.tolist()
    candidates = []
    for i in sorted(demoted):
        req, length = batch.reqs[i], int(lens[i])
        record = book.demotions[req.rid]
        if record.rebuildable:
            expected = offloader.slots_for(int(record.bytes_per_token * length))
            candidates.append(DemotedRow(i, expected, length - record.at_length, tokens_left(req),
                                         record.count))  # fmt: skip
    free = int(offloader.allocator.available_size())
    chosen = rows_to_reinstate(candidates, free, waiting, low_water([width] * len(batch.reqs)))
    pool_rows = batch.req_pool_indices.tolist()
    for i in chosen:
        req, length, row = batch.reqs[i], int(lens[i]), pool_rows[i]
        try:  # no prompt queries now: a compressor that needs them raises
            state = RequestDraftState.build(compressor, offloader.layer_reader(row, length),
                                            length, [None] * num_layers, num_layers)  # fmt: skip
        except ValueError as exc:
            book.demotions[req.rid].rebuildable = False
            logger.info("request %s stays demoted: its compressed KV cannot be rebuilt without "
                        "the prompt's queries (%s)", req.rid, exc)  # fmt: skip
            continue
        book.reinstate(req.rid, state.labelled(req, decode_mode(req)))
        held = offloader.hold(row, state)
        demoted.discard(i)
        logger.info("request %s: room returned; compressed KV rebuilt over %d tokens (%d pool "
                    "slots), it drafts again", req.rid, length, held)  # fmt: skip
    return demoted


def admission_waits(ledger: Any) -> bool:
    """A request waits for pool memory: an attempt lacked slots, or asks queue behind it."""
    return ledger.admission_deficit > 0 or bool(ledger.waiting_asks)


def starts_demoted(book: Any, rid: str, length: int, ledger: Any, full_bytes_per_token: int,
                   builds_later: bool) -> bool:  # fmt: skip
    """Whether request ``rid``, its prefill of ``length`` tokens settling now, starts demoted
    (module doc): it does where a request waits for memory, the planner last put admission
    first and its compressed KV can be built later (``builds_later``). Then the book holds it
    demoted, expected to take what the batch's compressed KV takes per token (the full KV's
    ``full_bytes_per_token`` while no row has one: the cautious guess)."""
    if not (builds_later and book.admission_first and admission_waits(ledger)):
        return False
    states = list(book.states.values())
    covered = sum(state.covered for state in states)
    per_token = (sum(state.nbytes for state in states) / covered if covered
                 else float(full_bytes_per_token))  # fmt: skip
    book.demote(rid, length, per_token)
    logger.info("request %s: no compressed KV built while requests wait for memory (the planner "
                "put admission first); it is built once room returns", rid)
    return True


def builds_without_queries(compressor: Any, num_layers: int, heads_kv: int,
                           head_dim: int) -> bool:  # fmt: skip
    """Whether ``compressor`` compresses a layer with no prompt queries (KIVI, StreamingLLM do;
    SnapKV and H2O score keys by them and raise), tried once on 1024 random tokens."""
    keys, values = torch.randn(2, heads_kv, 1024, head_dim).unbind(0)
    try:
        compressor.compress(0, keys, values, Observation(num_layers=num_layers))
    except ValueError:
        return False
    return True
