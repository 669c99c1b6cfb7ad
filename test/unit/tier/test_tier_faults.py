"""Faults and bad input against real server processes on 127.0.0.1.

In every case the client reports a clean miss/failure (the caller recomputes), the error is
logged and counted, the server keeps serving, and nothing stored earlier is lost.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from typing import Iterator

import msgpack
import pytest
import torch
import zmq

from sglang_vericache.tier import TaskStatus, open_tier
from sglang_vericache.tier.admin import server_request
from sglang_vericache.tier.client import ZmqTier
from sglang_vericache.tier.factory import TierOptions
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.handshake import (
    ZapHandler,
    authenticate_client_socket,
    require_authenticated_peers,
)
from sglang_vericache.tier.layout import alloc_chunks, join_chunks, split_chunks
from sglang_vericache.tier.keys import ChunkKey, chunk_keys
from sglang_vericache.tier.auth import seal
from sglang_vericache.tier.protocol import (
    MAX_KEYS_PER_REQUEST, PROTOCOL_VERSION, ChunkManifest, Op, unpack_header,
)
from sglang_vericache.tier.secret import resolve_secret
from sglang_vericache.tier.server import ServerConfig
from tier_testlib import TINY, Results, ServerProcess, free_port, raw_request, signed


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--fault-injection")
    yield proc
    assert proc.stop() == 0


def geometry(name: str, **changes: object) -> KVGeometry:
    return dataclasses.replace(TINY, model_id=name, **changes)


def store_sequence(tier: ZmqTier, n_tokens: int, seed: int = 0
                   ) -> tuple[list[ChunkKey], torch.Tensor, Results]:
    res = Results(tier)
    g = tier.geometry
    tokens = list(range(seed * 100_000, seed * 100_000 + n_tokens))
    kv = torch.randn(g.num_layers, 2, g.num_kv_heads, n_tokens, g.head_dim).to(g.torch_dtype)
    keys = chunk_keys(g, tokens)
    assert res.wait(tier.submit_put(keys, split_chunks(kv, g))).all_ok
    return keys, kv, res


def fetch_ok(tier: ZmqTier, keys: list[ChunkKey], kv: torch.Tensor, res: Results) -> bool:
    dst = alloc_chunks(tier.geometry, kv.shape[3])
    result = res.wait(tier.submit_fetch(keys, dst))
    return result.all_ok and torch.equal(join_chunks(dst), kv)


def test_server_killed_in_the_middle_of_a_fetch_then_restarted() -> None:
    proc = ServerProcess("--bandwidth-mbps", "4")  # 1 MiB reply takes ~0.26 s
    g = geometry("killed", chunk_tokens=4096)      # 512 KiB chunks
    tier = ZmqTier(proc.endpoint, g, timeout_s=30)
    keys, kv, res = store_sequence(tier, 8192)
    dst = alloc_chunks(g, 8192)
    sent = tier.stats()["bytes_sent"]
    task = tier.submit_fetch(keys, dst)
    while tier.stats()["bytes_sent"] == sent:
        time.sleep(0.001)
    t0 = time.monotonic()
    proc.kill()
    result = res.wait(task, timeout_s=10)
    assert result.status is TaskStatus.FAILED and not any(result.ok)
    assert time.monotonic() - t0 < 5  # the disconnect is noticed, not waited out (timeout 30)
    stats = tier.stats()
    assert stats["disconnects"] == 1 and stats["failures"] == 1 and stats["fallbacks"] == 1
    # A server restarted on the same port is used again without touching the client.
    again = ServerProcess(port=proc.port)
    try:
        look = res.wait(tier.submit_lookup(keys))
        assert look.status is TaskStatus.DONE and look.ok == (False, False)  # memory is gone
        assert res.wait(tier.submit_put(keys, split_chunks(kv, g))).all_ok
        assert fetch_ok(tier, keys, kv, res)
    finally:
        tier.close()
        assert again.stop() == 0


def test_unresponsive_server_times_out() -> None:
    proc = ServerProcess()
    g = geometry("frozen")
    tier = ZmqTier(proc.endpoint, g, timeout_s=0.5)
    keys, kv, res = store_sequence(tier, 16)
    proc.proc.send_signal(signal.SIGSTOP)
    try:
        result = res.wait(tier.submit_fetch(keys, alloc_chunks(g, 16)), timeout_s=5)
        assert result.status is TaskStatus.FAILED and "no reply" in (result.error or "")
        assert tier.stats()["timeouts"] == 1
    finally:
        proc.proc.send_signal(signal.SIGCONT)
    time.sleep(0.1)
    assert fetch_ok(tier, keys, kv, res)  # the late reply is ignored; the data is intact
    tier.close()
    assert proc.stop() == 0


def test_corrupted_chunk_is_a_miss_never_wrong_kv(server: ServerProcess) -> None:
    g = geometry("corrupt")
    tier = ZmqTier(server.endpoint, g, timeout_s=10)
    keys, kv, res = store_sequence(tier, 24)
    bystander_keys, bystander_kv, _ = store_sequence(tier, 16, seed=1)
    reply = server_request(server.endpoint, Op.CORRUPT, {"keys": [keys[1].digest]})
    assert reply["ok"] and reply["corrupted"] == 1
    dst = alloc_chunks(g, 24)
    result = res.wait(tier.submit_fetch(keys, dst))
    assert result.status is TaskStatus.DONE and result.ok == (True, False, False)
    assert torch.equal(dst[0], kv[:, :, :, :8]) and "checksum" in (result.error or "")
    assert tier.stats()["checksum_mismatch"] == 1 and tier.stats()["fallbacks"] == 1
    assert fetch_ok(tier, bystander_keys, bystander_kv, res)  # the server keeps serving
    tier.close()


def test_corrupt_or_inconsistent_put_is_rejected(server: ServerProcess) -> None:
    g = geometry("corrupt-put")
    tier = ZmqTier(server.endpoint, g, timeout_s=10)
    keys, kv, res = store_sequence(tier, 8)
    before = server.stats()
    payload = bytes(g.chunk_nbytes(8))
    wrong = ChunkManifest.of(g.namespace(), 8, g.num_layers, memoryview(b"\x01" + payload[1:]))
    new_key = chunk_keys(g, [9] * 8)[0]
    items = [{"key": new_key.digest, "m": wrong.to_wire()},      # checksum mismatch
             {"key": keys[0].digest, "m": wrong.to_wire()}]      # would overwrite good data
    reply = raw_request(server.endpoint, signed({"v": PROTOCOL_VERSION, "id": 5, "op": "put",
                                                 "items": items}, payload, payload))
    assert reply["ok"] and reply["status"] == ["corrupt", "corrupt"]
    assert server.stats()["corrupt_rejected"] == before["corrupt_rejected"] + 2
    assert res.wait(tier.submit_lookup([new_key])).ok == (False,)
    assert fetch_ok(tier, keys, kv, res)  # the good chunk was not replaced
    tier.close()


def test_other_geometry_or_model_is_a_miss(server: ServerProcess) -> None:
    a = geometry("model-a")
    tier_a = ZmqTier(server.endpoint, a, timeout_s=10)
    keys, kv, res_a = store_sequence(tier_a, 16)
    tokens = list(range(16))
    for other in (geometry("model-b"), geometry("model-a", head_dim=8),
                  geometry("model-a", dtype="float16"), geometry("model-a", num_layers=3)):
        tier_b = ZmqTier(server.endpoint, other, timeout_s=10)
        res_b = Results(tier_b)
        assert res_b.wait(tier_b.submit_lookup(chunk_keys(other, tokens))).ok == (False, False)
        # Even A's exact digests, presented by a client of another geometry, are a miss.
        forged = [ChunkKey(k.digest, k.num_tokens) for k in keys]
        result = res_b.wait(tier_b.submit_fetch(forged, alloc_chunks(other, 16)))
        assert result.status is TaskStatus.DONE and result.ok == (False, False)
        assert tier_b.stats()["fallbacks"] == 1
        tier_b.close()
    assert fetch_ok(tier_a, keys, kv, res_a)  # A's data is untouched
    tier_a.close()


def test_client_rejects_a_manifest_of_another_geometry() -> None:
    """A lying or buggy server: the client's own manifest check turns its reply into a miss."""
    g = geometry("liar")
    ctx = zmq.Context()  # a rogue that knows the secret, even: it lets the client connect
    zap = ZapHandler(ctx, resolve_secret().value)
    rogue = ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    require_authenticated_peers(rogue)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    tier = ZmqTier(f"tcp://127.0.0.1:{port}", g, timeout_s=5)
    res = Results(tier)
    key = chunk_keys(g, list(range(8)))[0]
    payload = torch.randn(g.chunk_shape(8)).view(torch.uint8).reshape(-1).numpy().tobytes()
    wrong_ns = geometry("other").namespace()
    try:
        for manifest in (ChunkManifest.of(wrong_ns, 8, 2, memoryview(payload)),
                         ChunkManifest.of(g.namespace(), 7, 2, memoryview(payload))):
            task = tier.submit_fetch([key], alloc_chunks(g, 8))
            deadline = time.monotonic() + 5
            while not rogue.poll(10):  # answering the client's handshake meanwhile
                zap.handle_ready()
                assert time.monotonic() < deadline
            ident, header = rogue.recv_multipart()[:2]
            request = msgpack.unpackb(header)
            rogue.send_multipart([ident, *seal({  # a rogue that knows the secret, even
                "v": PROTOCOL_VERSION, "id": request["id"], "sid": request["sid"], "ok": True,
                "items": [{"key": key.digest, "m": manifest.to_wire()}]}, [payload],
                resolve_secret().value)])
            result = res.wait(task)
            assert result.status is TaskStatus.DONE and result.ok == (False,)
        assert tier.stats()["geometry_mismatch"] == 2
    finally:
        tier.close()
        rogue.close()
        zap.close()
        ctx.term()


