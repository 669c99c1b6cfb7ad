"""The lookup -> fetch -> take state machine of srt/prefix/remote_prefix.py, on real tiers."""

from __future__ import annotations

import time

import torch
from sglang_vericache.srt.prefix.remote_prefix import RemotePrefixLink
from sglang_vericache.tier.client import ZmqTier
from sglang_vericache.tier.host import HostTier
from sglang_vericache.tier.link_bounds import LinkBounds
from sglang_vericache.tier.pending_prefix import PrefixPhase
from tier_testlib import TINY, ServerProcess

C = TINY.chunk_tokens  # 8


def _sequence_kv(n: int) -> torch.Tensor:
    """Distinct full KV per position: [L, 2, H_kv, n, D]."""
    return torch.arange(n, dtype=torch.float32).view(1, 1, 1, n, 1).expand(
        TINY.num_layers, 2, TINY.num_kv_heads, n, TINY.head_dim).contiguous()


def _settle(link: RemotePrefixLink, rid: str, tokens, device_len: int, timeout: float = 10.0):
    """Probe until the reported hit stops being provisional (what the scheduler does)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hit = link.probe(rid, tokens, device_len)
        link.check_integrity()  # requests' phases and their chunk claims agree at every step
        state = link.pending.get(rid)
        if state is None or state.phase in (PrefixPhase.READY, PrefixPhase.MISS):
            return hit
        time.sleep(0.01)
    raise AssertionError("tier task never finished")


def test_written_prefix_is_fetched_exactly_past_the_device_match() -> None:
    link = RemotePrefixLink(HostTier(TINY, capacity_bytes=1 << 20))
    tokens = list(range(100, 130))  # 3 whole chunks + 6 tokens
    kv = _sequence_kv(len(tokens))
    assert link.write_through(tokens, lambda s, e: kv[..., s:e, :]) == 3
    _settle(link, "warm", tokens, 0)  # completes the put
    assert link.write_through(tokens, lambda s, e: kv[..., s:e, :]) == 0  # already stored
    turn2 = tokens + [7, 7, 7]
    assert _settle(link, "r", turn2, device_len=5) == 3 * C - 5
    got = link.take("r", 5, 3 * C - 5)
    assert torch.equal(got, kv[..., 5 : 3 * C, :])  # exactly the positions past the match
    assert "r" not in link.pending and link.counters.hits_tokens == 3 * C - 5


def test_a_fetch_that_lands_short_is_never_loaded_short() -> None:
    """The probe that saw the lookup in flight reported every chunk; the fetch then lands with
    only the first (the middle one was evicted after the lookup). ``take`` of the promised
    length says "not yet" (SGLang would raise on a short load); the next probe reports exactly
    what arrived, and ``take`` of that length returns it."""
    tier = HostTier(TINY, capacity_bytes=1 << 20)
    link = RemotePrefixLink(tier)
    tokens = list(range(300, 300 + 3 * C))
    kv = _sequence_kv(len(tokens))
    link.write_through(tokens, lambda s, e: kv[..., s:e, :])
    link.poll()  # the put is published
    turn2 = tokens + [9]
    promised = link.probe("r", turn2, device_len=3)
    assert promised == 3 * C - 3  # lookup in flight: the whole stored prefix
    middle = link.pending["r"].keys[1]
    assert tier._store.remove(middle.digest)  # evicted between lookup and fetch
    assert link.take("r", 3, promised) is False  # lookup done, fetch submitted
    assert link.take("r", 3, promised) is False  # fetch landed with 1 of 3 chunks: not short
    assert "r" in link.pending
    exact = link.probe("r", turn2, device_len=3)
    assert exact == C - 3
    got = link.take("r", 3, exact)
    assert torch.equal(got, kv[..., 3:C, :]) and "r" not in link.pending
    assert link.counters.hits_tokens == C - 3


def test_other_tokens_miss_and_report_zero() -> None:
    link = RemotePrefixLink(HostTier(TINY, capacity_bytes=1 << 20))
    tokens = list(range(40))
    link.write_through(tokens, lambda s, e: _sequence_kv(e)[..., s:e, :])
    other = [1] + tokens[1:]  # one different first token: every chained key differs
    assert _settle(link, "x", other, 0) == 0
    assert link.take("x", 0, 0) is None
    assert link.probe("short", tokens[:C - 1], 0) == 0  # less than a chunk: no lookup at all


def test_dead_server_fails_over_to_recompute() -> None:
    server = ServerProcess()
    tier = ZmqTier(server.endpoint, TINY, timeout_s=2.0, connect_timeout_s=0.5)
    link = RemotePrefixLink(tier)
    tokens = list(range(24))
    link.write_through(tokens, lambda s, e: _sequence_kv(e)[..., s:e, :])
    assert _settle(link, "warm", tokens, 0) == 3 * C  # stored and found
    link.take("warm", 0, 3 * C)
    assert link.tier_up
    server.kill()
    assert _settle(link, "after", tokens, 0, timeout=15) == 0  # lookup failed: recompute
    assert link.counters.fetch_failures >= 1
    assert not link.tier_up  # the prefix cache now keeps finished requests' full KV itself
    link.close()
    server.stop()


def test_hung_server_costs_one_lookup_deadline_then_is_left_alone() -> None:
    """A KV server that is alive but answers nothing (SIGSTOP): the waiting request gives up
    after the lookup deadline, not the client's 30 s timeout; later probes do not contact the
    tier until the retry delay has passed, and then find the prefix again."""
    import os
    import signal

    server = ServerProcess()
    tier = ZmqTier(server.endpoint, TINY, timeout_s=30.0, connect_timeout_s=30.0)
    link = RemotePrefixLink(tier, bounds=LinkBounds(lookup_deadline_s=0.3, retry_down_after_s=1.0))
    tokens = list(range(24))
    link.write_through(tokens, lambda s, e: _sequence_kv(e)[..., s:e, :])
    assert _settle(link, "warm", tokens + [1], 0) == 3 * C
    link.take("warm", 0, 3 * C)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert link.probe("hung", tokens + [2], 0) == 3 * C  # lookup in flight
        assert _settle(link, "hung", tokens + [2], 0, timeout=5) == 0
        assert time.monotonic() - start < 3.0 and link.counters.overdue_lookups == 1
        assert link.take("hung", 0, 0) is None and not link.tier_up
        lookups = link.counters.lookups
        assert link.probe("while-down", tokens + [3], 0) == 0  # not asked: known down
        assert link.counters.lookups == lookups and link.counters.probes_skipped_down == 1
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    time.sleep(1.1)  # the retry delay passes
    assert _settle(link, "back", tokens + [4], 0) == 3 * C
    assert link.tier_up
    link.close()
    server.stop()


def test_hung_server_mid_fetch_costs_a_bounded_wait() -> None:
    """A KV server that answers the lookup, then hangs while the fetch streams (SIGSTOP): the
    fetch is abandoned after the lookup deadline plus four times its expected transfer time
    (2.3 s here), before the client notices anything (zmq heartbeats: 5 s; LMCache's client:
    its 30 s request timeout); the request recomputes and the tier counts as down."""
    import os
    import signal

    server = ServerProcess("--bandwidth-mbps", "0.01")  # 8 chunks (8 KiB): ~0.8 s to stream
    tier = ZmqTier(server.endpoint, TINY, timeout_s=30.0, connect_timeout_s=30.0)
    rate = 16 * TINY.chunk_nbytes(C)  # assumed 16 chunks/s: 8 due in 0.5 s, overdue after 2.3
    link = RemotePrefixLink(tier, bounds=LinkBounds(lookup_deadline_s=0.3,
                                                    assumed_fetch_bytes_per_s=rate))
    tokens = list(range(8 * C))
    link.write_through(tokens, lambda s, e: _sequence_kv(e)[..., s:e, :])
    _wait_puts(link, timeout=30)
    assert link.probe("hung", tokens + [1], 0) == 8 * C
    deadline = time.monotonic() + 10
    while link.pending["hung"].phase is PrefixPhase.LOOKUP and time.monotonic() < deadline:
        link.poll()
        time.sleep(0.002)
    assert link.pending["hung"].phase is PrefixPhase.FETCH
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert _settle(link, "hung", tokens + [1], 0, timeout=20) == 0
        waited = time.monotonic() - start
        assert waited < 3.5 and link.counters.overdue_fetches == 1, waited
        assert link.take("hung", 0, 0) is None and not link.tier_up
        assert link.fetch_bytes_in_flight() == 0  # its buffers went with it
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    link.close()
    server.stop()


def test_a_request_no_longer_probed_is_forgotten_with_its_buffers() -> None:
    """Aborted while queued: SGLang never calls the prefix cache again for it. Its fetched KV
    goes once it has not been probed for the bound; a live request probed meanwhile stays."""
    link = RemotePrefixLink(HostTier(TINY, capacity_bytes=1 << 20),
                            bounds=LinkBounds(forget_unprobed_after_s=0.3))  # fmt: skip
    prompts = {"aborted": list(range(600, 600 + 2 * C)), "alive": list(range(700, 700 + 2 * C))}
    for tokens in prompts.values():
        link.write_through(tokens, lambda s, e: _sequence_kv(e)[..., s:e, :])
    link.poll()
    for rid, tokens in prompts.items():
        assert _settle(link, rid, tokens + [1], 0) == 2 * C
    assert link.fetch_bytes_in_flight() == 4 * TINY.chunk_nbytes(C)  # both hold their chunks
    for _ in range(4):
        time.sleep(0.1)
        link.probe("alive", prompts["alive"] + [1], 0)
    link.poll()
    assert "aborted" not in link.pending and "alive" in link.pending
    assert link.fetch_bytes_in_flight() == 2 * TINY.chunk_nbytes(C)
    assert link.take("alive", 0, 2 * C) is not False
    link.check_integrity()


def test_bytes_in_flight_are_capped_for_writes_and_fetches() -> None:
    """A slow link cannot make host memory grow: a write-through past max_put_bytes is skipped
    (and sent by a later turn once the link caught up), a fetch past max_fetch_bytes is not
    started (the request recomputes)."""
    two_chunks = 2 * TINY.chunk_nbytes(C)
    server = ServerProcess("--bandwidth-mbps", "0.01")  # 2 KiB of TINY KV: ~0.2 s
    tier = ZmqTier(server.endpoint, TINY, timeout_s=30.0, connect_timeout_s=2.0)
    link = RemotePrefixLink(tier, bounds=LinkBounds(max_put_bytes=two_chunks,
                                                    max_fetch_bytes=two_chunks))  # fmt: skip
    read = lambda s, e: _sequence_kv(e)[..., s:e, :]
    a, b = list(range(2 * C)), list(range(1000, 1000 + 2 * C))
    assert link.write_through(a, read) == 2 and link.put_bytes_in_flight() == two_chunks
    assert link.write_through(b, read) == 0 and link.counters.puts_skipped_full == 1
    _wait_puts(link, timeout=30)
    assert link.write_through(b, read) == 2  # the link caught up: written now
    _wait_puts(link, timeout=30)
    assert _settle(link, "first", a + [1], 0, timeout=30) == 2 * C
    assert link.fetch_bytes_in_flight() == two_chunks  # fetched, not yet taken
    assert _settle(link, "second", b + [1], 0, timeout=30) == 0  # would exceed the cap
    assert link.counters.fetches_skipped_full == 1
    assert link.take("first", 0, 2 * C) is not False and link.fetch_bytes_in_flight() == 0
    link.close()
    server.stop()


def test_requests_waiting_for_one_prefix_share_one_fetch() -> None:
    """Two requests of one prefix, a third that extends it: the tier sends each chunk once,
    every request gets exactly its own positions, and buffers go with the last claim."""
    tier = HostTier(TINY, capacity_bytes=1 << 20)
    link = RemotePrefixLink(tier)
    tokens = list(range(900, 900 + 4 * C))
    kv = _sequence_kv(len(tokens))
    link.write_through(tokens, lambda s, e: kv[..., s:e, :])
    link.poll()
    short = tokens[: 2 * C]
    assert link.probe("a", short + [1], 0) == 2 * C
    assert link.probe("b", short + [2], 3) == 2 * C - 3
    assert link.probe("c", tokens + [3], 0) == 4 * C
    for rid, toks, dev, want in (("a", short + [1], 0, 2 * C), ("b", short + [2], 3, 2 * C - 3),
                                 ("c", tokens + [3], 0, 4 * C)):  # fmt: skip
        assert _settle(link, rid, toks, dev) == want
    assert tier.stats()["chunks_fetched"] == 4  # not 2 + 2 + 4
    assert link.fetch_bytes_in_flight() == 4 * TINY.chunk_nbytes(C)
    link.check_integrity()
    assert torch.equal(link.take("b", 3, 2 * C - 3), kv[..., 3 : 2 * C, :])
    link.forget("a")
    assert link.fetch_bytes_in_flight() == 4 * TINY.chunk_nbytes(C)  # c still claims them all
    assert torch.equal(link.take("c", 0, 4 * C), kv)
    assert link.fetch_bytes_in_flight() == 0 and not link.pending
    link.check_integrity()


def test_a_prefix_is_fetched_only_where_fetching_beats_recomputing() -> None:
    """Measured link bandwidth vs this server's prefill speed: a slow link beside a fast
    prefill recomputes (every 16th such decision fetches anyway, to re-measure the link);
    without a prefill measurement, or with a slow prefill, the prefix is fetched."""
    from sglang_vericache.srt.prefix.remote_prefix import EXPLORE_EVERY

    link = RemotePrefixLink(HostTier(TINY, capacity_bytes=1 << 20))
    tokens = list(range(1200, 1200 + 2 * C))
    link.write_through(tokens, lambda s, e: _sequence_kv(e)[..., s:e, :])
    link.poll()
    assert _settle(link, "unmeasured", tokens + [0], 0) == 2 * C  # no prefill speed: fetch
    link.forget("unmeasured")
    nbytes = 2 * TINY.chunk_nbytes(C)
    link.fetch_bytes_per_s = nbytes / 1.0  # this prefix takes 1 s to fetch
    link.observe_prefill(2 * C * 10, 1.0)  # and 0.1 s to recompute
    assert _settle(link, "fast-prefill", tokens + [1], 0) == 0
    assert link.counters.fetches_skipped_slower == 1 and link.take("fast-prefill", 0, 0) is None
    got = []
    for i in range(2 * EXPLORE_EVERY - 1):
        link.fetch_bytes_per_s = nbytes / 1.0  # (an in-process fetch would measure it fast)
        got.append(_settle(link, f"r{i}", tokens + [2, i], 0))
        link.forget(f"r{i}")  # (chunks another waiter holds would be shared, at no cost)
    assert got.count(2 * C) == 2  # the 16th and 32nd judged-slower fetches are made anyway
    assert link.counters.fetches_skipped_slower == 2 * EXPLORE_EVERY - 2
    slow = RemotePrefixLink(link.tier)
    slow.fetch_bytes_per_s = nbytes / 1.0
    slow.observe_prefill(2 * C, 10.0)  # recomputing would take 10 s
    assert _settle(slow, "slow-prefill", tokens + [3], 0) == 2 * C


def test_expected_wait_comes_from_the_measured_fetch_bandwidth() -> None:
    link = RemotePrefixLink(HostTier(TINY, capacity_bytes=1 << 20))
    tokens = list(range(200, 200 + 4 * C))
    link.write_through(tokens, lambda s, e: _sequence_kv(e)[..., s:e, :])
    _settle(link, "warm", tokens, 0)
    assert link.expected_wait_s("nobody") is None
    _settle(link, "first", tokens + [1], 0)  # one completed fetch: the bandwidth is measured
    assert link.fetch_bytes_per_s > 0
    link.take("first", 0, 4 * C)
    link.probe("second", tokens + [2], 0)  # lookup in flight: 4 chunks to come
    wait = link.expected_wait_s("second")
    assert wait is not None and wait >= 0.0
    assert abs(wait - 4 * TINY.chunk_nbytes(C) / link.fetch_bytes_per_s) < 1e-6


def _wait_puts(link: RemotePrefixLink, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while link._puts:
        assert time.monotonic() < deadline, "tier put never finished"
        link.poll()
        time.sleep(0.01)


def test_restarted_kv_server_gets_the_chunks_again() -> None:
    """Chunks remembered as stored are re-sent once the server's epoch says it restarted."""
    server = ServerProcess()
    tier = ZmqTier(server.endpoint, TINY, timeout_s=5.0, connect_timeout_s=2.0)
    link = RemotePrefixLink(tier)
    tokens, other = list(range(24)), list(range(1000, 1024))
    read = lambda s, e: _sequence_kv(e)[..., s:e, :]
    assert link.write_through(tokens, read) == 3
    _wait_puts(link)
    assert link.write_through(tokens, read) == 0  # remembered as stored
    server.kill()
    again = ServerProcess(port=server.port)  # empty: a new epoch
    try:
        # Any reply from the new server carries its epoch (here: another sequence's put).
        assert link.write_through(other, read) == 3
        _wait_puts(link)
        assert link.write_through(tokens, read) == 3  # forgotten, so written again
        _wait_puts(link)
        assert again.stats()["entries"] == 6
        assert _settle(link, "next-turn", tokens + [1], 0) == 3 * C  # and found again
    finally:
        link.close()
        again.stop()
        server.stop()


