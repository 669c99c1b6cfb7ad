"""Demoted rows draft again once room returns (``srt/kv/reinstate.py``), on SGLang's real pools.

A drafted row whose compressed KV was dropped for admission (``_demote_for_room``: the book
demotes it, its draft row's slots go back) used to stay plain for the rest of its life, however
much room came back. Now, once nothing waits for memory and the free slots hold it, its
compressed KV is rebuilt from its full KV, exactly as a fresh build over that KV, lodged in pool
slots at once, and the row drafts again; every table stays consistent.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_draft_rows import _assert_same, _views
from test_offload import LAYERS, _fill_row, _pools

from sglang_vericache.compress import build_compressor
from sglang_vericache.reinstatement import COOLDOWN_TOKENS

pytestmark = pytest.mark.sglang

ROW, PROMPT = 1, 60


def _req(rid: str, max_new: int = 200, output: int = 0):
    params = SimpleNamespace(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0, frequency_penalty=0.0,
                             presence_penalty=0.0, repetition_penalty=1.0, logit_bias=None,
                             min_new_tokens=0, max_new_tokens=max_new)  # fmt: skip
    return SimpleNamespace(rid=rid, sampling_params=params, output_ids=[0] * output, grammar=None,
                           custom_logit_processor=None, return_hidden_states=False)  # fmt: skip


def _demoted_row(spec: str):
    """A drafted row offloaded at its prompt (its compressed KV in its draft row), then demoted
    for admission as ``_demote_for_room`` does; its next ``COOLDOWN_TOKENS`` decoded plainly."""
    from sglang_vericache.requests.table import RequestTable
    from sglang_vericache.srt.kv.draft_state import RequestDraftState
    from sglang_vericache.srt.kv.offloader import PoolOffloader
    from sglang_vericache.srt.decode.request_book import RequestBook

    kv, rows, alloc = _pools(1)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    compressor = build_compressor(spec)
    _fill_row(rows, alloc, ROW, PROMPT)
    queries = [torch.randn(4, 8, 8) for _ in range(LAYERS)]  # the prompt's last 8 queries
    state = RequestDraftState.build(compressor, off.layer_reader(ROW, PROMPT), PROMPT, queries,
                                    LAYERS)  # fmt: skip
    off.offload(ROW, 0, PROMPT, state=state)
    assert off.ledger.reserved(ROW) > 0
    book = RequestBook(RequestTable(), offload_only=False, fixed=None, max_drafts=4)
    book.states["r"] = state
    book.demote("r", PROMPT)
    off.release_reserved(ROW)
    length = PROMPT + COOLDOWN_TOKENS  # decoded plainly since: each token followed to the host
    _fill_row(rows, alloc, ROW, COOLDOWN_TOKENS, start=PROMPT)
    assert off.offload(ROW, 0, length).moved == COOLDOWN_TOKENS
    batch = SimpleNamespace(reqs=[_req("x"), _req("r", output=COOLDOWN_TOKENS)],
                            req_pool_indices=torch.tensor([0, ROW]),
                            seq_lens_cpu=torch.tensor([8, length]))  # fmt: skip
    return off, rows, alloc, compressor, book, batch, length


def _still(batch, book, off, compressor) -> set[int]:
    from sglang_vericache.srt.kv.reinstate import still_demoted

    return still_demoted(batch, book, off, compressor, LAYERS, width=5)


@pytest.mark.parametrize("spec", ["kivi:bits=4,group=16,residual=16", "streaming:sink=4,window=32"])
def test_a_demoted_row_drafts_again_from_a_rebuilt_compressed_kv_once_room_returns(spec) -> None:
    from sglang_vericache.srt.kv.draft_state import RequestDraftState
    from sglang_vericache.srt.decode.eligibility import StepRows

    off, rows, alloc, compressor, book, batch, length = _demoted_row(spec)
    ledger = off.ledger
    ledger.admission_deficit, ledger.waiting_asks = 7, [("w", 100, 7)]
    assert _still(batch, book, off, compressor) == {1}  # a request waits: the room is its
    ledger.admission_deficit, ledger.waiting_asks = 0, []
    free = alloc.available_size()

    assert _still(batch, book, off, compressor) == set()  # room returned: it drafts again
    assert StepRows.of(batch.reqs).without(book.demoted_rows(batch.reqs)).drafted == [0, 1]
    state = book.states["r"]
    assert state.covered == length and book.stats("r").mode.value == "greedy"
    fresh = RequestDraftState.build(compressor, off.layer_reader(ROW, length), length,
                                    [None] * LAYERS, LAYERS)  # fmt: skip
    _assert_same(_views(fresh), _views(state))  # exactly a build over its full KV
    held = ledger.reserved(ROW)  # lodged in pool slots at once, counted by the allocator
    assert held > 0 and alloc.available_size() == free - held
    assert ledger.draft_rows[ROW].tenant is state and state.nbytes_in_pool > 0
    ledger.check_integrity(rows.req_to_token)
    state.check_integrity()
    book.check_integrity()
    assert book.demotions["r"].count == 1  # kept: a later demotion cools down longer


def test_a_row_that_cannot_be_rebuilt_without_prompt_queries_stays_demoted() -> None:
    """SnapKV scores tokens by the prompt's last queries, gone by now: the row stays plain,
    and it is tried once, not every step."""
    spec = "snapkv:ratio=0.25,window=8"
    off, rows, alloc, compressor, book, batch, _ = _demoted_row(spec)
    free = alloc.available_size()
    assert _still(batch, book, off, compressor) == {1}
    assert not book.demotions["r"].rebuildable and "r" not in book.states
    assert alloc.available_size() == free and off.ledger.reserved(ROW) == 0
    assert _still(batch, book, off, compressor) == {1}
    off.ledger.check_integrity(rows.req_to_token)
    book.check_integrity()


def test_no_rebuild_before_the_cooldown_or_without_the_room() -> None:
    off, rows, alloc, compressor, book, batch, length = _demoted_row("streaming:sink=4,window=32")
    batch.seq_lens_cpu = torch.tensor([8, length - 1])  # one token short of the cooldown
    assert _still(batch, book, off, compressor) == {1}
    batch.seq_lens_cpu = torch.tensor([8, length])
    hog = alloc.alloc(alloc.available_size() - 20)  # running requests took nearly all the room
    assert _still(batch, book, off, compressor) == {1} and "r" not in book.states
    alloc.free(hog)
    assert _still(batch, book, off, compressor) == set()
    off.ledger.check_integrity(rows.req_to_token)
    book.check_integrity()


@pytest.mark.parametrize("spec, later", [("kivi:bits=4,group=16,residual=16", True),
                                         ("streaming:sink=4,window=32", True),
                                         ("snapkv:ratio=0.25,window=8", False),
                                         ("h2o:ratio=0.25", False)])
def test_which_compressors_build_without_the_prompts_queries(spec: str, later: bool) -> None:
    from sglang_vericache.srt.kv.reinstate import builds_without_queries

    assert builds_without_queries(build_compressor(spec), LAYERS, 2, 8) is later


def test_a_prefill_settling_while_a_request_waits_starts_demoted_and_is_built_once_room_returns(
        ) -> None:  # fmt: skip
    """Where the planner last put the waiting requests first, its compressed KV would take the
    slots they need: none is built, the book holds the row demoted, expected to take what the batch's compressed KV takes per
    token, and once nothing waits and it cooled down it is built like any demoted row."""
    from sglang_vericache.srt.kv.draft_state import RequestDraftState
    from sglang_vericache.srt.kv.reinstate import starts_demoted

    off, rows, alloc, compressor, book, batch, length = _demoted_row(
        "kivi:bits=4,group=16,residual=16")
    ledger = off.ledger
    drafted = RequestDraftState.build(compressor, off.layer_reader(ROW, length), length,
                                      [None] * LAYERS, LAYERS)  # fmt: skip
    book.states["x"] = drafted  # the batch's drafted row: its bytes per token are the guess
    book.admission_first = True
    assert not starts_demoted(book, "n", PROMPT, ledger, 999, True)  # no one waits: it builds
    ledger.admission_deficit, ledger.waiting_asks = 7, [("w", 100, 7)]
    book.admission_first = False  # the planner last drafted rather than let them in
    assert not starts_demoted(book, "n", PROMPT, ledger, 999, True)
    book.admission_first = True
    assert not starts_demoted(book, "n", PROMPT, ledger, 999, False)  # it could not build later
    assert "n" not in book.demotions
    assert starts_demoted(book, "n", PROMPT, ledger, 999, True)
    record = book.demotions["n"]
    assert record.count == 1 and record.at_length == PROMPT and record.rebuildable
    assert record.bytes_per_token == pytest.approx(drafted.nbytes / drafted.covered)
    assert book.demoted_rows([_req("n")]) == {0} and "n" not in book.states
    book.states.clear()
    assert starts_demoted(book, "m", PROMPT, ledger, 999, True)  # no drafted row: the full KV's
    assert book.demotions["m"].bytes_per_token == 999
    book.check_integrity()
