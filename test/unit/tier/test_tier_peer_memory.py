"""No peer can make the KV server hold memory it did not agree to: a real server process.

The attacker speaks ZMTP itself (``RawZmtpPeer``): a libzmq peer such as a pyzmq DEALER sends
a multipart message only once its last frame is queued, but nothing stops a hand-written one
from sending frame after frame of a message that never ends, and the server's libzmq keeps
them all (it bounds neither the frames nor the bytes of an unfinished message). So a peer
without the shared secret must be turned away at the ZMTP handshake (``handshake.py``) before
it can send a data frame; a peer with the secret, or one still in its handshake, is cut off
at the first frame over ``--max-frame-mb`` before its bytes are buffered (ZMQ_MAXMSGSIZE).
After each attack the server must still serve an authenticated client.

The bound: the server's resident memory (VmRSS) never rises more than ``RSS_SLACK_MIB`` over
its idle RSS while the attack runs (the attacks offer 128 to 512 MiB).
"""

from __future__ import annotations

import dataclasses
import itertools
import socket
import struct
import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from sglang_vericache.tier.client import ZmqTier
from sglang_vericache.tier.handshake import USERNAME, connection_password
from sglang_vericache.tier.keys import chunk_keys
from sglang_vericache.tier.layout import alloc_chunks, join_chunks, split_chunks
from sglang_vericache.tier.secret import resolve_secret
from tier_testlib import TINY, Results, ServerProcess

MAX_FRAME_MB = 100  # above the 64 MiB frames the unauthenticated peer sends: only auth stops them
RSS_SLACK_MIB = 64
WATCH_S = 3.0  # how long the RSS is watched after the attack was sent
G = dataclasses.replace(TINY, model_id="peer-memory")
_SEQUENCES = itertools.count(1)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def peak_rss_mib(pid: int, seconds: float, stop_above: float) -> float:
    """The highest RSS seen over ``seconds`` (sampled every 20 ms; stops early above
    ``stop_above``, which already fails the bound)."""
    peak, deadline = 0.0, time.monotonic() + seconds
    while time.monotonic() < deadline and peak <= stop_above:
        peak = max(peak, rss_mib(pid))
        time.sleep(0.02)
    return peak


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-frame-mb", str(MAX_FRAME_MB))
    yield proc
    assert proc.stop() == 0


@pytest.fixture()
def idle_rss(server: ServerProcess) -> float:
    server.stats()  # a first request has allocated what serving needs
    return rss_mib(server.proc.pid)


def assert_still_serves(server: ServerProcess) -> None:
    """An authenticated client can still ping (stats), put and get (fresh tokens each time)."""
    assert server.stats()["entries"] >= 0
    tier = ZmqTier(server.endpoint, G, timeout_s=10)
    try:
        res = Results(tier)
        kv = torch.randn(2, 2, 2, 16, 4)
        start = next(_SEQUENCES) * 100
        keys = chunk_keys(G, list(range(start, start + 16)))
        assert res.wait(tier.submit_put(keys, split_chunks(kv, G))).all_ok
        dst = alloc_chunks(G, 16)
        assert res.wait(tier.submit_fetch(keys, dst)).all_ok
        assert torch.equal(join_chunks(dst), kv)
    finally:
        tier.close()