def test_a_chunk_found_missing_is_written_again() -> None:
    """Eviction (or anything) that loses a chunk: the lookup that misses it un-remembers it."""
    link = RemotePrefixLink(HostTier(TINY, capacity_bytes=2 * TINY.chunk_nbytes(C)))
    read = lambda s, e: _sequence_kv(e)[..., s:e, :]
    tokens = list(range(16))
    assert link.write_through(tokens, read) == 2
    link.poll()
    assert link.write_through(list(range(500, 516)), read) == 2  # evicts the first two
    link.poll()
    assert link.write_through(tokens, read) == 0  # the link does not know yet
    assert _settle(link, "turn", tokens + [3], 0) == 0  # a miss ...
    assert link.write_through(tokens, read) == 2  # ... which it remembers


def test_new_model_identity_reopens_the_tier_with_new_keys() -> None:
    """A weight update changes the geometry: old pending state is dropped, the tier is
    reopened under the new keys and nothing stored under the old ones is a hit."""
    import dataclasses

    shared = HostTier(TINY, capacity_bytes=1 << 20)  # one store behind both identities
    current = {"g": TINY}
    opened: list = []

    def reopen(g):
        tier = HostTier(g, capacity_bytes=1 << 20)
        tier._store = shared._store  # same storage, as a remote tier would be
        opened.append(tier)
        return tier

    link = RemotePrefixLink(shared, lambda: current["g"], reopen)
    tokens = list(range(24))
    read = lambda s, e: _sequence_kv(e)[..., s:e, :]
    assert link.write_through(tokens, read) == 3
    assert _settle(link, "before", tokens + [1], 0) == 3 * C
    link.probe("waiting", tokens + [2], 0)  # in flight when the weights change
    current["g"] = dataclasses.replace(TINY, model_id="tiny-llama@v2")
    assert link.probe("after", tokens + [1], 0) == 3 * C  # lookup of the new keys starts
    assert len(opened) == 1 and link.geometry is current["g"] and "waiting" not in link.pending
    assert _settle(link, "after", tokens + [1], 0) == 0  # the old model's KV is not a hit
    assert link.write_through(tokens, read) == 3  # stored again under the new identity
    assert _settle(link, "again", tokens + [1], 0) == 3 * C


