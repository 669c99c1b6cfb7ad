"""The order a tier client sends in (tier/outbox.py): pure, then against a throttled server."""

from __future__ import annotations

import dataclasses
import time

import torch
from sglang_vericache.tier.base import TaskId, TaskKind
from sglang_vericache.tier.client import ZmqTier
from sglang_vericache.tier.keys import chunk_keys
from sglang_vericache.tier.layout import split_chunks
from sglang_vericache.tier.outbox import ClientTask, plan_sends
from tier_testlib import TINY, Results, ServerProcess


def _task(n: int, kind: TaskKind, tokens: range) -> ClientTask:
    return ClientTask(TaskId(n), kind, chunk_keys(TINY, list(tokens)), [], deadline=10.0,
                      connect_deadline=1.0)


def test_reads_go_first_puts_keep_a_window_and_a_read_follows_the_put_it_needs() -> None:
    put1, put2, put3 = (_task(i, TaskKind.PUT, range(100 * i, 100 * i + 8)) for i in (1, 2, 3))
    lookup = _task(4, TaskKind.LOOKUP, range(900, 908))
    put4 = _task(5, TaskKind.PUT, range(500, 508))
    fetch = _task(6, TaskKind.FETCH, range(600, 608))
    needs_put1 = _task(7, TaskKind.LOOKUP, range(100, 108))
    needs_put3 = _task(8, TaskKind.LOOKUP, range(300, 308))
    queued = [put1, put2, put3, lookup, put4, fetch, needs_put1, needs_put3]
    plan = plan_sends(queued, puts_unanswered=0, window=2)
    assert plan.send == [lookup, fetch, needs_put3, put1, put2, needs_put1]
    assert plan.held == [put3, put4]
    busy = plan_sends(queued, puts_unanswered=2, window=2)  # the window is full: reads only
    assert busy.send == [lookup, fetch, needs_put1, needs_put3]
    assert busy.held == [put1, put2, put3, put4]


def test_a_held_put_is_not_late() -> None:
    task = _task(1, TaskKind.PUT, range(8))
    task.hold(now=100.0, timeout_s=30.0, connect_timeout_s=2.0)
    assert (task.deadline, task.connect_deadline) == (130.0, 102.0)
    task.hold(now=50.0, timeout_s=30.0, connect_timeout_s=2.0)  # never earlier
    assert (task.deadline, task.connect_deadline) == (130.0, 102.0)


def test_puts_go_two_at_a_time_and_a_lookup_overtakes_the_queue() -> None:
    """Eight write-throughs on a throttled link: two on the wire at a time (their deadlines
    count from when they are sent, so none fails while held), and a lookup submitted after
    them is answered before the last put."""
    g = dataclasses.replace(TINY, model_id="outbox", chunk_tokens=2048)  # 256 KiB per chunk
    with ServerProcess("--bandwidth-mbps", "5") as server:  # ~50 ms per put acknowledgement
        tier = ZmqTier(server.endpoint, g, timeout_s=20, connect_timeout_s=0.2)
        res = Results(tier)
        puts = []
        for i in range(8):
            keys = chunk_keys(g, [i] * 2048)
            puts.append(tier.submit_put(keys, split_chunks(torch.randn(2, 2, 2, 2048, 4), g)))
        lookup = tier.submit_lookup(chunk_keys(g, [0] * 2048))
        time.sleep(0.1)
        with tier._lock:  # what the I/O thread has put on the wire so far
            on_wire = sum(1 for t in tier._tasks.values() if t.kind is TaskKind.PUT and t.sent)
        assert on_wire <= 2
        res.wait(lookup)
        assert puts[-1] not in res.seen
        assert all(r.all_ok for r in res.wait_all(puts, timeout_s=20))  # none failed held
        tier.close()
