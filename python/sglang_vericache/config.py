"""VeriCache configuration: the ``--vericache*`` flags as frozen, validated dataclasses.

Stdlib only, so it loads in every SGLang process for free. The compressor spec is validated
by the compressor library itself (``sglang_vericache.compress``), which owns the list of
valid names and keys; this module only routes its message to the flag that carried it.

Flag surface (fixed so that every part of the system agrees)::

    --vericache                       turn the mode on
    --vericache-compressor SPEC       e.g. streaming:sink=4,window=252 | snapkv:ratio=0.25 |
                                      kivi:bits=4 | snapkv:ratio=0.5+kivi:bits=4
    --vericache-draft-len N|auto      draft tokens per verify window (auto: per request)
    --vericache-tier host|zmq://HOST:PORT|lmcache://HOST:PORT   where the full KV lives
    --vericache-tier-trusted-network  allow lmcache:// on a non-loopback host (no authentication)
    --vericache-fetch-drafting on|off  draft while a remote prefix is fetched
    --vericache-tier-lookup-deadline S  seconds a remote lookup may take before recomputing
    --vericache-tier-inflight-mb MB     host MB of remote writes (and of fetches) in flight
    --vericache-placement auto|pressure|eager   when a drafted request's full KV leaves the pool
    --vericache-draft-dtype auto|model|bfloat16|float16   the weights' precision in draft forwards
    --vericache-proposer auto|compressed|lookup   where drafts come from
"""

from __future__ import annotations

import argparse
import enum
import ipaddress
from dataclasses import asdict, dataclass
from typing import Any, Mapping

DEFAULT_COMPRESSOR = "kivi:bits=4"
DEFAULT_DRAFT_LEN = "auto"
DEFAULT_TIER = "host"
MAX_DRAFT_LEN = 64
DEFAULT_LOOKUP_DEADLINE_S = 1.0
DEFAULT_INFLIGHT_MB = 512
DRAFT_DTYPES = ("auto", "model", "bfloat16", "float16")
PROPOSERS = ("auto", "compressed", "lookup")


class VeriCacheConfigError(ValueError):
    """A ``--vericache*`` flag has a bad value. ``flag`` names it; the message says the fix."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag, self.reason = flag, message


class Placement(enum.Enum):
    """When a drafted request's full KV moves from the pool to its host buffer.

    PRESSURE: only while admission or the next step is short of pool slots. EAGER: right after
    prefill. AUTO: eager where the pool itself lives in host memory (the CPU backend: there the
    move is a compaction, and attention reads a host buffer in place but must gather a row's
    scattered pool slots), pressure elsewhere (an accelerator's pool is faster to read than
    host memory across PCIe).
    """

    AUTO = "auto"
    PRESSURE = "pressure"
    EAGER = "eager"


class TierKind(enum.Enum):
    HOST = "host"
    ZMQ = "zmq"
    LMCACHE = "lmcache"


@dataclass(frozen=True, slots=True)
class TierSpec:
    """Where the full KV lives. ``host``/``port`` are set exactly for the remote kinds."""

    kind: TierKind
    host: str | None = None
    port: int | None = None

    def __post_init__(self) -> None:
        remote = self.kind is not TierKind.HOST
        if remote != (self.host is not None and self.port is not None):
            raise VeriCacheConfigError(
                "--vericache-tier", f"{self.kind.value} needs HOST:PORT exactly when remote"
            )
        if self.port is not None and not 0 < self.port < 65536:
            raise VeriCacheConfigError("--vericache-tier", f"port {self.port} is not in 1..65535")

    @classmethod
    def parse(cls, spec: str) -> "TierSpec":
        accepted = "accepted: host, zmq://HOST:PORT, lmcache://HOST:PORT"
        if spec == TierKind.HOST.value:
            return cls(TierKind.HOST)
        scheme, sep, rest = spec.partition("://")
        kinds = {k.value: k for k in TierKind if k is not TierKind.HOST}
        if not sep or scheme not in kinds:
            raise VeriCacheConfigError("--vericache-tier", f"{spec!r} is not a tier ({accepted})")
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise VeriCacheConfigError(
                "--vericache-tier", f"{spec!r} lacks HOST:PORT (e.g. {scheme}://127.0.0.1:7300)"
            )
        return cls(kinds[scheme], host.strip("[]"), int(port))

    def __str__(self) -> str:
        if self.kind is TierKind.HOST:
            return self.kind.value
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{self.kind.value}://{host}:{self.port}"


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or ``localhost``; any other name or address counts as exposed."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname: it may resolve anywhere
        return False


def parse_draft_len(value: str) -> int | None:
    """``"auto"`` -> None (adaptive per request); ``"N"`` -> N in 0..MAX_DRAFT_LEN.

    0 is the offload-only baseline: the full KV still moves to the tier, but every decode step
    reads it back for one token, with no compressed KV and no drafting.
    """
    if value == "auto":
        return None
    if not value.isdigit() or not 0 <= int(value) <= MAX_DRAFT_LEN:
        raise VeriCacheConfigError(
            "--vericache-draft-len", f"{value!r} is not 'auto' or an integer in 0..{MAX_DRAFT_LEN}"
        )
    return int(value)


def parse_positive(flag: str, value: str | float, kind: type = float) -> Any:
    """``value`` as a ``kind`` > 0, else the flag's error."""
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not number > 0 or number != number:
        raise VeriCacheConfigError(flag, f"{value!r} is not a {kind.__name__} > 0")
    return number


