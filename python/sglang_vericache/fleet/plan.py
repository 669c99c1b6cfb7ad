"""The fleet's process plan: every piece's command line, environment, log file and readiness
check, in start order (tier, replicas, gateway), built from the options and ports alone.

Nothing here starts a process or touches the network; ``supervisor`` runs a plan. The
executables come in as arguments (``python``: the interpreter whose venv holds sglang and smg,
``lmcache``: LMCache's console script), so a plan is the same on every machine given the same
inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from sglang_vericache.fleet.options import FleetOptions
from sglang_vericache.fleet.ports import FleetPorts

LOOPBACK = "127.0.0.1"
# tokens per tier chunk (srt/prefix/radix_cache.py REMOTE_CHUNK_TOKENS): LMCache's server must
# use the same, or every tier request fails and the replicas recompute
LMCACHE_CHUNK_TOKENS = 128
# LMCache's usage telemetry and banner (testkit/lmcache_server.py QUIET_ENV)
LMCACHE_QUIET_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
                     "LMCACHE_DISABLE_BANNER": "1", "PYTHONHASHSEED": "0"}
# smg probes a worker every 60 s and needs 3 failures in a row by default: ~3 minutes during
# which a dead replica stays in the pool, and its circuit opens only after 10 failed requests,
# while a request is tried 5 times: cache_aware may pick the dead replica (it holds the prefix)
# for every try. Probing every 5 s takes a dead replica out within ~10 s, and a circuit that
# opens after 2 failures sends a request's later tries to another replica. On one machine a
# failed connection means a dead replica, not a congested network. A busy replica is not a
# dead one: its /health can take longer than smg's 5 s while it prefills a long prompt on a
# loaded CPU, and marking it unhealthy then (seen: the survivor of a kill marked NotReady, every
# moved turn answered 503) loses a live replica; a dead one refuses at once, so a 30 s timeout
# costs nothing in detecting it. smg's worker overload protection (on by default) leaves a
# replica out of routing at 80% KV usage or 8 queued requests while another is under them, and
# a dead replica's last load reads as 0: after a kill the survivor of a tight-budget fleet was
# vetoed in favour of the dead one, whose circuit is open, and moved turns got 503
# "no_available_workers" until the dead one was dropped (~30 s). A nearly full KV pool is how
# VeriCache replicas are meant to run; SGLang queues what does not fit. --gateway-arg comes
# later and wins.
GATEWAY_FAILOVER_ARGS = ("--health-check-interval-secs", "5", "--health-failure-threshold", "2",
                         "--health-check-timeout-secs", "30", "--cb-failure-threshold", "2",
                         "--disable-worker-overload-protection")
SECRET_FILE_ENV = "VERICACHE_TIER_SECRET_FILE"  # tier/secret.py


class Role(Enum):
    TIER = "tier"
    REPLICA = "replica"
    GATEWAY = "gateway"


class ReadyCheck(Enum):
    """How ``probes`` tells a piece is up; ``Piece.target`` is what it probes."""

    TIER_PING = "tier_ping"        # the zmq KV server answers an authenticated ping
    TCP_CONNECT = "tcp_connect"    # LMCache's server accepts a connection
    HTTP_HEALTH = "http_health"    # an SGLang server's GET /health is 200
    GATEWAY_MODELS = "gateway_models"  # the gateway's /v1/models lists the served model


@dataclass(frozen=True, slots=True)
class Piece:
    name: str
    role: Role
    argv: tuple[str, ...]
    check: ReadyCheck
    target: str                      # URL or tcp://HOST:PORT the check probes
    log_name: str                    # file name in the fleet's log directory
    env: dict[str, str] = field(default_factory=dict)  # added to the fleet's environment


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """``url``: the gateway's, the one clients use. ``model_name``: what they put in "model"
    (None only for --worker-urls without --served-model-name: then the gateway is ready once it
    lists any model). ``tier_spec``: what the replicas were given (None with --worker-urls)."""

    pieces: tuple[Piece, ...]
    url: str
    model_name: str | None
    tier_spec: str | None
    tier_secret_file: str | None

    def by_role(self, role: Role) -> list[Piece]:
        return [p for p in self.pieces if p.role == role]


def served_name(options: FleetOptions, model_path: str | None, default_name: str) -> str | None:
    """The name every replica serves under and clients send: the explicit one, else the
    embedded model's name (``default_name``) when the fleet serves it, else the model
    directory's name; for --worker-urls only the explicit one (the replicas chose theirs)."""
    if options.served_model_name:
        return options.served_model_name
    if options.remote:
        return None
    if options.model_path is None:
        return default_name
    return Path(str(model_path).rstrip("/")).name or str(model_path)


def tier_spec(options: FleetOptions, ports: FleetPorts) -> str:
    scheme = "lmcache" if options.tier == "lmcache" else "zmq"
    return f"{scheme}://{LOOPBACK}:{ports.tier}"


