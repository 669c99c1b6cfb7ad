"""Wire protocol pieces and the byte-bounded LRU store (pure, fast)."""

from __future__ import annotations

import os
import random

import msgpack
import pytest

from sglang_vericache.tier.auth import (
    ClientSession, RequestAuthenticator, compute_mac, mac_key, seal,
)
from sglang_vericache.tier.protocol import (
    CHECKSUM_ALGO, PROTOCOL_VERSION, ChunkManifest, ErrorCode, ProtocolError, unpack_header,
)
from sglang_vericache.tier.store import Admission, LRUByteStore

NS = bytes(range(16))
SECRET = b"0123456789abcdef-secret"


def test_manifest_roundtrip_and_verify() -> None:
    payload = bytearray(os.urandom(4 * 96))
    m = ChunkManifest.of(NS, 8, 4, memoryview(payload))
    assert m.algo == CHECKSUM_ALGO and len(m.sums) == 4 and m.nbytes == len(payload)
    again = ChunkManifest.from_wire(msgpack.unpackb(msgpack.packb(m.to_wire())))
    assert again == m and again.verify(memoryview(payload))
    for layer in range(4):  # a flipped byte in any layer is caught
        damaged = bytearray(payload)
        damaged[layer * 96 + 5] ^= 1
        assert not m.verify(memoryview(damaged))
    assert not m.verify(memoryview(payload)[:-4])  # truncated


@pytest.mark.parametrize("patch", [
    {"ns": b"short"}, {"n": 0}, {"layers": 3}, {"algo": "crc32"}, {"sums": "x"},
    {"nbytes": True},
])
def test_manifest_rejects_bad_fields(patch: dict) -> None:
    wire = ChunkManifest.of(NS, 8, 4, memoryview(bytes(64))).to_wire()
    with pytest.raises(ProtocolError):
        ChunkManifest.from_wire({**wire, **patch})
    with pytest.raises(ProtocolError):
        ChunkManifest.from_wire([1, 2])


def test_unpack_header_rejects_garbage() -> None:
    assert unpack_header(msgpack.packb({"v": PROTOCOL_VERSION, "id": 3}))["id"] == 3
    bad = [b"", b"\xc1\xff\x00", msgpack.packb([1, 2]), msgpack.packb({"id": 1}),
           msgpack.packb({"v": PROTOCOL_VERSION, "id": "x"}), b"\x00" * (2 << 20)]
    for frame in bad:
        with pytest.raises(ProtocolError):
            unpack_header(frame)
    with pytest.raises(ProtocolError) as info:
        unpack_header(msgpack.packb({"v": 99, "id": 1}))
    assert info.value.code is ErrorCode.VERSION


def _unauthorized(fn, *args) -> str:
    with pytest.raises(ProtocolError) as info:
        fn(*args)
    assert info.value.code is ErrorCode.UNAUTHORIZED
    return str(info.value)


def test_signed_request_is_accepted_once_and_tampering_is_refused() -> None:
    client, server = ClientSession(SECRET), RequestAuthenticator(SECRET)
    frames = client.sign({"v": PROTOCOL_VERSION, "id": 1, "op": "put"}, [b"payload"])
    header = unpack_header(frames[0])
    for tampered in ([frames[0], b"pay", b"load", frames[2]],      # frame boundary moved
                     [frames[0], b"payload!", frames[2]],          # payload length changed
                     [frames[0], frames[2]],                       # payload frame dropped
                     frames[:2]):                                  # MAC missing
        _unauthorized(server.check, header, tampered)
    forged_header = [frames[0].replace(b"put", b"get"), b"payload", frames[2]]
    _unauthorized(server.check, unpack_header(forged_header[0]), forged_header)
    _unauthorized(RequestAuthenticator(b"another-secret-of-16b").check, header, frames)
    server.check(header, frames)
    assert "replayed" in _unauthorized(server.check, header, frames)  # the same message again
    unsigned = [frames[0], b"payload"]
    _unauthorized(server.check, header, unsigned)
    assert compute_mac(mac_key(SECRET), [b"ab", b"c"]) != compute_mac(mac_key(SECRET),
                                                                      [b"ab", b"", b"c"])


