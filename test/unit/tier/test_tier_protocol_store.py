"""Wire protocol pieces and the byte-bounded LRU store (pure, fast)."""

from __future__ import annotations

import os
import random

import msgpack
import pytest

from sglang_vericache.tier.protocol import (
    CHECKSUM_ALGO, PROTOCOL_VERSION, ChunkManifest, ErrorCode, ProtocolError, check_mac,
    compute_mac, seal, unpack_header,
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


def test_mac_seal_and_check() -> None:
    frames = seal({"v": 1, "id": 1, "op": "put"}, [b"payload"], SECRET)
    header = unpack_header(frames[0])
    check_mac(SECRET, header, frames, check_time=True)
    for tampered in ([frames[0], b"payloaD", frames[2]],          # payload changed
                     [frames[0], b"pay", b"load", frames[2]],      # frame boundary moved
                     frames[:2]):                                  # mac missing
        with pytest.raises(ProtocolError) as info:
            check_mac(SECRET, header, tampered, check_time=True)
        assert info.value.code is ErrorCode.UNAUTHORIZED
    with pytest.raises(ProtocolError):
        check_mac(b"another-secret-of-16b", header, frames, check_time=True)
    unsigned = seal({"v": 1, "id": 1, "op": "put"}, [b"payload"], None)
    with pytest.raises(ProtocolError):
        check_mac(SECRET, unpack_header(unsigned[0]), unsigned, check_time=True)
    assert compute_mac(SECRET, [b"ab", b"c"]) != compute_mac(SECRET, [b"a", b"bc"])


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
