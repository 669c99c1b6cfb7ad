"""A tier client's requests in flight (``ClientTask``) and the order queued ones are sent in.

A client has one connection to its KV server and everything on it arrives in order, so a
lookup queued behind write-throughs waits for all of them to cross the link and be verified
by the server. A request in the scheduler's queue waits on every lookup and fetch; nothing
waits on a write-through. So ``plan_sends`` (no sockets, no clock)::

    queued:  put1 put2 put3 lookup(a) put4 fetch(b) lookup(k in put1)
    sent:    lookup(a) fetch(b) | put1 put2 | lookup(k in put1)      held: put3 put4

reads go first; then puts, while fewer than ``window`` are unanswered on the wire; a read of
a key a put being sent carries follows that put (it would otherwise miss what this client is
storing). A read of a key a *held* put carries goes first anyway and may miss: recomputing is
cheaper than waiting past a deadline that would make the tier count as down.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sglang_vericache.tier.base import TaskKind
from sglang_vericache.tier.task_table import TrackedTask

PUTS_ON_THE_WIRE = 2  # unanswered puts at once: the link stays busy, a lookup waits for two


@dataclass(eq=False, kw_only=True)
class ClientTask(TrackedTask):
    """One request of ``ZmqTier``: the table's record plus its deadlines and wire state."""

    deadline: float  # no reply by then: failed
    connect_deadline: float  # not sent by then (no server): failed
    sent: bool = False
    frames: list[Any] | None = None  # built once (checksums), resent while unconnected
    signed_at: float = 0.0           # when ``frames`` were signed (re-signed when stale)
    epoch: bytes | None = None       # the epoch in the server's authenticated reply

    def hold(self, now: float, timeout_s: float, connect_timeout_s: float) -> None:
        """Held back by its own client, it is not late: its deadlines count from now (the
        link caps write-through bytes in flight, so a hold is bounded)."""
        self.deadline = max(self.deadline, now + timeout_s)
        self.connect_deadline = max(self.connect_deadline, now + connect_timeout_s)


@dataclass(frozen=True, slots=True)
class SendPlan:
    """send: to send now, in this order; held: puts that wait for the window (oldest first)."""

    send: list[ClientTask]
    held: list[ClientTask]


def plan_sends(queued: Sequence[ClientTask], puts_unanswered: int,
               window: int = PUTS_ON_THE_WIRE) -> SendPlan:  # fmt: skip
    """Order ``queued`` (oldest first) with ``puts_unanswered`` puts already on the wire."""
    puts = [t for t in queued if t.kind is TaskKind.PUT]
    room = max(0, window - puts_unanswered)
    sending = {key.digest for task in puts[:room] for key in task.keys}
    first: list[ClientTask] = []
    after: list[ClientTask] = []  # reads of a key a put being sent carries
    for task in queued:
        if task.kind is not TaskKind.PUT:
            (first if sending.isdisjoint(k.digest for k in task.keys) else after).append(task)
    return SendPlan(first + puts[:room] + after, puts[room:])
