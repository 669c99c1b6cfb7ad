"""One blocking request to the zmq KV server (ping / stats / exists / corrupt).

For tests, health checks and tools, never for the scheduler thread (use ZmqTier there).
"""

from __future__ import annotations

from typing import Any

import zmq

from sglang_vericache.tier.protocol import PROTOCOL_VERSION, Op, check_mac, seal, unpack_header


def server_request(endpoint: str, op: Op, fields: dict[str, Any] | None = None, *,
                   secret: bytes | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """One blocking request without payload (ping/stats/exists/corrupt): for tests, health
    checks and tools, never for the scheduler thread. Raises TimeoutError / ProtocolError."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        header = {"v": PROTOCOL_VERSION, "id": 1, "op": op.value, **(fields or {})}
        sock.send_multipart(seal(header, [], secret))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"no reply from {endpoint} within {timeout_s}s")
        frames = sock.recv_multipart()
        reply = unpack_header(frames[0])
        if secret is not None:
            check_mac(secret, reply, frames, check_time=False)
        return reply
    finally:
        sock.close(linger=0)
