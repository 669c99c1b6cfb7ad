"""Staggered verification: which requests verify in which step.

Each step a request either drafts one token (from the compressed KV) or
verifies; a window of ``x`` drafts therefore spans ``x + 1`` steps, and in
steady state about ``bs / (x + 1)`` requests verify per step (the paper's
"about 1/x of the batch"). The scheduler gives each window a **verify step**:

* the window starting (first draft) at step ``s`` with desired length ``x``
  tries ``s + x``, then ``s + x - 1``, ``s + x + 1``, ``s + x - 2``, ... (the
  paper's x +- 1, x +- 2 search) within ``[s + min_len, s + max_len]``;
* a candidate is taken if fewer than ``ceil(n_active / (x + 1))`` verifies
  are already planned for that step and the two rings admit its transfer
  and buffer (:class:`~sglang_vericache.verify.rings.VerifyRings`);
* requests that fit nowhere wait in a FIFO queue and are planned, oldest
  first, at later steps (head-of-line: a later request never overtakes an
  earlier one, so none starves); a request whose window is over verifies at
  the first step that fits.

Because new windows pick the least-crowded nearby step, requests that arrive
together spread their phases over the cycle. Pure python; the worker passes
the step counter and the number of active requests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from sglang_vericache.verify.rings import Reservation, RingConfig, TransferDemand, VerifyRings

__all__ = ["StaggerConfig", "WindowPlan", "StepPlan", "StaggerScheduler"]


@dataclass(frozen=True, slots=True)
class StaggerConfig:
    """min_len, max_len: bounds of the draft length search (1 <= min <= max).
    rings: the resource rings; horizon_steps must exceed max_len + hold."""

    min_len: int
    max_len: int
    rings: RingConfig

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if self.rings.horizon_steps <= self.max_len + self.rings.hold_after_steps:
            raise ValueError("rings.horizon_steps must be > max_len + hold_after_steps")


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """A planned window: rid drafts from ``start_step`` and verifies in
    ``verify_step``; ``draft_len`` = min(verify_step - start_step, max_len)
    is the length to give the window (``VerifyWindow.retarget``); when the
    window ran late the request idles in AWAIT_FULL after ``draft_len`` drafts."""

    rid: str
    start_step: int
    verify_step: int
    draft_len: int
    reservation: Reservation


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the worker does in one step.

    planned: windows planned this step, oldest request first.
    start_fetch: rids whose transfer starts now (each reported once).
    verify: rids whose verify step has come (oldest due first), still
        planned until ``complete``; verify those whose full KV is resident.
    """

    planned: tuple[WindowPlan, ...]
    start_fetch: tuple[str, ...]
    verify: tuple[str, ...]


@dataclass(slots=True)
class _Pending:
    rid: str
    start_step: int
    draft_len: int
    demand: TransferDemand
    seq: int


@dataclass(slots=True)
class _Planned:
    res: Reservation
    start_step: int
    seq: int
    fetch_started: bool = False


def _search_order(x: int, lo: int, hi: int) -> list[int]:
    """x, x-1, x+1, x-2, x+2, ... restricted to [lo, hi]."""
    order = [x] if lo <= x <= hi else []
    for d in range(1, max(x - lo, hi - x) + 1):
        order += [v for v in (x - d, x + d) if lo <= v <= hi]
    return order


