"""The paper's two resource rings, over the next W scheduler steps.

* the **link ring**: bytes the interconnect / storage link can move during
  each step (``link_bytes_per_step`` = bandwidth x expected step time);
* the **buffer ring**: transient device memory for full-KV reload buffers,
  held from the step a transfer starts through the verify step.

A request's next verification is admitted only if both fit: its transfer is
packed into the link ring as late as possible before the verify step (just
in time, so the buffer is held briefly), then the buffer ring must have room
for the whole hold. ``can_admit`` / ``admit`` / ``release`` are the
query/mutate pairs; ``advance`` moves the window forward (reservations for
past steps are consumed, not freed early: a step's capacity is spent once).

Step numbers are absolute ints chosen by the caller (the worker's step
counter); the ring covers ``[now, now + horizon_steps)``.

::

    steps:    now  now+1  now+2  now+3  now+4 (verify)
    link:      .     .     ###    ###     .        transfer, latest-first
    buffer:    .     .     ===    ===    ===       hold through the verify
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RingConfig", "TransferDemand", "Reservation", "StepRing", "VerifyRings"]


@dataclass(frozen=True, slots=True)
class RingConfig:
    """horizon_steps: W, steps tracked from ``now`` (>= 2).
    link_bytes_per_step: bytes the link moves per step (>= 1).
    buffer_bytes: transient device memory for reload buffers (>= 1).
    hold_after_steps: extra steps a buffer stays held after its verify step
        (>= 0; covers a verify that slips by that many steps)."""

    horizon_steps: int
    link_bytes_per_step: int
    buffer_bytes: int
    hold_after_steps: int = 0

    def __post_init__(self) -> None:
        if self.horizon_steps < 2:
            raise ValueError(f"horizon_steps must be >= 2, got {self.horizon_steps}")
        if self.link_bytes_per_step < 1 or self.buffer_bytes < 1:
            raise ValueError("link_bytes_per_step and buffer_bytes must be >= 1")
        if not 0 <= self.hold_after_steps < self.horizon_steps - 1:
            raise ValueError("hold_after_steps must be in [0, horizon_steps - 2]")


@dataclass(frozen=True, slots=True)
class TransferDemand:
    """What one verification needs: link_bytes to move (>= 0; 0 when the full
    KV is already on the device) and buffer_bytes of transient memory (>= 0)."""

    link_bytes: int
    buffer_bytes: int

    def __post_init__(self) -> None:
        if self.link_bytes < 0 or self.buffer_bytes < 0:
            raise ValueError("link_bytes and buffer_bytes must be >= 0")


@dataclass(frozen=True, slots=True)
class Reservation:
    """An admitted verification.

    verify_step: the step the verify forward runs in.
    transfer: ((step, bytes), ...) ascending; sums to the demand's link_bytes;
        every step < verify_step. Empty for a zero-byte transfer.
    hold_first, hold_last: inclusive steps the buffer is held.
    """

    rid: str
    verify_step: int
    transfer: tuple[tuple[int, int], ...]
    hold_first: int
    hold_last: int
    buffer_bytes: int

    @property
    def fetch_step(self) -> int:
        """Step in which the transfer should start (verify_step when empty)."""
        return self.transfer[0][0] if self.transfer else self.verify_step

    @property
    def link_bytes(self) -> int:
        return sum(b for _, b in self.transfer)


class StepRing:
    """Per-step capacity over ``[now, now + horizon)`` with per-rid reservations."""

    __slots__ = ("name", "horizon", "capacity", "now", "_used", "_by_rid")

    def __init__(self, name: str, horizon: int, capacity: int, now: int = 0) -> None:
        self.name = name
        self.horizon = horizon
        self.capacity = capacity
        self.now = now
        self._used = [0] * horizon  # index: step % horizon
        self._by_rid: dict[str, dict[int, int]] = {}

    def in_window(self, step: int) -> bool:
        return self.now <= step < self.now + self.horizon

    def free_at(self, step: int) -> int:
        """Capacity left at ``step`` (0 outside the window)."""
        if not self.in_window(step):
            return 0
        return self.capacity - self._used[step % self.horizon]

    def can_reserve(self, amounts: Mapping[int, int]) -> bool:
        """Query: every (step, amount) is in the window and fits."""
        return all(a >= 0 and self.in_window(s) and a <= self.free_at(s)
                   for s, a in amounts.items())

    def reserve(self, rid: str, amounts: Mapping[int, int]) -> None:
        """Mutate: add a reservation for a rid that holds none here."""
        if rid in self._by_rid:
            raise KeyError(f"{self.name}: {rid} already holds a reservation")
        if not self.can_reserve(amounts):
            raise ValueError(f"{self.name}: reservation for {rid} does not fit")
        kept = {s: a for s, a in amounts.items() if a > 0}
        for s, a in kept.items():
            self._used[s % self.horizon] += a
        self._by_rid[rid] = kept

    def release(self, rid: str) -> int:
        """Mutate: free what remains of rid's reservation; returns the amount
        freed (steps already passed were consumed). KeyError if rid holds none."""
        amounts = self._by_rid.pop(rid)
        freed = 0
        for s, a in amounts.items():
            self._used[s % self.horizon] -= a
            freed += a
        return freed

    def holds(self, rid: str) -> bool:
        return rid in self._by_rid

    def reserved(self, rid: str) -> dict[int, int]:
        """rid's remaining (future or current) amounts by step."""
        return dict(self._by_rid[rid])

    def advance(self, now: int) -> None:
        """Move the window to start at ``now`` (never backwards)."""
        if now < self.now:
            raise ValueError(f"{self.name}: cannot move from step {self.now} back to {now}")
        for amounts in self._by_rid.values():
            for s in [s for s in amounts if s < now]:
                del amounts[s]
        for s in range(self.now, min(now, self.now + self.horizon)):
            self._used[s % self.horizon] = 0
        self.now = now
        # A step entering the window can only hold amounts that were
        # reserved for it, and nothing could be reserved beyond the window.

    def check_integrity(self) -> None:
        expected = [0] * self.horizon
        for rid, amounts in self._by_rid.items():
            for s, a in amounts.items():
                assert self.in_window(s), (self.name, rid, s, self.now)
                assert a > 0, (self.name, rid, s, a)
                expected[s % self.horizon] += a
        assert expected == self._used, (self.name, expected, self._used)
        assert all(0 <= u <= self.capacity for u in self._used), (self.name, self._used)


