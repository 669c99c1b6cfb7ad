"""Every request the worker holds VeriCache state for, in one place.

From its prefill until it leaves, a request is in exactly one of two tables:

- ``states``: drafted (greedy or sampled rows): its compressed KV and counters
  (``RequestDraftState``);
- ``plain``: decoded plainly, with its counters and why (``VeriCacheStats.plain``). Plain rows
  whose full KV is offloaded (``OFFLOAD_ONLY``: ``--vericache-draft-len 0``; ``DEMOTED``: its
  compressed KV was dropped to make room where drafting did not pay) move every committed
  token's KV to the host too.

A demoted request also has a ``demotions`` record (``Demotion``: when, how often, what its
compressed KV weighed), kept while it lives: once room returns it is ``reinstate``d (its
compressed KV rebuilt, back in ``states``: ``srt/kv/reinstate.py``), and a later demotion counts on.

Between its prefill and the worker's next forward a request may also have ``after_prefill``
work: building its compressed KV and moving its full KV to the host, left until its first
token has gone out (the worker runs it first thing in its next forward).

``ahead_used`` (drafts made while its prefix was fetched, and how many went to verify) and the
draft-length controller's acceptance estimate ride along. ``forget`` drops all of it
(idempotent), and only the request table calls it: the book is a participant of the
scheduler's ``RequestTable`` (``requests/table.py``), whose ``close`` is the one way a request
ends, whichever way it ended (released: finished, at prefill too, aborted, retracted; aborted
while queued; gone from the decode batch). Scheduler thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from sglang_vericache.verify.draft_length import DraftLengthController
from sglang_vericache.srt.kv.draft_state import RequestDraftState
from sglang_vericache.srt.decode.eligibility import plain_reason, whole_step_reason
from sglang_vericache.verify import VeriCacheStats

OFFLOAD_ONLY = "--vericache-draft-len 0: full KV offloaded, read back for every token, no drafts"
DEMOTED = ("compressed KV dropped to make room: drafting did not pay here; full KV offloaded, "
           "read back for every token")  # fmt: skip


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
    """The worker's per-request tables (module doc). ``offload_only``: every request is plain
    with ``OFFLOAD_ONLY``."""

    def __init__(self, draft_length: DraftLengthController, offload_only: bool) -> None:
        self.draft_length = draft_length
        self.offload_only = offload_only
        self.states: dict[str, RequestDraftState] = {}
        self.plain: dict[str, VeriCacheStats] = {}
        self.ahead_used: dict[str, list[int]] = {}
        self.after_prefill: dict[str, Callable[[], None]] = {}
        self.demotions: dict[str, Demotion] = {}

    def __len__(self) -> int:
        """Requests tracked (0 when idle: nothing leaked)."""
        return len(self.states | self.plain | self.after_prefill | self.demotions)

    def take_after_prefill(self) -> list[Callable[[], None]]:
        """The pending after-prefill work, in prefill order; the table is empty after."""
        work, self.after_prefill = list(self.after_prefill.values()), {}
        return work

    def stats(self, rid: str) -> VeriCacheStats | None:
        state = self.states.get(rid)
        return state.stats if state is not None else self.plain.get(rid)

    def note_plain(self, req: Any, reason: str | None = None) -> None:
        """``req`` decodes plainly (once noted, it keeps its first reason)."""
        if req.rid in self.plain or req.rid in self.states:
            return
        reason = reason or plain_reason(req) or whole_step_reason(req) or "plain step"
        self.plain[req.rid] = VeriCacheStats.plain(OFFLOAD_ONLY if self.offload_only else reason)

    def demote(self, rid: str, length: int) -> None:
        """``rid`` drops its compressed KV at committed ``length`` and decodes plainly from its
        offloaded full KV until it is ``reinstate``d (its counters keep what it drafted)."""
        state = self.states.pop(rid, None)
        self.plain[rid] = (VeriCacheStats.plain(DEMOTED) if state is None
                           else state.stats.demoted(DEMOTED))  # fmt: skip
        per_token = 0.0 if state is None else state.nbytes / max(state.covered, 1)
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

    # -- its part in the request table (requests/table.py) ------------------------------------

    participant_name = "worker"

    def tracked_rids(self) -> set[str]:
        """Every request any of the book's tables (and the acceptance estimates) holds."""
        return (self.states.keys() | self.plain.keys() | self.ahead_used.keys()
                | self.after_prefill.keys() | self.demotions.keys()
                | self.draft_length.estimates.keys())  # fmt: skip

    def forget(self, rid: str) -> None:
        self.after_prefill.pop(rid, None)  # finished at prefill, or aborted before its next step
        self.states.pop(rid, None)
        self.plain.pop(rid, None)
        self.demotions.pop(rid, None)
        self.ahead_used.pop(rid, None)  # reported in meta_info["vericache"] until now
        self.draft_length.forget(rid)

    def check_integrity(self) -> None:
        assert not self.states.keys() & self.plain.keys(), "a request both drafted and plain"
        for rid, stats in self.plain.items():
            assert stats.plain_reason, f"plain request {rid} without a reason"
            if stats.plain_reason == DEMOTED:
                assert rid in self.demotions, f"demoted request {rid} without its record"
        for rid in self.demotions:
            assert rid in self.states or rid in self.plain, f"demotion record of {rid} outlived it"
