"""The fleet's command line: ``python -m sglang_vericache.fleet [OPTIONS] [-- SGLANG_ARGS...]``.

Everything after ``--`` goes unchanged to every replica's ``sglang.launch_server``; the flags the
fleet sets itself on each replica (``FLEET_OWNED_FLAGS``) are refused there, so a replica can
never listen on a port or join a tier other than the one the plan (and the gateway) expects.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

# smg 1.13's `launch --policy` choices (`smg launch --help`)
GATEWAY_POLICIES = ("random", "round_robin", "passthrough", "cache_aware", "power_of_two",
                    "least_load", "manual", "consistent_hashing", "prefix_hash")
TIER_KINDS = ("zmq", "lmcache")
DEFAULT_GATEWAY_PORT = 30000
DEFAULT_TIER_CAPACITY_GB = 8.0

# set by the fleet on every replica (see plan.replica_argv); --model is SGLang's alias
FLEET_OWNED_FLAGS = ("--host", "--port", "--model-path", "--model", "--served-model-name",
                     "--vericache-tier")


class FleetOptionsError(ValueError):
    """The command line asks for something the fleet cannot start."""


@dataclass(frozen=True, slots=True)
class FleetOptions:
    """What to start. ``worker_urls`` non-empty: only the gateway, in front of those replicas.
    Port 0 means a free port chosen at start-up."""

    replicas: int = 2
    model_path: str | None = None          # None: the embedded default model
    served_model_name: str | None = None   # None: derived from the model (plan.served_name)
    host: str = "127.0.0.1"                # the gateway's bind address
    port: int = DEFAULT_GATEWAY_PORT       # the gateway's port
    policy: str = "cache_aware"
    tier: str = "zmq"
    tier_port: int = 0
    tier_capacity_gb: float = DEFAULT_TIER_CAPACITY_GB
    tier_secret_file: str | None = None
    worker_urls: tuple[str, ...] = ()
    log_dir: str | None = None              # None: a fresh directory under the temp dir
    startup_timeout_s: float = 900.0
    gateway_args: tuple[str, ...] = ()
    dry_run: bool = False                   # print the plan's commands, start nothing
    sglang_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def remote(self) -> bool:
        """Replicas run elsewhere: start only the gateway."""
        return bool(self.worker_urls)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_vericache.fleet",
        description="Start a shared KV tier, N --vericache SGLang replicas and SGLang's model "
                    "gateway (smg) in front of them; print the gateway's URL. Arguments after "
                    "'--' go to every replica's sglang.launch_server.",
    )
    p.add_argument("--replicas", type=int, default=2, help="replicas to start (default 2)")
    p.add_argument("--model-path", default=None,
                   help="the model every replica serves (default: the embedded SmolLM2)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients put in 'model' (default: the model's name; the "
                        "gateway routes by it, so every replica gets the same one)")
    p.add_argument("--host", default="127.0.0.1", help="the gateway's bind address")
    p.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT,
                   help=f"the gateway's port (default {DEFAULT_GATEWAY_PORT}; 0: a free one)")
    p.add_argument("--policy", choices=GATEWAY_POLICIES, default="cache_aware",
                   help="the gateway's routing policy (default cache_aware)")
    p.add_argument("--tier", choices=TIER_KINDS, default="zmq",
                   help="the shared KV tier to start: the zmq KV server (default) or LMCache's "
                        "server (needs the venv scripts/lmcache_venv.sh builds)")
    p.add_argument("--tier-port", type=int, default=0, help="the tier's port (0: a free one)")
    p.add_argument("--tier-capacity-gb", type=float, default=DEFAULT_TIER_CAPACITY_GB,
                   help=f"the tier's memory budget (default {DEFAULT_TIER_CAPACITY_GB:g})")
    p.add_argument("--tier-secret-file", default=None,
                   help="the zmq tier's shared secret file, for the KV server and every replica "
                        "(default: the file every server of this user on this machine shares)")
    p.add_argument("--worker-urls", nargs="+", default=[], metavar="URL",
                   help="replicas already running (elsewhere): start only the gateway in front "
                        "of them. They must share one tier endpoint and its secret")
    p.add_argument("--log-dir", default=None,
                   help="where each piece's log and fleet.json go (default: a new temp dir)")
    p.add_argument("--startup-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="how long each piece may take to become ready (default 900)")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for `smg launch` (repeat; e.g. "
                        "--gateway-arg=--log-level --gateway-arg=debug)")
    p.add_argument("--dry-run", action="store_true",
                   help="print every piece's command line and start nothing")
    return p


def split_sglang_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(fleet arguments, replica arguments): the replica's start after the first ``--``."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return list(argv), []


def owned_flags_in(sglang_args: list[str] | tuple[str, ...]) -> list[str]:
    """The fleet-owned flags among ``sglang_args`` (``--flag`` or ``--flag=value``)."""
    return [a for a in sglang_args if a.split("=", 1)[0] in FLEET_OWNED_FLAGS]


def parse_options(argv: list[str]) -> FleetOptions:
    """Parse and check a command line; raises FleetOptionsError with the reason."""
    own, sglang_args = split_sglang_args(argv)
    ns = build_arg_parser().parse_args(own)
    options = FleetOptions(
        replicas=ns.replicas, model_path=ns.model_path, served_model_name=ns.served_model_name,
        host=ns.host, port=ns.port, policy=ns.policy, tier=ns.tier, tier_port=ns.tier_port,
        tier_capacity_gb=ns.tier_capacity_gb, tier_secret_file=ns.tier_secret_file,
        worker_urls=tuple(ns.worker_urls), log_dir=ns.log_dir,
        startup_timeout_s=ns.startup_timeout, gateway_args=tuple(ns.gateway_arg),
        dry_run=ns.dry_run, sglang_args=tuple(sglang_args),
    )
    check_options(options)
    return options


def check_options(options: FleetOptions) -> None:
    if options.remote:
        bad = [u for u in options.worker_urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise FleetOptionsError(f"--worker-urls takes http(s)://HOST:PORT URLs, not {bad}")
        if options.sglang_args:
            raise FleetOptionsError("arguments after '--' go to replicas the fleet starts; with "
                                    "--worker-urls it starts none")
        return
    if options.replicas < 1:
        raise FleetOptionsError(f"--replicas must be at least 1, not {options.replicas}")
    owned = owned_flags_in(options.sglang_args)
    if owned:
        raise FleetOptionsError(
            f"{', '.join(owned)} after '--': the fleet sets these on every replica (use the "
            f"fleet's --model-path / --served-model-name; ports and the tier are its own)")
    if options.tier_capacity_gb <= 0:
        raise FleetOptionsError("--tier-capacity-gb must be positive")
    if options.tier == "lmcache" and options.tier_secret_file:
        raise FleetOptionsError("--tier-secret-file is the zmq tier's; LMCache's server has no "
                                "secret (see README: keep it on a trusted network)")
    for name, port in (("--port", options.port), ("--tier-port", options.tier_port)):
        if not 0 <= port < 65536:
            raise FleetOptionsError(f"{name} {port} is not a TCP port")
