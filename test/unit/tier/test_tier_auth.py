"""A KV server that lets no one in: real server processes on 127.0.0.1.

Every refused message gets a clear error reply, is counted, and never touches the store:
forged puts (no secret, wrong secret), oversized messages, too many frames, replays. The
secret itself: generated once into a 0600 file and shared through it, refused when others can
read it, overridden by $VERICACHE_TIER_SECRET. Forged messages are sent over a connection that
passed the handshake (``raw_request``), so they test the message layer behind it; a peer
without connection credentials: ``test_tier_peer_memory.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sglang_vericache.tier import TaskStatus, open_tier
from sglang_vericache.tier.client import ZmqTier
from sglang_vericache.tier.factory import TierOptions
from sglang_vericache.tier.keys import chunk_keys
from sglang_vericache.tier.layout import alloc_chunks, join_chunks, split_chunks
from sglang_vericache.tier.protocol import PROTOCOL_VERSION, ChunkManifest
from sglang_vericache.tier.secret import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    TierSecret,
    default_secret_path,
    resolve_secret,
)
from tier_testlib import TINY, Results, ServerProcess, raw_request, signed

MAX_FRAMES = 16
G = dataclasses.replace(TINY, model_id="auth")
HDR = {"v": PROTOCOL_VERSION, "id": 7}
_SEQUENCES = itertools.count(1)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-message-mb", "1", "--max-frames", str(MAX_FRAMES))
    yield proc
    assert proc.stop() == 0


@pytest.fixture()
def stored(server: ServerProcess) -> Iterator[tuple[ZmqTier, Results, list, torch.Tensor]]:
    """A legitimate client with one stored sequence (the data forgers must not touch)."""
    tier = ZmqTier(server.endpoint, G, timeout_s=10)
    res = Results(tier)
    kv = torch.randn(2, 2, 2, 16, 4)
    start = next(_SEQUENCES) * 1000  # fresh tokens per test: a put never finds old KV
    keys = chunk_keys(G, list(range(start, start + 16)))
    assert res.wait(tier.submit_put(keys, split_chunks(kv, G))).all_ok
    yield tier, res, keys, kv
    tier.close()


def _intact(tier: ZmqTier, res: Results, keys: list, kv: torch.Tensor) -> bool:
    dst = alloc_chunks(G, 16)
    return res.wait(tier.submit_fetch(keys, dst)).all_ok and torch.equal(join_chunks(dst), kv)


def _put_frames(key: bytes, payload: bytes, **kw: object) -> list:
    manifest = ChunkManifest.of(G.namespace(), 8, G.num_layers, memoryview(payload))
    return signed({**HDR, "op": "put", "items": [{"key": key, "m": manifest.to_wire()}]},
                  payload, **kw)


def _store_unchanged(before: dict, after: dict) -> None:
    for name in ("entries", "puts", "put_exists", "used_bytes", "corrupt_rejected"):
        assert after[name] == before[name], (name, before[name], after[name])


def test_forged_put_without_the_secret_is_refused_and_the_store_is_unchanged(
        server: ServerProcess, stored) -> None:
    tier, res, keys, kv = stored
    before = server.stats()
    payload = torch.full(G.chunk_shape(8), 6.0).view(torch.uint8).numpy().tobytes()
    new_key = chunk_keys(G, [424242] * 8)[0]
    unsigned = _put_frames(new_key.digest, payload)[:-1] + [bytes(64)]  # MAC frame zeroed
    no_mac = _put_frames(keys[0].digest, payload)[:-1]                  # no MAC frame at all
    wrong = _put_frames(keys[0].digest, payload, secret=b"a guessed secret, 16+ bytes")
    for frames in (unsigned, no_mac, wrong):
        reply = raw_request(server.endpoint, frames)
        assert reply["ok"] is False and reply["code"] == "unauthorized", reply
    after = server.stats()
    _store_unchanged(before, after)
    assert after["unauthorized"] == before["unauthorized"] + 3
    assert res.wait(tier.submit_lookup([new_key])).ok == (False,)
    assert _intact(tier, res, keys, kv)  # the first write still wins: no overwrite


def test_put_altered_in_transit_is_rejected_by_its_authenticated_manifest(
        server: ServerProcess, stored) -> None:
    """The MAC covers the header (with each chunk's checksums) and frame lengths; a payload
    swapped for another of the same length fails its manifest and is never stored."""
    tier, res, _, _ = stored
    genuine = torch.full(G.chunk_shape(8), 5.0).view(torch.uint8).numpy().tobytes()
    forged = torch.full(G.chunk_shape(8), 9.0).view(torch.uint8).numpy().tobytes()
    new_key = chunk_keys(G, [31337] * 8)[0]
    frames = _put_frames(new_key.digest, genuine)
    before = server.stats()
    reply = raw_request(server.endpoint, [frames[0], forged, frames[2]])
    assert reply["ok"] and reply["status"] == ["corrupt"]
    after = server.stats()
    _store_unchanged({**before, "corrupt_rejected": after["corrupt_rejected"]}, after)
    assert after["corrupt_rejected"] == before["corrupt_rejected"] + 1
    assert res.wait(tier.submit_lookup([new_key])).ok == (False,)


def test_client_with_another_secret_gets_an_error_naming_the_secret(
        server: ServerProcess, caplog: pytest.LogCaptureFixture) -> None:
    tier = open_tier(server.spec, G, TierOptions(timeout_s=5,
                                                 secret=b"wrong secret of 16+ bytes"))
    res = Results(tier)
    result = res.wait(tier.submit_lookup(chunk_keys(G, list(range(8)))))
    assert result.status is TaskStatus.FAILED
    assert "unauthorized" in (result.error or "") and SECRET_ENV in (result.error or "")
    assert "the secret given to the client" in (result.error or "")  # where it came from
    # refused at the connection (handshake.py): the request never left the client
    assert tier.stats()["unauthorized"] == 1 and tier.stats()["bytes_sent"] == 0
    assert server.stats()["connections_refused"] >= 1
    time.sleep(0.5)  # libzmq retries the connection meanwhile: each retry is refused again
    tier.close()
    assert not [r for r in caplog.records if "lost connection" in r.getMessage()]


def test_oversized_message_is_refused_unread_and_the_sender_stays_connected(
        server: ServerProcess, stored) -> None:
    tier, res, keys, kv = stored
    before = server.stats()
    big = [bytes(200 << 10)] * 8  # 1.6 MB in 8 frames, each under the frame limit
    reply = raw_request(server.endpoint, signed({**HDR, "op": "put", "items": []}, *big))
    assert reply["ok"] is False and reply["code"] == "limit" and "bytes" in reply["error"]
    after = server.stats()
    _store_unchanged(before, after)
    assert after["limit_rejected"] == before["limit_rejected"] + 1
    assert after["unauthorized"] == before["unauthorized"]  # refused before the MAC check
    assert _intact(tier, res, keys, kv)


def test_too_many_frames_are_refused_unread(server: ServerProcess, stored) -> None:
    tier, res, keys, kv = stored
    before = server.stats()
    frames = signed({**HDR, "op": "put", "items": []}, *([b"x"] * MAX_FRAMES))
    assert len(frames) == MAX_FRAMES + 2
    reply = raw_request(server.endpoint, frames)
    assert reply["ok"] is False and reply["code"] == "limit" and "frames" in reply["error"]
    garbage = [b"not even a header"] * (MAX_FRAMES + 1)  # unauthenticated: same answer
    assert raw_request(server.endpoint, garbage)["code"] == "limit"
    after = server.stats()
    _store_unchanged(before, after)
    assert after["limit_rejected"] == before["limit_rejected"] + 2
    assert _intact(tier, res, keys, kv)


def test_replayed_message_is_refused(server: ServerProcess, stored) -> None:
    tier, res, _, _ = stored
    payload = torch.full(G.chunk_shape(8), 3.0).view(torch.uint8).numpy().tobytes()
    new_key = chunk_keys(G, [777] * 8)[0]
    frames = _put_frames(new_key.digest, payload)
    first = raw_request(server.endpoint, frames)
    assert first["ok"] and first["status"] == ["stored"]
    before = server.stats()
    for _ in range(2):  # on a new connection each time, as a replaying attacker would
        reply = raw_request(server.endpoint, frames)
        assert reply["ok"] is False and reply["code"] == "unauthorized"
        assert "replayed" in reply["error"]
    after = server.stats()
    _store_unchanged(before, after)
    assert after["unauthorized"] == before["unauthorized"] + 2
    assert res.wait(tier.submit_lookup([new_key])).all_ok  # the genuine put did land


def test_secret_is_generated_once_0600_and_shared_by_servers_through_its_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sub" / "tier_secret"
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    a = ServerProcess()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    content = path.read_bytes()
    b = ServerProcess()
    try:
        assert path.read_bytes() == content  # the second server reused it
        secret = resolve_secret()
        assert secret.value == content.strip() and str(path) in secret.source
        for proc in (a, b):
            tier = ZmqTier(proc.endpoint, G, timeout_s=5)  # resolves the same file
            res = Results(tier)
            kv = torch.randn(2, 2, 2, 8, 4)
            assert res.wait(tier.submit_put(chunk_keys(G, list(range(8))),
                                            split_chunks(kv, G))).all_ok
            tier.close()
    finally:
        assert a.stop() == 0 and b.stop() == 0


def test_secret_file_readable_by_others_is_refused(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tier_secret"
    path.write_text("x" * 32)
    path.chmod(0o644)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    with pytest.raises(ValueError, match="chmod 600"):
        resolve_secret()
    proc = ServerProcess(expect_ready=False)
    assert proc.proc.wait(timeout=30) == 2
    assert "chmod 600" in proc.logs()
    proc.stop()


def test_secret_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = tmp_path / "explicit"
    explicit.write_text("e" * 20 + "\n")
    explicit.chmod(0o600)
    monkeypatch.setenv(SECRET_FILE_ENV, str(tmp_path / "default"))
    monkeypatch.setenv(SECRET_ENV, "v" * 20)
    assert resolve_secret(explicit).value == b"e" * 20          # a given file wins
    assert resolve_secret() == TierSecret(b"v" * 20, f"${SECRET_ENV}")  # then the variable
    monkeypatch.delenv(SECRET_ENV)
    assert not default_secret_path().exists()
    with pytest.raises(FileNotFoundError):
        resolve_secret(create=False)
    assert len(resolve_secret().value) == 64  # then the generated file
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match="16 bytes"):
        resolve_secret()
    assert "v" * 20 not in repr(TierSecret(b"v" * 20, "x"))  # never printed
