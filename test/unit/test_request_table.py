"""requests/: a request's record and the table with the one close path (no torch, no sglang)."""

from __future__ import annotations

import pytest
from sglang_vericache.requests.record import RequestEnd, VeriRequest
from sglang_vericache.requests.record import STATE_FIELDS
from sglang_vericache.requests.table import CLOSED_REMEMBERED, RecordField, RequestTable


class Holder:
    """A component with entries per request id (and, optionally, per pool row)."""

    def __init__(self, name: str) -> None:
        self.participant_name = name
        self.entries: dict[str, int] = {}
        self.rows: set[int] = set()
        self.forgotten: list[str] = []

    def forget(self, rid: str) -> None:
        self.forgotten.append(rid)
        self.entries.pop(rid, None)

    def tracked_rids(self) -> set[str]:
        return set(self.entries)

    def held_rows(self) -> set[int]:
        return set(self.rows)


def _nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {name: n for name, n in counts.items() if n}


def _table(*names: str) -> tuple[RequestTable, list[Holder]]:
    table, holders = RequestTable(), [Holder(n) for n in names]
    for holder in holders:
        table.join(holder)
        table.join(holder)  # twice: told once
    return table, holders


def test_open_is_idempotent_and_a_record_starts_without_a_row() -> None:
    table = RequestTable()
    record = table.open("a")
    assert record == VeriRequest("a") and not record.holds_row and not record.decoding
    assert table.open("a") is record and len(table) == 1 and "a" in table
    assert table.get("b") is None and "b" not in table and table.rid_at(0) is None
    table.check_integrity()


def test_bind_row_indexes_the_row_and_rebinding_moves_it() -> None:
    table = RequestTable()
    record = table.bind_row("a", 3)
    assert record.row == 3 and table.rid_at(3) == "a" and record.holds_row
    table.bind_row("a", 5)  # a retracted-and-rescheduled request gets another row
    assert table.rid_at(5) == "a" and table.rid_at(3) is None
    table.check_integrity()


def test_close_tells_every_participant_drops_the_record_and_its_row() -> None:
    table, (worker, link) = _table("worker", "link")
    closed: list[int] = []
    table.after_close.append(lambda: closed.append(len(table)))
    table.bind_row("a", 1)
    worker.entries["a"] = link.entries["a"] = 1
    assert _nonzero(table.entry_counts()) == {"records": 1, "worker": 1, "link": 1}
    assert table.close("a", RequestEnd.RELEASED)
    assert worker.forgotten == link.forgotten == ["a"] and not worker.entries and not link.entries
    assert len(table) == 0 and table.rid_at(1) is None and closed == [0]
    assert table.ended("a") is RequestEnd.RELEASED
    table.check_integrity()


def test_close_is_idempotent_and_tells_participants_even_without_a_record() -> None:
    table, (worker,) = _table("worker")
    closed: list[str] = []
    table.after_close.append(lambda: closed.append("x"))
    table.open("a")
    assert table.close("a", RequestEnd.RELEASED)
    assert not table.close("a", RequestEnd.RELEASED)  # again: nothing live, still told
    worker.entries["q"] = 1  # an entry for a request that never got a record (queued)
    assert not table.close("q", RequestEnd.ABORTED_QUEUED)
    assert worker.forgotten == ["a", "a", "q"] and not worker.entries
    assert len(closed) == 3  # listeners hear every close (an entry may have gone)
    assert table.ended("q") is RequestEnd.ABORTED_QUEUED
    table.check_integrity()


def test_a_closed_request_opens_again_under_its_id() -> None:
    """A retracted request: released (closed), then rescheduled with the same id."""
    table, (worker,) = _table("worker")
    table.bind_row("r", 2)
    table.close("r", RequestEnd.RELEASED)
    again = table.bind_row("r", 4)
    worker.entries["r"] = 1  # its new life's entry is no leak
    assert again.row == 4 and table.ended("r") is None and table.rid_at(2) is None
    table.check_integrity()


def test_keep_only_closes_only_requests_that_were_decoding() -> None:
    table, (worker,) = _table("worker")
    table.note_decoding(["a", "b"])
    table.open("queued")  # matched a prefix, not decoding yet
    worker.entries.update(a=1, b=1, queued=1)
    assert table.keep_only({"b"}) == ["a"]
    assert sorted(table.records) == ["b", "queued"] and worker.tracked_rids() == {"b", "queued"}
    assert table.ended("a") is RequestEnd.LEFT_BATCH
    assert table.keep_only({"b"}) == []
    table.check_integrity()