@dataclass(slots=True)
class StaggerScheduler:
    """Plans each request's next verification (step, transfer, buffer).

    Per step, the worker calls :meth:`step`; after a request verifies (or
    finishes) it calls :meth:`complete`; when a window starts it calls
    :meth:`submit`. Not thread-safe (scheduler thread only).
    """

    config: StaggerConfig
    now: int = 0
    rings: VerifyRings = field(init=False)
    _pending: list[_Pending] = field(default_factory=list)
    _planned: dict[str, _Planned] = field(default_factory=dict)
    _verifies_at: dict[int, int] = field(default_factory=dict)
    _seq: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.rings = VerifyRings(self.config.rings, self.now)

    # ----------------------------------------------------------------- queries
    def fits_ever(self, demand: TransferDemand) -> bool:
        """Admission check: could this demand ever be planned (empty rings)?
        A request failing it must be decoded without VeriCache."""
        return self.rings.fits_empty(demand)

    def cap(self, n_active: int, draft_len: int) -> int:
        """Planned verifies allowed per step: ceil(n_active / (draft_len + 1))."""
        return max(1, -(-n_active // (draft_len + 1)))

    def is_tracked(self, rid: str) -> bool:
        return rid in self._planned or any(p.rid == rid for p in self._pending)

    def reservation(self, rid: str) -> Reservation | None:
        p = self._planned.get(rid)
        return p.res if p else None

    def verifies_planned_at(self, step: int) -> int:
        return self._verifies_at.get(step, 0)

    # ----------------------------------------------------------------- mutates
    def submit(self, rid: str, start_step: int, draft_len: int,
               demand: TransferDemand) -> None:
        """Queue the window of rid that starts drafting at ``start_step`` with
        desired length ``draft_len`` (>= 0; clipped to [min_len, max_len] in
        the search). Planned at the next :meth:`step`. Raises if rid is
        already tracked or the demand can never fit."""
        if self.is_tracked(rid):
            raise KeyError(f"{rid} already has a window queued or planned")
        if draft_len < 0:
            raise ValueError(f"draft_len must be >= 0, got {draft_len}")
        if not self.fits_ever(demand):
            raise ValueError(f"{rid}: demand {demand} can never fit the rings")
        self._pending.append(_Pending(rid, start_step, draft_len, demand, next(self._seq)))

    def step(self, now: int, n_active: int) -> StepPlan:
        """Advance to step ``now``, plan queued windows FIFO, report the work.

        n_active: requests in the batch that use VeriCache (>= 1 when any is
        tracked); sets the per-step verify cap.
        """
        if now < self.now:
            raise ValueError(f"step {now} is before {self.now}")
        self.now = now
        self.rings.advance(now)
        for s in [s for s in self._verifies_at if s < now]:
            del self._verifies_at[s]
        planned: list[WindowPlan] = []
        while self._pending:
            res = self._try_plan(self._pending[0], max(n_active, 1))
            if res is None:
                break  # head-of-line: keep FIFO order so nobody starves
            p = self._pending.pop(0)
            self._planned[p.rid] = _Planned(res, p.start_step, p.seq)
            self._verifies_at[res.verify_step] = self._verifies_at.get(res.verify_step, 0) + 1
            draft_len = min(res.verify_step - p.start_step, self.config.max_len)
            planned.append(WindowPlan(p.rid, p.start_step, res.verify_step, draft_len, res))
        start_fetch = []
        for rid, pl in self._planned.items():
            if not pl.fetch_started and pl.res.fetch_step <= now:
                pl.fetch_started = True
                start_fetch.append(rid)
        due = sorted((pl.res.verify_step, pl.seq, rid) for rid, pl in self._planned.items()
                     if pl.res.verify_step <= now)
        return StepPlan(planned=tuple(planned), start_fetch=tuple(start_fetch),
                        verify=tuple(rid for _, _, rid in due))

    def complete(self, rid: str) -> None:
        """rid verified (or finished/aborted): drop its plan or queued window
        and free what remains of its reservation. KeyError if not tracked."""
        pl = self._planned.pop(rid, None)
        if pl is None:
            for i, p in enumerate(self._pending):
                if p.rid == rid:
                    del self._pending[i]
                    return
            raise KeyError(f"{rid} is not tracked")
        self.rings.release(rid)
        step = pl.res.verify_step
        if step in self._verifies_at:
            self._verifies_at[step] -= 1
            if self._verifies_at[step] == 0:
                del self._verifies_at[step]

    # ---------------------------------------------------------------- internal
    def _try_plan(self, p: _Pending, n_active: int) -> Reservation | None:
        cfg = self.config
        x = min(max(p.draft_len, cfg.min_len), cfg.max_len)
        cap = self.cap(n_active, x)
        earliest = self.now + 1  # planning happens at the start of step `now`
        lo, hi = p.start_step + cfg.min_len, p.start_step + cfg.max_len
        candidates = [p.start_step + v for v in _search_order(x, cfg.min_len, cfg.max_len)]
        if hi < earliest or not candidates:
            # The window is over: verify at the first step that fits.
            candidates = list(range(earliest, self.now + cfg.rings.horizon_steps))
        else:
            candidates = [c for c in candidates if c >= earliest] or \
                list(range(max(lo, earliest), self.now + cfg.rings.horizon_steps))
        for step in candidates:
            if self._verifies_at.get(step, 0) >= cap:
                continue
            if self.rings.can_admit(p.rid, p.demand, self.now, step):
                return self.rings.admit(p.rid, p.demand, self.now, step)
        return None

    def check_integrity(self) -> None:
        """Raise AssertionError if plans, counts and rings disagree."""
        self.rings.check_integrity()
        assert self.rings.now == self.now
        assert set(self._planned) == {r for r in self._planned if r in self.rings}
        assert len(self.rings) == len(self._planned)
        pending_rids = [p.rid for p in self._pending]
        assert len(pending_rids) == len(set(pending_rids))
        assert not set(pending_rids) & set(self._planned)
        assert [p.seq for p in self._pending] == sorted(p.seq for p in self._pending)
        counts: dict[int, int] = {}
        for pl in self._planned.values():
            s = pl.res.verify_step
            if s >= self.now:
                counts[s] = counts.get(s, 0) + 1
        assert counts == {s: c for s, c in self._verifies_at.items() if s >= self.now}
        for rid, pl in self._planned.items():
            assert pl.res.rid == rid and pl.res.verify_step > pl.start_step
