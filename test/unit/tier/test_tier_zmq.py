"""ZmqTier against a real server process on 127.0.0.1: the submit/poll contract."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Iterator

import pytest
import torch

from sglang_vericache.tier import TaskStatus, open_tier
from sglang_vericache.tier.client import ZmqTier
from sglang_vericache.tier.factory import TierOptions
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.layout import alloc_chunks, join_chunks, split_chunks
from sglang_vericache.tier.keys import chunk_keys
from tier_testlib import TINY, Results, ServerProcess


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--bandwidth-mbps", "20")  # 20 MB/s: fast enough, measurable
    yield proc
    assert proc.stop() == 0


def geometry(name: str, **changes: object) -> KVGeometry:
    return dataclasses.replace(TINY, model_id=name, **changes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_roundtrip_bit_exact(server: ServerProcess, dtype: str) -> None:
    g = geometry(f"roundtrip-{dtype}", dtype=dtype)
    tier = open_tier(server.spec, g, TierOptions(timeout_s=10))
    res = Results(tier)
    tokens = list(range(29))
    kv = torch.randn(2, 2, 2, 29, 4).to(g.torch_dtype)
    keys = chunk_keys(g, tokens)
    put = res.wait(tier.submit_put(keys, split_chunks(kv, g)))
    assert put.all_ok and put.nbytes == kv.nbytes
    assert res.wait(tier.submit_put(keys[:1], split_chunks(kv, g)[:1])).all_ok  # idempotent
    dst = alloc_chunks(g, 29)
    got = res.wait(tier.submit_fetch(keys, dst))
    assert got.all_ok and got.nbytes == kv.nbytes and torch.equal(join_chunks(dst), kv)
    look = res.wait(tier.submit_lookup(chunk_keys(g, tokens[:16] + [1, 2, 3])))
    assert look.ok == (True, True, False)
    assert tier.poll() == {}
    stats = tier.stats()
    assert stats["chunks_put"] == 5 and stats["chunks_fetched"] == 4 and stats["failures"] == 0
    tier.close()
    tier.close()  # idempotent


def test_prefix_semantics_and_misses(server: ServerProcess) -> None:
    g = geometry("prefix")
    tier = ZmqTier(server.endpoint, g, timeout_s=10)
    res = Results(tier)
    keys = chunk_keys(g, list(range(32)))
    chunks = split_chunks(torch.randn(2, 2, 2, 32, 4), g)
    assert res.wait(tier.submit_put([keys[0], keys[2], keys[3]],
                                    [chunks[0], chunks[2], chunks[3]])).all_ok
    dst = alloc_chunks(g, 32)
    got = res.wait(tier.submit_fetch(keys, dst))
    assert got.status is TaskStatus.DONE and got.ok == (True, False, False, False)
    assert torch.equal(dst[0], chunks[0]) and got.error is not None
    assert res.wait(tier.submit_lookup(keys)).num_ok_prefix == 1
    assert tier.stats()["fallbacks"] == 1 and tier.stats()["chunks_missed"] == 3
    tier.close()


def test_submit_and_poll_never_block_while_transfer_is_throttled(server: ServerProcess) -> None:
    g = geometry("nonblocking", chunk_tokens=2048)  # 2*2*2*2048*4 fp32 = 256 KiB per chunk
    tier = ZmqTier(server.endpoint, g, timeout_s=20)
    res = Results(tier)
    keys = chunk_keys(g, list(range(2048 * 2)))
    kv = torch.randn(2, 2, 2, 4096, 4)
    assert res.wait(tier.submit_put(keys, split_chunks(kv, g))).all_ok
    t0 = time.perf_counter()
    fetches = [tier.submit_fetch(keys, alloc_chunks(g, 4096)) for _ in range(8)]  # 4 MiB
    lookup = tier.submit_lookup(keys)
    submit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tier.poll()
    poll_s = time.perf_counter() - t0
    assert submit_s < 0.05 and poll_s < 0.01
    # The lookup carries no payload: the server answers it before the throttled fetches.
    look = res.wait(lookup)
    first_fetch_done = fetches[0] in res.seen
    assert look.all_ok and not first_fetch_done
    results = res.wait_all(fetches)
    assert all(r.all_ok for r in results)
    # 8 fetches x 512 KiB = 4.2 MB at 20 MB/s: about 0.21 s on the emulated link.
    assert time.perf_counter() - t0 >= 0.15
    tier.close()


def test_cancel_semantics(server: ServerProcess) -> None:
    g = geometry("cancel", chunk_tokens=4096)  # 512 KiB per chunk -> throttled ~25 ms each
    tier = ZmqTier(server.endpoint, g, timeout_s=20)
    res = Results(tier)
    keys = chunk_keys(g, list(range(4096 * 4)))
    kv = torch.randn(2, 2, 2, 4096 * 4, 4)
    assert res.wait(tier.submit_put(keys, split_chunks(kv, g))).all_ok
    dst = alloc_chunks(g, 4096 * 4)
    for d in dst:
        d.fill_(7.0)
    sent_before = tier.stats()["bytes_sent"]
    task = tier.submit_fetch(keys, dst)
    while tier.stats()["bytes_sent"] == sent_before:  # cancel once the request is on the wire
        time.sleep(0.001)
    tier.cancel(task)
    result = res.wait(task)
    assert result.status is TaskStatus.CANCELLED and not any(result.ok)
    time.sleep(0.3)  # the late reply must not touch dst after cancel() returned
    assert all(bool((d == 7.0).all()) for d in dst)
    assert tier.stats()["cancelled"] == 1 and tier.stats()["late_replies"] == 1
    done = tier.submit_lookup(keys)
    res.wait(done)
    tier.cancel(done)  # after completion: no-op, no second result
    tier.cancel(123456)  # unknown: no-op
    time.sleep(0.05)
    res.drain()
    assert set(res.seen) == {res.seen[t].task_id for t in res.seen}
    assert tier.stats()["completed"] == 3
    tier.close()


def test_many_threads_submit_concurrently(server: ServerProcess) -> None:
    g = geometry("threads")
    tier = ZmqTier(server.endpoint, g, timeout_s=20)
    ids: list[int] = []
    lock = threading.Lock()
    seqs = {i: list(range(i * 100, i * 100 + 20)) for i in range(8)}
    kvs = {i: torch.randn(2, 2, 2, 20, 4) for i in range(8)}

    def worker(i: int) -> None:
        task = tier.submit_put(chunk_keys(g, seqs[i]), split_chunks(kvs[i], g))
        with lock:
            ids.append(task)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    res = Results(tier)
    assert len(set(ids)) == 8 and all(r.all_ok for r in res.wait_all(ids))
    for i in range(8):
        dst = alloc_chunks(g, 20)
        assert res.wait(tier.submit_fetch(chunk_keys(g, seqs[i]), dst)).all_ok
        assert torch.equal(join_chunks(dst), kvs[i])
    tier.close()


def test_rejects_bad_arguments_synchronously(server: ServerProcess) -> None:
    g = geometry("badargs")
    tier = ZmqTier(server.endpoint, g)
    keys = chunk_keys(g, list(range(8)))
    with pytest.raises(ValueError, match="shape"):
        tier.submit_put(keys, [torch.randn(2, 2, 2, 7, 4)])
    with pytest.raises(ValueError, match="dtype"):
        tier.submit_fetch(keys, [torch.empty(2, 2, 2, 8, 4, dtype=torch.float64)])
    with pytest.raises(ValueError, match="ChunkKey"):
        tier.submit_lookup([b"x" * 32])  # type: ignore[list-item]
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.submit_lookup(keys)


def test_a_prefix_stored_by_another_process_is_a_hit(server: ServerProcess) -> None:
    """Two engines sharing one KV server: what process A computed, process B fetches."""
    import os
    import subprocess
    import sys

    from tier_testlib import PACKAGE_ROOT

    g = geometry("shared-between-processes")
    code = f"""
