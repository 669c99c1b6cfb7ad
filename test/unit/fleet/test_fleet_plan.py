"""The process plan: each piece's command line, environment and readiness check, in start
order; the gateway's command line is parsed by the installed smg's own parser (no processes)."""

from __future__ import annotations

import json

import pytest
from sglang_vericache.fleet.options import FleetOptions, parse_options
from sglang_vericache.fleet.plan import (
    LMCACHE_CHUNK_TOKENS,
    SECRET_FILE_ENV,
    ReadyCheck,
    Role,
    build_plan,
    gateway_url,
    served_name,
)
from sglang_vericache.fleet.ports import FleetPorts
from sglang_vericache.fleet.probes import lists_model

PY = "/venv/bin/python"
PORTS = FleetPorts(gateway=30000, gateway_metrics=20000, replicas=(20001, 20002), tier=7300)


def plan_for(argv: list[str], ports: FleetPorts = PORTS, **kw):
    kw.setdefault("model_path", "/models/SmolLM2")
    return build_plan(parse_options(argv), ports, python=PY, default_model_name="Smol", **kw)


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_tier_then_replicas_then_gateway() -> None:
    plan = plan_for([])
    assert [p.name for p in plan.pieces] == ["tier", "replica-0", "replica-1", "gateway"]
    assert [p.role for p in plan.pieces] == [Role.TIER, Role.REPLICA, Role.REPLICA, Role.GATEWAY]
    assert len({p.log_name for p in plan.pieces}) == 4
    assert plan.url == "http://127.0.0.1:30000" and plan.tier_spec == "zmq://127.0.0.1:7300"


def test_the_zmq_tier_is_the_kv_server_on_loopback() -> None:
    tier = plan_for(["--tier-capacity-gb", "2.5"]).pieces[0]
    assert tier.argv[:3] == (PY, "-m", "sglang_vericache.tier.server")
    assert (flag(tier.argv, "--host"), flag(tier.argv, "--port")) == ("127.0.0.1", "7300")
    assert flag(tier.argv, "--capacity-gb") == "2.5"
    assert tier.check is ReadyCheck.TIER_PING and tier.target == "tcp://127.0.0.1:7300"


def test_every_replica_joins_the_tier_under_one_served_name() -> None:
    plan = plan_for(["--", "--max-total-tokens", "4096"])
    replicas = plan.by_role(Role.REPLICA)
    for replica, port in zip(replicas, PORTS.replicas):
        argv = replica.argv
        assert argv[:4] == (PY, "-m", "sglang.launch_server", "--vericache")
        assert flag(argv, "--vericache-tier") == plan.tier_spec
        assert flag(argv, "--served-model-name") == plan.model_name == "Smol"
        assert flag(argv, "--model-path") == "/models/SmolLM2"
        assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", str(port))
        assert argv[-2:] == ("--max-total-tokens", "4096")  # the user's args come last
        assert replica.check is ReadyCheck.HTTP_HEALTH
        assert replica.target == f"http://127.0.0.1:{port}"


def test_the_gateway_routes_to_every_replica_as_the_installed_smg_parses_it() -> None:
    launch_router = pytest.importorskip("smg.launch_router")
    plan = plan_for(["--policy", "round_robin", "--gateway-arg=--health-check-interval-secs",
                     "--gateway-arg=9"])
    gateway = plan.pieces[-1]
    assert gateway.argv[:4] == (PY, "-m", "smg", "launch")
    args = launch_router.parse_router_args(list(gateway.argv[4:]))
    assert args.worker_urls == [p.target for p in plan.by_role(Role.REPLICA)]
    assert (args.host, args.port, args.policy) == ("127.0.0.1", 30000, "round_robin")
    assert (args.prometheus_host, args.prometheus_port) == ("127.0.0.1", 20000)
    assert args.health_check_interval_secs == 9  # the user's --gateway-arg wins
    assert args.health_failure_threshold == 2 and args.cb_failure_threshold == 2
    assert args.health_check_timeout_secs == 30  # a busy replica is not a dead one
    assert args.worker_overload_protection is False  # a full pool is not an overload here
    assert gateway.check is ReadyCheck.GATEWAY_MODELS and gateway.target == plan.url


