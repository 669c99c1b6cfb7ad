"""One blocking request to the zmq KV server (ping / stats / exists / corrupt), and its CLI.

For health checks, tools and tests, never for the scheduler thread (use ZmqTier there)::

    python -m sglang_vericache.tier.admin ping  [--endpoint tcp://127.0.0.1:7300] [--secret-file F]
    python -m sglang_vericache.tier.admin stats [...]

prints the server's reply as JSON (``stats``: entries, used and capacity bytes, hits, misses,
evictions, refusals...; and the store's integrity check); exit status 0 when the server answered
ok, 1 when it refused or did not answer in time (a health check), 2 for a bad secret.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import zmq

from sglang_vericache.tier.auth import ClientSession
from sglang_vericache.tier.handshake import authenticate_client_socket
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
    authenticate_client_socket(sock, secret.value)
    try:
        sock.connect(endpoint)
        header = {"v": PROTOCOL_VERSION, "id": 1, "op": op.value, **(fields or {})}
        sock.send_multipart(session.sign(header, []))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"no reply from {endpoint} within {timeout_s}s (down, or it "
                               f"refused a connection from {secret.source}: another secret?)")
        frames = sock.recv_multipart()
        reply = unpack_header(frames[0])
        session.check_reply(reply, frames)
        return reply
    finally:
        sock.close(linger=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_vericache.tier.admin",
                                description="Ask a VeriCache KV server for its health or stats.")
    p.add_argument("op", choices=[Op.PING.value, Op.STATS.value])
    p.add_argument("--endpoint", default="tcp://127.0.0.1:7300",
                   help="the KV server (zmq://HOST:PORT as in --vericache-tier works too)")
    p.add_argument("--secret-file", default=None,
                   help="the shared secret's file (default: $VERICACHE_TIER_SECRET, else the "
                        "file the servers on this machine share)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the reply")
    args = p.parse_args(argv)
    endpoint = "tcp://" + args.endpoint.removeprefix("zmq://").removeprefix("tcp://")
    try:
        secret = resolve_secret(args.secret_file, create=False)
    except (OSError, ValueError) as exc:
        print(f"no usable shared secret: {exc}", file=sys.stderr)
        return 2
    try:
        reply = server_request(endpoint, Op(args.op), secret=secret, timeout_s=args.timeout)
    except (TimeoutError, ValueError) as exc:  # ProtocolError is a ValueError
        print(f"{endpoint}: {exc}", file=sys.stderr)
        return 1
    shown = {k: v for k, v in reply.items() if not isinstance(v, bytes)}  # not the MAC, nonce
    print(json.dumps(shown, indent=2, sort_keys=True))
    return 0 if reply.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
