"""tier/shared_fetch.py: one fetch per chunk, shared by its waiters, on a real HostTier."""

from __future__ import annotations

import torch
from sglang_vericache.tier.host import HostTier
from sglang_vericache.tier.keys import chunk_keys
from sglang_vericache.tier.layout import split_chunks
from sglang_vericache.tier.shared_fetch import SharedFetches
from tier_testlib import TINY

C = TINY.chunk_tokens


def _stored_tier(n_chunks: int):
    tier = HostTier(TINY, capacity_bytes=1 << 20)
    n = n_chunks * C
    kv = torch.randn(TINY.num_layers, 2, TINY.num_kv_heads, n, TINY.head_dim)
    keys = chunk_keys(TINY, list(range(n)))
    tier.submit_put(keys, split_chunks(kv, TINY))
    tier.poll()
    return tier, keys, kv


def test_a_bad_shared_chunk_cuts_every_claimant_at_it() -> None:
    tier, keys, kv = _stored_tier(4)
    assert tier._store.remove(keys[1].digest)  # c1 is gone by the time anyone fetches it
    fetches = SharedFetches(tier)
    assert fetches.want("a", keys[:2]) == 2
    assert fetches.want("b", keys) == 2  # c0, c1 shared with a; only c2, c3 fetched
    assert not fetches.settled("a") and not fetches.settled("b")
    for task, result in tier.poll().items():
        fetches.complete(task, result)
    assert fetches.settled("a") and fetches.settled("b")
    assert fetches.leading_ok("a") == 1 and fetches.leading_ok("b") == 1
    assert torch.equal(fetches.buffers("b")[0], kv[..., :C, :])
    fetches.release("a")
    assert fetches.nbytes() == 4 * TINY.chunk_nbytes(C)  # b still claims all four
    fetches.check_integrity()
    fetches.release("b")
    assert fetches.nbytes() == 0
    fetches.check_integrity()


def test_a_fetch_nobody_waits_for_is_cancelled() -> None:
    tier, keys, _ = _stored_tier(2)
    fetches = SharedFetches(tier)
    fetches.want("x", keys)
    fetches.want("y", keys[:1])
    fetches.release("x")  # y still needs the task (c0 comes with it)
    assert tier.stats()["cancelled"] == 0
    fetches.release("y")
    assert tier.stats()["cancelled"] == 1 and fetches.nbytes() == 0
    fetches.check_integrity()
