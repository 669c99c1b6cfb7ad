"""Message authentication of the zmq tier: every request and reply carries a MAC, always.

The last frame of every message is a 32-byte keyed blake2b MAC (the shared secret of
``secret.py`` is the key) over the header frame and the LENGTH of every payload frame, not
over the payload bytes. The payload is bound to the header another way: every payload frame
is a chunk whose size and per-layer checksums are in its manifest, inside the authenticated
header, and both ends verify each chunk against its manifest before using it (the server
before storing, the client before copying out). So the MAC costs microseconds whatever the
message size, a peer without the secret is refused before a payload byte is hashed, and a
payload altered in transit is a rejected chunk, never stored or served. (Substituting a chunk
would need a second preimage of its truncated SHA-256 checksums: 2^128 work.) Lengths in the
MAC stop frame-boundary games; digests are compared with ``hmac.compare_digest``.

Replays: a request header carries ``ts`` (wall clock), ``sid`` (16 random bytes per client
session) and ``seq`` (strictly increasing per session: one DEALER socket delivers in order).
The server refuses a ``ts`` outside +-``max_skew_s``, a ``ts`` from before it started (less a
short grace), and a ``seq`` not above the last one it accepted for that ``sid``. A session is
forgotten only after it has been idle longer than any of its messages can stay fresh
(2 x max_skew_s + grace), so a forgotten session's messages are all stale. Replies echo the
request's ``sid``/``seq`` and are MACed too; a client accepts only replies to its own session.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from sglang_vericache.tier.protocol import ErrorCode, ProtocolError, pack_header

MAC_BYTES = 32
SESSION_ID_BYTES = 16
MAX_CLOCK_SKEW_S = 60.0
START_GRACE_S = 5.0
MAX_SESSIONS = 65536
_PERSON = b"vericache-tier-2"


def mac_key(secret: bytes) -> bytes:
    """blake2b keys are at most 64 bytes: longer secrets are digested first (not truncated)."""
    return secret if len(secret) <= 64 else hashlib.blake2b(secret).digest()


def compute_mac(key: bytes, frames: Sequence[memoryview | bytes]) -> bytes:
    """The MAC of ``frames`` = [header, *payload]: the header's bytes, every frame's length."""
    mac = hashlib.blake2b(key=key, digest_size=MAC_BYTES, person=_PERSON)
    mac.update(len(frames).to_bytes(8, "little"))
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "little"))
    mac.update(frames[0])
    return mac.digest()


def seal(header: dict[str, Any], payload: Sequence[memoryview | bytes],
         secret: bytes) -> list[memoryview | bytes]:
    """Frames ready for send_multipart(copy=False): header + payload + MAC frame."""
    frames: list[memoryview | bytes] = [pack_header(header), *payload]
    frames.append(compute_mac(mac_key(secret), frames))
    return frames


def _unauthorized(message: str) -> ProtocolError:
    return ProtocolError(message, ErrorCode.UNAUTHORIZED)


def check_mac(key: bytes, frames: Sequence[memoryview | bytes]) -> None:
    """Raise UNAUTHORIZED unless the last frame is the MAC of the others (cheap: see above)."""
    if len(frames) < 2 or len(frames[-1]) != MAC_BYTES:
        raise _unauthorized("message carries no MAC frame (a client without the shared secret?)")
    if not hmac.compare_digest(compute_mac(key, frames[:-1]), bytes(frames[-1])):
        raise _unauthorized("bad message authentication code (another shared secret?)")


class ClientSession:
    """One client's signing state: a random session id and a strictly increasing sequence.
    Thread-safe (sign() may be called from any thread; the socket sends in sign order)."""

    def __init__(self, secret: bytes) -> None:
        self._key = mac_key(secret)
        self.sid = os.urandom(SESSION_ID_BYTES)
        self._seq = 0
        self._lock = threading.Lock()

    def sign(self, header: dict[str, Any], payload: Sequence[memoryview | bytes]
             ) -> list[memoryview | bytes]:
        with self._lock:
            self._seq += 1
            seq = self._seq
        frames: list[memoryview | bytes] = [
            pack_header({**header, "ts": time.time(), "sid": self.sid, "seq": seq}), *payload]
        frames.append(compute_mac(self._key, frames))
        return frames

    def check_reply(self, header: dict[str, Any], frames: Sequence[memoryview | bytes]) -> None:
        """Raise UNAUTHORIZED unless ``frames`` is a reply MACed with our secret to our session."""
        check_mac(self._key, frames)
        if header.get("sid") != self.sid:
            raise _unauthorized("reply to another client session")


class RequestAuthenticator:
    """The server's checks on a request (module doc). Not thread-safe: the server loop only.
    ``check`` reads the header and the frame lengths only; the replay state advances only
    for a request that passed every check."""

    def __init__(self, secret: bytes, max_skew_s: float = MAX_CLOCK_SKEW_S,
                 max_sessions: int = MAX_SESSIONS) -> None:
        self._key = mac_key(secret)
        self.max_skew_s = max_skew_s
        self.max_sessions = max_sessions
        self.started_at = time.time()
        self._sessions: OrderedDict[bytes, tuple[int, float]] = OrderedDict()  # sid->(seq, t)

    def check(self, header: dict[str, Any], frames: Sequence[memoryview | bytes]) -> None:
        check_mac(self._key, frames)
        ts, sid, seq = header.get("ts"), header.get("sid"), header.get("seq")
        if not isinstance(ts, float) or not isinstance(sid, bytes) \
                or len(sid) != SESSION_ID_BYTES or not isinstance(seq, int) \
                or isinstance(seq, bool) or seq <= 0:
            raise _unauthorized("missing or malformed ts/sid/seq")
        now = time.time()
        if abs(now - ts) > self.max_skew_s:
            raise _unauthorized(f"timestamp {now - ts:+.1f}s off the server clock (more than "
                                f"{self.max_skew_s:g}s: a replay, or clocks out of sync)")
        if ts < self.started_at - START_GRACE_S:
            raise _unauthorized("message older than this server (a replay across a restart)")
        mono = time.monotonic()
        self._expire(mono)
        last = self._sessions.get(sid)
        if last is not None and seq <= last[0]:
            raise _unauthorized(f"replayed message (seq {seq} <= {last[0]} already seen)")
        if last is None and len(self._sessions) >= self.max_sessions:
            raise _unauthorized(f"too many client sessions (> {self.max_sessions})")
        self._sessions[sid] = (seq, mono)
        self._sessions.move_to_end(sid)

    def _expire(self, now: float) -> None:
        ttl = 2 * self.max_skew_s + START_GRACE_S
        while self._sessions:
            sid, (_, seen) = next(iter(self._sessions.items()))
            if now - seen <= ttl:
                return
            del self._sessions[sid]

    def __len__(self) -> int:
        return len(self._sessions)
