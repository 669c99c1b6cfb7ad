"""Who may open a connection to the zmq KV server: ZMTP PLAIN with a secret-derived password,
checked by the server's ZAP handler before the peer may send a single data frame.

Why at the connection: libzmq hands a multipart message to the server only once all of it has
arrived, and bounds neither the frames nor the bytes of an unfinished one (HWMs count complete
messages), so per-message checks (``auth.py``, ``intake.py``) come too late for a peer that
sends frame after frame and never a last one. (A libzmq sender never does that: it sends a
message once its last frame is queued; a hand-written ZMTP peer does it in a few lines.) A ZMTP
connection carries no data frame before its security handshake has succeeded.

What is still bounded only per connection: a peer in its handshake may send one command before
it is checked, of at most ZMQ_MAXMSGSIZE (``--max-frame-mb``) bytes, held at most
``HANDSHAKE_TIMEOUT_MS``; libzmq cannot cap the number of connections, so many at once hold
that much each. And a peer WITH the secret is trusted beyond the frame limit (it could still
send an endless message of small frames): the secret is the trust boundary.

Why PLAIN and not CURVE: CURVE encrypts every frame; on loopback (pyzmq 27.3, libzmq 4.3.5
with libsodium, 2 busy cores) 6 MiB messages moved at 0.1-0.4 GB/s under CURVE against
1.6-2.7 GB/s with no mechanism, and PLAIN, which costs nothing after the handshake, matched the
latter. What PLAIN does not give: the password travels in clear, so on a network an
eavesdropper learns it (never the secret: it is a one-way digest of it) and could then connect;
it still cannot forge a request or a reply (every message is MACed with the secret itself:
``auth.py``), so the per-message MAC and replay checks stay, none made redundant. Loopback, or a
trusted network, is what this fully protects.

The ZAP protocol is ZeroMQ RFC 27: the handler is a REP socket bound in the server's own
context at ``ZAP_ENDPOINT``; libzmq asks it about every PLAIN handshake on that context and
refuses every PLAIN peer while no handler is bound (it fails closed).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time

import zmq

from sglang_vericache.tier.auth import mac_key
from sglang_vericache.tier.secret import mismatch_hint

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: one handler per zmq context
ZAP_DOMAIN = b"vericache-tier"
USERNAME = b"vericache-tier-1"  # versions the password derivation
PASSWORD_BYTES = 32
HANDSHAKE_TIMEOUT_MS = 5000  # a peer's whole handshake, then libzmq drops it
_PERSON = b"vericache-conn-1"
_LOG_EVERY_S = 10.0

logger = logging.getLogger("sglang_vericache.tier.handshake")


def connection_password(secret: bytes) -> bytes:
    """The PLAIN password of every client of the secret: keyed blake2b, 32 bytes (one-way:
    a sniffed password does not reveal the secret, and no MAC can be made from it)."""
    return hashlib.blake2b(b"connect", key=mac_key(secret), digest_size=PASSWORD_BYTES,
                           person=_PERSON).digest()


def authenticate_client_socket(sock: zmq.Socket, secret: bytes) -> None:
    """Give a client socket the credentials the server's ZAP handler accepts. Call before
    ``connect`` (libzmq copies them into each connection it makes, reconnects included)."""
    sock.setsockopt(zmq.PLAIN_USERNAME, USERNAME)
    sock.setsockopt(zmq.PLAIN_PASSWORD, connection_password(secret))


def refusal_error(endpoint: str, zap_status: int, secret_source: str) -> str:
    """What a client tells its caller when ``endpoint`` refused its credentials (another
    secret, nearly always): says where this side's secret came from."""
    return (f"unauthorized: the KV server {endpoint} refused this client's credentials "
            f"(ZAP status {zap_status}): {mismatch_hint(secret_source)}")


def require_authenticated_peers(sock: zmq.Socket) -> None:
    """Make a server socket accept only peers that pass the ZAP handler (before ``bind``)."""
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)


class ZapHandler:
    """The server's ZAP handler: accepts a PLAIN handshake iff its domain, username and
    password are this secret's. Bind it in the server's context before the server socket
    binds (libzmq fails closed: with no handler it refuses every PLAIN peer). Not thread-safe: the
    server loop polls ``socket`` and calls ``handle_ready`` when it is readable."""

    def __init__(self, context: zmq.Context, secret: bytes) -> None:
        self._password = connection_password(secret)
        self.socket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self.refused = 0
        self._logged_at = float("-inf")

    def handle_ready(self) -> int:
        """Answer every waiting request; returns how many were refused (each is logged, at
        most once per ``_LOG_EVERY_S``: a misconfigured client retries every second)."""
        refused = 0
        while True:
            try:
                request = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return refused
            why = self._refusal(request)
            request_id = request[1] if len(request) > 1 else b""
            if why is None:
                reply = [b"1.0", request_id, b"200", b"OK", USERNAME, b""]
            else:
                refused += 1
                self._log_refusal(request, why)
                reply = [b"1.0", request_id, b"400", why.encode(), b"", b""]
            self.socket.send_multipart(reply)

    def _log_refusal(self, request: list[bytes], why: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY_S:
            self._logged_at = now
            address = request[3].decode(errors="replace") if len(request) > 3 else "?"
            logger.warning("refused a connection from %s: %s (%d refused so far)", address,
                           why, self.refused)

    def _refusal(self, request: list[bytes]) -> str | None:
        # RFC 27: version, request id, domain, address, routing id, mechanism, credentials...
        if len(request) != 8 or request[0] != b"1.0" or request[5] != b"PLAIN":
            return "not a PLAIN ZAP request"
        domain, username, password = request[2], request[6], request[7]
        if domain != ZAP_DOMAIN or username != USERNAME:
            return "unknown domain or username (not a client of this package's version?)"
        if not hmac.compare_digest(password, self._password):
            return "wrong password (a client with another shared secret)"
        return None

    def close(self) -> None:
        self.socket.close(linger=0)
