"""LMCacheTier. Without the [lmcache] extra only the clear-error path runs; with it, a real
``lmcache server`` (engine-driven) is started on 127.0.0.1:

    bash scripts/lmcache_venv.sh
    .venv-lmcache/bin/python -m pytest test/unit/tier/test_tier_lmcache.py -m lmcache
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import zmq
from sglang_vericache.tier import TaskStatus, open_tier
from sglang_vericache.tier.factory import TierOptions
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.keys import ChunkKey, chunk_keys
from sglang_vericache.tier.layout import alloc_chunks, join_chunks, split_chunks
from tier_testlib import Results, free_port

HAVE_LMCACHE = importlib.util.find_spec("lmcache") is not None
needs_lmcache = pytest.mark.skipif(
    not HAVE_LMCACHE, reason="needs LMCache: bash scripts/lmcache_venv.sh, then run in .venv-lmcache")

# chunk_tokens must equal the server's --chunk-size; each layer block must hold the manifest.
GEOMETRY = KVGeometry("tiny-lmcache", num_layers=2, num_kv_heads=2, head_dim=8,
                      dtype="float32", chunk_tokens=16)


@pytest.mark.skipif(HAVE_LMCACHE, reason="lmcache is installed: the error path cannot run")
def test_without_lmcache_the_error_names_the_script_that_installs_it() -> None:
    import sglang_vericache.tier.lmcache as adapter  # importing the module is always fine

    assert "lmcache" not in sys.modules
    with pytest.raises(ImportError, match=r"scripts/lmcache_venv.sh"):
        adapter.LMCacheTier("127.0.0.1", 5555, GEOMETRY)
    with pytest.raises(ImportError, match="lmcache_venv"):
        open_tier("lmcache://127.0.0.1:5555", GEOMETRY)


def test_pseudo_tokens_encode_the_whole_key() -> None:
    from sglang_vericache.tier.lmcache import manifest_nbytes, pseudo_tokens

    keys = chunk_keys(GEOMETRY, list(range(40)))
    encoded = [pseudo_tokens(k, GEOMETRY.chunk_tokens) for k in keys]
    assert all(len(e) == GEOMETRY.chunk_tokens and all(0 <= t < 2**31 for t in e)
               for e in encoded)
    assert len(set(encoded)) == len(keys)
    other = dataclasses.replace(GEOMETRY, head_dim=4)
    assert pseudo_tokens(chunk_keys(other, list(range(16)))[0], 16) != encoded[0]
    assert GEOMETRY.layer_nbytes(GEOMETRY.chunk_tokens) >= manifest_nbytes(GEOMETRY.num_layers)


@pytest.fixture(scope="module")
def lmcache_server() -> Iterator[str]:
    from testkit.lmcache_server import LMCacheServerProcess

    with LMCacheServerProcess(GEOMETRY.chunk_tokens, l1_size_gb=0.25) as server:
        yield server.spec


def wait_ready(spec: str, geometry: KVGeometry) -> None:
    deadline = time.monotonic() + 90
    while True:  # server start-up (imports) takes a while; lookups fail until it is up
        tier = open_tier(spec, geometry, TierOptions(timeout_s=5))
        res = Results(tier)
        result = res.wait(tier.submit_lookup(chunk_keys(geometry, [1] * 16)), timeout_s=30)
        tier.close()
        if result.status is TaskStatus.DONE:
            return
        assert time.monotonic() < deadline, f"lmcache server not ready: {result.error}"
        time.sleep(1)


@pytest.mark.lmcache
@needs_lmcache
def test_lmcache_roundtrip_partial_chunk_and_misses(lmcache_server: str) -> None:
    wait_ready(lmcache_server, GEOMETRY)
    tier = open_tier(lmcache_server, GEOMETRY, TierOptions(timeout_s=30))
    res = Results(tier)
    tokens = list(range(37))  # 2 full chunks + a 5-token chunk
    kv = torch.randn(2, 2, 2, 37, 8)
    keys = chunk_keys(GEOMETRY, tokens)
    assert res.wait(tier.submit_put(keys, split_chunks(kv, GEOMETRY)), timeout_s=60).all_ok
    dst = alloc_chunks(GEOMETRY, 37)
    got = res.wait(tier.submit_fetch(keys, dst), timeout_s=60)
    assert got.all_ok and torch.equal(join_chunks(dst), kv)
    look = res.wait(tier.submit_lookup(chunk_keys(GEOMETRY, tokens[:32] + [0] * 5)))
    assert look.ok == (True, True, False)
    # Another geometry, even with the same digests, is a miss.
    other = dataclasses.replace(GEOMETRY, model_id="another-model")
    other_tier = open_tier(lmcache_server, other, TierOptions(timeout_s=30))
    other_res = Results(other_tier)
    forged = [ChunkKey(k.digest, k.num_tokens) for k in keys]
    miss = other_res.wait(other_tier.submit_fetch(forged, alloc_chunks(other, 37)), timeout_s=60)
    assert miss.status is TaskStatus.DONE and not any(miss.ok)
    other_tier.close()
    tier.close()


@pytest.mark.lmcache
@needs_lmcache
def test_a_restarted_server_takes_the_next_put() -> None:
    """A restarted lmcache server (same port, empty) forgets every client's registration while
    zmq reconnects to it silently: the client's next store must register again and land, not be
    refused for ever (seen end to end: no write-through landed after a restart in 360 s; the
    server logged "context not registered" for every store)."""
    from testkit.lmcache_server import LMCacheServerProcess

    with LMCacheServerProcess(GEOMETRY.chunk_tokens, l1_size_gb=0.25) as server:
        # the refused store surfaces as a timeout, and its session's cleanup times out too:
        # a short one keeps the test short (the retry lands after about 2 x timeout_s)
        tier = open_tier(server.spec, GEOMETRY, TierOptions(timeout_s=5))
        res = Results(tier)
        before, after = list(range(16)), list(range(100, 116))
        kv = torch.randn(2, 2, 2, 16, 8)
        assert res.wait(tier.submit_put(chunk_keys(GEOMETRY, before), split_chunks(kv, GEOMETRY)),
                        timeout_s=60).all_ok  # fmt: skip
        server.kill()
        server.start()
        keys = chunk_keys(GEOMETRY, after)
        assert res.wait(tier.submit_put(keys, split_chunks(kv, GEOMETRY)), timeout_s=60).all_ok
        dst = alloc_chunks(GEOMETRY, 16)
        assert res.wait(tier.submit_fetch(keys, dst), timeout_s=60).all_ok
        assert torch.equal(join_chunks(dst), kv)
        tier.close()


@pytest.mark.lmcache
@needs_lmcache
def test_lmcache_unreachable_is_a_clean_failure() -> None:
    tier = open_tier(f"lmcache://127.0.0.1:{free_port()}", GEOMETRY, TierOptions(timeout_s=2))
    res = Results(tier)
    result = res.wait(tier.submit_fetch(chunk_keys(GEOMETRY, list(range(16))),
                                        alloc_chunks(GEOMETRY, 16)), timeout_s=30)
    assert result.status is TaskStatus.FAILED and tier.stats()["fallbacks"] == 1
    tier.close()


class _Unanswered:
    """An LMCache future whose reply never comes: ``result`` raises once its timeout is up."""

    def result(self, timeout: float | None = None) -> None:
        time.sleep(0.05)
        raise TimeoutError("Future result not available within timeout")


class _ClientOfADeadServer:
    """LMCache 0.5.6's zmq request client as it is once its server has died: a DEALER socket,
    made from the context the tier passes in, holding a request no peer will ever take, and
    closed with that context's default linger (``MessageQueueClient.close``)."""

    def __init__(self, url: str, context: zmq.Context) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.connect(url)
        self.socket.send(b"GET_CHUNK_SIZE", zmq.NOBLOCK)  # queued for a peer that never comes

    def get_chunk_size(self) -> _Unanswered:
        return _Unanswered()

    def close(self) -> None:
        self.socket.close()


def test_a_dead_server_fails_tasks_instead_of_hanging_the_io_thread(monkeypatch) -> None:
    """Dropping the connection to a dead server must not block: with the default linger (wait
    forever for queued messages), ``zmq.Context.term()`` never returned, the I/O thread hung,
    and every later task (a fetch a request waits on) stayed pending for ever. Seen end to end:
    an lmcache server killed while a replica fetched left that request unanswered. Runs
    without lmcache: the client is a stand-in with the same socket behaviour."""
    import sglang_vericache.tier.lmcache as adapter

    fake = SimpleNamespace(RequestClientFactory=SimpleNamespace(create=_ClientOfADeadServer))
    monkeypatch.setattr(adapter, "import_lmcache", lambda: fake)
    tier = adapter.LMCacheTier("127.0.0.1", free_port(), GEOMETRY, timeout_s=1)
    res = Results(tier)
    keys = chunk_keys(GEOMETRY, list(range(16)))
    for _ in range(2):  # the second task proves the I/O thread came back from the first
        result = res.wait(tier.submit_lookup(keys), timeout_s=20)
        assert result.status is TaskStatus.FAILED and "TimeoutError" in (result.error or "")
    tier.close()