def test_mac_reads_no_payload_byte() -> None:
    """The MAC covers the header and frame lengths only: payload bytes are authenticated by
    the manifest checksums inside the header (server before storing, client before use), so
    authenticating a huge message costs nothing and a refused one is never hashed."""
    client, server = ClientSession(SECRET), RequestAuthenticator(SECRET)
    frames = client.sign({"v": PROTOCOL_VERSION, "id": 1, "op": "put"}, [b"x" * 1000])
    same_length = [frames[0], b"y" * 1000, frames[2]]
    server.check(unpack_header(frames[0]), same_length)  # caught by the manifest instead
    m = ChunkManifest.of(NS, 8, 4, memoryview(b"x" * 1000))
    assert not m.verify(memoryview(b"y" * 1000))


def test_sequence_must_grow_per_session_and_stale_timestamps_are_refused() -> None:
    client, server = ClientSession(SECRET), RequestAuthenticator(SECRET, max_skew_s=5.0)
    first = client.sign({"v": PROTOCOL_VERSION, "id": 1, "op": "ping"}, [])
    second = client.sign({"v": PROTOCOL_VERSION, "id": 2, "op": "ping"}, [])
    server.check(unpack_header(second[0]), second)
    assert "replayed" in _unauthorized(server.check, unpack_header(first[0]), first)
    other = ClientSession(SECRET)  # another session has its own sequence
    third = other.sign({"v": PROTOCOL_VERSION, "id": 1, "op": "ping"}, [])
    server.check(unpack_header(third[0]), third)
    stale_header = {"v": PROTOCOL_VERSION, "id": 3, "op": "ping", "ts": 1.0,
                    "sid": bytes(16), "seq": 1}
    stale = seal(stale_header, [], SECRET)
    assert "timestamp" in _unauthorized(server.check, unpack_header(stale[0]), stale)
    assert len(server) == 2


def test_reply_must_be_signed_for_this_session() -> None:
    client = ClientSession(SECRET)
    good = seal({"v": PROTOCOL_VERSION, "id": 1, "ok": True, "sid": client.sid}, [b"kv"], SECRET)
    client.check_reply(unpack_header(good[0]), good)
    other = seal({"v": PROTOCOL_VERSION, "id": 1, "ok": True, "sid": bytes(16)}, [], SECRET)
    _unauthorized(client.check_reply, unpack_header(other[0]), other)
    forged = seal({"v": PROTOCOL_VERSION, "id": 1, "ok": True, "sid": client.sid}, [b"kv"],
                  b"not the secret, 16+ bytes")
    _unauthorized(client.check_reply, unpack_header(forged[0]), forged)
    long_secret = os.urandom(100)  # > 64 bytes: digested, not truncated
    assert mac_key(long_secret) != mac_key(long_secret[:64] + b"x" * 36)


def test_lru_evicts_oldest_and_refuses_oversize_without_evicting() -> None:
    store: LRUByteStore[str, int] = LRUByteStore(100)
    for i, key in enumerate("abcd"):
        assert store.put(key, i, 25).admission is Admission.STORED
        store.check_integrity()
    assert store.get("a") == 0  # refresh a: b is now the oldest
    out = store.put("e", 4, 30)
    assert out.admission is Admission.STORED and out.evicted == 2  # b and c
    assert not store.contains("b") and not store.contains("c") and store.contains("a")
    store.check_integrity()
    before = dict((k, store.peek(k)) for k in "ade")
    assert store.put("huge", 9, 101).admission is Admission.TOO_LARGE
    assert {k: store.peek(k) for k in "ade"} == before  # nothing lost
    assert store.put("a", 99, 25).admission is Admission.EXISTS and store.peek("a") == 0
    assert store.remove("a") and not store.remove("a")
    store.check_integrity()
    with pytest.raises(ValueError):
        LRUByteStore(0)


def test_lru_matches_reference_model_under_random_ops() -> None:
    rng = random.Random(0)
    store: LRUByteStore[int, int] = LRUByteStore(1000)
    model: list[tuple[int, int]] = []  # (key, size), oldest first
    for _ in range(2000):
        key, size = rng.randrange(40), rng.randrange(1, 300)
        if rng.random() < 0.3:
            hit = store.get(key)
            entry = next((e for e in model if e[0] == key), None)
            assert (hit is not None) == (entry is not None)
            if entry:
                model.remove(entry)
                model.append(entry)
        else:
            out = store.put(key, key, size)
            entry = next((e for e in model if e[0] == key), None)
            if entry:
                assert out.admission is Admission.EXISTS
                model.remove(entry)
                model.append(entry)
            else:
                while sum(s for _, s in model) + size > 1000:
                    model.pop(0)
                model.append((key, size))
        store.check_integrity()
        assert sorted(k for k, _ in model) == sorted(k for k in range(40) if store.contains(k))