def test_worker_urls_plan_only_the_gateway() -> None:
    launch_router = pytest.importorskip("smg.launch_router")
    ports = FleetPorts(gateway=30000, gateway_metrics=20000)
    plan = plan_for(["--worker-urls", "http://a:30001", "http://b:30001", "--served-model-name",
                     "m"], ports, model_path=None)
    assert [p.role for p in plan.pieces] == [Role.GATEWAY]
    args = launch_router.parse_router_args(list(plan.pieces[0].argv[4:]))
    assert args.worker_urls == ["http://a:30001", "http://b:30001"]
    assert plan.model_name == "m" and plan.tier_spec is None


def test_served_name_rules() -> None:
    assert served_name(FleetOptions(), "/cache/x", "Smol") == "Smol"  # embedded model
    assert served_name(FleetOptions(model_path="/m/llama-3/"), "/m/llama-3/", "Smol") == "llama-3"
    assert served_name(FleetOptions(served_model_name="n", model_path="/m"), "/m", "S") == "n"
    assert served_name(FleetOptions(worker_urls=("http://a:1",)), None, "Smol") is None


def test_lmcache_tier_runs_engine_driven_with_the_tiers_chunk_size() -> None:
    ports = FleetPorts(gateway=30000, gateway_metrics=20000, replicas=(20001,), tier=5555,
                       tier_aux=(20003, 20004))
    plan = plan_for(["--tier", "lmcache", "--replicas", "1"], ports, lmcache="/v/bin/lmcache")
    tier = plan.pieces[0]
    assert tier.argv[:2] == ("/v/bin/lmcache", "server")
    assert flag(tier.argv, "--chunk-size") == str(LMCACHE_CHUNK_TOKENS) == "128"
    assert flag(tier.argv, "--supported-transfer-mode") == "engine_driven"
    assert (flag(tier.argv, "--http-port"), flag(tier.argv, "--prometheus-port")) == (
        "20003", "20004")
    assert tier.check is ReadyCheck.TCP_CONNECT
    assert plan.tier_spec == "lmcache://127.0.0.1:5555"
    assert flag(plan.pieces[1].argv, "--vericache-tier") == plan.tier_spec


def test_a_secret_file_reaches_the_kv_server_and_every_replica(tmp_path) -> None:
    secret = tmp_path / "secret"
    plan = plan_for(["--tier-secret-file", str(secret)])
    for piece in plan.pieces:
        expected = {} if piece.role is Role.GATEWAY else {SECRET_FILE_ENV: str(secret)}
        assert piece.env == expected
    assert plan.tier_secret_file == str(secret)


def test_no_secret_file_means_the_shared_default() -> None:
    assert all(p.env == {} for p in plan_for([]).pieces)


def test_clients_reach_a_gateway_bound_to_every_interface_on_loopback() -> None:
    ports = FleetPorts(gateway=8000, gateway_metrics=1)
    assert gateway_url(FleetOptions(host="0.0.0.0"), ports) == "http://127.0.0.1:8000"
    assert gateway_url(FleetOptions(host="::1"), ports) == "http://[::1]:8000"
    assert gateway_url(FleetOptions(host="10.0.0.5"), ports) == "http://10.0.0.5:8000"


def test_gateway_readiness_needs_the_served_model_listed() -> None:
    body = json.dumps({"object": "list", "data": [{"id": "Smol", "object": "model"}]}).encode()
    assert lists_model(body, "Smol") and lists_model(body, None)
    assert not lists_model(body, "default")
    assert not lists_model(b'{"data": []}', None) and not lists_model(b"not json", "Smol")
