"""The worker's view of its requests' state, which lives in their records.

From its prefill until it leaves, a request has exactly one of two fields of its record
(``requests/record.py``), seen here as ``rid``-keyed mappings (``RecordField``):

- ``states`` (``draft``): drafted (greedy or sampled rows): its compressed KV and counters
  (``RequestDraftState``);
- ``plain``: decoded plainly, with its counters and why (``VeriCacheStats.plain``). Plain rows
  whose full KV is offloaded (``OFFLOAD_ONLY``: ``--vericache-draft-len 0``; ``DEMOTED``: its
  compressed KV was dropped to make room where drafting did not pay) move every committed
  token's KV to the host too.

A demoted request also has a ``demotions`` entry (``Demotion``: when, how often, what its
compressed KV weighed), kept while it lives: once room returns it is ``reinstate``d (its
compressed KV rebuilt, back in ``states``: ``srt/kv/reinstate.py``), and a later demotion counts on.

Between its prefill and the worker's next forward a request may also have ``after_prefill``
work: building its compressed KV and moving its full KV to the host, left until its first
token has gone out (the worker runs it first thing in its next forward).

``ahead_used`` (drafts made while its prefix was fetched, and how many went to verify), the
draft-length controller's acceptance estimate, a greedy request's prompt-lookup index
(``lookups``: ``verify/prompt_lookup.py``) and a penalized one's penalty mirror (``penalties``:
``srt/decode/penalized_rows.py``) ride along. Nothing here forgets a request: the
request table's ``close`` (``requests/table.py``), the one way a request ends, drops its record
and every field with it. Scheduler thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from sglang_vericache.requests.table import RecordField, RequestTable, table_finder
from sglang_vericache.verify.draft_length import DraftLengthController
from sglang_vericache.srt.kv.draft_state import RequestDraftState
from sglang_vericache.srt.decode.eligibility import plain_reason, whole_step_reason
from sglang_vericache.verify import VeriCacheStats
from sglang_vericache.verify.prompt_lookup import RequestLookup

OFFLOAD_ONLY = "--vericache-draft-len 0: full KV offloaded, read back for every token, no drafts"
DEMOTED = ("compressed KV dropped to make room: drafting from it did not pay here; full KV "
           "offloaded, read back for every step; greedy rows still verify drafts of their own "
           "context")  # fmt: skip


@dataclass(slots=True)
class Demotion:
    """A request's demotions: ``count`` so far, its committed length at the last one
    (``at_length``), its compressed KV's bytes per covered token then (``bytes_per_token``, what a
    rebuild is expected to take), and whether its compressed KV can be rebuilt (``rebuildable``:
    not where the compressor needs the prompt's queries, which are gone)."""

    count: int
    at_length: int
    bytes_per_token: float
    rebuildable: bool = True


class RequestBook:
    """The worker's per-request fields (module doc), over ``requests``' records.
    ``offload_only``: every request is plain with ``OFFLOAD_ONLY``. ``draft_length``'s
    acceptance estimates are the records' ``acceptance``."""

    def __init__(self, requests: RequestTable | Callable[[], RequestTable], offload_only: bool,
                 fixed: int | None, max_drafts: int, proposer: str = "auto") -> None:  # fmt: skip
        """requests: the table, or what finds it on use (``RecordField``); proposer:
        ``--vericache-proposer``."""
        self._requests = table_finder(requests)
        self.offload_only = offload_only
        self.draft_length = DraftLengthController(
            fixed, max_drafts, estimates=RecordField(self._requests, "acceptance"),
            proposer=proposer)  # fmt: skip
        self.lookups = RecordField(self._requests, "context_lookup")
        self.penalties = RecordField(self._requests, "penalty_mirror")
        self.states = RecordField(self._requests, "draft")
        self.plain = RecordField(self._requests, "plain")
        self.ahead_used = RecordField(self._requests, "ahead_used")
        self.after_prefill = RecordField(self._requests, "after_prefill")
        self.demotions = RecordField(self._requests, "demotion")
        # the planner's last measured word where requests waited for the compressed KV's
        # slots: plain decoding with them (True) or drafting without them
        self.admission_first = False

    def __len__(self) -> int:
        """Requests with a drafted, plain, after-prefill or demotion field (0 when idle)."""
        return len(self.states.keys() | self.plain.keys() | self.after_prefill.keys()
                   | self.demotions.keys())  # fmt: skip

    def take_after_prefill(self) -> list[Callable[[], None]]:
        """The pending after-prefill work, in the order the requests opened; none is left."""
        rids = list(self.after_prefill)
        return [self.after_prefill.pop(rid) for rid in rids]

    def stats(self, rid: str) -> VeriCacheStats | None:
        state = self.states.get(rid)
        return state.stats if state is not None else self.plain.get(rid)

    def lookup_drafts(self, reqs: list[Any], rows: list[int], most: int) -> dict[int, list[int]]:
        """Each of ``rows`` (``StepRows.lookup_rows``) to its prompt-lookup draft of at most
        ``most`` tokens (empty: its context does not repeat its last tokens); each row's index
        first catches up with what it committed, which scores its previous proposal."""
        drafts = {}
        for i in rows:
            req = reqs[i]
            lookup = self.lookups.get(req.rid)
            if lookup is None:
                lookup = self.lookups[req.rid] = RequestLookup()
            lookup.sync(req.origin_input_ids, req.output_ids)
            drafts[i] = lookup.propose(most)
        return drafts

    def note_plain(self, req: Any, reason: str | None = None) -> None:
        """``req`` decodes plainly (once noted, it keeps its first reason)."""
        if req.rid in self.plain or req.rid in self.states:
            return
        reason = reason or plain_reason(req) or whole_step_reason(req) or "plain step"
        self.plain[req.rid] = VeriCacheStats.plain(OFFLOAD_ONLY if self.offload_only else reason)

    def demote(self, rid: str, length: int, per_token: float = 0.0) -> None:
        """``rid`` drops its compressed KV at committed ``length`` and decodes plainly from its
        offloaded full KV until it is ``reinstate``d (its counters keep what it drafted).
        ``per_token``: the bytes per token a rebuild is expected to take where it has no
        compressed KV to measure (it starts demoted: ``srt/kv/reinstate.starts_demoted``)."""
        state = self.states.pop(rid, None)
        self.plain[rid] = (VeriCacheStats.plain(DEMOTED) if state is None
                           else state.stats.demoted(DEMOTED))  # fmt: skip
        if state is not None:
            per_token = state.nbytes / max(state.covered, 1)
        last = self.demotions.get(rid)
        self.demotions[rid] = Demotion((0 if last is None else last.count) + 1, length, per_token,
                                       last is None or last.rebuildable)  # fmt: skip

    def demoted_rows(self, reqs: list[Any]) -> set[int]:
        """Indices of ``reqs`` that are demoted now (they decode plainly)."""
        return {i for i, r in enumerate(reqs)
                if r.rid in self.plain and self.plain[r.rid].plain_reason == DEMOTED}  # fmt: skip

    def reinstate(self, rid: str, state: RequestDraftState) -> None:
        """Demoted ``rid`` drafts again from ``state`` (its rebuilt compressed KV, labelled with
        its mode): its counters carry on from before its demotion."""
        stats = self.plain.pop(rid)
        state.stats = replace(stats, mode=state.stats.mode, constrained=state.stats.constrained,
                              plain_reason="")  # fmt: skip
        self.states[rid] = state

    def offloads_plainly(self, rid: str) -> bool:
        """A plain row whose committed KV follows the rest of its KV to the host."""
        plain = self.plain.get(rid)
        return plain is not None and plain.plain_reason in (OFFLOAD_ONLY, DEMOTED)

    def check_integrity(self) -> None:
        """Each record's own (``VeriRequest.check_integrity``), and: a plain request has its
        reason, a demoted one its demotion."""
        self._requests().check_integrity()
        for rid, stats in self.plain.items():
            assert stats.plain_reason, f"plain request {rid} without a reason"
            if stats.plain_reason == DEMOTED:
                assert rid in self.demotions, f"demoted request {rid} without its record"
