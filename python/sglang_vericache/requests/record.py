"""One request's record: who it is, which pool row it holds, and every piece of VeriCache state
it has, whichever component made it.

Modelled on nano-vllm's ``Sequence``: plain fields, no torch, no sglang. Components keep their
logic; the state they keep *per request* is a field here (``None``: none), read and written
through ``RecordField`` views (``table.py``), so closing the record drops all of it at once and
no component can hold state for a request that has ended. Resources a field stands for (a tier
lookup's task, a drafting thread's job, fetch buffers) are released by their component, which
the table calls with the record before it goes (``RequestTable.join``).

Life of a record::

    open (prefix match, prefill) --bind_row--> ROW --note_decoding--> DECODING
         \\__________________________ close (released, aborted, left the batch) ___/

A retracted request is closed when SGLang releases its row and opened again when it is
scheduled again (same id, a fresh record).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable


class RequestEnd(str, Enum):
    """How a request's record was closed (``RequestTable.close``)."""

    RELEASED = "released"  # SGLang released its row: finished (at prefill too), aborted, retracted
    ABORTED_QUEUED = "aborted_queued"  # aborted before it held a row (SGLang's queue)
    LEFT_BATCH = "left_batch"  # gone from the decode batch with no release seen (a safety net)


@dataclass(slots=True)
class VeriRequest:
    """One live request (module doc).

    Identity and place: ``rid``, SGLang's request id; ``row``, its ``req_to_token`` row while it
    holds one (None before its prefill and after its release); ``decoding``, it has been in a
    decode batch, so leaving one without a release means it is gone (``RequestTable.keep_only``).

    The worker's (``srt/decode/request_book.py``): exactly one of ``draft`` (drafted: its
    compressed KV and counters) and ``plain`` (decoded plainly: its counters and why) once it
    has prefilled; ``demotion`` while it lives after its first demotion; ``after_prefill``, the
    work its prefill left for the next forward; ``ahead_used``, ``[drafts made while its prefix
    was fetched, drafts of those verified]``; ``acceptance``, the draft-length controller's
    estimate of its acceptance (``verify/draft_length.py``); ``context_lookup``, the n-gram
    index over its tokens that proposes lookup drafts, and their acceptance
    (``verify/prompt_lookup.py``); ``penalty_learned``, the tokens SGLang's penalizers learned
    for it (``srt/hooks/penalties.py``), and ``penalty_mirror``, their mirror along a draft chain
    (``verify/penalty_mirror.py``).

    The prefix path's (``srt/prefix/``): ``tier_generation``, the weights generation its prefix
    match saw (it may write to the tier only while that is the one served); ``lookup``, its
    remote-tier lookup or fetch in any phase, and ``fetch_claims``, the fetched chunks it
    claims (each shared with every request that claims it: ``tier/shared_fetch.py``);
    ``ahead_job``, drafting while its prefix is fetched; ``ahead_declined``, it waited too
    short to draft ahead (asked once); ``finished_draft``, its compressed KV between its finish
    and its release (kept by the prefix cache as a demoted prefix).
    """

    rid: str
    row: int | None = None
    decoding: bool = False
    # (typed Any where the type's module builds on this one: no import circle)
    draft: Any = None  # srt/kv/draft_state.RequestDraftState
    plain: Any = None  # verify/stats.VeriCacheStats
    demotion: Any = None  # srt/decode/request_book.Demotion
    after_prefill: Callable[[], None] | None = None
    ahead_used: list[int] | None = None
    acceptance: Any = None  # verify/policy.AcceptanceEstimate
    context_lookup: Any = None  # verify/prompt_lookup.RequestLookup
    penalty_learned: int | None = None  # feed-stream tokens its penalizers learned (hooks)
    penalty_mirror: Any = None  # verify/penalty_mirror.PenaltyMirror
    tier_generation: int | None = None
    lookup: Any = None  # tier/pending_prefix.PendingPrefix
    fetch_claims: list[Any] | None = None  # tier/shared_fetch chunks, in order
    ahead_job: Any = None  # srt/prefix/draft_ahead.AheadJob
    ahead_declined: bool | None = None
    finished_draft: Any = None  # srt/kv/draft_state.RequestDraftState

    @property
    def holds_row(self) -> bool:
        return self.row is not None

    def check_integrity(self) -> None:
        """Drafted or plain, never both; a demotion only of a request that is one of them."""
        assert self.draft is None or self.plain is None, f"{self.rid} both drafted and plain"
        assert self.demotion is None or self.draft is not None or self.plain is not None, (
            f"demotion record of {self.rid} outlived its state")


# The per-request state fields (everything but identity and place): ``RecordField`` views name
# one of these, and ``RequestTable.entry_counts`` counts each.
STATE_FIELDS = ("draft", "plain", "demotion", "after_prefill", "ahead_used", "acceptance",
                "context_lookup", "penalty_learned", "penalty_mirror", "tier_generation", "lookup",
                "fetch_claims", "ahead_job", "ahead_declined", "finished_draft")  # fmt: skip
