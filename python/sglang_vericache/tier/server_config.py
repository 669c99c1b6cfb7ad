"""ServerConfig: what the zmq KV server (``server.py``) runs with, and its command line.

Kept apart from the server loop so the safety rules on a configuration (a shared secret
always, message limits, fault injection on loopback only) read in one place. Where the
secret comes from: ``secret.py``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from sglang_vericache.config import is_loopback_host
from sglang_vericache.tier.auth import MAX_CLOCK_SKEW_S
from sglang_vericache.tier.protocol import MAX_FRAMES
from sglang_vericache.tier.secret import (
    MIN_SECRET_BYTES,
    SECRET_ENV,
    SECRET_FILE_ENV,
    TierSecret,
    resolve_secret,
)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """capacity_bytes: the LRU byte budget. secret: the shared secret (>= 16 bytes; every
    request must be MACed with it). bandwidth_mb_s: megabytes (10^6 B) per second, None =
    unthrottled. port 0 = any free. max_frame_bytes / max_frames / max_message_bytes: the
    per-frame, frame-count and per-message limits (``protocol.py``). max_clock_skew_s: how far
    a request's timestamp may be from the server clock (``auth.py``)."""

    capacity_bytes: int
    secret: bytes
    host: str = "127.0.0.1"
    port: int = 7300
    bandwidth_mb_s: float | None = None
    max_frame_bytes: int = 1 << 30
    max_frames: int = MAX_FRAMES
    max_message_bytes: int = 4 << 30
    max_clock_skew_s: float = MAX_CLOCK_SKEW_S
    fault_injection: bool = False

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError("capacity must be > 0")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"bad port {self.port}")
        if self.bandwidth_mb_s is not None and self.bandwidth_mb_s <= 0:
            raise ValueError("bandwidth must be > 0 MB/s")
        if self.max_frame_bytes <= 0 or self.max_message_bytes <= 0:
            raise ValueError("max_frame_bytes and max_message_bytes must be > 0")
        if self.max_frames < 3:  # header + one payload frame + MAC
            raise ValueError("max_frames must be >= 3")
        if self.max_clock_skew_s <= 0:
            raise ValueError("max_clock_skew_s must be > 0")
        if not isinstance(self.secret, bytes) or len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the shared secret must be at least {MIN_SECRET_BYTES} bytes "
                             f"(--secret-file or ${SECRET_ENV})")
        if self.fault_injection and not is_loopback_host(self.host):
            raise ValueError("--fault-injection is only allowed on a loopback address")


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_vericache.tier.server",
                                description="VeriCache full-KV tier server (pyzmq ROUTER, LRU).")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7300, help="TCP port (0 = pick a free one)")
    p.add_argument("--capacity-gb", type=float, required=True,
                   help="byte budget in GiB (2^30 B); least recently used chunks are evicted")
    p.add_argument("--bandwidth-mbps", type=float, default=None, metavar="MB_PER_S",
                   help="throttle to this many MEGABYTES (10^6 B) per second, not megabits; "
                        "emulates remote storage (default: unthrottled)")
    p.add_argument("--secret-file", default=None,
                   help=f"file holding the shared secret (>= 16 bytes, mode 0600); default "
                        f"${SECRET_ENV}, else the file ${SECRET_FILE_ENV}, else "
                        f"~/.cache/sglang_vericache/tier_secret (created on first start)")
    p.add_argument("--max-frame-mb", type=float, default=1024.0,
                   help="largest accepted frame in MiB; bigger ones disconnect the sender "
                        "(also bounds the one handshake command a peer without credentials "
                        "can send)")
    p.add_argument("--max-message-mb", type=float, default=None,
                   help="largest accepted message (all frames) in MiB, refused unread "
                        "(default: the capacity, at least 4 GiB)")
    p.add_argument("--max-frames", type=int, default=MAX_FRAMES,
                   help="most frames in one message; more are refused unread")
    p.add_argument("--fault-injection", action="store_true",
                   help="enable the test-only 'corrupt' op (loopback only)")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> tuple[ServerConfig, TierSecret]:
    """The configuration ``build_arg_parser`` describes, and the secret (its source is for the
    log). Raises ValueError / OSError for a bad value or an unusable secret."""
    secret = resolve_secret(args.secret_file)
    capacity = int(args.capacity_gb * (1 << 30))
    # default: a put bigger than the whole budget would evict its own first chunks
    max_message = max(capacity, 4 << 30) if args.max_message_mb is None \
        else int(args.max_message_mb * (1 << 20))
    config = ServerConfig(
        capacity_bytes=capacity, secret=secret.value, host=args.host, port=args.port,
        bandwidth_mb_s=args.bandwidth_mbps, max_frame_bytes=int(args.max_frame_mb * (1 << 20)),
        max_frames=args.max_frames, max_message_bytes=max_message,
        fault_injection=args.fault_injection)
    return config, secret
