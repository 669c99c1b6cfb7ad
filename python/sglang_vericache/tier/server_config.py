"""ServerConfig: what the zmq KV server (``server.py``) runs with, and the command line and
secret file / environment variable it is read from.

Kept apart from the server loop so the safety rules on a configuration (no non-loopback
address without a shared secret, fault injection on loopback only) read in one place.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass

SECRET_ENV = "VERICACHE_TIER_SECRET"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name or hostname: treat as exposed
        return False


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """bandwidth_mb_s: megabytes (10^6 B) per second, None = unthrottled. port 0 = any free."""

    capacity_bytes: int
    host: str = "127.0.0.1"
    port: int = 7300
    bandwidth_mb_s: float | None = None
    secret: bytes | None = None
    max_frame_bytes: int = 1 << 30
    fault_injection: bool = False

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError("capacity must be > 0")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"bad port {self.port}")
        if self.bandwidth_mb_s is not None and self.bandwidth_mb_s <= 0:
            raise ValueError("bandwidth must be > 0 MB/s")
        if self.max_frame_bytes <= 0:
            raise ValueError("max_frame_bytes must be > 0")
        if self.secret is not None and len(self.secret) < 16:
            raise ValueError("the shared secret must be at least 16 bytes")
        if not is_loopback(self.host) and self.secret is None:
            raise ValueError(f"refusing to bind non-loopback address {self.host!r} without a "
                             f"shared secret (--secret-file or ${SECRET_ENV})")
        if self.fault_injection and not is_loopback(self.host):
            raise ValueError("--fault-injection is only allowed on a loopback address")


def read_secret(path: str | None) -> bytes | None:
    if path is not None:
        with open(path, "rb") as f:
            return f.read().strip()
    env = os.environ.get(SECRET_ENV)
    return env.encode() if env else None


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_vericache.tier.server",
                                description="VeriCache full-KV tier server (pyzmq ROUTER, LRU).")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; non-loopback needs a secret)")
    p.add_argument("--port", type=int, default=7300, help="TCP port (0 = pick a free one)")
    p.add_argument("--capacity-gb", type=float, required=True,
                   help="byte budget in GiB (2^30 B); least recently used chunks are evicted")
    p.add_argument("--bandwidth-mbps", type=float, default=None, metavar="MB_PER_S",
                   help="throttle to this many MEGABYTES (10^6 B) per second, not megabits; "
                        "emulates remote storage (default: unthrottled)")
    p.add_argument("--secret-file", default=None,
                   help=f"file holding the shared secret (>= 16 bytes); default ${SECRET_ENV}")
    p.add_argument("--max-frame-mb", type=float, default=1024.0,
                   help="largest accepted frame in MiB; bigger ones disconnect the sender")
    p.add_argument("--fault-injection", action="store_true",
                   help="enable the test-only 'corrupt' op (loopback only)")
    p.add_argument("--log-level", default="INFO")
    return p