import time, torch
from sglang_vericache.tier import KVGeometry, chunk_keys, open_tier, split_chunks
g = KVGeometry(*{dataclasses.astuple(g)!r})
torch.manual_seed(1234)
kv = torch.randn(2, 2, 2, 20, 4)
tier = open_tier({server.spec!r}, g)
task = tier.submit_put(chunk_keys(g, list(range(500, 520))), split_chunks(kv, g))
deadline = time.monotonic() + 30
while True:
    done = tier.poll()
    if task in done:
        assert done[task].all_ok, done[task]
        break
    assert time.monotonic() < deadline
    time.sleep(0.005)
tier.close()
"""
    env = {**os.environ, "PYTHONPATH": PACKAGE_ROOT}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    torch.manual_seed(1234)
    expected = torch.randn(2, 2, 2, 20, 4)
    tier = ZmqTier(server.endpoint, g, timeout_s=10)
    res = Results(tier)
    dst = alloc_chunks(g, 20)
    got = res.wait(tier.submit_fetch(chunk_keys(g, list(range(500, 520))), dst))
    assert got.all_ok and torch.equal(join_chunks(dst), expected)
    tier.close()


def test_random_mix_of_tasks_and_cancels_returns_each_result_once(server: ServerProcess) -> None:
    import random

    rng = random.Random(7)
    g = geometry("stress", chunk_tokens=64)
    tier = ZmqTier(server.endpoint, g, timeout_s=20)
    res = Results(tier)
    seqs = {i: list(range(i * 1000, i * 1000 + 150)) for i in range(6)}
    kvs = {i: torch.randn(2, 2, 2, 150, 4) for i in range(6)}
    stored: set[int] = set()
    fetches: dict[int, tuple[int, list[torch.Tensor]]] = {}
    cancelled: set[int] = set()
    submitted: list[int] = []
    for _ in range(120):
        i = rng.randrange(6)
        op = rng.random()
        if op < 0.3:
            task = tier.submit_put(chunk_keys(g, seqs[i]), split_chunks(kvs[i], g))
            stored.add(i)
        elif op < 0.8:
            dst = alloc_chunks(g, 150)
            task = tier.submit_fetch(chunk_keys(g, seqs[i]), dst)
            fetches[task] = (i, dst)
        else:
            task = tier.submit_lookup(chunk_keys(g, seqs[i]))
        submitted.append(task)
        if rng.random() < 0.2:
            victim = rng.choice(submitted)
            tier.cancel(victim)
            cancelled.add(victim)
        res.drain()
    results = res.wait_all(submitted, timeout_s=30)
    time.sleep(0.1)
    res.drain()  # nothing more may arrive
    assert len(res.seen) == len(submitted) and tier.poll() == {}
    for result in results:
        assert result.status is not TaskStatus.FAILED, result
        if result.status is TaskStatus.CANCELLED:
            assert result.task_id in cancelled and not any(result.ok)
        if result.task_id in fetches and result.all_ok:  # a hit is always the right KV
            i, dst = fetches[result.task_id]
            assert torch.equal(join_chunks(dst), kvs[i])
    stats = tier.stats()
    assert stats["submitted"] == stats["completed"] == len(submitted)
    server.stats()  # the server's own integrity check
    tier.close()


def test_admin_cli_reports_stats_and_fails_a_health_check_on_a_dead_server(
    server: ServerProcess,
) -> None:
    """``python -m sglang_vericache.tier.admin``: an operator's health check and stats."""
    import json
    import os
    import subprocess
    import sys

    from tier_testlib import PACKAGE_ROOT, free_port

    env = {**os.environ, "PYTHONPATH": PACKAGE_ROOT}
    cmd = [sys.executable, "-m", "sglang_vericache.tier.admin"]
    ok = subprocess.run(cmd + ["stats", "--endpoint", server.spec], env=env, capture_output=True,
                        text=True, timeout=60)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    reply = json.loads(ok.stdout)
    assert reply["ok"] and reply["integrity"] == "ok" and "capacity_bytes" in reply["stats"], reply
    dead = f"tcp://127.0.0.1:{free_port()}"
    down = subprocess.run(cmd + ["ping", "--endpoint", dead, "--timeout", "0.5"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert down.returncode == 1 and dead in down.stderr and "no reply" in down.stderr
