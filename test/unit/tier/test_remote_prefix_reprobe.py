"""A waiting request's tier state when it is probed anew (srt/prefix/remote_prefix.py) and a chunk
whose fetch failed (tier/shared_fetch.py), on a real HostTier.

SGLang re-probes a queued request every admission round; its device prefix can shrink
meanwhile (evicted). Whatever the request held (lookup, chunk claims, fetch buffers) must go
before it starts anew, and nothing may be left behind when it is forgotten.
"""

from __future__ import annotations

import time

import torch
from sglang_vericache.srt.prefix.remote_prefix import RemotePrefixLink
from sglang_vericache.tier import chunk_keys
from sglang_vericache.tier.host import HostTier
from sglang_vericache.tier.keys import ChunkKey
from sglang_vericache.tier.pending_prefix import PrefixPhase
from tier_testlib import TINY

C = TINY.chunk_tokens  # 8
CHUNK_BYTES = TINY.chunk_nbytes(C)


def _sequence_kv(n: int) -> torch.Tensor:
    """Distinct full KV per position: [L, 2, H_kv, n, D]."""
    return torch.arange(n, dtype=torch.float32).view(1, 1, 1, n, 1).expand(
        TINY.num_layers, 2, TINY.num_kv_heads, n, TINY.head_dim).contiguous()


def _settle(link: RemotePrefixLink, rid: str, tokens, device_len: int) -> int:
    """Probe until the reported hit stops being provisional (what the scheduler does)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        hit = link.probe(rid, tokens, device_len)
        link.check_integrity()
        state = link.pending.get(rid)
        if state is None or state.phase in (PrefixPhase.READY, PrefixPhase.MISS):
            return hit
        time.sleep(0.01)
    raise AssertionError("tier task never finished")


def _stored_link(n_chunks: int) -> tuple[RemotePrefixLink, HostTier, list[int], torch.Tensor]:
    """A link whose host tier holds the ``n_chunks`` whole chunks of a prompt (+1 token)."""
    tier = HostTier(TINY, capacity_bytes=1 << 20)
    link = RemotePrefixLink(tier)
    tokens = list(range(2000, 2000 + n_chunks * C))
    kv = _sequence_kv(len(tokens))
    assert link.write_through(tokens, lambda s, e: kv[..., s:e, :]) == n_chunks
    link.poll()  # the put is published
    return link, tier, tokens + [1], kv


def _chunk_keys(link: RemotePrefixLink, prompt: list[int]) -> list[ChunkKey]:
    return chunk_keys(link.geometry, prompt[: len(prompt) // C * C])


def test_a_ready_request_whose_device_prefix_shrank_is_fetched_anew() -> None:
    """F2: READY with chunks 2..3 (device held 0..1); the device prefix is then evicted. The
    next probe used to start a lookup beside the old claims, and the lookup's fetch raised
    ``ValueError: request r already claims chunks`` on the scheduler thread."""
    link, _, prompt, kv = _stored_link(4)
    assert _settle(link, "r", prompt, 2 * C) == 2 * C
    assert link.fetch_bytes_in_flight() == 2 * CHUNK_BYTES
    assert _settle(link, "r", prompt, 0) == 4 * C  # the whole prefix, fetched anew
    assert link.fetch_bytes_in_flight() == 4 * CHUNK_BYTES  # not 6: the old claims went
    assert torch.equal(link.take("r", 0, 4 * C), kv)
    assert link.fetch_bytes_in_flight() == 0 and not link.pending
    link.check_integrity()


def test_a_shrunk_request_whose_new_lookup_misses_releases_its_old_buffers() -> None:
    """F2: the re-probe's lookup misses (chunk 0 evicted from the tier meanwhile): the chunks
    the request held from before are released, bytes in flight go back to 0."""
    link, tier, prompt, _ = _stored_link(4)
    assert _settle(link, "r", prompt, 2 * C) == 2 * C
    assert tier._store.remove(_chunk_keys(link, prompt)[0].digest)  # the new lookup's first
    assert _settle(link, "r", prompt, 0) == 0
    assert link.fetch_bytes_in_flight() == 0
    assert link.take("r", 0, 0) is None and not link.pending
    link.check_integrity()


def test_a_probe_while_the_tier_is_down_drops_the_stale_state() -> None:
    """The device prefix shrank while the tier is known down: the request recomputes, and
    the chunks it held for the longer device prefix go at once (not at its release)."""
    link, _, prompt, _ = _stored_link(4)
    assert _settle(link, "r", prompt, 2 * C) == 2 * C
    link._mark(False)  # the tier failed a task meanwhile: not asked for a while
    assert link.probe("r", prompt, 0) == 0
    assert "r" not in link.pending and link.fetch_bytes_in_flight() == 0
    link.check_integrity()


def test_take_of_nothing_releases_a_ready_requests_buffers() -> None:
    """``take(length=0)`` (a hit rounded down to no whole page) consumes the state: its
    fetched chunks go with it, not when the request is released much later."""
    link, _, prompt, _ = _stored_link(2)
    assert _settle(link, "r", prompt, 0) == 2 * C
    assert link.take("r", 0, 0) is None
    assert not link.pending and link.fetch_bytes_in_flight() == 0
    link.check_integrity()


def test_a_failed_chunk_is_fetched_again_for_a_later_request() -> None:
    """F9: A's fetch finds chunk 1 gone (evicted after its lookup); A, still queued, keeps
    its claims. Chunk 1 is then written again; B, wanting the same prefix, gets a fresh
    fetch of it, not A's stale failure (which it used to inherit until every claim went)."""
    link, tier, prompt, kv = _stored_link(4)
    assert link.probe("a", prompt, 0) == 4 * C  # lookup in flight
    middle = link.pending["a"].keys[1]
    assert tier._store.remove(middle.digest)  # evicted between lookup and fetch
    assert _settle(link, "a", prompt, 0) == C  # only chunk 0 arrived
    assert link.write_through(prompt, lambda s, e: kv[..., s:e, :]) == 3  # 1..3 re-sent
    link.poll()
    other = prompt[:-1] + [2]
    assert _settle(link, "b", other, 0) == 4 * C
    assert torch.equal(link.take("b", 0, 4 * C), kv)
    assert torch.equal(link.take("a", 0, C), kv[..., :C, :])  # A's own view is unchanged
    assert link.fetch_bytes_in_flight() == 0 and not link.pending
    link.check_integrity()