def tier_piece(options: FleetOptions, ports: FleetPorts, *, python: str,
               lmcache: str | None) -> Piece:
    if options.tier == "lmcache":
        if lmcache is None:
            raise ValueError("an LMCache tier needs the lmcache executable")
        http_port, metrics_port = ports.tier_aux
        argv = (lmcache, "server", "--host", LOOPBACK, "--port", str(ports.tier),
                "--chunk-size", str(LMCACHE_CHUNK_TOKENS),
                "--l1-size-gb", f"{options.tier_capacity_gb:g}",
                "--supported-transfer-mode", "engine_driven", "--eviction-policy", "LRU",
                "--http-port", str(http_port), "--prometheus-port", str(metrics_port))
        return Piece("tier", Role.TIER, argv, ReadyCheck.TCP_CONNECT,
                     f"tcp://{LOOPBACK}:{ports.tier}", "tier-lmcache.log",
                     dict(LMCACHE_QUIET_ENV))
    argv = (python, "-m", "sglang_vericache.tier.server", "--host", LOOPBACK,
            "--port", str(ports.tier), "--capacity-gb", f"{options.tier_capacity_gb:g}")
    return Piece("tier", Role.TIER, argv, ReadyCheck.TIER_PING,
                 f"tcp://{LOOPBACK}:{ports.tier}", "tier.log", _secret_env(options))


def replica_argv(options: FleetOptions, *, python: str, model_path: str, model_name: str,
                 spec: str, port: int) -> tuple[str, ...]:
    """``sglang.launch_server --vericache`` joined to the tier, then the user's extra args."""
    return (python, "-m", "sglang.launch_server", "--vericache",
            "--model-path", model_path, "--served-model-name", model_name,
            "--vericache-tier", spec, "--host", LOOPBACK, "--port", str(port),
            *options.sglang_args)


def gateway_argv(options: FleetOptions, ports: FleetPorts, *, python: str,
                 worker_urls: list[str]) -> tuple[str, ...]:
    return (python, "-m", "smg", "launch", "--host", options.host, "--port", str(ports.gateway),
            "--policy", options.policy, "--prometheus-host", LOOPBACK,
            "--prometheus-port", str(ports.gateway_metrics), *GATEWAY_FAILOVER_ARGS,
            "--worker-urls", *worker_urls, *options.gateway_args)


def gateway_url(options: FleetOptions, ports: FleetPorts) -> str:
    """Where clients go: loopback when the gateway binds every interface."""
    host = LOOPBACK if options.host in ("0.0.0.0", "") else options.host
    host = "[::1]" if host == "::" else (f"[{host}]" if ":" in host else host)
    return f"http://{host}:{ports.gateway}"


def build_plan(options: FleetOptions, ports: FleetPorts, *, python: str,
               model_path: str | None, default_model_name: str,
               lmcache: str | None = None) -> FleetPlan:
    """The pieces to start, in order. ``model_path``: resolved (the embedded model's directory
    when ``options.model_path`` is None); unused with --worker-urls."""
    name = served_name(options, model_path, default_model_name)
    url = gateway_url(options, ports)
    if options.remote:
        gateway = Piece("gateway", Role.GATEWAY,
                        gateway_argv(options, ports, python=python,
                                     worker_urls=list(options.worker_urls)),
                        ReadyCheck.GATEWAY_MODELS, url, "gateway.log")
        return FleetPlan((gateway,), url, name, None, None)
    if model_path is None or name is None:
        raise ValueError("a fleet that starts replicas needs the resolved model path")
    spec = tier_spec(options, ports)
    pieces = [tier_piece(options, ports, python=python, lmcache=lmcache)]
    urls = []
    for i, port in enumerate(ports.replicas):
        replica_url = f"http://{LOOPBACK}:{port}"
        urls.append(replica_url)
        argv = replica_argv(options, python=python, model_path=model_path, model_name=name,
                            spec=spec, port=port)
        pieces.append(Piece(f"replica-{i}", Role.REPLICA, argv, ReadyCheck.HTTP_HEALTH,
                            replica_url, f"replica-{i}.log", _secret_env(options)))
    pieces.append(Piece("gateway", Role.GATEWAY,
                        gateway_argv(options, ports, python=python, worker_urls=urls),
                        ReadyCheck.GATEWAY_MODELS, url, "gateway.log"))
    return FleetPlan(tuple(pieces), url, name, spec, options.tier_secret_file)


def _secret_env(options: FleetOptions) -> dict[str, str]:
    """The tier server and every replica read the secret from the same file: the zmq tier's
    clients take no secret flag, so the file travels as $VERICACHE_TIER_SECRET_FILE."""
    if options.tier == "zmq" and options.tier_secret_file:
        return {SECRET_FILE_ENV: str(Path(options.tier_secret_file).expanduser().resolve())}
    return {}
