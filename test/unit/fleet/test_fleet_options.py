"""The fleet's command line: defaults, the '--' split, and what it refuses (no processes)."""

from __future__ import annotations

import pytest
from sglang_vericache.fleet.options import (
    GATEWAY_POLICIES,
    FleetOptions,
    FleetOptionsError,
    parse_options,
    split_sglang_args,
)


def test_no_arguments_is_two_replicas_a_zmq_tier_and_cache_aware_routing() -> None:
    options = parse_options([])
    assert options == FleetOptions()
    assert (options.replicas, options.tier, options.policy) == (2, "zmq", "cache_aware")
    assert options.model_path is None and not options.remote


def test_arguments_after_the_double_dash_go_to_every_replica() -> None:
    options = parse_options(["--replicas", "3", "--", "--max-total-tokens", "4096", "--", "x"])
    assert options.replicas == 3
    assert options.sglang_args == ("--max-total-tokens", "4096", "--", "x")
    assert split_sglang_args(["--port", "1"]) == (["--port", "1"], [])


@pytest.mark.parametrize("flag", ["--port", "--host", "--model-path", "--model",
                                  "--served-model-name", "--vericache-tier"])
def test_flags_the_fleet_sets_are_refused_after_the_double_dash(flag: str) -> None:
    with pytest.raises(FleetOptionsError, match=flag):
        parse_options(["--", f"{flag}=x"])
    with pytest.raises(FleetOptionsError, match=flag):
        parse_options(["--", flag, "x"])


def test_worker_urls_start_only_the_gateway_and_take_no_replica_args() -> None:
    options = parse_options(["--worker-urls", "http://a:30001", "http://b:30001"])
    assert options.remote and options.worker_urls == ("http://a:30001", "http://b:30001")
    with pytest.raises(FleetOptionsError, match="starts none"):
        parse_options(["--worker-urls", "http://a:1", "--", "--max-total-tokens", "1"])
    with pytest.raises(FleetOptionsError, match="http"):
        parse_options(["--worker-urls", "a:30001"])


@pytest.mark.parametrize("argv, reason", [
    (["--replicas", "0"], "at least 1"),
    (["--tier-capacity-gb", "0"], "positive"),
    (["--port", "70000"], "not a TCP port"),
    (["--tier", "lmcache", "--tier-secret-file", "/s"], "no secret"),
])
def test_impossible_fleets_are_refused_with_the_reason(argv: list[str], reason: str) -> None:
    with pytest.raises(FleetOptionsError, match=reason):
        parse_options(argv)


def test_unknown_policy_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit):
        parse_options(["--policy", "fastest"])


def test_policies_are_the_installed_gateways() -> None:
    router_args = pytest.importorskip("smg.router_args")
    assert list(GATEWAY_POLICIES) == router_args.COMMON_POLICY_CHOICES


def test_gateway_args_repeat_in_order() -> None:
    options = parse_options(["--gateway-arg=--log-level", "--gateway-arg=debug"])
    assert options.gateway_args == ("--log-level", "debug")