def test_integrity_fails_on_an_entry_left_for_a_closed_request() -> None:
    table, (_, ahead) = _table("worker", "draft ahead")
    table.open("a")
    table.close("a", RequestEnd.RELEASED)
    ahead.entries["a"] = 1  # a component re-created an entry after the close: a leak
    with pytest.raises(AssertionError, match="draft ahead holds closed requests"):
        table.check_integrity()
    table.close("a", RequestEnd.RELEASED)
    table.check_integrity()


def test_integrity_fails_on_a_row_held_for_no_live_request() -> None:
    table = RequestTable()
    ledger = Holder("offload ledger")
    table.hold_rows(ledger)
    table.bind_row("a", 7)
    ledger.rows.add(7)
    table.check_integrity()
    assert _nonzero(table.entry_counts()) == {"records": 1, "offload ledger rows": 1}
    table.close("a", RequestEnd.RELEASED)  # the row's host range was not dropped
    with pytest.raises(AssertionError, match=r"offload ledger holds rows \[7\]"):
        table.check_integrity()
    ledger.rows.clear()
    table.check_integrity()


def test_integrity_fails_where_a_row_is_bound_while_another_request_holds_it() -> None:
    table = RequestTable()
    table.bind_row("a", 1)
    table.bind_row("b", 1)  # a's release was missed: serving goes on, the check fails
    assert table.rid_at(1) == "b" and table.get("a").row is None
    with pytest.raises(AssertionError, match="while a live request held them"):
        table.check_integrity()


def test_integrity_fails_where_the_row_index_and_records_disagree() -> None:
    table = RequestTable()
    table.bind_row("a", 1)
    table.get("a").row = 2  # a record mutated behind the table's back
    with pytest.raises(AssertionError, match="row 1 indexed for a, whose row is 2"):
        table.check_integrity()


def test_integrity_runs_each_participants_own_check() -> None:
    table, (worker,) = _table("worker")

    def broken() -> None:
        raise AssertionError("worker's own invariant")

    worker.check_integrity = broken
    with pytest.raises(AssertionError, match="worker's own invariant"):
        table.check_integrity()


def test_closed_ids_remembered_are_bounded() -> None:
    table = RequestTable()
    for i in range(CLOSED_REMEMBERED + 10):
        table.close(str(i), RequestEnd.RELEASED)
    assert table.ended("0") is None and table.ended(str(CLOSED_REMEMBERED + 9))
    assert len(table._closed) == CLOSED_REMEMBERED


def test_a_record_field_is_a_mapping_whose_entries_go_with_the_record() -> None:
    """A component's per-request state is a field of the record: setting it opens the record,
    closing the record drops every field at once, and nothing can be held for a closed id."""
    table = RequestTable()
    drafts, lookups = table.field("draft"), table.field("lookup")
    assert isinstance(drafts, RecordField) and len(drafts) == 0 and "a" not in drafts
    drafts["a"] = "state of a"  # opens a's record
    lookups["a"], lookups["b"] = "lookup of a", "lookup of b"
    assert table.get("a").draft == "state of a" and sorted(table.records) == ["a", "b"]
    assert list(drafts) == ["a"] and dict(lookups) == {"a": "lookup of a", "b": "lookup of b"}
    assert drafts.get("b") is None and drafts.pop("b", None) is None
    with pytest.raises(KeyError):
        del drafts["b"]
    with pytest.raises(ValueError, match="delete it instead"):
        drafts["a"] = None
    counts = table.entry_counts()
    assert set(STATE_FIELDS) <= counts.keys()  # every field is counted, 0 or not
    assert _nonzero(counts) == {"records": 2, "draft": 1, "lookup": 2}
    table.close("a", RequestEnd.RELEASED)
    assert "a" not in drafts and "a" not in lookups and list(lookups) == ["b"]
    assert lookups.pop("b") == "lookup of b" and table.get("b").lookup is None
    assert len(table) == 1  # b's record lives on (only its field went)
    table.check_integrity()
    with pytest.raises(ValueError, match="not a request state field"):
        table.field("row")
