"""HostTier: the same submit/poll contract, in process memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_vericache.tier import TaskKind, TaskStatus, open_tier
from sglang_vericache.tier.factory import TierOptions
from sglang_vericache.tier.layout import alloc_chunks, join_chunks, split_chunks
from sglang_vericache.tier.host import HostTier
from sglang_vericache.tier.keys import chunk_keys
from tier_testlib import TINY, Results


def make(capacity: int = 1 << 20) -> tuple[HostTier, Results]:
    tier = HostTier(TINY, capacity_bytes=capacity, pin_memory=False)
    return tier, Results(tier)


def test_put_fetch_lookup_roundtrip_bit_exact() -> None:
    tier, res = make()
    tokens = list(range(21))
    kv = torch.randn(2, 2, 2, 21, 4)
    keys = chunk_keys(TINY, tokens)
    chunks = split_chunks(kv, TINY)
    put = res.wait(tier.submit_put(keys, chunks))
    tier.check_integrity()
    assert put.all_ok and put.kind is TaskKind.PUT and put.nbytes == kv.nbytes
    chunks[0].zero_()  # the tier copied: the caller may reuse its buffers after the result
    dst = alloc_chunks(TINY, 21)
    got = res.wait(tier.submit_fetch(keys, dst))
    assert got.all_ok and got.num_ok_prefix == 3 and torch.equal(join_chunks(dst), kv)
    look = res.wait(tier.submit_lookup(chunk_keys(TINY, tokens[:16] + [7] * 5)))
    assert look.ok == (True, True, False) and look.num_ok_prefix == 2
    tier.check_integrity()
    assert tier.poll() == {}  # each result exactly once


def test_fetch_has_prefix_semantics() -> None:
    tier, res = make()
    keys = chunk_keys(TINY, list(range(24)))
    chunks = split_chunks(torch.randn(2, 2, 2, 24, 4), TINY)
    res.wait(tier.submit_put([keys[0], keys[2]], [chunks[0], chunks[2]]))  # hole at 1
    got = res.wait(tier.submit_fetch(keys, alloc_chunks(TINY, 24)))
    assert got.status is TaskStatus.DONE and got.ok == (True, False, False)
    assert tier.stats()["fallbacks"] == 1 and tier.stats()["chunks_missed"] == 2


def test_capacity_lru_and_oversize() -> None:
    chunk_bytes = TINY.chunk_nbytes(8)
    tier, res = make(capacity=2 * chunk_bytes)
    keys = chunk_keys(TINY, list(range(24)))
    chunks = split_chunks(torch.randn(2, 2, 2, 24, 4), TINY)
    assert res.wait(tier.submit_put(keys, chunks)).all_ok
    tier.check_integrity()
    present = res.wait(tier.submit_lookup(keys[1:]))
    assert present.ok == (True, True) and tier.stats()["evictions"] == 1
    big = dataclasses.replace(TINY, chunk_tokens=64)
    big_tier = HostTier(big, capacity_bytes=big.chunk_nbytes(64) - 1, pin_memory=False)
    big_res = Results(big_tier)
    k = chunk_keys(big, list(range(64)))
    out = big_res.wait(big_tier.submit_put(k, split_chunks(torch.randn(2, 2, 2, 64, 4), big)))
    assert out.ok == (False,) and big_tier.stats()["put_rejected"] == 1


def test_cancel_and_bad_arguments() -> None:
    tier, res = make()
    keys = chunk_keys(TINY, list(range(8)))
    task = tier.submit_put(keys, split_chunks(torch.randn(2, 2, 2, 8, 4), TINY))
    tier.cancel(task)  # before poll: result is CANCELLED, and nothing was published
    result = res.wait(task)
    assert result.status is TaskStatus.CANCELLED and result.ok == (False,)
    assert res.wait(tier.submit_lookup(keys)).ok == (False,)
    tier.cancel(task)  # after completion: a no-op
    tier.check_integrity()
    with pytest.raises(ValueError, match="shape"):
        tier.submit_fetch(keys, [torch.empty(2, 2, 2, 7, 4)])
    with pytest.raises(ValueError, match="keys"):
        tier.submit_fetch(keys, [])
    tier.close()


def test_open_tier_host_and_bad_specs() -> None:
    tier = open_tier("host", TINY, TierOptions(host_capacity_bytes=1 << 20))
    assert isinstance(tier, HostTier)
    for spec in ("", "hosts", "zmq://", "zmq://host", "zmq://h:0", "zmq://h:70000",
                 "redis://h:1", "zmq://h:12x"):
        with pytest.raises(ValueError, match="tier"):
            open_tier(spec, TINY)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (async pinned copies)")
def test_cuda_async_roundtrip() -> None:
    tier = HostTier(TINY, capacity_bytes=1 << 20)
    res = Results(tier)
    keys = chunk_keys(TINY, list(range(16)))
    kv = torch.randn(2, 2, 2, 16, 4, device="cuda")
    assert res.wait(tier.submit_put(keys, split_chunks(kv, TINY))).all_ok
    dst = alloc_chunks(TINY, 16, device="cuda")
    assert res.wait(tier.submit_fetch(keys, dst)).all_ok
    assert torch.equal(join_chunks(dst), kv)