def test_tier_full_evicts_lru_and_refuses_oversize_without_loss() -> None:
    proc = ServerProcess(capacity_gb=0.001)  # 1,073,741 bytes
    g = geometry("full", chunk_tokens=2048)  # 256 KiB chunks: 4 fit
    tier = ZmqTier(proc.endpoint, g, timeout_s=10)
    try:
        keys, kv, res = store_sequence(tier, 4 * 2048)
        newer_keys, newer_kv, _ = store_sequence(tier, 2 * 2048, seed=1)
        stats = proc.stats()
        assert stats["evictions"] == 2 and stats["used_bytes"] <= stats["capacity_bytes"]
        look = res.wait(tier.submit_lookup(keys))
        assert look.status is TaskStatus.DONE and look.ok == (False,) * 4  # head evicted: miss
        assert res.wait(tier.submit_fetch(keys, alloc_chunks(g, 4 * 2048))).ok == (False,) * 4
        # A chunk bigger than the whole budget is refused and evicts nothing.
        big = geometry("full", chunk_tokens=16384)  # one 2 MiB chunk > 1 MiB capacity
        big_tier = ZmqTier(proc.endpoint, big, timeout_s=10)
        big_res = Results(big_tier)
        big_kv = torch.randn(2, 2, 2, 16384, 4)
        big_keys = chunk_keys(big, list(range(16384)))
        out = big_res.wait(big_tier.submit_put(big_keys, split_chunks(big_kv, big)))
        assert out.status is TaskStatus.DONE and out.ok == (False,)
        assert "too_large" in (out.error or "") and big_tier.stats()["put_rejected"] == 1
        assert proc.stats()["full_rejected"] == 1
        assert fetch_ok(tier, newer_keys, newer_kv, res)
        big_tier.close()
    finally:
        tier.close()
        assert proc.stop() == 0


