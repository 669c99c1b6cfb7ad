"""Every live request's record, keyed by request id, with a row -> request index, and the ONE
way a request's state is dropped: ``close(rid)``.

A request's VeriCache state is the fields of its record (``record.py``): the worker's drafted
or plain state, demotion, after-prefill work and acceptance estimate; the tier link's lookup;
drafting ahead; the tier eligibility stamp. Components read and write them through
``RecordField`` views (a ``MutableMapping`` from request id to one field), so closing the
record drops all of it. A component whose fields stand for a resource (a tier task to cancel, a
drafting job to stop, fetch buffers to release) or that keeps a structure shared between
requests (the fetch cache's claims, the admission queue's asks) ``join``s the table as a
``RequestParticipant``: ``close(rid)`` calls its ``forget(rid)`` while the record still holds
its fields, whichever way the request ended:

- SGLang released its row (finished, at prefill too; aborted mid-step; retracted): the prefix
  cache's ``on_release``;
- aborted while queued, before it held a row: the prefix cache's ``release_aborted_request``;
- gone from the decode batch without a release (a safety net): ``keep_only``.

Rows: the offload ledger keeps state per pool row (host ranges, draft rows). Those are freed by
the prefix cache (by row) when the row is released; ``hold_rows`` registers such a holder, and
``check_integrity`` asserts each row it holds is the row of a live record.

Closing is idempotent and a closed id may open again (a retracted request is rescheduled under
its id). Scheduler thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any, Protocol

from sglang_vericache.requests.record import STATE_FIELDS, RequestEnd, VeriRequest

CLOSED_REMEMBERED = 4096  # closed ids checked against leftovers (check_integrity)


class RequestParticipant(Protocol):
    """A component told of every close: it releases what ``rid``'s fields stand for, and drops
    any entry for ``rid`` it keeps in a structure shared between requests."""

    participant_name: str

    def forget(self, rid: str) -> None:
        """``rid`` closes (its record, if live, still holds its fields). Idempotent."""

    def tracked_rids(self) -> set[str]:
        """The request ids its shared structures hold an entry for (none: an empty set)."""


class RowHolder(Protocol):
    """A component that keeps entries per pool row (freed by its owner when the row is)."""

    participant_name: str

    def held_rows(self) -> set[int]:
        """Pool rows it holds an entry for."""


def table_finder(table: RequestTable | Callable[[], RequestTable]) -> Callable[[], RequestTable]:
    """What finds ``table`` on use: the callable itself, or one that returns the table."""
    return table if callable(table) else (lambda: table)


class RecordField(MutableMapping[str, Any]):
    """Request id -> one state field of each live record (``record.STATE_FIELDS``); a record
    whose field is None has no entry. Setting one opens the record where it is not live (as
    the component that sets it starts the request's life there); deleting sets None. Iteration
    is in record order (the order requests opened) over a snapshot.

    ``table`` is the table, or what finds it on use: the worker is built before SGLang makes
    the pool the table hangs on (``srt/context.py``)."""

    def __init__(self, table: RequestTable | Callable[[], RequestTable], name: str) -> None:
        if name not in STATE_FIELDS:
            raise ValueError(f"{name!r} is not a request state field: one of {STATE_FIELDS}")
        self._table = table_finder(table)
        self.name = name

    def __getitem__(self, rid: str) -> Any:
        record = self._table().records.get(rid)
        value = None if record is None else getattr(record, self.name)
        if value is None:
            raise KeyError(rid)
        return value

    def __setitem__(self, rid: str, value: Any) -> None:
        if value is None:
            raise ValueError(f"{self.name} of {rid}: None is 'no entry' (delete it instead)")
        setattr(self._table().open(rid), self.name, value)

    def __delitem__(self, rid: str) -> None:
        record = self._table().records.get(rid)
        if record is None or getattr(record, self.name) is None:
            raise KeyError(rid)
        setattr(record, self.name, None)

    def __iter__(self) -> Iterator[str]:
        name, records = self.name, self._table().records
        return iter([rid for rid, r in records.items() if getattr(r, name) is not None])

    def __len__(self) -> int:
        name = self.name
        return sum(1 for r in self._table().records.values() if getattr(r, name) is not None)

    def __contains__(self, rid: object) -> bool:
        record = self._table().records.get(rid)  # type: ignore[arg-type]
        return record is not None and getattr(record, self.name) is not None


class RequestTable:
    """The records of live requests and their one close path (module doc)."""

    def __init__(self) -> None:
        self.records: dict[str, VeriRequest] = {}
        self._by_row: dict[int, str] = {}
        self._closed: OrderedDict[str, RequestEnd] = OrderedDict()  # most recent last
        self.row_conflicts = 0  # rows bound while another live record held them
        self.last_conflict: tuple[int, str, str] | None = None  # (row, live holder, new request)
        self._participants: list[RequestParticipant] = []
        self._row_holders: list[RowHolder] = []
        # called after each close (the worker republishes its gauges: the server may be idle
        # from now on, with no forward left to publish them)
        self.after_close: list[Callable[[], None]] = []

    # -- membership ---------------------------------------------------------------------------

    def join(self, participant: RequestParticipant) -> None:
        """``participant`` is told of every close from now on (joining twice: once)."""
        if not any(p is participant for p in self._participants):
            self._participants.append(participant)

    def hold_rows(self, holder: RowHolder) -> None:
        if not any(h is holder for h in self._row_holders):
            self._row_holders.append(holder)

    # -- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Live records (0 when idle: nothing leaked)."""
        return len(self.records)

    def __contains__(self, rid: object) -> bool:
        return rid in self.records

    def get(self, rid: str) -> VeriRequest | None:
        return self.records.get(rid)

    def rid_at(self, row: int) -> str | None:
        """The live request holding pool row ``row`` (None: no live record holds it)."""
        return self._by_row.get(row)

    def ended(self, rid: str) -> RequestEnd | None:
        """How ``rid`` was last closed, while it is closed and remembered; None otherwise."""
        return self._closed.get(rid)

    def field(self, name: str) -> RecordField:
        """A view of state field ``name`` of every live record (``RecordField``)."""
        return RecordField(self, name)

    def entry_counts(self) -> dict[str, int]:
        """Live records, the records holding each state field, and the entries each
        participant keeps in its shared structures and each row holder keeps: all 0 when the
        server is idle (``vericache:request_entries``)."""
        counts = {"records": len(self.records)}
        for name in STATE_FIELDS:
            counts[name] = len(self.field(name))
        for p in self._participants:
            counts[p.participant_name] = counts.get(p.participant_name, 0) + len(p.tracked_rids())
        for h in self._row_holders:
            name = f"{h.participant_name} rows"
            counts[name] = counts.get(name, 0) + len(h.held_rows())
        return counts

    # -- mutations ----------------------------------------------------------------------------

    def open(self, rid: str) -> VeriRequest:
        """``rid``'s record, made where it has none (a closed id opens afresh)."""
        record = self.records.get(rid)
        if record is None:
            self._closed.pop(rid, None)
            record = self.records[rid] = VeriRequest(rid)
        return record

    def bind_row(self, rid: str, row: int) -> VeriRequest:
        """``rid`` (opened where needed) holds pool row ``row``. A row is one live request's:
        where another live record holds it (that request's release was missed) the row moves to
        ``rid`` and the conflict is counted (``row_conflicts``; ``check_integrity`` fails on
        it): serving goes on, a test sees the leak."""
        record = self.open(rid)
        holder = self._by_row.get(row)
        if holder is not None and holder != rid:
            self.row_conflicts += 1
            self.last_conflict = (row, holder, rid)
            self.records[holder].row = None
        if record.row is not None and record.row != row:
            self._by_row.pop(record.row, None)
        record.row = row
        self._by_row[row] = rid
        return record

    def note_decoding(self, rids: Iterable[str]) -> None:
        """``rids`` are in a decode batch now (``keep_only`` closes them once they are not)."""
        for rid in rids:
            self.open(rid).decoding = True

    def close(self, rid: str, end: RequestEnd) -> bool:
        """Every participant forgets ``rid`` (its record still live); then the record, every
        state field with it, and its row binding go. Idempotent (the participants are told
        again: a component may have taken an entry since). Returns whether a live record was
        closed."""
        for participant in self._participants:
            participant.forget(rid)
        record = self.records.pop(rid, None)
        if record is not None and record.row is not None and self._by_row.get(record.row) == rid:
            del self._by_row[record.row]
        self._closed.pop(rid, None)
        self._closed[rid] = end
        while len(self._closed) > CLOSED_REMEMBERED:
            self._closed.popitem(last=False)
        for listener in self.after_close:  # also without a record: an entry may have gone
            listener()
        return record is not None

    def keep_only(self, live: set[str]) -> list[str]:
        """Close every record that was in a decode batch and is not in ``live`` (the batch now):
        it left without its release being seen (a safety net; a release closes it first).
        Records not yet decoding (queued, prefilling) stay. Returns the ids closed."""
        gone = [rid for rid, r in self.records.items() if r.decoding and rid not in live]
        for rid in gone:
            self.close(rid, RequestEnd.LEFT_BATCH)
        return gone

    # -- invariants ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Records and the row index agree (each indexed row is its live record's, each bound
        record is indexed); every row a holder keeps is a live record's; no participant holds
        an entry for a closed id; each participant's own invariants (``check_integrity``)."""
        assert not self.row_conflicts, (
            f"{self.row_conflicts} rows bound while a live request held them, the last (row, "
            f"holder, request): {self.last_conflict}")
        for row, rid in self._by_row.items():
            record = self.records.get(rid)
            assert record is not None, f"row {row} indexed for {rid}, which is not live"
            assert record.row == row, f"row {row} indexed for {rid}, whose row is {record.row}"
        for rid, record in self.records.items():
            assert record.rid == rid, f"record of {record.rid} filed under {rid}"
            if record.row is not None:
                assert self._by_row.get(record.row) == rid, f"{rid}'s row {record.row} unindexed"
            assert rid not in self._closed, f"{rid} both live and closed"
            record.check_integrity()
        for holder in self._row_holders:
            stray = holder.held_rows() - self._by_row.keys()
            assert not stray, f"{holder.participant_name} holds rows {sorted(stray)} of no live request"
        for participant in self._participants:
            leaked = participant.tracked_rids() & self._closed.keys()
            assert not leaked, (
                f"{participant.participant_name} holds closed requests {sorted(leaked)}")
            check = getattr(participant, "check_integrity", None)
            if check is not None:
                check()