class VerifyRings:
    """Link ring + buffer ring; one reservation per rid at a time."""

    __slots__ = ("config", "link", "buffer", "_reservations")

    def __init__(self, config: RingConfig, now: int = 0) -> None:
        self.config = config
        self.link = StepRing("link", config.horizon_steps, config.link_bytes_per_step, now)
        self.buffer = StepRing("buffer", config.horizon_steps, config.buffer_bytes, now)
        self._reservations: dict[str, Reservation] = {}

    @property
    def now(self) -> int:
        return self.link.now

    def advance(self, now: int) -> None:
        self.link.advance(now)
        self.buffer.advance(now)

    def fits_empty(self, demand: TransferDemand) -> bool:
        """Could ``demand`` be admitted at all (on empty rings, latest verify step)?"""
        cfg = self.config
        usable = cfg.horizon_steps - 1 - cfg.hold_after_steps  # transfer steps before verify
        steps_needed = -(-demand.link_bytes // cfg.link_bytes_per_step)
        return steps_needed <= usable and demand.buffer_bytes <= cfg.buffer_bytes

    def plan(self, rid: str, demand: TransferDemand, earliest: int,
             verify_step: int) -> Reservation | None:
        """Query: the reservation ``admit`` would make, or None if it does not fit.

        The transfer uses steps in ``[max(earliest, now), verify_step)``, filled
        latest-first; the buffer is held from the first transfer step through
        ``verify_step + hold_after_steps``, which must lie inside the window.
        """
        first_ok = max(earliest, self.now)
        hold_last = verify_step + self.config.hold_after_steps
        if verify_step < first_ok or not self.link.in_window(hold_last):
            return None
        left = demand.link_bytes
        transfer: list[tuple[int, int]] = []
        step = verify_step - 1
        while left > 0 and step >= first_ok:
            take = min(left, self.link.free_at(step))
            if take > 0:
                transfer.append((step, take))
                left -= take
            step -= 1
        if left > 0:
            return None
        transfer.reverse()
        hold_first = transfer[0][0] if transfer else verify_step
        if demand.buffer_bytes > 0 and any(
                self.buffer.free_at(s) < demand.buffer_bytes
                for s in range(hold_first, hold_last + 1)):
            return None
        return Reservation(rid=rid, verify_step=verify_step, transfer=tuple(transfer),
                           hold_first=hold_first, hold_last=hold_last,
                           buffer_bytes=demand.buffer_bytes)

    def can_admit(self, rid: str, demand: TransferDemand, earliest: int,
                  verify_step: int) -> bool:
        """Query: ``admit`` with these arguments would succeed."""
        return rid not in self._reservations and \
            self.plan(rid, demand, earliest, verify_step) is not None

    def admit(self, rid: str, demand: TransferDemand, earliest: int,
              verify_step: int) -> Reservation:
        """Mutate: reserve link bytes and buffer memory for rid's next verify.
        Raises KeyError if rid already holds one, ValueError if it does not fit."""
        if rid in self._reservations:
            raise KeyError(f"{rid} already holds a reservation")
        res = self.plan(rid, demand, earliest, verify_step)
        if res is None:
            raise ValueError(f"verification of {rid} at step {verify_step} does not fit")
        self.link.reserve(rid, dict(res.transfer))
        hold = {s: res.buffer_bytes for s in range(res.hold_first, res.hold_last + 1)}
        self.buffer.reserve(rid, hold)
        self._reservations[rid] = res
        return res

    def release(self, rid: str) -> None:
        """Mutate: free what remains of rid's reservation (after its verify, or
        on abort). KeyError if rid holds none."""
        res = self._reservations.pop(rid)
        self.link.release(res.rid)
        self.buffer.release(res.rid)

    def reservation(self, rid: str) -> Reservation | None:
        return self._reservations.get(rid)

    def __contains__(self, rid: object) -> bool:
        return rid in self._reservations

    def __len__(self) -> int:
        return len(self._reservations)

    def check_integrity(self) -> None:
        self.link.check_integrity()
        self.buffer.check_integrity()
        assert self.link.now == self.buffer.now
        assert set(self._reservations) == set(self.link._by_rid) == set(self.buffer._by_rid)
        for rid, res in self._reservations.items():
            assert res.rid == rid
            assert all(s < res.verify_step for s, _ in res.transfer)
            assert res.hold_first <= res.hold_last
            # What is still reserved is exactly the not-yet-passed part.
            assert self.link.reserved(rid) == {s: b for s, b in res.transfer
                                               if s >= self.now and b > 0}
            want = {s: res.buffer_bytes for s in range(max(res.hold_first, self.now),
                                                       res.hold_last + 1)
                    if res.buffer_bytes > 0}
            assert self.buffer.reserved(rid) == want