def test_server_unreachable_at_startup_then_comes_up() -> None:
    port = free_port()
    g = geometry("late-server")
    tier = open_tier(f"zmq://127.0.0.1:{port}", g,
                     TierOptions(timeout_s=5, connect_timeout_s=0.3))  # never raises
    res = Results(tier)
    keys = chunk_keys(g, list(range(8)))
    t0 = time.monotonic()
    result = res.wait(tier.submit_fetch(keys, alloc_chunks(g, 8)))
    assert result.status is TaskStatus.FAILED and "unreachable" in (result.error or "")
    assert time.monotonic() - t0 < 2
    assert tier.stats()["unreachable"] == 1 and tier.stats()["fallbacks"] == 1
    proc = ServerProcess(port=port)
    try:
        deadline = time.monotonic() + 5
        while not res.wait(tier.submit_lookup(keys)).status is TaskStatus.DONE:
            assert time.monotonic() < deadline
        kv = torch.randn(2, 2, 2, 8, 4)
        assert res.wait(tier.submit_put(keys, split_chunks(kv, g))).all_ok
        assert fetch_ok(tier, keys, kv, res)
    finally:
        tier.close()
        assert proc.stop() == 0


def test_malformed_messages_get_error_replies_and_server_survives(server: ServerProcess) -> None:
    g = geometry("malformed")
    tier = ZmqTier(server.endpoint, g, timeout_s=10)
    keys, kv, res = store_sequence(tier, 16)
    before = server.stats()["bad_requests"]
    hdr = {"v": PROTOCOL_VERSION, "id": 9}
    ns = g.namespace()
    bad_messages = [  # signed where the server would get as far as the MAC
        [os.urandom(64)],                                            # not msgpack
        [msgpack.packb([1, 2, 3])],                                  # not a map
        [msgpack.packb({**hdr, "v": 99, "op": "ping"})],             # wrong version
        signed({**hdr, "op": "explode"}),                            # unknown op
        signed({**hdr}),                                             # no op
        signed({**hdr, "op": "put", "items": [{}]}),                 # items without frames
        signed({**hdr, "op": "put", "items": [{"key": b"k"}]}, b"x"),  # short key
        signed({**hdr, "op": "put", "items": [{"key": bytes(32), "m": {}}]}, b"x"),
        signed({**hdr, "op": "get", "keys": ["a"], "ns": ns}),          # bad keys
        signed({**hdr, "op": "get", "keys": [bytes(32)], "ns": b"x"}),  # bad ns
        signed({**hdr, "op": "exists", "ns": ns,
                "keys": [bytes(32)] * (MAX_KEYS_PER_REQUEST + 1)}),     # too many
        signed({**hdr, "op": "ping"}, b"unexpected payload"),
        [msgpack.packb({**hdr, "op": "ping", "pad": b"x" * (1 << 20)})],  # header > 1 MiB
        [msgpack.packb({**hdr, "op": "ping"}), bytes(64)],                # unsigned
    ]
    for frames in bad_messages:
        reply = raw_request(server.endpoint, frames)
        assert reply["ok"] is False and reply["code"] in ("bad_request", "version",
                                                          "unauthorized"), reply
    stats = server.stats()
    assert stats["bad_requests"] + stats["unauthorized"] >= before + len(bad_messages)
    # Raw non-ZMTP bytes on the port: dropped by libzmq, counted, nothing breaks.
    # One long-lived socket for stats, so that only the garbage connection can be dropped.
    stats_sock = zmq.Context.instance().socket(zmq.DEALER)
    authenticate_client_socket(stats_sock, resolve_secret().value)
    stats_sock.connect(server.endpoint)

    def dropped_peers() -> int:
        stats_sock.send_multipart(signed({**hdr, "op": "stats"}))
        assert stats_sock.poll(5000)
        stats = unpack_header(stats_sock.recv_multipart()[0])["stats"]
        return stats["handshake_failures"] + stats["peer_disconnects"]

    dropped = -1
    while dropped != dropped_peers():  # let disconnects of the sockets above settle first
        dropped = dropped_peers()
        time.sleep(0.1)
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(b"\xff" + os.urandom(4096))
    deadline = time.monotonic() + 5
    while dropped_peers() == dropped:
        assert time.monotonic() < deadline, "garbage connection was not dropped"
        time.sleep(0.02)
    stats_sock.close(linger=0)
    assert server_request(server.endpoint, Op.PING)["ok"]
    assert fetch_ok(tier, keys, kv, res)
    assert "rejected request" in server.logs()
    tier.close()