def test_shared_fetches_refetch_a_failed_chunk_beside_its_stale_claimant() -> None:
    """F9 in ``SharedFetches`` alone: while ``a`` still claims its failed chunk, ``b`` gets a
    fresh fetch of it; each holds its own buffer until released, then bytes go back to 0."""
    from sglang_vericache.tier.layout import split_chunks
    from sglang_vericache.tier.shared_fetch import SharedFetches

    tier = HostTier(TINY, capacity_bytes=1 << 20)
    keys = chunk_keys(TINY, list(range(2 * C)))
    kv = _sequence_kv(2 * C)
    fetches = SharedFetches(tier)
    assert fetches.want("a", keys) == 2  # nothing stored yet: both chunks fail
    for task, result in tier.poll().items():
        fetches.complete(task, result)
    assert fetches.settled("a") and fetches.leading_ok("a") == 0
    tier.submit_put(keys, split_chunks(kv, TINY))  # stored now (a later lookup says so)
    tier.poll()
    assert fetches.new_bytes(keys) == 2 * CHUNK_BYTES
    assert fetches.want("b", keys) == 2  # fetched afresh, not a's failures
    assert fetches.nbytes() == 4 * CHUNK_BYTES  # a's stale copies until a releases
    for task, result in tier.poll().items():
        fetches.complete(task, result)
    assert fetches.leading_ok("b") == 2 and fetches.leading_ok("a") == 0
    assert fetches.want("c", keys) == 0  # the verified copies are shared again
    fetches.check_integrity()
    fetches.release("a")
    assert fetches.nbytes() == 2 * CHUNK_BYTES
    fetches.release("b")
    assert torch.equal(torch.cat(fetches.buffers("c"), dim=3), kv)
    fetches.release("c")
    assert fetches.nbytes() == 0
    fetches.check_integrity()