def parse_placement(value: str) -> Placement:
    try:
        return Placement(value)
    except ValueError:
        accepted = ", ".join(p.value for p in Placement)
        raise VeriCacheConfigError("--vericache-placement",
                                   f"{value!r} is not a placement (accepted: {accepted})") from None


def parse_draft_dtype(value: str) -> str:
    return parse_choice("--vericache-draft-dtype", value, DRAFT_DTYPES)


def parse_choice(flag: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise VeriCacheConfigError(flag, f"{value!r} is not one of {', '.join(choices)}")
    return value


def parse_on_off(flag: str, value: str) -> bool:
    if value not in ("on", "off"):
        raise VeriCacheConfigError(flag, f"{value!r} is not 'on' or 'off'")
    return value == "on"


def canonical_compressor(spec: str) -> str:
    """Validate ``spec`` with the compressor library; return its canonical spelling."""
    from sglang_vericache.compress import build_compressor  # torch import: only when validating

    try:
        return build_compressor(spec).spec
    except ValueError as exc:
        raise VeriCacheConfigError("--vericache-compressor", str(exc)) from None


@dataclass(frozen=True, slots=True)
class VeriCacheConfig:
    """Everything the ``--vericache*`` flags say, validated.

    ``draft_len`` None means adaptive ("auto"). ``compressor`` is the canonical spec string
    (the compressor objects themselves are rebuilt from it in each process).
    """

    enabled: bool = False
    compressor: str = DEFAULT_COMPRESSOR
    draft_len: int | None = None
    tier: TierSpec = TierSpec(TierKind.HOST)
    fetch_drafting: bool = True
    tier_lookup_deadline_s: float = DEFAULT_LOOKUP_DEADLINE_S
    tier_inflight_mb: int = DEFAULT_INFLIGHT_MB
    placement: Placement = Placement.AUTO
    draft_dtype: str = "auto"
    tier_trusted_network: bool = False
    proposer: str = "auto"

    def __post_init__(self) -> None:
        # LMCache authenticates nobody (tier/lmcache.py): whoever reaches its port can read
        # and plant KV, so off loopback the user must say that network is trusted.
        tier = self.tier
        if tier.kind is TierKind.LMCACHE and not self.tier_trusted_network \
                and not is_loopback_host(tier.host or ""):
            raise VeriCacheConfigError(
                "--vericache-tier",
                f"{tier} is not a loopback address, and an LMCache server authenticates no one: "
                "anyone who can reach it can read the KV or plant wrong KV (VeriCache detects "
                "corrupt entries, not forged ones). Run LMCache on 127.0.0.1, use the "
                "authenticated zmq:// tier, or pass --vericache-tier-trusted-network if only "
                "trusted hosts can reach that network")

    @classmethod
    def from_flags(
        cls, *, enabled: bool, compressor: str, draft_len: str, tier: str,
        fetch_drafting: str = "on", tier_lookup_deadline: str | float = DEFAULT_LOOKUP_DEADLINE_S,
        tier_inflight_mb: str | int = DEFAULT_INFLIGHT_MB, placement: str = "auto",
        draft_dtype: str = "auto", tier_trusted_network: bool = False, proposer: str = "auto",
    ) -> "VeriCacheConfig":  # fmt: skip
        return cls(
            enabled=enabled,
            compressor=canonical_compressor(compressor),
            draft_len=parse_draft_len(draft_len),
            tier=TierSpec.parse(tier),
            fetch_drafting=parse_on_off("--vericache-fetch-drafting", fetch_drafting),
            tier_lookup_deadline_s=parse_positive("--vericache-tier-lookup-deadline",
                                                  tier_lookup_deadline),  # fmt: skip
            tier_inflight_mb=parse_positive("--vericache-tier-inflight-mb", tier_inflight_mb, int),
            placement=parse_placement(placement),
            draft_dtype=parse_draft_dtype(draft_dtype),
            tier_trusted_network=tier_trusted_network,
            proposer=parse_choice("--vericache-proposer", proposer, PROPOSERS),
        )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "VeriCacheConfig":
        return cls.from_flags(
            enabled=ns.vericache,
            compressor=ns.vericache_compressor,
            draft_len=ns.vericache_draft_len,
            tier=ns.vericache_tier,
            fetch_drafting=ns.vericache_fetch_drafting,
            tier_lookup_deadline=ns.vericache_tier_lookup_deadline,
            tier_inflight_mb=ns.vericache_tier_inflight_mb,
            placement=ns.vericache_placement,
            draft_dtype=ns.vericache_draft_dtype,
            tier_trusted_network=ns.vericache_tier_trusted_network,
            proposer=ns.vericache_proposer,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data, safe to pickle into SGLang's subprocesses and to log."""
        d = asdict(self)
        d["tier"] = str(self.tier)
        d["draft_len"] = "auto" if self.draft_len is None else self.draft_len
        d["fetch_drafting"] = "on" if self.fetch_drafting else "off"
        d["placement"] = self.placement.value
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "VeriCacheConfig":
        return cls(
            enabled=bool(d["enabled"]),
            compressor=str(d["compressor"]),
            draft_len=parse_draft_len(str(d["draft_len"])),
            tier=TierSpec.parse(str(d["tier"])),
            fetch_drafting=parse_on_off("fetch_drafting", str(d.get("fetch_drafting", "on"))),
            tier_lookup_deadline_s=float(d.get("tier_lookup_deadline_s", DEFAULT_LOOKUP_DEADLINE_S)),
            tier_inflight_mb=int(d.get("tier_inflight_mb", DEFAULT_INFLIGHT_MB)),
            placement=parse_placement(str(d.get("placement", "auto"))),
            draft_dtype=parse_draft_dtype(str(d.get("draft_dtype", "auto"))),
            tier_trusted_network=bool(d.get("tier_trusted_network", False)),
            proposer=parse_choice("proposer", str(d.get("proposer", "auto")), PROPOSERS),
        )


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Add the VeriCache group to ``parser`` (SGLang's, or a private one for re-parsing)."""
    group = parser.add_argument_group(
        "VeriCache",
        "Lossless decoding from a compressed KV cache: draft from the compressed cache, "
        "verify against the full KV kept off the device.",
    )
    group.add_argument(
        "--vericache",
        action="store_true",
        help="Enable VeriCache: keep a compressed KV on the device, the full KV in the tier.",
    )
    group.add_argument(
        "--vericache-compressor",
        default=DEFAULT_COMPRESSOR,
        metavar="SPEC",
        help="Compressor spec name:k=v,...; '+' composes (drop then quantize), e.g. "
        "'streaming:sink=4,window=252', 'snapkv:ratio=0.25', 'kivi:bits=4', "
        f"'snapkv:ratio=0.5+kivi:bits=4'. Default: {DEFAULT_COMPRESSOR}.",
    )
    group.add_argument(
        "--vericache-draft-len",
        default=DEFAULT_DRAFT_LEN,
        metavar="N|auto",
        help=f"Tokens drafted per verification (1..{MAX_DRAFT_LEN}), or 'auto' to adapt per "
        "request from its acceptance history and the full-KV fetch time; 0 is a baseline that "
        "offloads the full KV and reads it back for every token, without drafting. "
        "Default: auto.",
    )
    group.add_argument(
        "--vericache-tier",
        default=DEFAULT_TIER,
        metavar="TIER",
        help="Where the full KV lives: 'host' (host memory), 'zmq://HOST:PORT' (the built-in KV "
        "server, python -m sglang_vericache.tier.server), or 'lmcache://HOST:PORT'. "
        "Default: host.",
    )
    group.add_argument(
        "--vericache-tier-trusted-network",
        action="store_true",
        help="Allow 'lmcache://HOST:PORT' on a HOST that is not loopback. LMCache authenticates "
        "no one: anyone who can reach its port can read the KV or plant wrong KV. Pass this only "
        "when every host on that network is trusted (the zmq:// tier needs no such flag: it "
        "authenticates with a shared secret).",
    )
    group.add_argument(
        "--vericache-fetch-drafting",
        default="on",
        metavar="on|off",
        help="With a remote tier: draft a request from the locally kept compressed prefix while "
        "its full-KV prefix is fetched ('off': fetch, then decode). Default: on.",
    )
    group.add_argument(
        "--vericache-tier-lookup-deadline",
        default=str(DEFAULT_LOOKUP_DEADLINE_S),
        metavar="SECONDS",
        help="With a remote tier: a prefix lookup unanswered after this many seconds is given "
        "up (the request recomputes) and the tier is left alone for 5 s; a waiting request "
        f"holds SGLang's admission, so keep it short. Default: {DEFAULT_LOOKUP_DEADLINE_S}.",
    )
    group.add_argument(
        "--vericache-tier-inflight-mb",
        default=str(DEFAULT_INFLIGHT_MB),
        metavar="MB",
        help="With a remote tier: host memory for write-throughs in flight, and separately for "
        "fetches in flight (past it a write is skipped for a later turn, a fetch recomputes). "
        f"Default: {DEFAULT_INFLIGHT_MB}.",
    )
    group.add_argument(
        "--vericache-placement",
        default=Placement.AUTO.value,
        metavar="auto|pressure|eager",
        help="When a drafted request's full KV leaves the KV pool for its host buffer: "
        "'pressure' only while admission or the next step lacks pool slots, 'eager' right after "
        "prefill, 'auto' eager where the pool is in host memory (CPU: attention then reads one "
        "contiguous buffer in place instead of gathering pool slots) and pressure elsewhere. "
        "Default: auto.",
    )
    group.add_argument(
        "--vericache-draft-dtype",
        default="auto",
        choices=DRAFT_DTYPES,
        help="Precision of the weights in draft forwards (verification always uses the model's "
        "own): 'auto', where the model runs in float32, drafts with the faster of a float16 copy "
        "of the weights packed for fbgemm (x86 CPUs; fp32 arithmetic) and a bfloat16 copy, if a "
        "matmul measures it faster on this device; 'float16' / 'bfloat16' force one; 'model' "
        "never copies them. Drafts only propose, so this moves acceptance, never the output. "
        "Default: auto.",
    )


    group.add_argument(
        "--vericache-proposer",
        default="auto",
        choices=PROPOSERS,
        help="Where drafts come from: 'compressed', draft forwards of the model over the "
        "compressed KV; 'lookup', the request's own context where its last tokens occurred "
        "before (prompt lookup: no forward; greedy requests without such a match draft from the "
        "compressed KV); 'auto', whichever the step planner measures faster, step by step. "
        "Either is verified over the full KV, so this moves speed, never the output. "
        "Default: auto.",
    )


def parse_cli_flags(argv: list[str]) -> VeriCacheConfig:
    """Parse only the ``--vericache*`` flags out of a full command line (others are ignored)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_cli_flags(parser)
    ns, _ = parser.parse_known_args(argv)
    return VeriCacheConfig.from_namespace(ns)


def is_vericache_flag(arg: str) -> bool:
    """True for ``--vericache`` and ``--vericache-*`` (with or without ``=value``)."""
    name = arg.split("=", 1)[0]
    return name == "--vericache" or name.startswith("--vericache-")