def test_oversized_frame_cuts_the_sender_off_only() -> None:
    proc = ServerProcess("--max-frame-mb", "1")
    small = geometry("oversize-small")
    tier = ZmqTier(proc.endpoint, small, timeout_s=5)
    keys, kv, res = store_sequence(tier, 16)
    big = geometry("oversize-big", chunk_tokens=16384)  # 2 MiB frame > 1 MiB
    big_tier = ZmqTier(proc.endpoint, big, timeout_s=5)
    big_res = Results(big_tier)
    big_keys = chunk_keys(big, list(range(16384)))
    out = big_res.wait(big_tier.submit_put(big_keys, split_chunks(torch.randn(2, 2, 2, 16384, 4),
                                                                  big)))
    assert out.status is TaskStatus.FAILED
    assert big_tier.stats()["disconnects"] + big_tier.stats()["timeouts"] == 1
    assert proc.stats()["peer_disconnects"] >= 1 and proc.stats()["entries"] == 2
    assert fetch_ok(tier, keys, kv, res)  # other clients and earlier data unaffected
    big_tier.close()
    tier.close()
    assert proc.stop() == 0


def test_server_config_needs_a_secret_and_keeps_fault_injection_on_loopback() -> None:
    ServerConfig(capacity_bytes=1 << 20, secret=b"s" * 16, host="0.0.0.0")  # allowed
    with pytest.raises(ValueError, match="loopback"):
        ServerConfig(capacity_bytes=1 << 20, secret=b"s" * 16, host="10.0.0.1",
                     fault_injection=True)
    with pytest.raises(ValueError, match="16 bytes"):
        ServerConfig(capacity_bytes=1 << 20, secret=b"short")
    with pytest.raises(ValueError, match="16 bytes"):
        ServerConfig(capacity_bytes=1 << 20, secret=None)  # type: ignore[arg-type]


def test_fault_injection_is_off_by_default_and_sigterm_is_clean() -> None:
    proc = ServerProcess("--bandwidth-mbps", "100")
    reply = server_request(proc.endpoint, Op.CORRUPT, {"keys": []})
    assert reply["ok"] is False and reply["code"] == "disabled"
    assert proc.stop() == 0
    assert "shutting down; stats=" in proc.logs()
