"""Per-request verify-window state machine (pure python).

One :class:`VerifyWindow` per greedy request follows it through repeated
windows::

              add_drafts*          end_draft            begin_verify
    +--> DRAFT ----------> DRAFT ----------> AWAIT_FULL -----------> VERIFY
    |                                     (needs fetch RESIDENT)        |
    |                                                              resolve(committed)
    |                                                       all drafts |  some draft
    |                 settle(next_len)                      accepted   v  rejected
    +---------------------------------------------------- COMMIT  or  ROLLBACK

    finish(): DRAFT | AWAIT_FULL | COMMIT | ROLLBACK -> FINISHED (terminal)

The full-KV fetch for the window's verification is a second, independent
track (``NONE -> IN_FLIGHT -> RESIDENT``) that may start in DRAFT so the
transfer overlaps drafting; ``fetch_failed`` returns it to NONE (the worker
then recomputes or refetches). ``settle`` releases the transient buffer
(back to NONE). Illegal transitions raise :class:`IllegalTransition` and
leave the window unchanged. Time is always passed in (``now``, seconds from
any monotonic clock), never read here, so tests are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from sglang_vericache.verify.stats import VeriCacheStats, VerifyRecord

__all__ = ["Phase", "FetchState", "IllegalTransition", "VerifyWindow"]


class Phase(str, Enum):
    DRAFT = "draft"  # drafting from the compressed KV
    AWAIT_FULL = "await_full"  # draft closed; waiting for the full KV / verify slot
    VERIFY = "verify"  # verify forward over the full KV in progress
    COMMIT = "commit"  # every draft accepted (+ bonus); committed KV to append
    ROLLBACK = "rollback"  # a draft rejected: accepted prefix + correction committed, rest dropped
    FINISHED = "finished"  # request done; no further transitions


class FetchState(str, Enum):
    NONE = "none"
    IN_FLIGHT = "in_flight"
    RESIDENT = "resident"


class IllegalTransition(RuntimeError):
    """A transition was requested from a state that does not allow it."""


class VerifyWindow:
    """Verify-window state of one request.

    Holds the current window's drafts (python ints), its target draft length,
    the fetch track and the request's cumulative :class:`VeriCacheStats`.
    Not thread-safe: the scheduler thread owns it; fetch completions are
    reported by the worker after polling the tier.
    """

    __slots__ = ("rid", "phase", "target_len", "_drafts", "fetch", "fetch_bytes",
                 "_await_since", "_window_wait_s", "_fetch_failures_window", "stats",
                 "last_record")

    def __init__(self, rid: str, target_len: int) -> None:
        """rid: request id; target_len: drafts planned for the first window (>= 0)."""
        if target_len < 0:
            raise ValueError(f"target_len must be >= 0, got {target_len}")
        self.rid = rid
        self.phase = Phase.DRAFT
        self.target_len = target_len
        self._drafts: list[int] = []
        self.fetch = FetchState.NONE
        self.fetch_bytes = 0
        self._await_since: float | None = None
        self._window_wait_s = 0.0
        self._fetch_failures_window = 0
        self.stats = VeriCacheStats()
        self.last_record: VerifyRecord | None = None

    # ----------------------------------------------------------------- queries
    @property
    def drafts(self) -> tuple[int, ...]:
        """Drafted token ids of the current window, in order."""
        return tuple(self._drafts)

    @property
    def num_drafted(self) -> int:
        return len(self._drafts)

    @property
    def draft_room(self) -> int:
        """Drafts still allowed in this window (0 outside DRAFT)."""
        return self.target_len - len(self._drafts) if self.phase is Phase.DRAFT else 0

    def ready_to_verify(self) -> bool:
        """AWAIT_FULL with the full KV resident: ``begin_verify`` would succeed."""
        return self.phase is Phase.AWAIT_FULL and self.fetch is FetchState.RESIDENT

    @property
    def rolled_back(self) -> int:
        """Drafts discarded by the last resolve (COMMIT/ROLLBACK only, else 0)."""
        if self.phase in (Phase.COMMIT, Phase.ROLLBACK) and self.last_record is not None:
            return self.last_record.drafted - self.last_record.accepted
        return 0

    # ------------------------------------------------------------- transitions
    def _require(self, *phases: Phase, action: str) -> None:
        if self.phase not in phases:
            allowed = ", ".join(p.name for p in phases)
            raise IllegalTransition(f"{self.rid}: {action} in {self.phase.name} (needs {allowed})")

    def retarget(self, target_len: int) -> None:
        """DRAFT: change the planned draft length (>= drafts already made)."""
        self._require(Phase.DRAFT, action="retarget")
        if target_len < len(self._drafts):
            raise IllegalTransition(
                f"{self.rid}: retarget to {target_len} below {len(self._drafts)} drafts made")
        self.target_len = target_len

    def add_drafts(self, tokens: Sequence[int]) -> None:
        """DRAFT: append drafted token ids; never beyond ``target_len``."""
        self._require(Phase.DRAFT, action="add_drafts")
        if len(self._drafts) + len(tokens) > self.target_len:
            raise IllegalTransition(
                f"{self.rid}: {len(self._drafts)} + {len(tokens)} drafts exceed {self.target_len}")
        self._drafts.extend(int(t) for t in tokens)

    def end_draft(self, now: float) -> None:
        """DRAFT -> AWAIT_FULL: close the draft (full, or early at EOS/budget)."""
        self._require(Phase.DRAFT, action="end_draft")
        self.phase = Phase.AWAIT_FULL
        self._await_since = now

    def start_fetch(self, nbytes: int) -> None:
        """Fetch NONE -> IN_FLIGHT (in DRAFT or AWAIT_FULL); nbytes >= 0 to move."""
        self._require(Phase.DRAFT, Phase.AWAIT_FULL, action="start_fetch")
        if self.fetch is not FetchState.NONE:
            raise IllegalTransition(f"{self.rid}: start_fetch with fetch {self.fetch.name}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.fetch = FetchState.IN_FLIGHT
        self.fetch_bytes = nbytes

    def fetch_done(self, now: float) -> None:
        """Fetch IN_FLIGHT -> RESIDENT; time spent in AWAIT_FULL counts as wait."""
        self._require(Phase.DRAFT, Phase.AWAIT_FULL, action="fetch_done")
        if self.fetch is not FetchState.IN_FLIGHT:
            raise IllegalTransition(f"{self.rid}: fetch_done with fetch {self.fetch.name}")
        if self._await_since is not None:
            self._window_wait_s += max(0.0, now - self._await_since)
        self.fetch = FetchState.RESIDENT

    def fetch_failed(self, now: float) -> None:
        """Fetch IN_FLIGHT -> NONE; counted. The wait so far still counts."""
        self._require(Phase.DRAFT, Phase.AWAIT_FULL, action="fetch_failed")
        if self.fetch is not FetchState.IN_FLIGHT:
            raise IllegalTransition(f"{self.rid}: fetch_failed with fetch {self.fetch.name}")
        if self._await_since is not None:
            self._window_wait_s += max(0.0, now - self._await_since)
            self._await_since = now
        self.fetch = FetchState.NONE
        self.fetch_bytes = 0
        self.stats.record_fetch_failure()
        self._fetch_failures_window += 1

    def begin_verify(self) -> None:
        """AWAIT_FULL (full KV resident) -> VERIFY."""
        self._require(Phase.AWAIT_FULL, action="begin_verify")
        if self.fetch is not FetchState.RESIDENT:
            raise IllegalTransition(f"{self.rid}: begin_verify with fetch {self.fetch.name}")
        self.phase = Phase.VERIFY

    def resolve(self, committed: Sequence[int]) -> VerifyRecord:
        """VERIFY -> COMMIT | ROLLBACK with the tokens the verifier committed.

        committed: the row's committed tokens (``AcceptResult.row_tokens``):
        1 to ``num_drafted + 1`` ints whose all-but-last must equal the first
        drafts (greedy acceptance guarantees it; a mismatch is a worker bug
        and raises ``ValueError`` without changing state).
        Returns the :class:`VerifyRecord`, also added to ``stats``.
        """
        self._require(Phase.VERIFY, action="resolve")
        n = len(committed)
        if not 1 <= n <= len(self._drafts) + 1:
            raise ValueError(f"{self.rid}: {n} committed tokens for {len(self._drafts)} drafts")
        if [int(t) for t in committed[:-1]] != self._drafts[: n - 1]:
            raise ValueError(f"{self.rid}: committed prefix differs from the accepted drafts")
        rec = VerifyRecord(drafted=len(self._drafts), committed=n,
                           bytes_fetched=self.fetch_bytes, wait_full_s=self._window_wait_s)
        self.stats.record(rec)
        self.last_record = rec
        self.phase = Phase.COMMIT if n == len(self._drafts) + 1 else Phase.ROLLBACK
        return rec

    def settle(self, next_target_len: int) -> None:
        """COMMIT | ROLLBACK -> DRAFT: committed KV appended, transient full KV
        released by the caller; start the next window with ``next_target_len``."""
        self._require(Phase.COMMIT, Phase.ROLLBACK, action="settle")
        if next_target_len < 0:
            raise ValueError(f"next_target_len must be >= 0, got {next_target_len}")
        self.phase = Phase.DRAFT
        self.target_len = next_target_len
        self._drafts.clear()
        self.fetch = FetchState.NONE
        self.fetch_bytes = 0
        self._await_since = None
        self._window_wait_s = 0.0
        self._fetch_failures_window = 0

    def finish(self) -> FetchState:
        """Any phase but VERIFY/FINISHED -> FINISHED.

        Returns the fetch state it had: IN_FLIGHT means the caller must still
        poll the transfer to completion (the tier returns every result exactly
        once) and free its buffer; RESIDENT means the transient full KV is
        still on the device and the caller frees it; NONE means nothing to do.
        """
        self._require(Phase.DRAFT, Phase.AWAIT_FULL, Phase.COMMIT, Phase.ROLLBACK,
                      action="finish")
        had = self.fetch
        self.phase = Phase.FINISHED
        self._drafts.clear()
        self.fetch = FetchState.NONE
        self.fetch_bytes = 0
        self._await_since = None
        return had

    # --------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Raise AssertionError if the window's fields contradict its phase."""
        self.stats.check_integrity()
        assert self.target_len >= 0
        assert 0 <= len(self._drafts) <= self.target_len
        assert self.fetch_bytes >= 0 and self._window_wait_s >= 0.0
        if self.fetch is FetchState.NONE:
            assert self.fetch_bytes == 0
        if self.phase is Phase.DRAFT:
            assert self._await_since is None
        if self.phase is Phase.AWAIT_FULL:
            assert self._await_since is not None
        if self.phase in (Phase.VERIFY, Phase.COMMIT, Phase.ROLLBACK):
            assert self.fetch is FetchState.RESIDENT
        if self.phase in (Phase.COMMIT, Phase.ROLLBACK):
            rec = self.last_record
            assert rec is not None and rec.drafted == len(self._drafts)
            assert (rec.committed == rec.drafted + 1) == (self.phase is Phase.COMMIT)
        if self.phase is Phase.FINISHED:
            assert not self._drafts and self.fetch is FetchState.NONE
        assert self._fetch_failures_window <= self.stats.fetch_failures
