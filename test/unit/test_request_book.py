"""srt/decode/request_book.py: the worker's per-request fields (in the records), and StepRows.without."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_vericache.requests.record import RequestEnd
from sglang_vericache.requests.table import RequestTable
from sglang_vericache.srt.decode.eligibility import StepRows
from sglang_vericache.srt.decode.request_book import DEMOTED, OFFLOAD_ONLY, Demotion, RequestBook
from sglang_vericache.verify import VeriCacheStats, VerifyRecord
from sglang_vericache.verify.stats import DecodeMode


def _req(rid: str, **sampling):
    params = {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0,
              "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
              "logit_bias": None, "min_new_tokens": 0, "max_new_tokens": 16, **sampling}  # fmt: skip
    return SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(**params), grammar=None,
                           return_hidden_states=False, custom_logit_processor=None)  # fmt: skip


def test_a_demoted_request_is_plain_offloaded_and_drafts_again_once_reinstated() -> None:
    table = RequestTable()
    book = RequestBook(table, offload_only=False, fixed=None, max_drafts=4)
    stats = VeriCacheStats()
    stats.record(VerifyRecord(drafted=4, committed=3, bytes_fetched=0, wait_full_s=0.0))
    book.states["a"] = SimpleNamespace(stats=stats, nbytes=400, covered=40)  # a drafted request
    book.draft_length.observe("a", 4, 2)
    book.demote("a", 40)
    reqs = [_req("x"), _req("a"), _req("y")]
    assert book.demoted_rows(reqs) == {1} and book.offloads_plainly("a")
    demoted = book.stats("a")
    assert demoted.plain_reason == DEMOTED and "a" not in book.states
    # what it drafted before stays counted (meta_info would otherwise restart at zero)
    assert (demoted.mode.value, demoted.drafted, demoted.accepted, demoted.committed) == (
        "plain", 4, 2, 3)
    assert book.demotions["a"] == Demotion(count=1, at_length=40, bytes_per_token=10.0)
    demoted.check_integrity()
    book.check_integrity()
    step = StepRows(drafted=[0, 1, 2], sampled=[1], plain=[], grammar=[2]).without({1})
    assert (step.drafted, step.sampled, step.plain, step.grammar) == ([0, 2], [], [1], [2])
    assert step.demoted == [1]

    # room returned: a rebuilt state, labelled greedy, takes over and its counters carry on
    rebuilt = SimpleNamespace(stats=VeriCacheStats(), nbytes=500, covered=60)
    rebuilt.stats.mode = DecodeMode.GREEDY
    book.reinstate("a", rebuilt)
    assert book.demoted_rows(reqs) == set() and not book.offloads_plainly("a")
    again = book.stats("a")
    assert (again.mode, again.plain_reason, again.drafted, again.committed) == (
        DecodeMode.GREEDY, "", 4, 3)
    again.record(VerifyRecord(drafted=4, committed=5, bytes_fetched=0, wait_full_s=0.0))
    again.check_integrity()
    book.check_integrity()
    book.demote("a", 90)  # a second demotion counts on
    assert book.demotions["a"].count == 2 and book.demotions["a"].at_length == 90
    book.check_integrity()
    assert table.get("a").demotion.count == 2 and table.get("a").acceptance is not None
    table.note_decoding(["a", "b", "x"])  # the fields go only when the table closes a request
    assert sorted(table.keep_only({"x"})) == ["a", "b"]
    assert len(book) == 0 and "a" not in book.draft_length.estimates and not book.demotions
    table.check_integrity()


def test_plain_reasons_and_a_close_drops_them() -> None:
    table = RequestTable()
    book = RequestBook(table, offload_only=False, fixed=None, max_drafts=4)
    book.note_plain(_req("p", repetition_penalty=1.2, temperature=0.7, top_k=50))  # sampled
    assert "penalt" in book.stats("p").plain_reason and not book.offloads_plainly("p")
    book.note_plain(_req("p"), "another reason")  # keeps its first reason
    assert "penalt" in book.stats("p").plain_reason
    only = RequestBook(RequestTable(), offload_only=True, fixed=0, max_drafts=4)
    only.note_plain(_req("o"))
    assert only.stats("o").plain_reason == OFFLOAD_ONLY and only.offloads_plainly("o")
    book.ahead_used["p"] = [3, 1]
    book.after_prefill["p"] = lambda: None
    book.after_prefill["q"] = lambda: None
    assert len(book.take_after_prefill()) == 2 and not book.after_prefill
    table.close("p", RequestEnd.RELEASED)
    table.close("p", RequestEnd.RELEASED)  # idempotent
    assert len(book) == 0 and not book.ahead_used
