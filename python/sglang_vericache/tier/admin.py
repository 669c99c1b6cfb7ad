"""One blocking request to the zmq KV server (ping / stats / exists / corrupt).

For tests, health checks and tools, never for the scheduler thread (use ZmqTier there).
"""

from __future__ import annotations

from typing import Any

import zmq

from sglang_vericache.tier.auth import ClientSession
from sglang_vericache.tier.protocol import PROTOCOL_VERSION, Op, unpack_header
from sglang_vericache.tier.secret import TierSecret, resolve_secret


def server_request(endpoint: str, op: Op, fields: dict[str, Any] | None = None, *,
                   secret: TierSecret | bytes | None = None,
                   timeout_s: float = 5.0) -> dict[str, Any]:
    """One blocking request without payload (ping/stats/exists/corrupt): for tests, health
    checks and tools, never for the scheduler thread. ``secret`` None resolves the shared
    secret as the server does (``secret.py``). The reply is authenticated; an error reply
    comes back as it is (``ok`` False). Raises TimeoutError / ProtocolError."""
    if not isinstance(secret, TierSecret):
        secret = resolve_secret() if secret is None else TierSecret(secret, "argument")
    session = ClientSession(secret.value)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        header = {"v": PROTOCOL_VERSION, "id": 1, "op": op.value, **(fields or {})}
        sock.send_multipart(session.sign(header, []))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"no reply from {endpoint} within {timeout_s}s")
        frames = sock.recv_multipart()
        reply = unpack_header(frames[0])
        session.check_reply(reply, frames)
        return reply
    finally:
        sock.close(linger=0)
