"""open_tier(spec, geometry): build a full-KV tier from a ``--vericache-tier`` string.

    host                  full KV in this process's host memory (pinned when CUDA is present)
    zmq://HOST:PORT       the built-in KV server (python -m sglang_vericache.tier.server)
    lmcache://HOST:PORT   an LMCache multiprocess server (scripts/lmcache_venv.sh installs it)
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_vericache.tier.base import FullKVTier
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.secret import MIN_SECRET_BYTES, TierSecret

SCHEMES = ("host", "zmq://HOST:PORT", "lmcache://HOST:PORT")


@dataclass(frozen=True, slots=True)
class TierOptions:
    """host_capacity_bytes: the host tier's byte budget (LRU beyond it).
    timeout_s / connect_timeout_s: remote request / no-server deadlines (remote tiers).
    secret: the zmq server's shared secret (>= 16 bytes); None resolves it as the server
        does ($VERICACHE_TIER_SECRET, else the per-user secret file: ``secret.py``)."""

    host_capacity_bytes: int = 32 << 30
    timeout_s: float = 30.0
    connect_timeout_s: float = 2.0
    secret: TierSecret | bytes | None = None

    def __post_init__(self) -> None:
        if self.host_capacity_bytes <= 0:
            raise ValueError("host_capacity_bytes must be > 0")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if isinstance(self.secret, bytes) and len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes")


@dataclass(frozen=True, slots=True)
class TierSpec:
    scheme: str          # "host" | "zmq" | "lmcache"
    host: str | None
    port: int | None


def parse_tier_spec(spec: str) -> TierSpec:
    """Parse a tier spec string; ValueError with the accepted forms on anything else."""
    if not isinstance(spec, str):
        raise ValueError(f"tier spec must be a string, got {type(spec).__name__}")
    text = spec.strip()
    if text == "host":
        return TierSpec("host", None, None)
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("zmq", "lmcache"):
        raise ValueError(f"unknown tier spec {spec!r}; expected one of: {', '.join(SCHEMES)}")
    if rest.startswith("["):  # [IPv6]:PORT
        host, close, port_part = rest[1:].partition("]")
        port_text = port_part[1:] if close and port_part.startswith(":") else ""
    else:
        host, _, port_text = rest.rpartition(":")
    if not host or "/" in host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad tier address in {spec!r}; expected {scheme}://HOST:PORT "
                         f"with a port in 1..65535")
    return TierSpec(scheme, host, int(port_text))


def open_tier(spec: str, geometry: KVGeometry, options: TierOptions | None = None) -> FullKVTier:
    """Build the tier named by ``spec`` for KV of ``geometry``. Never contacts the network
    synchronously: an unreachable server shows up as failed tasks, not as an exception.
    Raises ValueError for a bad spec or an unusable shared secret (``secret.py``)."""
    parsed = parse_tier_spec(spec)
    opts = options or TierOptions()
    if parsed.scheme == "host":
        from sglang_vericache.tier.host import HostTier
        return HostTier(geometry, capacity_bytes=opts.host_capacity_bytes)
    address = f"[{parsed.host}]" if ":" in (parsed.host or "") else parsed.host
    if parsed.scheme == "zmq":
        from sglang_vericache.tier.client import ZmqTier
        return ZmqTier(f"tcp://{address}:{parsed.port}", geometry, timeout_s=opts.timeout_s,
                       connect_timeout_s=opts.connect_timeout_s, secret=opts.secret)
    from sglang_vericache.tier.lmcache import LMCacheTier
    return LMCacheTier(str(parsed.host), int(parsed.port), geometry, timeout_s=opts.timeout_s)