def test_sequences_finishing_together_write_their_shared_prefix_once() -> None:
    """An agent fleet's turns share a system prompt: while one write-through is storing its
    chunks, another sequence that starts with them sends only its own."""
    with ServerProcess("--bandwidth-mbps", "0.01") as server:  # ~0.1 s per 1 KiB chunk ack
        link = RemotePrefixLink(ZmqTier(server.endpoint, TINY, timeout_s=20))
        system = list(range(1000, 1000 + 2 * C))
        a, b = system + list(range(C)), system + list(range(50, 50 + C))  # 3 chunks each

        def read(start: int, end: int) -> torch.Tensor:
            return _sequence_kv(end)[..., start:end, :]

        assert link.write_through(a, read) == 3
        assert link.write_through(b, read) == 1  # its first two chunks are being written
        assert link.counters.chunks_already_writing == 2
        assert _settle(link, "b", b + [7], 0, timeout=15) == 3 * C  # and all of b is stored
        link.close()


def test_a_lookup_answered_while_the_scheduler_was_busy_is_not_overdue() -> None:
    """The scheduler thread polls between forwards; a prefill can take longer than the lookup
    deadline. An answer that came meanwhile is used, and the tier does not count as down."""
    link = RemotePrefixLink(HostTier(TINY, capacity_bytes=1 << 20),
                            bounds=LinkBounds(lookup_deadline_s=0.05))  # fmt: skip
    tokens = list(range(500, 500 + 3 * C))
    link.write_through(tokens, lambda s, e: _sequence_kv(e)[..., s:e, :])
    link.poll()
    assert link.probe("r", tokens + [1], 0) == 3 * C  # lookup submitted
    time.sleep(0.1)  # a long prefill: the answer is there, unread, past the deadline
    assert _settle(link, "r", tokens + [1], 0) == 3 * C
    assert link.counters.overdue_lookups == 0 and link.tier_up