class RawZmtpPeer:
    """A hand-written ZMTP 3.0 DEALER on a plain TCP socket (ZeroMQ RFC 23/24/27): it can do
    what a libzmq peer never does, such as sending frames of a message that never ends.
    Every method raises OSError once the server has hung up."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def greet(self, mechanism: bytes) -> None:
        """Exchange the 64-byte greetings, announcing ``mechanism`` (NULL or PLAIN)."""
        self.sock.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00"
                          + mechanism.ljust(20, b"\0") + b"\0" + bytes(31))
        self._recv_exact(64)

    def handshake(self, password: bytes | None) -> None:
        """The whole handshake: NULL when ``password`` is None, else PLAIN with it."""
        socket_type = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        if password is None:
            self.greet(b"NULL")
            self.send_frame(b"\x05READY" + socket_type, command=True)
            self._recv_command(b"READY")
            return
        self.greet(b"PLAIN")
        self.send_frame(b"\x05HELLO" + bytes([len(USERNAME)]) + USERNAME
                        + bytes([len(password)]) + password, command=True)
        self._recv_command(b"WELCOME")
        self.send_frame(b"\x08INITIATE" + socket_type, command=True)
        self._recv_command(b"READY")

    def send_frame(self, body: bytes, *, more: bool = False, command: bool = False) -> None:
        self.send_frame_header(len(body), more=more, command=command)
        self.sock.sendall(body)

    def send_frame_header(self, size: int, *, more: bool = False, command: bool = False) -> None:
        flags = (1 if more else 0) | (4 if command else 0) | (2 if size > 255 else 0)
        self.sock.sendall(bytes([flags]) + (struct.pack(">Q", size) if size > 255
                                            else bytes([size])))

    def send_unfinished_message(self, frames: Sequence[bytes]) -> None:
        for frame in frames:  # MORE on every frame: the message never ends
            self.send_frame(frame, more=True)

    def hung_up(self, timeout_s: float = 5.0) -> bool:
        """Whether the server closes the connection within ``timeout_s``."""
        self.sock.settimeout(timeout_s)
        try:
            return self.sock.recv(1 << 16) == b""
        except TimeoutError:
            return False
        except OSError:  # reset
            return True

    def _recv_command(self, name: bytes) -> None:
        flags = self._recv_exact(1)[0]
        size = struct.unpack(">Q", self._recv_exact(8))[0] if flags & 2 \
            else self._recv_exact(1)[0]
        body = self._recv_exact(size)
        if body[1:1 + body[0]] != name:
            raise ConnectionRefusedError(f"expected {name!r}, got {body[:40]!r}")

    def _recv_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            part = self.sock.recv(n - len(out))
            if not part:
                raise ConnectionResetError("the server closed the connection")
            out += part
        return out

    def close(self) -> None:
        self.sock.close()


ONE_MIB = bytes(1 << 20)


@pytest.mark.parametrize("password,frame_bytes,count", [
    pytest.param(None, 64 << 20, 8, id="no-credentials-8x64MiB"),
    # ~250 MiB of zmq messages if the server kept them
    pytest.param(None, 255, 500_000, id="no-credentials-500k-small-frames"),
    pytest.param(connection_password(b"another secret, 16+ bytes"), 64 << 20, 8,
                 id="another-secret-8x64MiB"),
])
def test_peer_without_the_secret_cannot_make_the_server_hold_memory(
        server: ServerProcess, idle_rss: float, password: bytes | None, frame_bytes: int,
        count: int) -> None:
    frames = [bytes(frame_bytes)] * count  # one buffer, sent ``count`` times
    before = server.stats()
    bound = idle_rss + RSS_SLACK_MIB
    peer = RawZmtpPeer(server.port)
    try:
        try:
            peer.handshake(password)
            peer.send_unfinished_message(frames)
            refused = False
        except OSError:  # the server hung up on it
            refused = True
        peak = peak_rss_mib(server.proc.pid, WATCH_S, stop_above=bound)
        assert peak <= bound, f"server RSS {peak:.0f} MiB > idle {idle_rss:.0f} + " \
                              f"{RSS_SLACK_MIB} MiB: it kept an unauthenticated peer's frames"
        assert refused or peer.hung_up(), "a peer without the secret is still connected"
    finally:
        peer.close()
    after = server.stats()
    assert after["handshake_failures"] + after["connections_refused"] \
        > before["handshake_failures"] + before["connections_refused"]
    assert_still_serves(server)


def test_peer_with_the_secret_is_cut_off_at_a_frame_over_the_limit(
        server: ServerProcess, idle_rss: float) -> None:
    bound = idle_rss + RSS_SLACK_MIB
    peer = RawZmtpPeer(server.port)
    try:
        peer.handshake(connection_password(resolve_secret().value))  # accepted
        peer.send_frame(b"a header", more=True)
        peer.send_frame_header((MAX_FRAME_MB + 28) << 20, more=True)
        sent_mib = 0
        with pytest.raises(OSError):  # the server hangs up at the frame header
            for sent_mib in range(MAX_FRAME_MB + 28):
                peer.sock.sendall(ONE_MIB)
        assert sent_mib < MAX_FRAME_MB  # long before the frame could have been received
        assert peak_rss_mib(server.proc.pid, 0.5, stop_above=bound) <= bound
    finally:
        peer.close()
    assert_still_serves(server)


def test_handshake_command_over_the_frame_limit_is_cut_off_unbuffered(
        server: ServerProcess, idle_rss: float) -> None:
    """A peer in its handshake can send one command before it is checked: libzmq bounds it
    by ZMQ_MAXMSGSIZE too (so per connection a peer without the secret can make the server
    hold at most --max-frame-mb, for at most handshake.HANDSHAKE_TIMEOUT_MS)."""
    peer = RawZmtpPeer(server.port)
    try:
        peer.greet(b"PLAIN")
        peer.send_frame_header(512 << 20, command=True)
        sent_mib = 0
        with pytest.raises(OSError):  # the server hangs up at the frame header
            for sent_mib in range(512):
                peer.sock.sendall(ONE_MIB)
        assert sent_mib < 256
        assert rss_mib(server.proc.pid) <= idle_rss + RSS_SLACK_MIB
    finally:
        peer.close()
    assert_still_serves(server)
